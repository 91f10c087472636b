"""One iteration's policy step under ``update.objective`` nft / awm (docs/objectives.md), read top to bottom in
:func:`train_objective`::

    for each epoch (its own seed: fresh noise levels, fresh noise, a fresh order):
        per unit (a clean sample with its advantage), its noise levels (update.nft_levels / awm_levels of the
        objective's candidates at or below the unit's ceiling), one noise draw each: the epoch's M items
        split them into optimizer steps (as the grpo update: ``optimizer_steps``)
        for each optimizer step, for each micro-batch of this process's share:
            x_t = (1 - t) x0 + t eps; the policy's velocity (with gradient), the old adapter's / EMA's and the
            base model's (no gradient) as the objective needs; loss (tpgrpo.algo.objectives), backward
        sum the gradient over processes, clip, AdamW step (awm: then the EMA step)
    nft: the old adapter becomes d old + (1 - d) current
    then, once: how far the policy moved from the sampling policy, on a sample of the items

The velocity is the sampler's guided velocity (the store's guidance scale; 1 = conditional only, the papers'
CFG-free setting): the policy trained is the one that sampled. Latents are the backend's float32 latents.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Callable, Sequence

import torch

from tpgrpo.algo import objectives as obj
from tpgrpo.algo.objective_units import Units
from tpgrpo.distributed import Dist, even_slice
from tpgrpo.errors import PipelineError
from tpgrpo.policy.checkpoint import optimizer_step_count
from tpgrpo.policy.lora import LoraEMA, lora_state_dict, reference_mode
from tpgrpo.policy.slow_adapter import weights_applied
from tpgrpo.policy.transitions import optimizer_steps
from tpgrpo.policy.update import LossStats, _apply_step, _context, _micro_batches, _MicroBatches

LOSS_KEYS = ("policy_loss", "kl", "anchor")


@dataclass(frozen=True)
class ObjectiveInputs:
    """What every micro-batch reads: the policy ``backend`` (LoRA attached), the prompts' ``embeds``, the
    ``units``, their clean latents ``latents`` ``(rows, C, H, W)`` float32 on the CPU (``Units.latent_row``
    indexes them), the sampler's ``guidance`` scale and ``schedule`` ``(T + 1,)``, the ``update`` params
    (``UpdateConfig``) and the processes."""

    backend: object
    embeds: object
    units: Units
    latents: torch.Tensor
    guidance: float
    schedule: torch.Tensor
    update: object
    dist: Dist = field(default_factory=Dist)


@dataclass
class ObjectiveResult:
    """The update's log (``update.json``) and the new slow adapter (NFT's old policy / AWM's EMA)."""

    log: dict
    slow: dict[str, torch.Tensor]


def clean_latents(arrays: dict, name: str, source: str) -> torch.Tensor:
    """The clean latents ``(rows, C, H, W)`` the nft / awm units index: array ``name`` of a trajectory store read
    by ``read_trajectories`` (``final_latents`` of a chain, ``leaf_latents`` of a tree: each shape's ``units``,
    :mod:`tpgrpo.rollout_shape`). A store without them (sampled under grpo) is one line naming it (``source``)."""
    from tpgrpo.io.schemas import ArtifactError

    if name not in arrays:
        raise ArtifactError(f"{source}: no array '{name}' (the rollout keeps the clean samples only under "
                            "update.objective nft or awm): re-run the rollout")
    return torch.from_numpy(arrays[name])


