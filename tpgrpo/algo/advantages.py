"""Group-relative advantages per window step (spec section 6), vectorised with index_add / scatter."""

from __future__ import annotations

import math

import torch


def group_advantages(step_reward: torch.Tensor, group_ids: torch.Tensor, global_std: bool = False,
                     eps: float = 1e-4, clip: float = 5.0) -> torch.Tensor:
    """GRPO advantages ``A = (r - mean) / (std + eps)`` per window step, clipped to ``[-clip, clip]``.

    Args:
        step_reward: ``(N, K)`` float step rewards ``r_k`` (from ``credit.compute_credit``).
        group_ids: ``(N,)`` integer prompt-group ids (any values, need not be contiguous).
        global_std: False: the std of the trajectory's prompt group at that step (Flow-GRPO's
            per-prompt tracker); True: the std over all N samples at that step (Flow-GRPO's
            ``global_std``). The mean is always the prompt group's.
        eps: added to the std (1e-4 in Flow-GRPO), > 0.
        clip: symmetric clip bound (5 in Flow-GRPO), > 0.

    Returns: ``(N, K)`` advantages, dimensionless, in ``step_reward``'s dtype. Stds are population
    stds (ddof 0). Each step k is normalised separately. A group whose rewards at a step are all
    identical gets exactly 0 there (computed mean can differ from the common value by rounding; that
    residue is not a signal and must not mark the sample as informative).
    """
    if step_reward.ndim != 2 or not step_reward.is_floating_point():
        got = f"{step_reward.dtype} {tuple(step_reward.shape)}"
        raise ValueError(f"step_reward must be a float (N, K) tensor, got {got}")
    n = step_reward.shape[0]
    if group_ids.shape != (n,) or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer ({n},) tensor, got {group_ids.dtype} {tuple(group_ids.shape)}")
    if not (math.isfinite(eps) and eps > 0):
        raise ValueError(f"eps must be a finite number > 0, got {eps}")
    if not clip > 0:
        raise ValueError(f"clip must be > 0, got {clip}")
    r = step_reward.double()
    # float64 so that the group sums do not lose the small differences that carry the signal.
    _, group = torch.unique(group_ids, return_inverse=True)  # arbitrary ids -> 0..G-1
    num_groups = int(group.max()) + 1 if group.numel() else 0
    counts = torch.bincount(group, minlength=num_groups).to(r.dtype)[:, None]  # (G, 1)
    mean = torch.zeros(num_groups, r.shape[1], dtype=r.dtype, device=r.device).index_add_(0, group, r) / counts
    centered = r - mean[group]
    if global_std:
        std = r.std(dim=0, correction=0, keepdim=True)  # (1, K), over all samples of each step
    else:
        var = torch.zeros_like(mean).index_add_(0, group, centered**2) / counts
        std = var.sqrt()[group]
    index = group[:, None].expand_as(r)
    hi = torch.full_like(mean, -math.inf).scatter_reduce(0, index, r, "amax")
    lo = torch.full_like(mean, math.inf).scatter_reduce(0, index, r, "amin")
    constant = (hi == lo)[group]
    adv = torch.where(constant, torch.zeros_like(r), centered / (std + eps))
    return adv.clamp(-clip, clip).to(step_reward.dtype)


def informative_samples(adv: torch.Tensor) -> torch.Tensor:
    """``(N,)`` bool: True where any step's advantage is non-zero (spec section 6).

    ``adv`` is ``(N, K)``; samples with ``False`` carry no policy-gradient signal and may be dropped.
    """
    if adv.ndim != 2:
        raise ValueError(f"adv must be an (N, K) tensor, got shape {tuple(adv.shape)}")
    return (adv != 0).any(dim=1)
