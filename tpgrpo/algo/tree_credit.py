"""Credit on an ODE-anchored tree (spec sections 5-6 run along root-to-leaf paths).

Input per edge e (E edges, any order): ``Q(parent)``, ``Q(child)`` (each the reward of the leaf reached from
that node by ODE children: exact, see :mod:`tpgrpo.algo.tree`), ``parent_edge`` (-1 below a root),
``depth`` j (the path's split index: the chain's window step k), ``sde`` and the prompt group.

Per edge, along the unique path from its root:
- increment ``d = Q(child) - Q(parent)`` (an ODE edge's is exactly 0: its child reaches its parent's leaf);
- previous increment ``d_prev`` = the parent edge's increment (the path's step k - 1);
- ``Q_0`` = Q of the path's root;
- the edge's final reward ``F``, defined ONCE per edge although an edge lies on many root-to-leaf paths:

  ``edge_return="mean"`` (the default): F = the mean reward of the leaves below the child, the child's value
  under the tree's own later branching, ODE children's leaves included (BranchGRPO's node values are such
  subtree means). Why: it is the only one of the two
  choices under which TP's aggregated reward carries anything beyond the increment. With
  ``edge_return="ode"`` (F = Q(child), the ODE path's leaf), ``B = F - Q(parent) = d`` and the rest
  ``F - Q(child) = 0``, so the consistency condition never holds: ``tp`` and ``tp_unconstrained`` replace
  ``d`` by ``B = d``, i.e. both collapse to ``incremental``. "ode" is kept for offline replay
  (``bench/tree_credit_replay.py``).

Then, as in :mod:`tpgrpo.algo.credit`: trend ``D = F - Q_0``, aggregated ``B = F - Q(parent)``, rest
``F - Q(child)`` (0 at the last depth: it is never a turning point), turning points by
:func:`tpgrpo.algo.credit.turning_points` on the pair (previous step, this step), balanced by
:func:`tpgrpo.algo.credit.balance_turning_points` within each prompt group (all depths together, as the chain
balances all window steps of a group). Step reward: ``flow_grpo`` F; ``incremental`` d; ``tp`` /
``tp_unconstrained`` B at a kept turning point, else d. Advantages (``tree.baseline``): ``ode_sibling`` (the
default, :func:`sibling_advantages`): each SDE edge's step reward minus its ODE sibling's (the deterministic
step from the same parent), centred and scaled per depth over the iteration's SDE edges, so the trained
advantages have mean 0; ``depth_group`` (the earlier default, :func:`tree_advantages`): normalised among the
nodes of the same prompt at the same depth, ODE children included, then 0 on ODE edges, which leaves the trained
ones a shared-sign mean. An ODE edge has no policy and is never trained: its advantage is 0 either way.

:func:`tree_credit_table` is the credit stage's table: from the long ``schemas.PROBE_TREE`` table (rows (edge,
step 0..1): Q(parent), Q(child), the tree columns) to the chain's ``credit.parquet`` contract with K = 1 (one
row per edge, step 0), so the update reads it unchanged. ``edge_return`` is an argument so an offline replay
(``bench/tree_credit_replay.py``) computes the alternative from the same table.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from tpgrpo.algo.advantages import group_advantages
from tpgrpo.algo.credit import BALANCE_MODES, CREDIT_MODES, balance_turning_points, turning_points

EDGE_RETURNS = ("mean", "ode")


@dataclass(frozen=True)
class TreeCreditResult:
    """Credit of E edges, all ``(E,)`` float64 (reward units) unless noted: ``incremental`` d, ``aggregated``
    B, ``trend`` D, ``edge_return`` F, ``turning_point`` (bool, kept), ``candidate_turning_point`` (bool,
    before balancing), ``step_reward``."""

    incremental: torch.Tensor
    aggregated: torch.Tensor
    trend: torch.Tensor
    edge_return: torch.Tensor
    turning_point: torch.Tensor
    candidate_turning_point: torch.Tensor
    step_reward: torch.Tensor


def _by_depth(depth: torch.Tensor) -> list[torch.Tensor]:
    """Edge indices per depth 0..max, each ascending."""
    return [torch.nonzero(depth == j).flatten() for j in range(int(depth.max()) + 1)] if depth.numel() else []


def check_tree(parent_edge: torch.Tensor, depth: torch.Tensor, sde: torch.Tensor) -> None:
    """ValueError (one line naming the edge) unless every edge of depth 0 hangs from a root (-1), every other
    edge from an edge one depth up, and every node with children has exactly one ODE child."""
    E = depth.numel()
    if parent_edge.shape != (E,) or sde.shape != (E,):
        raise ValueError(f"tree arrays must all be ({E},), got parent_edge {tuple(parent_edge.shape)}, "
                         f"sde {tuple(sde.shape)}")
    top = depth == 0
    bad = (top & (parent_edge != -1)) | (~top & ((parent_edge < 0) | (parent_edge >= E)))
    if not bad.any():
        bad = ~top & (depth[parent_edge.clamp(0, max(E - 1, 0))] != depth - 1)
    if bad.any():
        e = int(bad.nonzero()[0])
        raise ValueError(f"tree edge {e}: parent edge {int(parent_edge[e])} does not sit one depth above "
                         f"depth {int(depth[e])}")
    inner = parent_edge[~top]
    if inner.numel():
        ode_kids = torch.bincount(inner[~sde[~top]], minlength=E)[inner]
        if (ode_kids != 1).any():
            e = int(inner[ode_kids != 1][0])
            raise ValueError(f"tree edge {e}: its child has {int(ode_kids[ode_kids != 1][0])} ODE children, "
                             "expected exactly 1")


def leaf_means(q_child: torch.Tensor, parent_edge: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``(E,)`` mean reward of the leaves below each edge's child: Q(child) at the deepest depth of its
    subtree, else the leaf-count-weighted mean of its child edges' values (bottom-up, one depth at a time)."""
    sums, counts = q_child.double().clone(), torch.ones_like(q_child, dtype=torch.float64)
    has_kids = torch.zeros_like(depth, dtype=torch.bool)
    has_kids[parent_edge[parent_edge >= 0]] = True
    sums[has_kids], counts[has_kids] = 0.0, 0.0
    for rows in reversed(_by_depth(depth)[1:]):
        parents = parent_edge[rows]
        sums.index_add_(0, parents, sums[rows])
        counts.index_add_(0, parents, counts[rows])
    return sums / counts


