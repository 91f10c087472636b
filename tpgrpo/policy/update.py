"""One iteration's policy step (spec section 7): PPO-clipped updates of the LoRA policy on the
iteration's stored window transitions, plus the optimizer / EMA state that makes resume exact.

Units: latents are the backend's float32 latents; sigmas are unitless noise levels in [0, 1];
log-probs are per-element means (see ``tpgrpo.algo.sampling``); advantages are unitless (spec section 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Any, Callable

import torch

from tpgrpo.algo.advantages import informative_samples
from tpgrpo.distributed import Dist, even_slice, sum_gradients
from tpgrpo.errors import PipelineError
from tpgrpo.algo.loss import policy_loss
from tpgrpo.policy.lora import LoraEMA, lora_parameters, reference_mode
from tpgrpo.policy.states import LazyStates, all_finite, state_pairs
from tpgrpo.algo.sampling import sde_std, stochastic_step

# Largest max |rho - 1| the first pass may show on fresh data (the rollout's own policy and sampler
# re-scoring its own transitions). Measured on honest runs here: exactly 0.0 in fp32, bf16 and fp16, with 1
# or 2 threads, rollout batches of 4-12 against update micro-batches of 3-12, and 2 processes (gloo), and
# 0.0 in every iteration of the archived runs (450 updates); damaged log-probs gave 27.1. A deviation past
# this is already 1/10 of the default PPO clip range: the stored log-probs are not the sampling policy's.
FIRST_PASS_RATIO_TOLERANCE = 1e-3


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


def make_optimizer(backend, update_cfg) -> torch.optim.AdamW:
    """AdamW over the trainable LoRA weights only (lr, weight decay from ``UpdateConfig``)."""
    params = [p for _, p in lora_parameters(backend) if p.requires_grad]
    if not params:
        raise ValueError("no trainable LoRA weights on the backend (call tpgrpo.policy.lora.attach_lora first)")
    return torch.optim.AdamW(params, lr=update_cfg.lr, weight_decay=update_cfg.weight_decay,
                             betas=(0.9, 0.999), eps=1e-8)


def _context(iteration: int | None, where: str = "") -> str:
    """`` (iteration 3, optimizer step 1/2)`` for error messages (empty when nothing is known)."""
    parts = ([f"iteration {iteration}"] if iteration is not None else []) + ([where] if where else [])
    return f" ({', '.join(parts)})" if parts else ""


LOSS_KEYS = ("policy_loss", "kl", "approx_kl", "clip_fraction")


class _Stats:
    """Transition-weighted running means of scalar diagnostics (fixed keys, so processes can sum them)."""

    def __init__(self, keys: tuple[str, ...]):
        self.keys = keys
        self.sums: dict[str, float] = dict.fromkeys(keys, 0.0)
        self.count = 0

    def add(self, weight: int, **values: float) -> None:
        self.count += weight
        for key, value in values.items():
            self.sums[key] += weight * float(torch.as_tensor(value).detach())

    def reduce(self, dist: Dist) -> None:
        """Sum the counts and weighted sums over processes, in place (one all-reduce)."""
        if dist.world == 1:
            return
        total = dist.reduce(torch.tensor([float(self.count), *self.sums.values()], dtype=torch.float64),
                            "sum", "update metrics")
        self.count = int(round(float(total[0])))
        self.sums = dict(zip(self.keys, total[1:].tolist()))

    def means(self, prefix: str = "", suffix: str = "") -> dict[str, float]:
        return {f"{prefix}{k}{suffix}": (v / self.count if self.count else 0.0) for k, v in self.sums.items()}


@dataclass
class _Pass:
    """What every micro-batch of one ``update_policy`` call needs (``adv`` (N, K) float32 on the CPU)."""

    backend: Any
    embeds: Any
    batch: TransitionBatch
    adv: torch.Tensor
    sampling_cfg: Any
    update_cfg: Any
    dist: Dist
    progress: Callable[[int, int], None] | None
    counters: dict = field(default_factory=lambda: {"forward_passes": 0, "micro_batches": 0})


def _forward(backend, embeds, batch, n_idx, k_idx, sampling_cfg, reference: bool):
    """Re-score transitions ``(n_idx[i], k_idx[i])`` under the current policy.

    Returns ``(StepOutput, mean_ref or None)``; the step output carries the gradient, the reference
    mean (adapter disabled, ``reference=True``) does not. Shapes ``(B,)`` / ``(B, C, H, W)``. The batch
    stays on the CPU (lazy states: these are read here); only these transitions move to ``backend.device``,
    where the step maths runs (the device rule of ``tpgrpo.algo.trajectory``); the outputs are on that device.
    """
    dev = backend.device
    x, x_next = (t.to(dev) for t in state_pairs(batch.latents, n_idx, k_idx))
    s, s_next = batch.sigmas[n_idx, k_idx].to(dev), batch.sigmas[n_idx, k_idx + 1].to(dev)
    emb = embeds.select(batch.prompt_index[n_idx])
    g, kind, eta = sampling_cfg.guidance_scale, sampling_cfg.step_kind, sampling_cfg.noise_level

    def step(v):
        return stochastic_step(kind, x, v, s, s_next, eta, sigma_at_one=batch.sigma_at_one,
                               prev_sample=x_next)

    out = step(backend.velocity(x, s, emb, g))
    mean_ref = None
    if reference:
        with torch.no_grad(), reference_mode(backend):
            mean_ref = step(backend.velocity(x, s, emb, g)).mean
    return out, mean_ref


def _optimizer_step(run: _Pass, optimizer, ema, ctx: str) -> float:
    """Sum the gradient over processes, clip, check and apply it; returns the pre-clip grad norm."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sum_gradients(params, run.dist)
    norm = float(torch.nn.utils.clip_grad_norm_(params, run.update_cfg.max_grad_norm))
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise PipelineError(f"update{ctx}: non-finite gradient norm ({norm}); weights left unchanged")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.step(run.backend)
    return norm


