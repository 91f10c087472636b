"""One iteration's policy step (spec section 7), read top to bottom in :func:`train_iteration`::

    for each epoch (a pass over the iteration's trained transitions, reshuffled with its own seed):
        split them into optimizer steps (``optimizer_steps``: as many as the data carry)
        for each optimizer step:
            for each micro-batch of this process's share of the step's transitions:
                re-score under the current policy (``rescore``), PPO-clip loss (+ KL), backward
            (first step of the first epoch: the stored log-probs must be this policy's)
            sum the gradient over processes, clip, AdamW step, EMA step
    then, once: how far the policy moved, on a sample of the transitions

The optimizer / EMA state that makes resume exact is saved by the stage (``tpgrpo.policy.checkpoint``).
Units: latents are the backend's float32 latents; sigmas are unitless; log-probs are per-element means
(``tpgrpo.algo.sampling``); advantages are unitless (spec section 6).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Callable, Sequence

import torch

from tpgrpo.algo.loss import policy_loss
from tpgrpo.algo.sampling import sde_std
from tpgrpo.distributed import Dist, even_slice, sum_gradients
from tpgrpo.errors import PipelineError
from tpgrpo.policy.lora import LoraEMA, lora_parameters
from tpgrpo.policy.transitions import (TransitionBatch, optimizer_steps, rescore, select_transitions,  # noqa: F401
                                       validate_inputs)

if TYPE_CHECKING:  # annotations only: the update runs on whatever backend the stage loaded
    from tpgrpo.config import SamplingConfig, UpdateConfig
    from tpgrpo.models.base import FlowBackend, PromptEmbeddings

# Largest max |rho - 1| the first pass may show on fresh data (the rollout's own policy and sampler
# re-scoring its own transitions). Measured on honest runs here: exactly 0.0 in fp32, bf16 and fp16, with 1
# or 2 threads, rollout batches of 4-12 against update micro-batches of 3-12, and 2 processes (gloo), and
# 0.0 in every iteration of the archived runs (450 updates); damaged log-probs gave 27.1. A deviation past
# this is already 1/10 of the default PPO clip range: the stored log-probs are not the sampling policy's.
FIRST_PASS_RATIO_TOLERANCE = 1e-3
LOSS_KEYS = ("policy_loss", "kl", "approx_kl", "clip_fraction")
EPOCH_KEYS = ("approx_kl", "clip_fraction", "policy_loss", "grad_norm")  # listed per epoch in update.json


def make_optimizer(backend, update_cfg) -> torch.optim.AdamW:
    """AdamW over the trainable LoRA weights only (lr, weight decay from ``UpdateConfig``)."""
    params = [p for _, p in lora_parameters(backend) if p.requires_grad]
    if not params:
        raise ValueError("no trainable LoRA weights on the backend (call tpgrpo.policy.lora.attach_lora first)")
    return torch.optim.AdamW(params, lr=update_cfg.lr, weight_decay=update_cfg.weight_decay,
                             betas=(0.9, 0.999), eps=1e-8)


@dataclass(frozen=True)
class UpdateInputs:
    """What every micro-batch of an update reads: the policy (``backend``, a ``FlowBackend`` with LoRA), the
    prompts' ``embeds`` (``PromptEmbeddings``), the stored ``batch``, ``advantages`` ``(N, K)`` float32 on
    the CPU, the sampler (``SamplingConfig``) and update (``UpdateConfig``) params, and the processes."""

    backend: FlowBackend
    embeds: PromptEmbeddings
    batch: TransitionBatch
    advantages: torch.Tensor
    sampling: SamplingConfig
    update: UpdateConfig
    dist: Dist = field(default_factory=Dist)


@dataclass
class FirstPass:
    """The first optimizer step's check, made before any weight moves: on fresh data the policy re-scoring its
    own rollout gives ratio rho = 1, so |rho - 1| measures damaged log-probs or a policy or sampler that is not
    the rollout's.

    ``max_dev``: max |rho - 1| over the step's transitions (0.0 when nothing is trained); ``per_step``
    ``(K,)`` float32: the max per window step, -1.0 where the step had no transition (below any |rho - 1|,
    so the max over processes keeps the figure of a process that had one)."""

    max_dev: float
    per_step: torch.Tensor

    @classmethod
    def empty(cls, num_steps: int) -> FirstPass:
        """Before the first step: nothing measured (``num_steps`` window steps, K)."""
        return cls(0.0, torch.full((num_steps,), -1.0))

    def reduced(self, dist: Dist) -> FirstPass:
        """The max over processes of both fields (one all-reduce), so every process stops or none."""
        packed = dist.reduce(torch.cat([torch.tensor([self.max_dev], dtype=torch.float32), self.per_step]), "max",
                             "update metrics")
        return FirstPass(float(packed[0]), packed[1:])

    def check(self, tolerance: float | None, optimizer, ctx: str) -> None:
        """Stop (weights unchanged, gradients cleared) when ``max_dev`` exceeds ``tolerance`` (None: never;
        a NaN deviation stops too)."""
        if tolerance is None or self.max_dev <= tolerance:
            return
        optimizer.zero_grad(set_to_none=True)
        step = int(torch.argmax(self.per_step))
        raise PipelineError(
            f"update{ctx}: the stored log-probs do not match the policy that sampled them: first-pass "
            f"max |ratio - 1| = {self.max_dev:.3g} (window step {step}; tolerance {tolerance:g}); "
            "trajectories.zarr's log_probs are damaged, or the previous policy or the sampler is not the "
            "rollout's; weights left unchanged")

    def as_log(self) -> dict:
        """``update.json``'s ``first_pass_ratio_max_dev`` and ``first_pass_ratio_dev_per_step`` (None where
        the window step had no transition)."""
        return {"first_pass_ratio_max_dev": float(self.max_dev),
                "first_pass_ratio_dev_per_step": [None if v < 0 else float(v) for v in self.per_step.tolist()]}


class LossStats:
    """Transition-weighted running means of ``keys`` (fixed, so processes can sum them)."""

    def __init__(self, keys: tuple[str, ...] = LOSS_KEYS):
        self.keys, self.sums, self.count = keys, dict.fromkeys(keys, 0.0), 0

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

    def means(self, suffix: str = "") -> dict[str, float]:
        return {f"{k}{suffix}": (v / self.count if self.count else 0.0) for k, v in self.sums.items()}


@dataclass
class UpdateMetrics:
    """What one iteration's update measured (``update.json``: :meth:`as_log`, keys in docs/metrics.md).

    ``epochs``: per epoch, ``LOSS_KEYS`` (means over its transitions, each before its step) and
    ``grad_norm`` (mean pre-clip norm); ``first_pass``: the first step's check (:class:`FirstPass`);
    ``after``: the ``*_after``
    figures measured once after the last step."""

    num_transitions: int
    num_samples: int
    steps_per_epoch: int
    first_pass: FirstPass
    epochs: list[dict[str, float]] = field(default_factory=list)
    after: dict[str, float] = field(default_factory=dict)
    forward_passes: int = 0
    processes: int = 1

    def as_log(self) -> dict:
        """The flat ``update.json`` keys: the plain loss keys average the epochs, ``*_per_epoch`` list them."""
        n = max(1, len(self.epochs))
        log = {key: sum(e[key] for e in self.epochs) / n for key in (*LOSS_KEYS, "grad_norm")}
        log.update({f"{key}_per_epoch": [e[key] for e in self.epochs] for key in EPOCH_KEYS})
        log.update(self.after, epochs=len(self.epochs), optimizer_steps=self.steps_per_epoch * len(self.epochs),
                   num_transitions=self.num_transitions, num_samples=self.num_samples,
                   transitions_per_step=self.num_transitions / self.steps_per_epoch if self.steps_per_epoch else 0.0,
                   **self.first_pass.as_log(), forward_passes=self.forward_passes, processes=self.processes)
        return log


def train_iteration(inputs: UpdateInputs, optimizer, seeds: Sequence[int], ema: LoraEMA | None = None,
                    iteration: int | None = None, progress: Callable[[int, int], None] | None = None,
                    ratio_tolerance: float | None = FIRST_PASS_RATIO_TOLERANCE, after_sample: int = 64) -> UpdateMetrics:
    """The iteration's update (module docstring): one epoch per seed in ``seeds`` (``update.epochs`` of them
    in the stage), each ``select_transitions`` shuffled by its seed and split into ``optimizer_steps`` steps
    of at most ``update.optimizer_steps_per_iter / epochs``. Inputs are checked first: a non-finite value
    raises ``PipelineError`` before a weight changes, as does a non-finite loss or gradient before its step.
    ``ratio_tolerance``: the first step's max |rho - 1| past it stops the update before any step (None skips
    it: data the policy has moved on from). ``progress(done, total)`` is called per micro-batch."""
    batch, cfg, dist = inputs.batch, inputs.update, inputs.dist
    validate_inputs(batch, inputs.advantages, len(inputs.embeds), _context(iteration))
    stochastic = batch.sigmas[:, 1:] > 0  # a cps step to sigma 0 has no policy
    orders = [select_transitions(inputs.advantages.detach().cpu(), seed, stochastic=stochastic) for seed in seeds]
    total = orders[0][0].numel() if orders else 0
    steps = optimizer_steps(total, cfg.optimizer_steps_per_iter // len(seeds), cfg.min_transitions_per_step)
    metrics = UpdateMetrics(total, int(orders[0][0].unique().numel()) if orders else 0, steps if total else 0,
                            FirstPass.empty(batch.num_steps), processes=dist.world)
    counter = _MicroBatches(progress, len(seeds) * sum(_micro_batches(c.numel(), dist, cfg.micro_batch)
                                                       for c in torch.tensor_split(orders[0][0], steps)) if total else 0)
    optimizer.zero_grad(set_to_none=True)
    for epoch, (n_idx, k_idx) in enumerate(orders):
        if not total:  # nothing to train on (every advantage 0): no step, zeros logged per epoch
            metrics.epochs.append(dict.fromkeys((*LOSS_KEYS, "grad_norm"), 0.0))
            continue
        stats, norms = LossStats(), []
        for step, (n_step, k_step) in enumerate(zip(torch.tensor_split(n_idx, steps), torch.tensor_split(k_idx, steps))):
            ctx = _context(iteration, f"optimizer step {step + 1}/{steps}")
            first = epoch == 0 and step == 0
            per_step_dev = metrics.first_pass.per_step if first else torch.full((batch.num_steps,), -1.0)
            dev = accumulate_step(inputs, n_step, k_step, stats, per_step_dev, ctx, counter)
            if first:  # before any step: every process sees the same reduced figure, so all stop or none
                metrics.first_pass = FirstPass(dev, per_step_dev).reduced(dist)
                metrics.first_pass.check(ratio_tolerance, optimizer, _context(iteration))
            norms.append(_apply_step(inputs, optimizer, ema, ctx))
        stats.reduce(dist)
        metrics.epochs.append({**stats.means(), "grad_norm": sum(norms) / len(norms)})
    metrics.after = {"approx_kl_after": 0.0, "clip_fraction_after": 0.0, "ratio_max_dev_after": 0.0}
    if total:
        metrics.after = _after_stats(inputs, orders[-1][0][:after_sample], orders[-1][1][:after_sample], counter)
    metrics.forward_passes = int(dist.reduce(torch.tensor([counter.passes], dtype=torch.int64), "sum",
                                             "update metrics")[0])
    return metrics


def accumulate_step(inputs: UpdateInputs, n_step: torch.Tensor, k_step: torch.Tensor, stats: LossStats,
                    ratio_dev: torch.Tensor, ctx: str = "", counter: "_MicroBatches | None" = None) -> float:
    """Accumulate this process's share of one optimizer step's gradient, micro-batch by micro-batch.

    The step's M transitions ``(n_step[i], k_step[i])`` are split into ``dist.world`` contiguous near-equal
    slices; this process takes its slice and weights each micro-batch's mean loss by ``(its transitions) /
    M``, so the sum over processes is the mean over all M. Returns max |rho - 1| over the slice;
    ``ratio_dev`` ``(K,)`` collects the per-window-step max; ``stats`` the loss means."""
    batch, cfg, counter = inputs.batch, inputs.update, counter or _MicroBatches(None, 0)
    mine = even_slice(n_step.numel(), inputs.dist.world, inputs.dist.rank)
    n_all, k_all = n_step[mine], k_step[mine]
    max_dev, mb, reference = 0.0, cfg.micro_batch, cfg.kl_beta > 0
    for start in range(0, n_all.numel(), mb):
        n_idx, k_idx = n_all[start:start + mb], k_all[start:start + mb]
        out, mean_ref = rescore(inputs.backend, inputs.embeds, batch, n_idx, k_idx, inputs.sampling, reference)
        # The KL's std_k is the sde std without sqrt(-dt) for both step kinds (spec section 7).
        kl_std = None if mean_ref is None else sde_std(
            batch.sigmas[n_idx, k_idx], batch.sigma_at_one, inputs.sampling.noise_level).to(out.mean.device)
        at = out.log_prob.device
        lo = policy_loss(out.log_prob, batch.old_log_probs[n_idx, k_idx].to(at), inputs.advantages[n_idx, k_idx].to(at),
                         cfg.clip_range, mean_theta=out.mean if reference else None, mean_ref=mean_ref, std=kl_std,
                         kl_beta=cfg.kl_beta)
        loss, values, dev = _to_host(lo)
        if not math.isfinite(loss):
            raise PipelineError(f"update{ctx}: non-finite loss ({loss}) in micro-batch {start // mb + 1} (window "
                                f"steps {sorted(set(k_idx.tolist()))}); weights left unchanged by it")
        (lo.loss * (n_idx.numel() / n_step.numel())).backward()
        ratio_dev.scatter_reduce_(0, k_idx, dev, reduce="amax")
        max_dev = max(max_dev, float(dev.max()))
        stats.add(n_idx.numel(), **values)
        counter.done(n_idx.numel() * (2 if reference else 1))
    return max_dev


def update_policy(backend, embeds, batch: TransitionBatch, advantages: torch.Tensor, sampling_cfg, update_cfg,
                  optimizer, ema: LoraEMA | None = None, progress: Callable[[int, int], None] | None = None,
                  seed: int | None = None, iteration: int | None = None, after_sample: int = 64,
                  dist: Dist | None = None, ratio_tolerance: float | None = FIRST_PASS_RATIO_TOLERANCE) -> dict:
    """One epoch of :func:`train_iteration` (``update_cfg.optimizer_steps_per_iter`` steps at most, whatever
    ``update.epochs`` says) shuffled by ``seed`` (None: drawn from torch's global generator); returns the
    ``update.json`` dict (:meth:`UpdateMetrics.as_log`). For tests and benches that drive one pass."""
    if seed is None:
        seed = int(torch.randint(0, 2**62, (1,)))
    inputs = UpdateInputs(backend, embeds, batch, advantages.detach().float().cpu(), sampling_cfg, update_cfg,
                          dist if dist is not None else Dist())
    return train_iteration(inputs, optimizer, [seed], ema=ema, iteration=iteration, progress=progress,
                           ratio_tolerance=ratio_tolerance, after_sample=after_sample).as_log()


class _MicroBatches:
    """Counts micro-batches (for ``progress(done, total)``) and transformer rows (``forward_passes``)."""

    def __init__(self, progress: Callable[[int, int], None] | None, total: int):
        self.progress, self.total, self.count, self.passes = progress, total, 0, 0

    def done(self, rows: int, trained: bool = True) -> None:
        self.passes += rows
        if trained:
            self.count += 1
            if self.progress is not None:
                self.progress(self.count, self.total)


def _micro_batches(transitions: int, dist: Dist, micro_batch: int) -> int:
    """Micro-batches this process runs for a step of ``transitions``."""
    share = even_slice(transitions, dist.world, dist.rank)
    return -(-(share.stop - share.start) // micro_batch)


def _context(iteration: int | None, where: str = "") -> str:
    """`` (iteration 3, optimizer step 1/2)`` for error messages (empty when nothing is known)."""
    parts = ([f"iteration {iteration}"] if iteration is not None else []) + ([where] if where else [])
    return f" ({', '.join(parts)})" if parts else ""


def _apply_step(inputs: UpdateInputs, optimizer, ema, ctx: str) -> float:
    """Sum the gradient over processes, clip, check and apply it; returns the pre-clip grad norm."""
    params = [p for group in optimizer.param_groups for p in group["params"]]
    sum_gradients(params, inputs.dist)
    norm = float(torch.nn.utils.clip_grad_norm_(params, inputs.update.max_grad_norm))
    if not math.isfinite(norm):
        optimizer.zero_grad(set_to_none=True)
        raise PipelineError(f"update{ctx}: non-finite gradient norm ({norm}); weights left unchanged")
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if ema is not None:
        ema.step(inputs.backend)
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


@torch.no_grad()
def _after_stats(inputs: UpdateInputs, n_idx, k_idx, counter: _MicroBatches) -> dict:
    """How far the policy moved: approx KL / clip fraction / max |rho - 1| on the given transitions
    (split over processes like a step, reduced over them)."""
    stats, max_dev, mb = LossStats(("approx_kl", "clip_fraction")), 0.0, inputs.update.micro_batch
    mine = even_slice(n_idx.numel(), inputs.dist.world, inputs.dist.rank)
    n_idx, k_idx = n_idx[mine], k_idx[mine]
    for start in range(0, n_idx.numel(), mb):
        n, k = n_idx[start:start + mb], k_idx[start:start + mb]
        out, _ = rescore(inputs.backend, inputs.embeds, inputs.batch, n, k, inputs.sampling)
        dlogp = out.log_prob.cpu() - inputs.batch.old_log_probs[n, k]
        dev = (torch.exp(dlogp) - 1.0).abs()
        max_dev = max(max_dev, float(dev.max()))
        stats.add(n.numel(), approx_kl=0.5 * dlogp.pow(2).mean(),
                  clip_fraction=(dev > inputs.update.clip_range).float().mean())
        counter.done(n.numel(), trained=False)
    stats.reduce(inputs.dist)
    max_dev = float(inputs.dist.reduce(torch.tensor([max_dev], dtype=torch.float64), "max", "update metrics")[0])
    return {**stats.means(suffix="_after"), "ratio_max_dev_after": max_dev}


__all__ = ["FIRST_PASS_RATIO_TOLERANCE", "FirstPass", "LOSS_KEYS", "LossStats", "TransitionBatch", "UpdateInputs", "UpdateMetrics",
           "accumulate_step", "make_optimizer", "optimizer_steps", "rescore", "select_transitions", "train_iteration",
           "update_policy", "validate_inputs"]
