"""Probe modes side by side on the SAME trajectories of the shipped model: cost and agreement with exact.

Usage: ``python -m bench.probe_cost [--model data/base] [--threads 1] [--seeds 1] [--modes exact,ode:1,ode:2,x0]
[--out result.json]``, or the offline study over trained runs' stored exact probes
(``bench/probe_study.py``): ``python -m bench.probe_cost --runs RUN [RUN ...] --modes grid:3,heun:2,subset:0.25
--out bench/results/probe_study.json [--markdown table.md]``.
In a temporary project with the repo's params.yaml (chains: 8 prompts x 8 samples, T = 10, window 9) one
first-iteration rollout per train seed keeps the x0 estimates (its states are the same as without them); then the probe
stage runs on it in every mode (exact, ode:1, ode:2, x0). (``credit.mode: flow_grpo`` runs no probe at all.)
Per mode it prints the probe's wall seconds (stage stopwatch: model load included, imports warm) and
transformer passes, and against exact: Pearson correlation of Q_k (k < K; Q_K is R_fin in every mode),
agreement of sign(d_k), turning points of credit mode tp (share of exact's found: recall; share of the
found that are exact's: precision) and the Pearson correlation of the advantages.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import yaml

from bench.common import REPO  # noqa: E402 - the checkout
MODES = ("exact", "ode:1", "ode:2", "x0")
FIRST = 1  # the first iteration's number (it samples from the base model)


def _project(folder: Path, model: Path) -> Path:
    (folder / "data").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "prompts", folder / "data" / "prompts")
    shutil.copytree(model, folder / "data" / "base")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["tree"]["enabled"] = False  # a chain: the probe's cost (pinned, whatever the default)
    (folder / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


def _probe(cfg, root: Path, iteration: int) -> dict:
    """Run the probe stage, then credit mode tp on its table: Q (N, K+1), d, turning points, advantages."""
    from bench.common import run_stage
    from tpgrpo.algo.credit_table import credit_table
    from tpgrpo.io.artifacts import IterationPaths, read_table
    from tpgrpo.io.schemas import PROBE

    metrics = run_stage("probe", cfg, iteration, root)
    table = read_table(IterationPaths(root, iteration).probe, PROBE, "probe.parquet")
    n = table["trajectory"].nunique()
    q = table["reward"].to_numpy().reshape(n, -1)
    credit = credit_table(table, cfg)
    k = q.shape[1] - 1
    return {"wall": metrics["wall_seconds"], "passes": metrics["forward_passes"], "q": q, "d": np.diff(q, axis=1),
            "tp": credit["turning_point"].to_numpy().reshape(n, k),
            "adv": credit["advantage"].to_numpy().reshape(n, k)}


def _pearson(a: np.ndarray, b: np.ndarray) -> float:
    a, b = a.reshape(-1), b.reshape(-1)
    if a.std() == 0 or b.std() == 0:
        return float("nan")
    return float(np.corrcoef(a, b)[0, 1])


def compare(mode: dict, exact: dict) -> dict:
    """Agreement of one mode's probe with the exact one (all over the N x K window states/steps)."""
    both = (mode["tp"] & exact["tp"]).sum()
    return {
        "q_corr": _pearson(mode["q"][:, :-1], exact["q"][:, :-1]),
        "d_sign_agree": float((np.sign(mode["d"]) == np.sign(exact["d"])).mean()),
        "tp_recall": float(both / max(exact["tp"].sum(), 1)),
        "tp_precision": float(both / mode["tp"].sum()) if mode["tp"].sum() else float("nan"),
        "tp_count": int(mode["tp"].sum()),
        "adv_corr": _pearson(mode["adv"], exact["adv"]),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "data" / "base")
    parser.add_argument("--threads", type=int, default=1, help="torch threads")
    parser.add_argument("--seeds", type=int, default=1, help="rollouts of the base model to pool (train.seed 0..)")
    parser.add_argument("--modes", default=",".join(MODES), help="probe.completion values, comma-separated")
    parser.add_argument("--out", type=Path, default=None, help="also write the numbers as JSON here")
    parser.add_argument("--runs", type=Path, nargs="+", default=None,
                        help="trained run folders: the offline study of their stored exact probes (probe_study.py)")
    parser.add_argument("--markdown", type=Path, default=None, help="with --runs: also write the table here")
    args = parser.parse_args()
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
    import torch

    torch.set_num_threads(args.threads)
    from tpgrpo.config import load_config

    if args.runs:
        return _study(args)
    modes = ["exact", *(m for m in args.modes.split(",") if m != "exact")]  # exact: the reference
    start = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="probe-modes-") as tmp:
        root = _project(Path(tmp) / "project", args.model)
        params = root / "params.yaml"
        runs: dict[str, list[dict]] = {m: [] for m in modes}
        rollout_wall = []
        for seed in range(args.seeds):  # the first iteration samples from the base model: no update needed
            from bench.common import run_stage

            cfg = lambda **o: load_config(params, {"train.seed": seed, **o})  # noqa: E731
            rollout_wall.append(run_stage("rollout", cfg(**{"probe.completion": "x0"}), FIRST, root)["wall_seconds"])
            for mode in modes:
                runs[mode].append(_probe(cfg(**{"probe.completion": mode}), root, FIRST))
    pooled = {m: {key: (np.concatenate([r[key] for r in rs]) if key in ("q", "d", "tp", "adv")
                        else sum(r[key] for r in rs)) for key in ("wall", "passes", "q", "d", "tp", "adv")}
              for m, rs in runs.items()}
    _report(pooled, rollout_wall, args, time.perf_counter() - start)


