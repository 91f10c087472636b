"""The paper's headline in its own form: how soon each mode reaches Flow-GRPO's best held-out reward.

The paper reports that TP-GRPO reaches Flow-GRPO's final reward in about a third of the steps. Here the
target is Flow-GRPO's best held-out reward within the iteration budget (the mean over its training seeds,
at the evaluated iterations every seed has); for each main mode, the iteration at which its own mean curve
first reaches it (linear between evaluated iterations: with ``eval.every`` = 6 the curve is known at 0, 6,
12 only, so this is a coarse estimate) and the training seconds there, with and without model loading (mean
over the seeds every mode has: seeds added later ran under other machine load). The same crossing per
training seed gives the interval over seeds (a t interval, where every seed reaches it).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import pandas as pd

from tpgrpo.comparison.runs import BASELINE_MODE
from tpgrpo.comparison.stats import t_quantile

COLUMNS = ["variant", "seeds", "time_seeds", "target", "target_iteration", "iteration", "first_evaluated", "seconds",
           "net_seconds", "seeds_reaching", "per_seed_iteration", "iteration_lo", "iteration_hi", "seconds_lo",
           "seconds_hi", "fraction_of_flow_iterations"]


def crossing(xs: Sequence[float], ys: Sequence[float], target: float) -> float:
    """The first x at which the curve (xs ascending, ys) reaches ``target``, linear between points; NaN if
    it never does. A curve that starts at or above the target gives xs[0]."""
    xs, ys = np.asarray(xs, dtype=float), np.asarray(ys, dtype=float)
    above = np.flatnonzero(ys >= target)
    if not len(above):
        return float("nan")
    k = int(above[0])
    if k == 0:
        return float(xs[0])
    return float(xs[k - 1] + (target - ys[k - 1]) * (xs[k] - xs[k - 1]) / (ys[k] - ys[k - 1]))


def _curve(curves: pd.DataFrame, variant: str, budget: int) -> pd.DataFrame:
    """Per evaluated iteration <= budget that every seed of ``variant`` has: the eval reward and cumulative
    seconds (gross and net) of each seed, columns (iteration, seed, eval_reward, cum_seconds, net_cum_seconds)."""
    rows = curves[(curves["variant"] == variant) & (curves["iteration"] <= budget)].dropna(subset=["eval_reward"])
    seeds = rows["seed"].nunique()
    complete = rows.groupby("iteration")["seed"].transform("nunique") == seeds
    return rows[complete].sort_values(["iteration", "seed"])


def _interval(values: Sequence[float]) -> tuple[float, float]:
    """A 95% t interval over seeds of ``values``; NaN where fewer than 2 or any seed never got there."""
    v = np.asarray(values, dtype=float)
    if len(v) < 2 or not np.isfinite(v).all():
        return float("nan"), float("nan")
    half = t_quantile(0.975, len(v) - 1) * v.std(ddof=1) / np.sqrt(len(v))
    return float(v.mean() - half), float(v.mean() + half)


def headline_row(curves: pd.DataFrame, variant: str, budget: int, target: float, target_iteration: int,
                 time_seeds: Sequence[int]) -> dict:
    """One mode's row of :func:`headline_table`; seconds from the runs of ``time_seeds`` only."""
    c = _curve(curves, variant, budget)
    mean = c.groupby("iteration")[["eval_reward"]].mean()
    clock = c[c["seed"].isin(time_seeds)].groupby("iteration")[["cum_seconds", "net_cum_seconds"]].mean()
    it = crossing(mean.index, mean["eval_reward"], target)
    reached = mean.index[mean["eval_reward"].to_numpy() >= target]
    at = (lambda col: float(np.interp(it, clock.index, clock[col])) if np.isfinite(it) else float("nan"))  # noqa: E731
    per_seed, per_seed_s = [], []
    for seed, g in c.groupby("seed"):
        x = crossing(g["iteration"], g["eval_reward"], target)
        per_seed.append(x)
        if seed in time_seeds:
            per_seed_s.append(float(np.interp(x, g["iteration"], g["cum_seconds"])) if np.isfinite(x) else np.nan)
    lo, hi = _interval(per_seed)
    s_lo, s_hi = _interval(per_seed_s)
    return {"variant": variant, "seeds": ",".join(str(s) for s in sorted(c["seed"].unique())),
            "time_seeds": ",".join(map(str, time_seeds)), "target": target,
            "target_iteration": target_iteration, "iteration": it,
            "first_evaluated": int(reached[0]) if len(reached) else np.nan, "seconds": at("cum_seconds"),
            "net_seconds": at("net_cum_seconds"), "seeds_reaching": int(np.isfinite(per_seed).sum()),
            "per_seed_iteration": ", ".join("-" if not np.isfinite(x) else f"{x:.1f}" for x in per_seed),
            "iteration_lo": lo, "iteration_hi": hi, "seconds_lo": s_lo, "seconds_hi": s_hi,
            "fraction_of_flow_iterations": it / target_iteration if target_iteration else np.nan}


def headline_table(curves: pd.DataFrame, runs: dict) -> pd.DataFrame:
    """Per main variant (``runs``: ``{variant: {seed: run}}``) how soon it reaches Flow-GRPO's best held-out
    reward within the budget (within its extra iterations for a mode extended at equal wall clock, as a
    cheaper tree is): see the module docstring. Empty without main flow_grpo runs, or where
    flow_grpo's mean never rose above the base model's (there is then no reward to reach)."""
    main = [v for v, seeds in runs.items() if next(iter(seeds.values()))["family"] == "main"]
    if BASELINE_MODE not in main:
        return pd.DataFrame(columns=COLUMNS)
    budget = min(int(r["budget"]) for v in main for r in runs[v].values())
    flow_budget = min(int(r["budget"]) for r in runs[BASELINE_MODE].values())  # its best over its own budget
    flow = _curve(curves, BASELINE_MODE, flow_budget).groupby("iteration")["eval_reward"].mean()
    trained = flow[flow.index > 0]
    if trained.empty or trained.max() <= flow.get(0, -np.inf):  # no target: it never rose above the base model
        return pd.DataFrame(columns=COLUMNS)
    target, target_iteration = float(trained.max()), int(trained.idxmax())
    order = [BASELINE_MODE, *sorted(set(main) - {BASELINE_MODE})]
    # seconds from the seeds every mode has: runs trained side by side; seeds added later ran under other load
    time_seeds = sorted(set.intersection(*(set(runs[v]) for v in order)))
    rows = [headline_row(curves, v, _horizon(runs[v], budget) if v != BASELINE_MODE else flow_budget, target,
                         target_iteration, time_seeds) for v in order]
    return pd.DataFrame(rows, columns=COLUMNS)


def _horizon(seeds: dict, budget: int) -> int:
    """How far a mode's curve is followed: the budget, or, for a mode the equal-wall pass extended (an arm
    cheaper than flow_grpo, such as a tree), the iterations every seed of it was given: it reaches Flow-GRPO's
    best there, if at all, and its seconds say what that cost."""
    return max(budget, min(int(r["params"]["train"]["iterations"]) for r in seeds.values()))