def root_q(q_parent: torch.Tensor, parent_edge: torch.Tensor, depth: torch.Tensor) -> torch.Tensor:
    """``(E,)`` Q_0 of each edge's path: Q of its root (top-down over depths)."""
    q0 = q_parent.double().clone()
    for rows in _by_depth(depth)[1:]:
        q0[rows] = q0[parent_edge[rows]]
    return q0


def tree_credit(q_parent: torch.Tensor, q_child: torch.Tensor, parent_edge: torch.Tensor, depth: torch.Tensor,
                sde: torch.Tensor, group_ids: torch.Tensor, mode: str = "tp", balance: str = "group",
                edge_return: str = "mean") -> TreeCreditResult:
    """Step rewards of E tree edges (module docstring). Args ``(E,)`` each: Q's float, ``parent_edge`` /
    ``depth`` / ``group_ids`` int64, ``sde`` bool; ``mode`` one of ``CREDIT_MODES``; ``balance`` one of
    ``BALANCE_MODES``; ``edge_return`` ``mean`` | ``ode``. Returns :class:`TreeCreditResult`."""
    for name, value, allowed in (("mode", mode, CREDIT_MODES), ("balance", balance, BALANCE_MODES),
                                 ("edge_return", edge_return, EDGE_RETURNS)):
        if value not in allowed:
            raise ValueError(f"{name} must be one of {allowed}, got {value!r}")
    check_tree(parent_edge, depth, sde)
    qp, qc = q_parent.double(), q_child.double()
    if not (torch.isfinite(qp).all() and torch.isfinite(qc).all()):
        raise ValueError("tree Q values must be finite")
    d = qc - qp
    final = leaf_means(qc, parent_edge, depth) if edge_return == "mean" else qc.clone()
    trend, agg, rest = final - root_q(qp, parent_edge, depth), final - qp, final - qc
    d_prev = torch.where(parent_edge >= 0, d[parent_edge.clamp(min=0)], torch.zeros_like(d))
    top = depth == 0
    candidate = torch.zeros_like(top)
    if mode in ("tp", "tp_unconstrained"):
        constrained = mode == "tp"
        first = turning_points(d[:, None], trend, rest[:, None], constrained)[:, 0]
        later = turning_points(torch.stack([d_prev, d], 1), trend, torch.stack([rest, rest], 1), constrained)[:, 1]
        candidate = torch.where(top, first, later)
    kept = balance_turning_points(candidate[:, None], trend, group_ids)[:, 0] if balance == "group" else candidate
    if mode == "flow_grpo":
        step_reward = final.clone()
    else:
        step_reward = torch.where(kept, agg, d)
    return TreeCreditResult(incremental=d, aggregated=agg, trend=trend, edge_return=final, turning_point=kept,
                            candidate_turning_point=candidate, step_reward=step_reward)