def _study(args) -> None:
    """The offline study: candidates against the runs' stored exact probes; JSON and a table."""
    from bench.probe_study import study, table_markdown

    start, load = time.perf_counter(), Path("/proc/loadavg").read_text().strip()
    result = study([r.resolve() for r in args.runs], [m for m in args.modes.split(",") if m != "exact"], compare,
                   args.threads)
    result.update({"total_seconds": time.perf_counter() - start, "load_average_start": load,
                   "load_average_end": Path("/proc/loadavg").read_text().strip(),
                   "cpu": _cpu_model(), "runs": [str(r) for r in args.runs]})
    table = table_markdown(result["summary"], result["summary"]["exact"]["passes_per_trajectory"]["mean"])
    print(table)
    if args.out:
        args.out.write_text(json.dumps(result, indent=2) + "\n")
    if args.markdown:
        args.markdown.write_text(table + "\n")


def _cpu_model() -> str:
    lines = [ln for ln in Path("/proc/cpuinfo").read_text().splitlines() if ln.startswith("model name")]
    return lines[0].split(":", 1)[1].strip() if lines else "unknown"


def _report(pooled: dict, rollout_wall: list[float], args, total: float) -> None:
    import torch

    exact = pooled["exact"]
    n, k = exact["adv"].shape
    print(f"probe modes on the same {n} trajectories (K = {k} window steps; {len(rollout_wall)} rollout(s) of "
          f"{args.model}), torch {torch.get_num_threads()} thread(s); rollout {sum(rollout_wall):.1f} s")
    print(f"{'mode':<16}{'probe s':>9}{'passes':>8}{'Q_k corr':>10}{'d_k sign':>10}{'TP found':>10}"
          f"{'TP exact':>10}{'TPs':>6}{'A corr':>8}")
    rows = {}
    for mode, run in pooled.items():
        c = compare(run, exact) if mode != "exact" else {}
        label = mode
        rows[label] = {"probe_seconds": run["wall"], "passes": int(run["passes"]), **c}
        fmt = lambda key: f"{c[key]:.3f}" if key in c else "-"  # noqa: E731
        tps = c.get("tp_count", int(run["tp"].sum()))
        print(f"{label:<16}{run['wall']:>9.2f}{int(run['passes']):>8}{fmt('q_corr'):>10}{fmt('d_sign_agree'):>10}"
              f"{fmt('tp_recall'):>10}{fmt('tp_precision'):>10}{tps!s:>6}{fmt('adv_corr'):>8}")
    print("TP found = share of exact's turning points the mode finds; TP exact = share of its turning points that "
          f"are exact's (credit mode tp, balance group). Total wall {total:.0f} s.")
    if args.out:
        args.out.write_text(json.dumps({"threads": torch.get_num_threads(), "trajectories": int(n), "window": int(k),
                                        "rollout_seconds": rollout_wall, "total_seconds": total, "modes": rows},
                                       indent=2) + "\n")


if __name__ == "__main__":
    main()
