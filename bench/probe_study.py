"""The offline study of cheap probe completions: stored exact probes vs candidates.

Used by ``python -m bench.probe_cost --runs DIR [DIR ...]``: each DIR is a trained project (``tpgrpo run`` or
``tpgrpo compare run``, credit mode tp, ``probe.completion: exact``, code recent enough that its rollouts
stored ``velocities``). For every iteration of every run it reads the stored exact ``probe.parquet`` and
``trajectories.zarr``, scores each candidate ``probe.completion`` on the same states with the same policy
(``tpgrpo.policy.probe_scoring.score_states``; nothing is written to the run), runs the credit stage's function on both
tables and compares: sign agreement of the increments d_k, turning-point recall / precision, the
advantages' Pearson correlation, the credit table's difference (mean |A - A_exact|, share of turning-point
flags that differ), transformer passes and wall seconds. Candidates named ``subset:F`` are a credit replay:
the first ceil(F x P) prompt groups of an iteration (P groups) keep the exact table's tp credit, the rest get
Flow-GRPO's (R_fin at every step); passes are F' x exact's (F' the share of groups probed), no model runs.
"""

from __future__ import annotations

import math
import time
from pathlib import Path

import numpy as np


def iterations_of(run: Path) -> list[int]:
    """The iterations of ``run`` with a stored probe table, in order."""
    folders = sorted(p for p in (run / "data" / "iters").iterdir() if p.name.isdigit())
    return [int(p.name) for p in folders if (p / "probe.parquet").is_file() and (p / "trajectories.zarr").is_dir()]


def summarize(table, cfg) -> dict:
    """Q (N, K+1), d (N, K), credit tp's turning points and advantages (N, K) of one probe table."""
    from tpgrpo.algo.credit_table import credit_table

    n = table["trajectory"].nunique()
    q = table["reward"].to_numpy().reshape(n, -1)
    credit = credit_table(table, cfg)
    k = q.shape[1] - 1
    return {"q": q, "d": np.diff(q, axis=1), "tp": credit["turning_point"].to_numpy().reshape(n, k),
            "adv": credit["advantage"].to_numpy().reshape(n, k)}


def credit_difference(mode: dict, exact: dict) -> dict:
    """How far the credit stage's output moves: mean |A - A_exact| and the share of differing TP flags."""
    return {"adv_mean_abs_diff": float(np.abs(mode["adv"] - exact["adv"]).mean()),
            "tp_flag_diff": float((mode["tp"] != exact["tp"]).mean())}


def candidate(cfg, run: Path, iteration: int, name: str, arrays: dict, attrs: dict) -> tuple[dict, int, float]:
    """Score ``name`` on the iteration's stored states: (summary, transformer passes, wall seconds)."""
    from tpgrpo.algo.probe_modes import parse_completion
    from tpgrpo.config import load_config
    from tpgrpo.io.probe_table import probe_table
    from tpgrpo.policy.probe_scoring import score_states

    completion = parse_completion(name)
    mode_cfg = load_config(run / "params.yaml", {"probe.completion": name})
    start = time.perf_counter()
    merged, _ = score_states(mode_cfg, iteration, run, arrays, attrs, completion)
    wall = time.perf_counter() - start
    table = probe_table(arrays, attrs["prompts"], merged["reward"], merged["strict"])
    return summarize(table, cfg), int(merged["passes"].sum()), wall


def subset_replay(table, cfg, fraction: float) -> tuple[dict, float]:
    """Credit replay: tp on the exact table for the first ceil(fraction x P) prompt groups, Flow-GRPO's
    credit for the rest. Returns (summary, share of groups probed)."""
    import dataclasses

    from tpgrpo.algo.credit_table import credit_table

    exact = summarize(table, cfg)
    flow_cfg = dataclasses.replace(cfg, credit=dataclasses.replace(cfg.credit, mode="flow_grpo"))
    flow = credit_table(table, flow_cfg)
    n, k = exact["adv"].shape
    groups = table.loc[table.step == 0, "prompt_id"].to_numpy()
    order = list(dict.fromkeys(groups))  # groups in trajectory order
    keep = set(order[:math.ceil(fraction * len(order))])
    probed = np.isin(groups, list(keep))[:, None]  # (N, 1)
    return {"q": exact["q"], "d": np.where(probed, exact["d"], 0.0),
            "tp": np.where(probed, exact["tp"], False),
            "adv": np.where(probed, exact["adv"], flow["advantage"].to_numpy().reshape(n, k))}, len(keep) / len(order)