BASELINES = ("ode_sibling", "depth_group")


def ode_siblings(parent_edge: torch.Tensor, root: torch.Tensor, sde: torch.Tensor) -> torch.Tensor:
    """``(E,)`` index of each edge's ODE sibling: the ODE edge out of the same parent node (an ODE edge is its
    own). The parent node is the parent edge's child, or the root (``root``, any integer id per edge) at depth 0;
    ``check_tree`` guarantees exactly one ODE child per node with children."""
    E = parent_edge.numel()
    key = root.long() * (E + 1) + (parent_edge.long() + 1)  # one key per parent node
    ode_of = {int(k): e for e, k in enumerate(key.tolist()) if not bool(sde[e])}
    missing = [e for e, k in enumerate(key.tolist()) if int(k) not in ode_of]
    if missing:
        raise ValueError(f"tree edge {missing[0]}: no ODE sibling (no ODE edge leaves its parent node)")
    return torch.tensor([ode_of[int(k)] for k in key.tolist()], dtype=torch.int64)


def sibling_advantages(step_reward: torch.Tensor, depth: torch.Tensor, sde: torch.Tensor,
                       sibling: torch.Tensor, eps: float = 1e-4, clip: float = 5.0) -> torch.Tensor:
    """``(E,)`` float64 centred advantages of the trained (SDE) edges; 0 on ODE edges.

    Per SDE edge, ``u = r - r(ODE sibling)``: the deterministic step from the same parent is the per-parent
    baseline (it removes the prompt's and the parent's level; for ``incremental`` r(ODE) = 0, so u = d).
    Then, per depth, over every SDE edge of the iteration (all prompts and roots: at depth 0 a prompt has
    only R x m of them, one in the default tree, too few to centre or scale on their own):
    ``A = (u - mean u) / (std u + eps)``, clipped to ``[-clip, clip]``. So the trained advantages of each
    depth have mean 0 (before clipping): no shared-sign push on every log-prob of a depth, which the
    group normalisation with the ODE children left (|policy_loss| ~0.1 on trees against 2e-5 on chains).
    A depth whose u are all equal gets 0. ``sibling`` is :func:`ode_siblings`' index."""
    r = step_reward.double()
    u = r - r[sibling]
    adv = torch.zeros_like(r)
    for j in torch.unique(depth).tolist():
        at = (depth == j) & sde
        if int(at.sum()) == 0:
            continue
        v = u[at]
        if bool((v == v[0]).all()):
            continue  # nothing to tell the edges apart (rounding of an equal mean must not make a signal)
        adv[at] = ((v - v.mean()) / (v.std(correction=0) + eps)).clamp(-clip, clip)
    return adv


