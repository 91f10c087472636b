"""Stage summary: one row per iteration of every stage's metrics, for `dvc plots show` and README tables.

Writes ``data/metrics/history.csv`` (x = iteration; the base model is iteration -1) and
``data/metrics/summary.json`` (first vs last evaluation).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tpgrpo.artifacts import IterationPaths, atomic_path, read_json, write_json
from tpgrpo.config import Config

COLUMNS = {
    "rollout": ["mean_reward", "strict_accuracy", "wall_seconds", "forward_passes"],
    "probe": ["zero_increment_fraction", "wall_seconds", "forward_passes"],
    "credit": ["turning_point_rate", "incremental_abs_mean", "trend_mean", "wall_seconds"],
    "update": ["approx_kl", "clip_fraction", "approx_kl_after", "clip_fraction_after",
               "first_pass_ratio_max_dev", "policy_loss", "grad_norm", "wall_seconds", "forward_passes"],
    "eval": ["eval_reward", "eval_strict_accuracy", "train_reward", "wall_seconds"],
}


def history(cfg: Config, root: Path) -> pd.DataFrame:
    base = read_json(root / "data" / "iters" / "baseline_eval.json", "baseline eval: run the baseline stage")
    rows = [{"iteration": -1, **{f"eval_{k}": base.get(k) for k in COLUMNS["eval"]}}]
    for i in range(cfg.train.iterations):
        paths = IterationPaths(root, i)
        row: dict = {"iteration": i}
        for stage, keys in COLUMNS.items():
            m = read_json(getattr(paths, f"{stage}_metrics"), f"{stage} metrics of iteration {i}")
            if stage == "eval" and not m.get("evaluated"):
                continue
            row.update({f"{stage}_{k}": m.get(k) for k in keys})
        rows.append(row)
    return pd.DataFrame(rows)


def run(cfg: Config, iteration: int | None, root: Path) -> dict:
    frame = history(cfg, root)
    out = root / "data" / "metrics"
    with atomic_path(out / "history.csv") as tmp:
        frame.to_csv(tmp, index=False)
    evaluated = frame.dropna(subset=["eval_eval_reward"])
    first, last = evaluated.iloc[0], evaluated.iloc[-1]
    summary = {
        "base_eval_reward": float(first["eval_eval_reward"]), "final_eval_reward": float(last["eval_eval_reward"]),
        "eval_reward_gain": float(last["eval_eval_reward"] - first["eval_eval_reward"]),
        "base_train_reward": float(first["eval_train_reward"]),
        "final_train_reward": float(last["eval_train_reward"]),
        "base_strict_accuracy": float(first["eval_eval_strict_accuracy"]),
        "final_strict_accuracy": float(last["eval_eval_strict_accuracy"]),
        "iterations": int(cfg.train.iterations),
    }
    write_json(out / "summary.json", summary)
    print(json.dumps(summary, indent=2))
    return summary