def study(runs: list[Path], names: list[str], compare, threads: int) -> dict:
    """Every candidate against exact on every (run, iteration): per-cell rows and their mean / std."""
    import json

    from tpgrpo.config import load_config
    from tpgrpo.io.artifacts import IterationPaths, read_table
    from tpgrpo.io.stage_logs import read_log
    from tpgrpo.io.schemas import PROBE
    from tpgrpo.io.trajectories import read_trajectories

    cells = []
    for run in runs:
        cfg = load_config(run / "params.yaml")
        for it in iterations_of(run):
            paths = IterationPaths(run, it)
            table = read_table(paths.probe, PROBE, "probe.parquet")
            logged = read_log(paths.probe_metrics, "probe.json")  # seconds: its timing sidecar
            exact = summarize(table, cfg)
            arrays, attrs = read_trajectories(paths.trajectories, lazy=("states", "x0_estimates", "velocities"))
            n = exact["adv"].shape[0]
            rows = {"exact": {"passes_per_trajectory": logged["forward_passes"] / n,
                              "wall_seconds": logged["wall_seconds"]}}
            for name in names:
                if name.startswith("subset:"):
                    got, share = subset_replay(table, cfg, float(name.split(":")[1]))
                    passes, wall = share * logged["forward_passes"], 0.0
                else:
                    got, passes, wall = candidate(cfg, run, it, name, arrays, attrs)
                rows[name] = {"passes_per_trajectory": passes / n, "wall_seconds": wall, **compare(got, exact),
                              **credit_difference(got, exact)}
                print(f"{run.name} it {it} {name}: " + json.dumps({k: round(v, 4) for k, v in rows[name].items()
                                                                    if isinstance(v, float)}), flush=True)
            cells.append({"run": str(run), "iteration": it, "trajectories": n, "modes": rows})
    return {"threads": threads, "cells": cells, "summary": aggregate(cells, ["exact", *names])}


def aggregate(cells: list[dict], names: list[str]) -> dict:
    """Mean and std (ddof 0) over the (run, iteration) cells of each metric of each candidate."""
    out = {}
    for name in names:
        keys = cells[0]["modes"][name].keys()
        out[name] = {}
        for key in keys:
            values = np.array([c["modes"][name][key] for c in cells], dtype=float)
            out[name][key] = {"mean": float(np.nanmean(values)), "std": float(np.nanstd(values)),
                              "cells": int(np.isfinite(values).sum())}
    return out


def table_markdown(summary: dict, exact_passes: float) -> str:
    """The study's table: mean +- std over cells, passes as a share of exact's."""
    cols = [("d_sign_agree", "sign of d_k agrees"), ("tp_recall", "exact TPs found"),
            ("tp_precision", "found TPs that are exact"), ("adv_corr", "corr. of advantages"),
            ("adv_mean_abs_diff", "mean abs. adv. diff"), ("tp_flag_diff", "TP flags differing")]
    lines = ["| mode | passes / trajectory | share of exact's | wall s / iteration | "
             + " | ".join(label for _, label in cols) + " |", "|---" * (4 + len(cols)) + "|"]
    for name, m in summary.items():
        passes = m["passes_per_trajectory"]["mean"]
        same = {"adv_mean_abs_diff": "0", "tp_flag_diff": "0"}  # exact against itself
        cells = [f"{m[k]['mean']:.3f} ± {m[k]['std']:.3f}" if k in m else same.get(k, "1") for k, _ in cols]
        lines.append(f"| {name} | {passes:.1f} | {passes / exact_passes:.0%} | {m['wall_seconds']['mean']:.1f} | "
                     + " | ".join(cells) + " |")
    return "\n".join(lines)