def tree_advantages(step_reward: torch.Tensor, depth: torch.Tensor, sde: torch.Tensor, group_ids: torch.Tensor,
                    global_std: bool = False, clip: float = 5.0) -> torch.Tensor:
    """``(E,)`` float64 advantages, ``tree.baseline: depth_group`` (the earlier default):
    :func:`tpgrpo.algo.advantages.group_advantages` over the nodes of the same prompt at the same depth, ODE
    children included (``global_std``: the prompt group's mean, the std over every node of that depth,
    Flow-GRPO's ``global_std``), clipped to ``[-clip, clip]``; then 0 on ODE edges (no policy). The trained
    advantages of a group are NOT centred: the ODE child took part in the mean and is then dropped."""
    r, adv = step_reward.double(), torch.zeros(step_reward.numel(), dtype=torch.float64)
    for j in torch.unique(depth).tolist():  # each depth is its own "window step"
        at = depth == j
        adv[at] = group_advantages(r[at][:, None], group_ids[at], global_std=global_std, clip=clip)[:, 0]
    return torch.where(sde, adv, torch.zeros_like(adv))


def tree_credit_table(probe: pd.DataFrame, mode: str, balance: str, global_std: bool, clip: float,
                      edge_return: str = "mean", baseline: str = "ode_sibling") -> pd.DataFrame:
    """``schemas.CREDIT`` rows (edge, step 0) from a ``PROBE_TREE`` table (checked, sorted by (trajectory,
    step)); ``mode`` / ``balance`` / ``global_std`` / ``clip`` as the ``credit`` params, ``baseline`` as
    ``tree.baseline`` (:func:`sibling_advantages` or :func:`tree_advantages`). ``aggregated`` is B,
    ``trend`` D of each edge's path with its edge return; ODE edges' advantage is 0."""
    if baseline not in BASELINES:
        raise ValueError(f"baseline must be one of {BASELINES}, got {baseline!r}")
    import numpy as np
    import pandas as pd

    probe = probe.sort_values(["trajectory", "step"], kind="stable")
    heads = probe[probe.step == 0].reset_index(drop=True)
    tails = probe[probe.step == 1].reset_index(drop=True)
    as_t = lambda col, frame=heads, dtype=torch.int64: torch.tensor(frame[col].to_numpy(), dtype=dtype)  # noqa: E731
    group_ids = torch.tensor(pd.factorize(heads["prompt_id"])[0], dtype=torch.int64)
    depth, sde = as_t("depth"), as_t("sde", dtype=torch.bool)
    c = tree_credit(as_t("reward", dtype=torch.float64), as_t("reward", tails, torch.float64),
                    as_t("parent_trajectory"), depth, sde, group_ids, mode=mode, balance=balance,
                    edge_return=edge_return)
    if baseline == "ode_sibling":
        # A root is its prompt's and its seed's (each root has its own seeded noise): depth-0 siblings share it.
        root = torch.tensor(pd.factorize(pd.MultiIndex.from_arrays([heads["prompt_id"], heads["seed"]]))[0])
        sibling = ode_siblings(as_t("parent_trajectory"), root, sde)
        adv = sibling_advantages(c.step_reward, depth, sde, sibling, clip=clip)
    else:
        adv = tree_advantages(c.step_reward, depth, sde, group_ids, global_std=global_std, clip=clip)
    f64 = lambda t: t.numpy().astype(np.float64)  # noqa: E731
    return pd.DataFrame({
        "trajectory": heads["trajectory"].to_numpy(), "prompt_id": heads["prompt_id"].to_numpy(),
        "sample": heads["sample"].to_numpy(), "step": np.zeros(len(heads), dtype=np.int64),
        "incremental": f64(c.incremental), "aggregated": f64(c.aggregated), "trend": f64(c.trend),
        "turning_point": c.turning_point.numpy().astype(bool), "step_reward": f64(c.step_reward),
        "advantage": f64(adv),
    })