def _to_host(lo) -> tuple[float, dict[str, float], torch.Tensor]:
    """A micro-batch's loss, its ``LOSS_KEYS`` diagnostics and ``|rho - 1|`` ``(B,)`` on the CPU, in ONE
    device-to-host copy: on a GPU each copy waits for the device (six did, per micro-batch)."""
    scalars = [lo.loss, *(getattr(lo, key) for key in LOSS_KEYS)]
    ratio = lo.ratio.detach().float()
    flat = torch.cat([torch.stack([torch.as_tensor(v, dtype=torch.float32, device=ratio.device).detach().reshape(())
                                   for v in scalars]), (ratio - 1.0).abs()]).cpu()
    head = flat[:len(scalars)].tolist()
    return head[0], dict(zip(LOSS_KEYS, head[1:])), flat[len(scalars):]


def _run_chunk(run: _Pass, chunk, ctx: str, stats: _Stats, ratio_dev: torch.Tensor) -> float:
    """Accumulate this process's share of one chunk's gradient in micro-batches.

    The chunk's M transitions are split into ``dist.world`` contiguous near-equal slices; this process
    takes its slice and weights each micro-batch's mean loss by ``(its transitions) / M``, so the sum over
    processes is the mean over all M transitions. Returns ``max |rho - 1|`` over the slice;
    ``ratio_dev`` (K,) collects the per-step max.
    """
    update_cfg, batch, counters = run.update_cfg, run.batch, run.counters
    total = chunk[0].numel()
    mine = even_slice(total, run.dist.world, run.dist.rank)
    n_all, k_all = chunk[0][mine], chunk[1][mine]
    max_dev, mb = 0.0, update_cfg.micro_batch
    for start in range(0, n_all.numel(), mb):
        n_idx, k_idx = n_all[start:start + mb], k_all[start:start + mb]
        out, mean_ref = _forward(run.backend, run.embeds, batch, n_idx, k_idx, run.sampling_cfg,
                                 reference=update_cfg.kl_beta > 0)
        # The KL's std_k is the sde std without sqrt(-dt) for both step kinds (spec section 7).
        kl_std = None if mean_ref is None else sde_std(
            batch.sigmas[n_idx, k_idx], batch.sigma_at_one, run.sampling_cfg.noise_level).to(out.mean.device)
        lo = policy_loss(out.log_prob, batch.old_log_probs[n_idx, k_idx].to(out.log_prob.device),
                         run.adv[n_idx, k_idx].to(out.log_prob.device), update_cfg.clip_range,
                         mean_theta=out.mean if mean_ref is not None else None, mean_ref=mean_ref,
                         std=kl_std, kl_beta=update_cfg.kl_beta)
        loss, values, dev = _to_host(lo)
        if not math.isfinite(loss):
            raise PipelineError(f"update{ctx}: non-finite loss ({loss}) in micro-batch "
                                f"{start // mb + 1} (window steps "
                                f"{sorted(set(k_idx.tolist()))}); weights left unchanged by it")
        (lo.loss * (n_idx.numel() / total)).backward()
        ratio_dev.scatter_reduce_(0, k_idx, dev, reduce="amax")
        max_dev = max(max_dev, float(dev.max()))
        stats.add(n_idx.numel(), **values)
        counters["forward_passes"] += n_idx.numel() * (2 if mean_ref is not None else 1)
        counters["micro_batches"] += 1
        if run.progress is not None:
            run.progress(counters["micro_batches"], counters["total_micro_batches"])
    return max_dev


