"""Plain-loop reference of spec sections 5-6, for tests only.

Written straight from the spec's sentences, one trajectory (and one group) at a time, on Python
floats and lists; it deliberately shares no code with ``tpgrpo.algo.credit`` / ``tpgrpo.algo.advantages``.
"""

from __future__ import annotations

import math


def sign(x: float) -> int:
    """-1, 0 or +1."""
    return (x > 0) - (x < 0)


def trajectory_credit(q: list[float], mode: str) -> dict:
    """Credit of one trajectory from ``q = [Q_0, ..., Q_K]`` (``Q_K = R_fin``), before balancing."""
    k_steps = len(q) - 1
    r_fin = q[k_steps]
    d = [q[k + 1] - q[k] for k in range(k_steps)]
    trend = r_fin - q[0]
    agg = [r_fin - q[k] for k in range(k_steps)]
    align = [sign(d[k]) * sign(trend) for k in range(k_steps)]
    tp = []
    for k in range(k_steps):
        consistent = sign(d[k]) * sign(r_fin - q[k + 1]) > 0
        if mode == "tp":
            if k == 0:
                is_tp = consistent
            else:
                is_tp = align[k - 1] < 0 and align[k] > 0 and consistent
        elif mode == "tp_unconstrained":
            if k == 0:
                is_tp = align[0] > 0
            else:
                is_tp = align[k - 1] < 0 and align[k] > 0
        else:
            is_tp = False
        tp.append(is_tp)
    return {"d": d, "D": trend, "B": agg, "a": align, "tp": tp, "r_fin": r_fin}


def reference_credit(rewards: list[list[float]], group_ids: list[int], mode: str, balance: str) -> dict:
    """Turning points (after balancing) and step rewards for a whole table, with plain loops.

    Balancing (spec section 5): a group with P positive- and M negative-trend turning points, P > 0 and
    M > 0, keeps min(P, M) of each sign (largest |D| first); a group with one sign or none keeps all.
    """
    per_traj = [trajectory_credit(row, mode) for row in rewards]
    candidates = [list(t["tp"]) for t in per_traj]
    kept = [list(t["tp"]) for t in per_traj]
    if balance == "group":
        for g in sorted(set(group_ids)):
            pos, neg = [], []
            for n, t in enumerate(per_traj):
                if group_ids[n] != g:
                    continue
                for k, is_tp in enumerate(t["tp"]):
                    if is_tp:
                        (pos if t["D"] > 0 else neg).append((-abs(t["D"]), n, k))
            if not pos or not neg:
                continue  # one sign (or none): the group keeps its turning points unchanged
            m = min(len(pos), len(neg))
            for side in (pos, neg):
                side.sort()  # largest |D| first, then trajectory index, then step
                for _, n, k in side[m:]:
                    kept[n][k] = False
    step_reward = []
    for n, t in enumerate(per_traj):
        row = []
        for k in range(len(t["d"])):
            if mode == "flow_grpo":
                row.append(t["r_fin"])
            elif kept[n][k]:
                row.append(t["B"][k])
            else:
                row.append(t["d"][k])
        step_reward.append(row)
    return {
        "d": [t["d"] for t in per_traj], "D": [t["D"] for t in per_traj], "B": [t["B"] for t in per_traj],
        "a": [t["a"] for t in per_traj], "candidate": candidates, "tp": kept, "step_reward": step_reward,
    }


def reference_advantages(step_reward: list[list[float]], group_ids: list[int], global_std: bool = False,
                         eps: float = 1e-4, clip: float = 5.0) -> list[list[float]]:
    """Per step, per group ``(r - mean) / (std + eps)`` (population std), clipped; constant group -> 0."""
    n_rows = len(step_reward)
    k_steps = len(step_reward[0]) if n_rows else 0
    adv = [[0.0] * k_steps for _ in range(n_rows)]
    for k in range(k_steps):
        column = [step_reward[n][k] for n in range(n_rows)]
        all_mean = sum(column) / n_rows
        all_std = math.sqrt(sum((x - all_mean) ** 2 for x in column) / n_rows)
        for g in set(group_ids):
            members = [n for n in range(n_rows) if group_ids[n] == g]
            values = [column[n] for n in members]
            mean = sum(values) / len(values)
            std = all_std if global_std else math.sqrt(sum((x - mean) ** 2 for x in values) / len(values))
            for n in members:
                if max(values) == min(values):
                    adv[n][k] = 0.0
                else:
                    adv[n][k] = max(-clip, min(clip, (column[n] - mean) / (std + eps)))
    return adv
