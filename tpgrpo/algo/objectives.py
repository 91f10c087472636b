"""The forward-process objectives (``update.objective`` nft / awm, docs/objectives.md): pure maths on tensors.

Both train the velocity model on forward-process noisings ``x_t = (1 - t) x0 + t eps`` of the rollout's clean
samples ``x0`` (rectified-flow convention of :mod:`tpgrpo.algo.schedule`: the flow-matching target is
``eps - x0``), weighted by the credit tables' advantages. No SDE log-prob is needed. Shapes: ``B`` noised
samples of latents ``(B, C, H, W)`` (any trailing dims); ``t`` and advantages ``(B,)``; losses are 0-d.

- DiffusionNFT: the implicit policies ``v+ = b v + (1 - b) v_old`` and ``v- = (1 + b) v_old - b v`` (they
  average to ``v_old``), each scored in x0 space with a self-normalised squared error; the advantage mixes them.
- AWM: on-policy, the gradient of ``-A exp(log p - log p_old)`` at ratio 1 is that of ``A (t/p) ell^p`` with
  ``ell`` the per-sample mean flow-matching error: an advantage-weighted, robustly weighted flow-matching loss.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

NFT_ADV_CLIP = 5.0  # DiffusionNFT clips advantages to +-5 and scales its loss by the same 5
NFT_MIN_SCALE = 1e-5  # the floor of the self-normalising factor (as the public script)
AWM_MIN_ERROR = 1e-12  # ell^p has an infinite slope at 0 for p < 1: never evaluated below this


@dataclass(frozen=True)
class ObjectiveLoss:
    """One micro-batch's loss: ``loss`` (0-d, differentiable) = ``policy_loss`` + the weighted regularisers;
    ``kl`` (mean squared velocity distance to the adapter-disabled base, 0 without one) and ``anchor`` (to
    the slow adapter: NFT's old policy, diagnostic; AWM's EMA, weighted), both 0-d."""

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    anchor: torch.Tensor


def _per_sample_mean(x: torch.Tensor) -> torch.Tensor:
    """``(B, ...)`` -> ``(B,)`` mean over every non-batch dim."""
    return x.flatten(1).mean(dim=1)


def _bcast(t: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
    """``(B,)`` -> ``(B, 1, 1, ...)`` against ``like``."""
    return t.reshape(-1, *([1] * (like.ndim - 1))).to(like.dtype)


def _check_positive(name: str, value: float) -> None:
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{name} must be a finite number > 0, got {value}")


def noised(x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor) -> torch.Tensor:
    """The forward process ``x_t = (1 - t) x0 + t eps``: ``x0``, ``eps`` ``(B, ...)``, ``t`` ``(B,)``."""
    tb = _bcast(t, x0)
    return (1 - tb) * x0 + tb * eps


def implicit_policies(v: torch.Tensor, v_old: torch.Tensor, beta: float) -> tuple[torch.Tensor, torch.Tensor]:
    """DiffusionNFT's ``(v+, v-)``: ``v+ = b v + (1 - b) v_old``, ``v- = (1 + b) v_old - b v``, ``(B, ...)``
    each (``v_old`` detached). ``(v+ + v-) / 2 = v_old`` and ``v+ - v- = 2 b (v - v_old)``."""
    _check_positive("beta", beta)
    old = v_old.detach()
    return beta * v + (1 - beta) * old, (1 + beta) * old - beta * v


def nft_weight(advantages: torch.Tensor) -> torch.Tensor:
    """``r = clamp(0.5 + 0.5 clip(A, +-5) / 5, 0, 1)`` ``(B,)``: the weight of ``L+`` (``1 - r`` of ``L-``)."""
    a = advantages.detach().clamp(-NFT_ADV_CLIP, NFT_ADV_CLIP)
    return (0.5 + 0.5 * a / NFT_ADV_CLIP).clamp(0.0, 1.0)


def x0_error(x_t: torch.Tensor, v: torch.Tensor, t: torch.Tensor, x0: torch.Tensor) -> torch.Tensor:
    """``(B,)`` self-normalised x0-space error of velocity ``v``: with ``e = x_t - t v - x0``,
    ``mean(e^2) / stopgrad(max(mean|e|, 1e-5))`` per sample (DiffusionNFT's adaptive weighting)."""
    e = x_t - _bcast(t, x_t) * v - x0
    scale = _per_sample_mean(e.detach().abs()).clamp_min(NFT_MIN_SCALE)
    return _per_sample_mean(e.pow(2)) / scale


def nft_loss(v: torch.Tensor, v_old: torch.Tensor, x_t: torch.Tensor, x0: torch.Tensor, t: torch.Tensor,
             advantages: torch.Tensor, beta: float, v_base: torch.Tensor | None = None,
             kl_weight: float = 0.0) -> ObjectiveLoss:
    """DiffusionNFT: ``5 mean((r L+ + (1 - r) L-) / b) + kl_weight mean_B mean((v - v_base)^2)``.

    Args: ``v`` ``(B, C, H, W)`` the current policy's velocity at ``x_t`` (carries the gradient); ``v_old`` the
    old adapter's (no gradient); ``x_t`` the noised samples, ``x0`` the clean ones; ``t`` ``(B,)``;
    ``advantages`` ``(B,)``; ``beta`` b > 0; ``v_base`` the adapter-disabled model's velocity (None: no KL).
    ``L+-`` are :func:`x0_error` of ``v+-`` (:func:`implicit_policies`), ``r`` is :func:`nft_weight`.
    ``anchor`` reports mean ``(v - v_old)^2`` (not in the loss)."""
    if kl_weight > 0 and v_base is None:
        raise ValueError("kl_weight > 0 needs v_base")
    v_pos, v_neg = implicit_policies(v, v_old, beta)
    r = nft_weight(advantages).to(v.dtype)
    per_sample = (r * x0_error(x_t, v_pos, t, x0) + (1 - r) * x0_error(x_t, v_neg, t, x0)) / beta
    policy = NFT_ADV_CLIP * per_sample.mean()
    kl = _velocity_distance(v, v_base)
    anchor = _velocity_distance(v.detach(), v_old)
    return ObjectiveLoss(policy + kl_weight * kl, policy, kl, anchor)


def flow_matching_error(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor) -> torch.Tensor:
    """``ell`` ``(B,)``: per-sample mean of ``(v - (eps - x0))^2``, the flow-matching error."""
    return _per_sample_mean((v - (eps - x0)).pow(2))


def awm_loss(v: torch.Tensor, x0: torch.Tensor, eps: torch.Tensor, t: torch.Tensor, advantages: torch.Tensor,
             p: float, v_base: torch.Tensor | None = None, kl_weight: float = 0.0,
             v_ema: torch.Tensor | None = None, ema_weight: float = 0.0) -> ObjectiveLoss:
    """AWM on-policy: ``mean(A (t / p) ell^p) + kl_weight mean((v - v_base)^2) + ema_weight mean((v - v_ema)^2)``.

    Args: ``v`` ``(B, C, H, W)`` the policy's velocity at ``x_t = (1 - t) x0 + t eps`` (carries the gradient);
    ``x0``, ``eps`` the clean sample and its noise; ``t``, ``advantages`` ``(B,)``; ``p`` > 0; ``v_base`` /
    ``v_ema`` the base model's / the EMA adapter's velocity (no gradient; None: that term is 0).
    ``-(t/p) ell^p`` is AWM's surrogate log-prob; at ratio 1 the PPO surrogate ``-A ratio`` has this gradient."""
    _check_positive("p", p)
    if (kl_weight > 0 and v_base is None) or (ema_weight > 0 and v_ema is None):
        raise ValueError("a regulariser with a weight > 0 needs its velocity (v_base, v_ema)")
    ell = flow_matching_error(v, x0, eps).clamp_min(AWM_MIN_ERROR)
    policy = (advantages.detach().to(v.dtype) * t.to(v.dtype) / p * ell.pow(p)).mean()
    kl, anchor = _velocity_distance(v, v_base), _velocity_distance(v, v_ema)
    return ObjectiveLoss(policy + kl_weight * kl + ema_weight * anchor, policy, kl, anchor)


def _velocity_distance(v: torch.Tensor, other: torch.Tensor | None) -> torch.Tensor:
    """0-d ``mean_B mean((v - other)^2)`` (``other`` detached); 0 when ``other`` is None."""
    if other is None:
        return torch.zeros((), dtype=v.dtype, device=v.device)
    return _per_sample_mean((v - other.detach()).pow(2)).mean()


def slow_decay(step: int, rate: float, cap: float) -> float:
    """The slow adapter's decay ``d = min(rate x step, cap)`` after ``step`` optimizer steps in all (NFT's old
    policy: rate 0.001, cap 0.5; AWM's EMA: 0.001, 0.3). ``d = 0`` makes it a copy of the current weights."""
    if step < 0 or rate < 0 or not 0.0 <= cap <= 1.0:
        raise ValueError(f"need step >= 0, rate >= 0 and cap in [0, 1], got {step}, {rate}, {cap}")
    return min(rate * step, cap)


@torch.no_grad()
def blend(slow: dict[str, torch.Tensor], current: dict[str, torch.Tensor], decay: float) -> dict[str, torch.Tensor]:
    """``d slow + (1 - d) current`` per weight (new tensors; the same keys in both, else ValueError)."""
    if set(slow) != set(current):
        raise ValueError("slow and current adapters hold different LoRA weights")
    return {k: (decay * slow[k].float() + (1.0 - decay) * current[k].float()).contiguous() for k in sorted(slow)}


def level_candidates(schedule: torch.Tensor, objective: str) -> torch.Tensor:
    """The noise levels an objective trains at, from the sampler's schedule ``(T + 1,)`` (``s_0 = 1 > ... >
    s_T = 0``): NFT the step levels ``s_0 .. s_{T-1}``; AWM those without ``t = 1`` and the two lowest
    (``s_1 .. s_{T-3}``; at least ``s_1``, on a schedule that short)."""
    steps = schedule[:-1]
    if objective == "nft":
        return steps.clone()
    if objective == "awm":
        return steps[1:max(2, steps.numel() - 2)].clone()
    raise ValueError(f"objective must be nft or awm, got {objective!r}")


def choose_levels(candidates: torch.Tensor, ceilings: torch.Tensor, per_unit: int,
                  generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """For each of U units, ``min(per_unit, available)`` distinct levels drawn at random from ``candidates``
    ``(L,)`` at or below its ceiling (``ceilings`` ``(U,)``, 1 = every level). Returns ``(unit, t)`` ``(M,)``
    each, units ascending; a unit with no level at or below its ceiling gets none."""
    units, levels = [], []
    for u, ceiling in enumerate(ceilings.tolist()):
        allowed = candidates[candidates <= ceiling + 1e-6]
        pick = torch.randperm(allowed.numel(), generator=generator)[:per_unit]
        units += [u] * pick.numel()
        levels.append(allowed[pick])
    t = torch.cat(levels) if levels else torch.zeros(0)
    return torch.tensor(units, dtype=torch.int64), t.float()
