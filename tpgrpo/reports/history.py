"""A run's history: every iteration's stage logs as one table, its curves and the numbers a user scans.

What the summary stage (``stages/summary.py``) and ``tpgrpo plot`` read: :func:`history` has one row per
iteration of every stage's metrics (the base model is iteration 0); :func:`eval_curve` (base + every evaluated
iteration), :func:`train_curve` (one row per iteration), :func:`headline` (``summary.json``) and
:func:`at_a_glance` (the run's DVC metrics, a small quantity x (base, latest, best) table) are cut from it.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tpgrpo.config import Config
from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.io.stage_logs import read_log
from tpgrpo.stage_params import BASELINE_LOG

COLUMNS = {
    "rollout": ["mean_reward", "strict_accuracy", "wall_seconds", "forward_passes"],
    "probe": ["zero_increment_fraction", "wall_seconds", "forward_passes"],
    "credit": ["turning_point_rate", "incremental_abs_mean", "trend_mean", "wall_seconds"],
    "update": ["approx_kl", "clip_fraction", "approx_kl_after", "clip_fraction_after",
               "first_pass_ratio_max_dev", "policy_loss", "grad_norm", "wall_seconds", "forward_passes"],
    "eval": ["eval_reward", "eval_strict_accuracy", "train_reward", "wall_seconds"],
}
STAGES = tuple(COLUMNS)


def baseline_path(root: Path) -> Path:
    return root / BASELINE_LOG


def summary_log_path(root: Path) -> Path:
    """The summary stage's log (its wall seconds, the figures it drew): not a DVC output."""
    return root / "data" / "iters" / "summary_log.json"


def history(cfg: Config, root: Path) -> pd.DataFrame:
    """One row per iteration (``iteration`` 1..N) plus the base model's row (``iteration`` 0). The
    ``*_wall_seconds`` columns come from each log's untracked timing sidecar (:mod:`tpgrpo.io.stage_logs`) as
    it is when the summary runs: the one place a tracked output holds seconds, which no DVC dependency
    records (a stage re-run by hand re-runs nothing, so the summary keeps the seconds of the run it read)."""
    base = read_log(baseline_path(root), "baseline eval: run the baseline stage")
    rows = [{"iteration": 0, **{f"eval_{k}": base.get(k) for k in COLUMNS["eval"]}}]
    for i in range(1, cfg.train.iterations + 1):
        paths = IterationPaths(root, i)
        row: dict = {"iteration": i}
        for stage, keys in COLUMNS.items():
            path = getattr(paths, f"{stage}_metrics")
            m = read_log(path, f"{stage} metrics of iteration {i}")  # seconds from its sidecar
            if stage == "eval" and not m.get("evaluated"):
                continue
            row.update({f"{stage}_{k}": m.get(k) for k in keys})
        rows.append(row)
    return pd.DataFrame(rows)


def eval_curve(frame: pd.DataFrame) -> pd.DataFrame:
    """Base model (iteration 0) and every evaluated iteration: held-out reward and strict accuracy."""
    rows = frame.dropna(subset=["eval_eval_reward"])
    return pd.DataFrame({"iteration": rows["iteration"].astype(int), "eval_reward": rows["eval_eval_reward"],
                         "strict_accuracy": rows["eval_eval_strict_accuracy"],
                         "train_reward": rows["eval_train_reward"]})


def train_curve(frame: pd.DataFrame) -> pd.DataFrame:
    """Per iteration: the rollout's reward, turning-point rate, approx KL after the update, wall seconds."""
    rows = frame[frame["iteration"] > 0]
    # reindex: a flow_grpo run made before its probe stage existed has no probe columns
    walls = rows.reindex(columns=[f"{s}_wall_seconds" for s in STAGES]).fillna(0.0).sum(axis=1)
    return pd.DataFrame({"iteration": rows["iteration"].astype(int), "train_reward": rows["rollout_mean_reward"],
                         "turning_point_rate": rows["credit_turning_point_rate"],
                         "approx_kl_after": rows["update_approx_kl_after"], "wall_seconds": walls})


def headline(evals: pd.DataFrame, train: pd.DataFrame) -> dict:
    """The numbers `dvc metrics show` prints: base / latest / best held-out reward and strict accuracy,
    the latest training reward, turning-point rate and approx KL, mean wall seconds per iteration."""
    base, trained = evals.iloc[0], evals.iloc[1:]
    latest = trained.iloc[-1] if len(trained) else base
    best = trained.loc[trained["eval_reward"].idxmax()] if len(trained) else base
    best_strict = trained.loc[trained["strict_accuracy"].idxmax()] if len(trained) else base  # a policy's best
    last = train.iloc[-1]
    r = lambda x: round(float(x), 4)  # noqa: E731 - 4 decimals: the eval's noise is ~1e-2
    return {
        "iterations": int(last["iteration"]),
        "held_out": {"base": r(base["eval_reward"]), "latest": r(latest["eval_reward"]),
                     "best": r(best["eval_reward"]), "best_iter": int(best["iteration"])},
        "strict": {"base": r(base["strict_accuracy"]), "latest": r(latest["strict_accuracy"]),
                   "best": r(best_strict["strict_accuracy"]), "best_iter": int(best_strict["iteration"])},
        "train_reward": r(last["train_reward"]), "tp_rate": r(last["turning_point_rate"]),
        "approx_kl": float(f"{float(last['approx_kl_after']):.3g}"),
        "s_per_iter": round(float(train["wall_seconds"].mean()), 1),
    }


# `dvc metrics show` prints one row per file and one column per key: a small table, quantity x
# (base, latest, best, best_at, mean), about 80 characters wide at any run length. DVC rounds to 5 decimals,
# so the approx KL (~1e-6) is given in units of 1e-6.


def at_a_glance(evals: pd.DataFrame, train: pd.DataFrame) -> dict[str, dict]:
    """The metric files' contents, ``{name: {column: value}}`` (base = the base model for the held-out rows,
    iteration 1 for the training rows, whose rollout samples the base model)."""
    head = headline(evals, train)
    first, last = train.iloc[0], train.iloc[-1]
    best_train = train.loc[train["train_reward"].idxmax()]
    r = lambda x: round(float(x), 4)  # noqa: E731
    return {
        "held_out": {**{k: head["held_out"][k] for k in ("base", "latest", "best")},
                     "best_at": head["held_out"]["best_iter"]},
        "strict": {**{k: head["strict"][k] for k in ("base", "latest", "best")},
                   "best_at": head["strict"]["best_iter"]},
        "train_reward": {"base": r(first["train_reward"]), "latest": r(last["train_reward"]),
                         "best": r(best_train["train_reward"]), "best_at": int(best_train["iteration"])},
        "tp_rate": {"base": r(first["turning_point_rate"]), "latest": r(last["turning_point_rate"]),
                    "mean": r(train["turning_point_rate"].mean())},
        "approx_kl_x1e6": {"base": r(first["approx_kl_after"] * 1e6), "latest": r(last["approx_kl_after"] * 1e6),
                           "mean": r(train["approx_kl_after"].mean() * 1e6)},
        "seconds_per_iter": {"latest": round(float(last["wall_seconds"]), 1), "mean": head["s_per_iter"]},
    }
