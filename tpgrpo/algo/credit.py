"""Step-wise credit assignment of TP-GRPO (spec section 5), vectorised over trajectories.

Input: for N trajectories the probe rewards ``Q_0..Q_K`` (``Q_k`` = reward of the ODE completion of
the state before window step k, ``Q_K = R_fin``). Output: per-step rewards ``r_k`` and the turning-point
bookkeeping. Signs and ranks are decided in float64 so that results do not depend on how the rewards
were rounded on the way in; reward-valued outputs come back in the input's floating dtype.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

CREDIT_MODES = ("flow_grpo", "incremental", "tp", "tp_unconstrained")
BALANCE_MODES = ("none", "group")


@dataclass(frozen=True)
class CreditResult:
    """Credit of N trajectories with K window steps (spec section 5). All ``(N, K)`` unless noted.

    Fields:
        incremental: ``d_k = Q_{k+1} - Q_k`` (paper r_t), reward units.
        aggregated: ``B_k = R_fin - Q_k`` (paper r_t^agg, includes step k itself).
        trend: ``(N,)`` global trend ``D = R_fin - Q_0``.
        alignment: int8 ``a_k = sign(d_k) * sign(D)`` in {-1, 0, 1}.
        turning_point: bool, the turning points that replace ``d_k`` by ``B_k`` -- after balancing;
            all False for ``flow_grpo`` and ``incremental``.
        step_reward: ``r_k`` fed to the advantages (section 6).
        candidate_turning_point: bool, the turning points before balancing (for logging the sign
            balance; equal to ``turning_point`` when ``balance="none"``).
    """

    incremental: torch.Tensor
    aggregated: torch.Tensor
    trend: torch.Tensor
    alignment: torch.Tensor
    turning_point: torch.Tensor
    step_reward: torch.Tensor
    candidate_turning_point: torch.Tensor


def _validate(rewards: torch.Tensor, group_ids: torch.Tensor, mode: str, balance: str) -> None:
    """Raise ValueError with a one-line message for any malformed argument."""
    if mode not in CREDIT_MODES:
        raise ValueError(f"mode must be one of {CREDIT_MODES}, got {mode!r}")
    if balance not in BALANCE_MODES:
        raise ValueError(f"balance must be one of {BALANCE_MODES}, got {balance!r}")
    if rewards.ndim != 2 or rewards.shape[1] < 2 or not rewards.is_floating_point():
        raise ValueError(f"rewards must be a float (N, K+1) tensor with K >= 1, "
                         f"got {rewards.dtype} {tuple(rewards.shape)}")
    n = rewards.shape[0]
    if group_ids.shape != (n,) or group_ids.is_floating_point() or group_ids.dtype == torch.bool:
        raise ValueError(f"group_ids must be an integer ({n},) tensor, got {group_ids.dtype} {tuple(group_ids.shape)}")
    bad = (~torch.isfinite(rewards)).any(dim=1).nonzero()
    if bad.numel():
        raise ValueError(f"rewards must be finite, row {int(bad[0])} is not: {rewards[int(bad[0])].tolist()}")


def turning_points(d: torch.Tensor, trend: torch.Tensor, rest: torch.Tensor, constrained: bool) -> torch.Tensor:
    """Turning-point mask ``(N, K)`` before balancing (spec section 5, paper Def. 4.1/5.1, Remark 5.2).

    Args:
        d: ``(N, K)`` incremental rewards ``d_k``.
        trend: ``(N,)`` ``D = R_fin - Q_0``.
        rest: ``(N, K)`` ``R_fin - Q_{k+1}`` (the change still to come after step k; 0 at k = K-1).
        constrained: True for ``tp`` (Def. 5.1 consistency), False for ``tp_unconstrained``.

    k >= 1: ``a_{k-1} < 0 and a_k > 0`` (the local trend flips INTO the global direction), plus, when
    constrained, ``sign(d_k) sign(rest_k) > 0``. k = 0 (no earlier step to flip from): constrained
    ``sign(d_0) sign(rest_0) > 0``; unconstrained ``a_0 > 0``. A zero sign never fires.
    """
    sd = torch.sign(d)
    align = sd * torch.sign(trend)[:, None]
    consistent = sd * torch.sign(rest) > 0
    flip = torch.zeros_like(consistent)
    flip[:, 1:] = (align[:, :-1] < 0) & (align[:, 1:] > 0)
    if constrained:
        tp = flip & consistent
        tp[:, 0] = consistent[:, 0]
    else:
        tp = flip
        tp[:, 0] = align[:, 0] > 0
    return tp


def balance_turning_points(tp: torch.Tensor, trend: torch.Tensor, group_ids: torch.Tensor) -> torch.Tensor:
    """Keep equally many positive- and negative-trend turning points per prompt group (paper App. D).

    Args:
        tp: ``(N, K)`` bool candidate turning points (every one has ``D != 0``).
        trend: ``(N,)`` trends ``D``; its sign is the turning point's sign.
        group_ids: ``(N,)`` integer prompt-group ids (any values, need not be contiguous).

    Returns: ``(N, K)`` bool, the kept turning points. Per group, with P positive and M negative
    candidates: where P > 0 and M > 0, ``min(P, M)`` of each sign are kept: all of the smaller side
    and, of the larger side, those with the largest ``|D|``; ties in ``|D|`` go to the smaller
    (trajectory index, step), i.e. row-major order. Where P == 0 or M == 0 (one sign, or none) the
    group's turning points are kept unchanged, as the release does (spec section 5). Balancing within
    a prompt group (not the release's per-GPU batch) keeps the result independent of how the work is
    split over processes.
    """
    rows, cols = tp.nonzero(as_tuple=True)  # row-major, i.e. ascending (trajectory, step)
    if rows.numel() == 0:
        return tp.clone()
    _, group = torch.unique(group_ids, return_inverse=True)
    num_groups = int(group.max()) + 1
    # Bucket = (group, sign): 2g for D > 0, 2g + 1 for D < 0.
    bucket = 2 * group[rows] + (trend[rows] < 0).long()
    # Order by bucket, then |D| descending, then (trajectory, step): two stable sorts, the second
    # preserving the order established by the first (the nonzero order already gives the last key).
    order = torch.sort(-trend[rows].abs(), stable=True).indices
    order = order[torch.sort(bucket[order], stable=True).indices]
    counts = torch.bincount(bucket, minlength=2 * num_groups)
    starts = torch.cumsum(counts, 0) - counts
    rank = torch.arange(order.numel(), device=tp.device) - starts[bucket[order]]
    quota = torch.minimum(counts[0::2], counts[1::2])  # (num_groups,); 0 where a group has one sign
    one_sign = quota == 0  # nothing to balance against: keep every turning point of the group
    group_sorted = bucket[order] // 2
    keep_sorted = (rank < quota[group_sorted]) | one_sign[group_sorted]
    kept = torch.zeros_like(tp)
    kept[rows[order], cols[order]] = keep_sorted
    return kept


def compute_credit(rewards: torch.Tensor, group_ids: torch.Tensor, mode: str = "tp",
                   balance: str = "group") -> CreditResult:
    """Step rewards from probe rewards (spec section 5).

    Args:
        rewards: ``(N, K+1)`` float, ``rewards[n, k] = Q_k`` for k < K and ``rewards[n, K] = R_fin``.
        group_ids: ``(N,)`` integer prompt-group id of each trajectory.
        mode: ``flow_grpo`` (``R_fin`` at every step), ``incremental`` (``d_k`` everywhere),
            ``tp`` (``B_k`` at consistent turning points, else ``d_k``), ``tp_unconstrained``.
        balance: ``group`` (balance turning-point signs within each prompt group) or ``none``.

    Returns: ``CreditResult``; see its docstring for the fields and their shapes.
    """
    _validate(rewards, group_ids, mode, balance)
    out_dtype = rewards.dtype
    q = rewards.double()
    r_fin = q[:, -1:]
    d = q[:, 1:] - q[:, :-1]
    agg = r_fin - q[:, :-1]
    rest = r_fin - q[:, 1:]  # R_fin - Q_{k+1}; exactly 0 for the last window step
    trend = r_fin[:, 0] - q[:, 0]
    alignment = (torch.sign(d) * torch.sign(trend)[:, None]).to(torch.int8)
    if mode in ("tp", "tp_unconstrained"):
        candidate = turning_points(d, trend, rest, constrained=(mode == "tp"))
        tp = balance_turning_points(candidate, trend, group_ids) if balance == "group" else candidate.clone()
    else:
        candidate = torch.zeros_like(d, dtype=torch.bool)
        tp = candidate.clone()
    if mode == "flow_grpo":
        step_reward = r_fin.expand_as(d).clone()
    else:
        step_reward = torch.where(tp, agg, d)  # replace (not add) at turning points
    return CreditResult(
        incremental=d.to(out_dtype), aggregated=agg.to(out_dtype), trend=trend.to(out_dtype),
        alignment=alignment, turning_point=tp, step_reward=step_reward.to(out_dtype),
        candidate_turning_point=candidate,
    )