@torch.no_grad()
def _after_stats(run: _Pass, n_idx, k_idx) -> dict:
    """How far the policy moved: approx KL / clip fraction / max |rho - 1| on the given transitions
    (split over processes like a chunk, reduced over them)."""
    stats, max_dev, mb = _Stats(("approx_kl", "clip_fraction")), 0.0, run.update_cfg.micro_batch
    mine = even_slice(n_idx.numel(), run.dist.world, run.dist.rank)
    n_idx, k_idx = n_idx[mine], k_idx[mine]
    for start in range(0, n_idx.numel(), mb):
        n, k = n_idx[start:start + mb], k_idx[start:start + mb]
        out, _ = _forward(run.backend, run.embeds, run.batch, n, k, run.sampling_cfg, reference=False)
        dlogp = out.log_prob.cpu() - run.batch.old_log_probs[n, k]
        dev = (torch.exp(dlogp) - 1.0).abs()
        max_dev = max(max_dev, float(dev.max()))
        stats.add(n.numel(), approx_kl=0.5 * dlogp.pow(2).mean(),
                  clip_fraction=(dev > run.update_cfg.clip_range).float().mean())
        run.counters["forward_passes"] += n.numel()
    stats.reduce(run.dist)
    max_dev = float(run.dist.reduce(torch.tensor([max_dev], dtype=torch.float64), "max", "update metrics")[0])
    return {**stats.means(suffix="_after"), "ratio_max_dev_after": max_dev}


