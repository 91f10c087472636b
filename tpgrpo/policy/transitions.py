"""The iteration's trained transitions and how the update reads them: :class:`TransitionBatch` (what the
rollout stored), :func:`validate_inputs`, :func:`select_transitions` (which transitions, in what order),
:func:`optimizer_steps` (how many steps they carry) and :func:`rescore` (a transition's log-prob under the
current policy: the update's forward pass, shared by the stage and the benches).

Units: latents are the backend's float32 latents; sigmas are unitless noise levels in [0, 1]; log-probs are
per-element means (see ``tpgrpo.algo.sampling``); advantages are unitless (spec section 6).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpgrpo.algo.advantages import informative_samples
from tpgrpo.algo.sampling import StepOutput, stochastic_step
from tpgrpo.errors import PipelineError
from tpgrpo.policy.lora import reference_mode
from tpgrpo.policy.states import LazyStates, all_finite, state_pairs


@dataclass
class TransitionBatch:
    """The iteration's window transitions, as stored by the rollout.

    Fields:
        latents: ``(N, K+1, C, H, W)`` float32, states ``z_0..z_K`` around the K window steps
            (``z_k`` before window step k, ``z_{k+1}`` after it); a tensor, or ``LazyStates`` read per micro-batch.
        old_log_probs: ``(N, K)`` float32, the rollout policy's log-prob of each transition.
        sigmas: ``(N, K+1)`` float32; window step k maps ``sigmas[:, k] -> sigmas[:, k+1]``.
        prompt_index: ``(N,)`` int64, rows of the prompt-embeddings table (``embeds.select``).
        sigma_at_one: the schedule's ``s_1`` (``sde`` uses it at ``s = 1``).
    """

    latents: "torch.Tensor | LazyStates"
    old_log_probs: torch.Tensor
    sigmas: torch.Tensor
    prompt_index: torch.Tensor
    sigma_at_one: float

    @property
    def num_samples(self) -> int:
        return int(self.latents.shape[0])

    @property
    def num_steps(self) -> int:
        """K, window steps per sample."""
        return int(self.latents.shape[1]) - 1


def _where(name: str, t: torch.Tensor, ctx: str) -> str:
    """One line naming the first non-finite entry of ``t`` (sample, window step)."""
    bad = (~torch.isfinite(t)).nonzero()
    first = tuple(int(i) for i in bad[0][:2])
    loc = f"sample {first[0]}" + (f", window step {first[1]}" if len(first) > 1 else "")
    return f"update{ctx}: {name} has {bad.shape[0]} non-finite value(s) (first at {loc})"


def validate_inputs(batch: TransitionBatch, advantages: torch.Tensor, num_prompts: int,
                    ctx: str = "") -> None:
    """Raise ``PipelineError`` (one line: quantity and location) on bad shapes or non-finite values."""
    n, k = batch.num_samples, batch.num_steps
    shapes = {"latents": (batch.latents, 5), "old_log_probs": (batch.old_log_probs, (n, k)),
              "sigmas": (batch.sigmas, (n, k + 1)), "prompt_index": (batch.prompt_index, (n,)),
              "advantages": (advantages, (n, k))}
    for name, (t, want) in shapes.items():
        ok = t.ndim == want if isinstance(want, int) else tuple(t.shape) == want
        if not ok:
            raise PipelineError(f"update{ctx}: {name} has shape {tuple(t.shape)}, expected "
                                f"{'5 dims (N, K+1, C, H, W)' if isinstance(want, int) else want}")
    if k < 1:
        raise PipelineError(f"update{ctx}: latents hold no window step (K+1 = {k + 1} states)")
    for name in ("latents", "old_log_probs", "sigmas"):  # lazy states: checked chunk by chunk, and as read
        if not all_finite(getattr(batch, name)):
            raise PipelineError(_where(name, getattr(batch, name), ctx))
    if not bool(torch.isfinite(advantages).all()):
        raise PipelineError(_where("advantages", advantages, ctx))
    idx = batch.prompt_index
    if n and (int(idx.min()) < 0 or int(idx.max()) >= num_prompts):
        raise PipelineError(f"update{ctx}: prompt_index out of range [0, {num_prompts})")


def optimizer_steps(num_transitions: int, max_steps: int, min_transitions_per_step: int) -> int:
    """How many optimizer steps one pass over ``num_transitions`` trained transitions takes:
    ``min(max_steps, max(1, num_transitions // min_transitions_per_step))``.

    Why: AdamW moves each weight by about ``lr`` per step whatever the data behind the step, so a fixed step
    count fitted to a small iteration (a default tree trains ~50 transitions, a chain 576) takes as many
    full-size steps on much noisier gradients (a default tree at 4 steps per iteration unlearned
    geneval_soft). With the defaults (4 steps, 100 transitions) a chain keeps its 4 steps from 400 transitions
    up; a default tree takes 1. At least one step: an iteration with any data trains on it."""
    if max_steps < 1 or min_transitions_per_step < 1:
        raise ValueError(f"max_steps and min_transitions_per_step must be >= 1, got {max_steps}, "
                         f"{min_transitions_per_step}")
    return min(max_steps, max(1, num_transitions // min_transitions_per_step))


def select_transitions(advantages: torch.Tensor, seed: int,
                       stochastic: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """``(n_idx, k_idx)`` of every transition of the kept samples, shuffled by ``seed``, ``(M,)`` each.

    ``advantages`` is ``(N, K)``. Only a sample whose advantage is 0 at every window step is dropped
    (spec section 6); a kept sample keeps all K transitions, ``A == 0`` ones included: they add no
    policy gradient but their KL term counts and they are in the loss's mean (the denominator M).
    ``stochastic`` ``(N, K)`` bool (None: all True) marks the transitions that have a policy: a ``cps``
    step to ``s = 0`` (a window reaching the last step) is deterministic, its rollout log-prob exactly 0,
    so it is left out of the PPO term (and of the test for a sample's being kept).
    """
    if stochastic is not None:
        advantages = torch.where(stochastic, advantages, torch.zeros((), dtype=advantages.dtype))
    keep = informative_samples(advantages)[:, None].expand_as(advantages)
    n_idx, k_idx = (keep if stochastic is None else keep & stochastic).nonzero(as_tuple=True)
    perm = torch.randperm(n_idx.numel(), generator=torch.Generator().manual_seed(int(seed)))
    return n_idx[perm], k_idx[perm]



def rescore(backend, embeds, batch: TransitionBatch, n_idx: torch.Tensor, k_idx: torch.Tensor, sampling_cfg,
            reference: bool = False) -> tuple[StepOutput, torch.Tensor | None]:
    """Re-score transitions ``(n_idx[i], k_idx[i])`` (``(B,)`` each) under the current policy.

    Returns ``(StepOutput, mean_ref or None)``: the step output (``log_prob`` ``(B,)``, ``mean``
    ``(B, C, H, W)``) carries the gradient; the reference mean (adapter disabled, ``reference=True``) does
    not. The batch stays on the CPU (lazy states are read here); only these transitions move to
    ``backend.device``, where the step maths runs (the device rule of ``tpgrpo.algo.trajectory``); the
    outputs are on that device.
    """
    dev = backend.device
    x, x_next = (t.to(dev) for t in state_pairs(batch.latents, n_idx, k_idx))
    s, s_next = batch.sigmas[n_idx, k_idx].to(dev), batch.sigmas[n_idx, k_idx + 1].to(dev)
    emb = embeds.select(batch.prompt_index[n_idx])
    g, kind, eta = sampling_cfg.guidance_scale, sampling_cfg.step_kind, sampling_cfg.noise_level

    def step(v):
        return stochastic_step(kind, x, v, s, s_next, eta, sigma_at_one=batch.sigma_at_one, prev_sample=x_next)

    out = step(backend.velocity(x, s, emb, g))
    mean_ref = None
    if reference:
        with torch.no_grad(), reference_mode(backend):
            mean_ref = step(backend.velocity(x, s, emb, g)).mean
    return out, mean_ref