def epoch_items(inputs: ObjectiveInputs, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The epoch's M items, shuffled: ``(unit (M,), t (M,), eps (M, C, H, W))`` from one generator seeded by
    ``seed`` (the same on every process)."""
    cfg = inputs.update
    gen = torch.Generator().manual_seed(int(seed))
    per_unit = cfg.nft_levels if cfg.objective == "nft" else cfg.awm_levels
    candidates = obj.level_candidates(inputs.schedule, cfg.objective)
    unit, t = obj.choose_levels(candidates, inputs.units.ceiling, per_unit, gen)
    eps = torch.randn((unit.numel(), *inputs.latents.shape[1:]), generator=gen)
    order = torch.randperm(unit.numel(), generator=gen)
    return unit[order], t[order], eps[order]


def _velocities(inputs: ObjectiveInputs, x_t, t, emb, slow, need_base: bool):
    """The policy's velocity (with gradient) and, without gradient, the slow adapter's (None when not
    weighted or needed) and the base model's (None unless ``need_base``); ``(B, C, H, W)`` each."""
    backend, g = inputs.backend, inputs.guidance
    with torch.no_grad():
        v_slow = None
        if slow is not None:
            with weights_applied(backend, slow):
                v_slow = backend.velocity(x_t, t, emb, g)
        v_base = None
        if need_base:
            with reference_mode(backend):
                v_base = backend.velocity(x_t, t, emb, g)
    return backend.velocity(x_t, t, emb, g), v_slow, v_base


def micro_batch_loss(inputs: ObjectiveInputs, unit, t, eps, slow) -> tuple[obj.ObjectiveLoss, int]:
    """The objective's loss on B items (``unit``, ``t`` ``(B,)``, ``eps`` ``(B, C, H, W)``) and the forward
    passes it took."""
    cfg, units, dev = inputs.update, inputs.units, inputs.backend.device
    x0 = inputs.latents[units.latent_row[unit]].to(dev)
    eps, t = eps.to(dev), t.to(dev)
    adv = units.advantage[unit].to(dev)
    emb = inputs.embeds.select(units.prompt_index[unit])
    x_t = obj.noised(x0, eps, t)
    if cfg.objective == "nft":
        v, v_old, v_base = _velocities(inputs, x_t, t, emb, slow, cfg.nft_kl > 0)
        out = obj.nft_loss(v, v_old, x_t, x0, t, adv, cfg.nft_beta, v_base, cfg.nft_kl)
    else:
        ema = slow if cfg.awm_ema_weight > 0 else None
        v, v_ema, v_base = _velocities(inputs, x_t, t, emb, ema, cfg.awm_kl > 0)
        out = obj.awm_loss(v, x0, eps, t, adv, cfg.awm_p, v_base, cfg.awm_kl, v_ema, cfg.awm_ema_weight)
    passes = 1 + (v_base is not None) + (cfg.objective == "nft" or cfg.awm_ema_weight > 0)
    return out, passes * int(unit.numel())


def _accumulate(inputs: ObjectiveInputs, items, stats: LossStats, slow, ctx: str, counter: _MicroBatches) -> None:
    """This process's share of one optimizer step's items, micro-batch by micro-batch, each loss weighted by
    its share of the step (the sum over processes is the step's mean)."""
    unit, t, eps = items
    mine = even_slice(unit.numel(), inputs.dist.world, inputs.dist.rank)
    mb = inputs.update.micro_batch
    for start in range(mine.start, mine.stop, mb):
        part = slice(start, min(start + mb, mine.stop))
        out, passes = micro_batch_loss(inputs, unit[part], t[part], eps[part], slow)
        loss = float(out.loss.detach())
        if not math.isfinite(loss):
            raise PipelineError(f"update{ctx}: non-finite {inputs.update.objective} loss ({loss}); weights left "
                                "unchanged by it")
        (out.loss * ((part.stop - part.start) / unit.numel())).backward()
        stats.add(part.stop - part.start, policy_loss=out.policy_loss, kl=out.kl, anchor=out.anchor)
        counter.done(passes)


def train_objective(inputs: ObjectiveInputs, optimizer, seeds: Sequence[int], slow: dict[str, torch.Tensor],
                    ema: LoraEMA | None = None, iteration: int | None = None,
                    progress: Callable[[int, int], None] | None = None, after_sample: int = 64) -> ObjectiveResult:
    """The iteration's nft / awm update (module docstring): one epoch per seed. ``slow``: the slow adapter the
    iteration starts from (NFT's old policy, which sampled the rollout; AWM's EMA). Returns the log and the
    new slow adapter; the backend holds the new policy. A non-finite loss or gradient stops before its step."""
    cfg, backend = inputs.update, inputs.backend
    sampler = slow if cfg.objective == "nft" else lora_state_dict(backend)  # the weights that sampled the data
    epochs = [epoch_items(inputs, seed) for seed in seeds]
    total = int(epochs[0][0].numel()) if epochs else 0
    steps = optimizer_steps(total, cfg.optimizer_steps_per_iter // len(seeds), cfg.min_transitions_per_step)
    parts = torch.tensor_split(torch.arange(total), steps) if total else []
    counter = _MicroBatches(progress, len(seeds) * sum(_micro_batches(p.numel(), inputs.dist, cfg.micro_batch)
                                                       for p in parts))
    log: dict = {"objective": cfg.objective, "epochs": len(seeds), "num_samples": len(inputs.units),
                 "num_noisings": total, "optimizer_steps": steps * len(seeds) if total else 0}
    per_epoch = []
    optimizer.zero_grad(set_to_none=True)
    for items in epochs:
        stats, norms = LossStats(LOSS_KEYS), []
        for step, part in enumerate(parts):
            ctx = _context(iteration, f"optimizer step {step + 1}/{steps}")
            _accumulate(inputs, tuple(x[part] for x in items), stats, slow, ctx, counter)
            norms.append(_apply_step(inputs, optimizer, ema, ctx))
            if cfg.objective == "awm":  # the EMA follows every optimizer step
                d = obj.slow_decay(optimizer_step_count(optimizer), cfg.awm_ema_decay_rate, cfg.awm_ema_decay_max)
                slow = obj.blend(slow, lora_state_dict(backend), d)
        stats.reduce(inputs.dist)
        per_epoch.append({**stats.means(), "grad_norm": sum(norms) / len(norms) if norms else 0.0})
    if cfg.objective == "nft":  # the old policy moves once per iteration, after its steps
        d = obj.slow_decay(optimizer_step_count(optimizer), cfg.nft_decay_rate, cfg.nft_decay_max)
        slow = obj.blend(slow, lora_state_dict(backend), d)
        log["old_decay"] = d
    for key in (*LOSS_KEYS, "grad_norm"):
        log[key] = sum(e[key] for e in per_epoch) / max(1, len(per_epoch))
        log[f"{key}_per_epoch"] = [e[key] for e in per_epoch]
    sample = tuple(x[:after_sample] for x in epochs[-1]) if epochs else None
    log["approx_kl_after"] = _moved(inputs, sample, sampler, counter) if total else 0.0
    log["forward_passes"] = int(inputs.dist.reduce(torch.tensor([counter.passes], dtype=torch.int64), "sum",
                                                   "update metrics")[0])
    log["processes"] = inputs.dist.world
    return ObjectiveResult(log, slow)


@torch.no_grad()
def _moved(inputs: ObjectiveInputs, items, sampler: dict[str, torch.Tensor], counter: _MicroBatches) -> float:
    """How far the policy moved from the sampling policy: ``0.5 mean((v_new - v_sampler)^2)`` over ``items``
    (the velocity-space counterpart of the grpo update's ``approx_kl_after``), split and reduced over processes."""
    unit, t, eps = items
    units, dev, mb = inputs.units, inputs.backend.device, inputs.update.micro_batch
    mine = even_slice(unit.numel(), inputs.dist.world, inputs.dist.rank)
    total = 0.0
    for start in range(mine.start, mine.stop, mb):
        u, tt = unit[start:min(start + mb, mine.stop)], t[start:min(start + mb, mine.stop)].to(dev)
        x_t = obj.noised(inputs.latents[units.latent_row[u]].to(dev), eps[start:start + u.numel()].to(dev), tt)
        emb = inputs.embeds.select(units.prompt_index[u])
        v_new = inputs.backend.velocity(x_t, tt, emb, inputs.guidance)
        with weights_applied(inputs.backend, sampler):
            v_old = inputs.backend.velocity(x_t, tt, emb, inputs.guidance)
        total += float((v_new - v_old).pow(2).flatten(1).mean(1).sum())
        counter.done(2 * u.numel(), trained=False)
    summed = inputs.dist.reduce(torch.tensor([total, float(mine.stop - mine.start)], dtype=torch.float64), "sum",
                                "update metrics")
    return 0.5 * float(summed[0]) / max(1.0, float(summed[1]))