def optimizer_steps(num_transitions: int, max_steps: int, min_transitions_per_step: int) -> int:
    """How many optimizer steps one pass over ``num_transitions`` trained transitions takes:
    ``min(max_steps, max(1, num_transitions // min_transitions_per_step))``.

    Why: AdamW moves each weight by about ``lr`` per step whatever the data behind the step, so a fixed step
    count fitted to a small iteration (a default tree trains ~50 transitions, a chain 576) takes as many
    full-size steps on much noisier gradients (issue 45: the tree unlearned geneval_soft at 4 steps per
    iteration). With the defaults (4 steps, 100 transitions) a chain keeps its 4 steps from 400 transitions
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


def update_policy(backend, embeds, batch: TransitionBatch, advantages: torch.Tensor, sampling_cfg,
                  update_cfg, optimizer, ema: LoraEMA | None = None,
                  progress: Callable[[int, int], None] | None = None, seed: int | None = None,
                  iteration: int | None = None, after_sample: int = 64, dist: Dist | None = None,
                  ratio_tolerance: float | None = FIRST_PASS_RATIO_TOLERANCE) -> dict:
    """One iteration's policy step on ``batch``; returns a dict of metrics (floats, ints, one list).

    Every stochastic transition (to a sigma > 0) of the samples with a nonzero advantage at some such step
    (``advantages`` ``(N, K)``, ``select_transitions``), shuffled with ``seed`` (None: drawn
    from torch's global generator, so ``torch.manual_seed`` before the call fixes it too; pass it when
    several processes run), are split into ``optimizer_steps_per_iter`` near-equal chunks; each chunk's
    gradient is the mean of the PPO loss (+ ``kl_beta`` KL to the adapter-disabled reference) over its
    transitions, accumulated in micro-batches of ``micro_batch`` (per process); then grad-norm clip,
    AdamW step, EMA step. With ``dist`` (several processes) every chunk's transitions are split over
    the processes and the gradients summed (``_run_chunk``): the same optimisation as one process, up to
    float round-off. Inputs are checked first: any non-finite value raises ``PipelineError`` before a
    weight changes; a non-finite loss or gradient later raises before that chunk's optimizer step.
    ``progress(done, total)`` is called per micro-batch of this process. ``ratio_tolerance``: the first
    chunk's max |rho - 1| past it raises ``PipelineError`` before any optimizer step (the stored log-probs
    are not those of this policy); None skips the check (a pass over data the policy has moved on from).

    Metrics (reduced over processes): ``first_pass_ratio_max_dev`` (max |rho - 1| over the first chunk,
    before any step: ~0 on fresh data), ``first_pass_ratio_dev_per_step`` (list, per window step, None
    where absent), ``policy_loss``, ``kl``, ``approx_kl``, ``clip_fraction`` (means over the transitions
    of all chunks, each measured before its chunk's step), ``approx_kl_after``, ``clip_fraction_after``,
    ``ratio_max_dev_after`` (on up to ``after_sample`` transitions after the last step), ``grad_norm``
    (mean pre-clip), ``optimizer_steps``, ``num_transitions``, ``num_samples`` (kept samples),
    ``forward_passes`` (transitions put through ``backend.velocity``, each one CFG-doubled batch row).
    """
    validate_inputs(batch, advantages, len(embeds), _context(iteration))
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    dist = dist if dist is not None else Dist()
    n_idx, k_idx = select_transitions(advantages.detach().cpu(), seed, stochastic=batch.sigmas[:, 1:] > 0)
    steps = optimizer_steps(n_idx.numel(), update_cfg.optimizer_steps_per_iter, update_cfg.min_transitions_per_step)
    chunks = [c for c in zip(torch.tensor_split(n_idx, steps), torch.tensor_split(k_idx, steps)) if c[0].numel()]
    run = _Pass(backend, embeds, batch, advantages.detach().float().cpu(), sampling_cfg, update_cfg, dist, progress)
    run.counters["total_micro_batches"] = sum(
        -(-_len(even_slice(c[0].numel(), dist.world, dist.rank)) // update_cfg.micro_batch) for c in chunks)
    stats, norms = _Stats(LOSS_KEYS), []
    first = torch.cat([torch.zeros(1), torch.full((batch.num_steps,), -1.0)])  # max |rho - 1|: all, per step
    optimizer.zero_grad(set_to_none=True)
    for j, chunk in enumerate(chunks):
        step_ctx = _context(iteration, f"optimizer step {j + 1}/{len(chunks)}")
        per_step = first[1:] if j == 0 else torch.full_like(first[1:], -1.0)
        dev = _run_chunk(run, chunk, step_ctx, stats, per_step)
        if j == 0:  # before any step: every process sees the same reduced figure, so all stop or none
            first[0] = dev
            first = dist.reduce(first, "max", "update metrics")
            _check_first_pass(first, ratio_tolerance, optimizer, _context(iteration))
        norms.append(_optimizer_step(run, optimizer, ema, step_ctx))
    stats.reduce(dist)
    metrics = {**stats.means(), "first_pass_ratio_max_dev": float(first[0]),
               "first_pass_ratio_dev_per_step": [None if v < 0 else float(v) for v in first[1:].tolist()],
               "grad_norm": sum(norms) / len(norms) if norms else 0.0, "optimizer_steps": len(chunks),
               "transitions_per_step": n_idx.numel() / len(chunks) if chunks else 0.0,
               "num_transitions": int(n_idx.numel()), "num_samples": int(n_idx.unique().numel())}
    after = {"approx_kl_after": 0.0, "clip_fraction_after": 0.0, "ratio_max_dev_after": 0.0}
    if chunks:
        after = _after_stats(run, n_idx[:after_sample], k_idx[:after_sample])
    passes = dist.reduce(torch.tensor([run.counters["forward_passes"]], dtype=torch.int64), "sum", "update metrics")
    metrics.update(after, forward_passes=int(passes[0]), processes=dist.world)
    return metrics


def _check_first_pass(first: torch.Tensor, tolerance: float | None, optimizer, ctx: str) -> None:
    """Stop (weights unchanged) when the first pass's max |rho - 1| (``first[0]``; per window step in
    ``first[1:]``, -1 where absent) exceeds ``tolerance``."""
    if tolerance is None or float(first[0]) <= tolerance:  # (a NaN deviation stops too)
        return
    optimizer.zero_grad(set_to_none=True)
    step = int(torch.argmax(first[1:]))
    raise PipelineError(
        f"update{ctx}: the stored log-probs do not match the policy that sampled them: first-pass "
        f"max |ratio - 1| = {float(first[0]):.3g} (window step {step}; tolerance {tolerance:g}); "
        "trajectories.zarr's log_probs are damaged, or the previous policy or the sampler is not the "
        "rollout's; weights left unchanged")


def _len(s: slice) -> int:
    return s.stop - s.start
