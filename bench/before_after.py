"""One short run of the same params at two commits, side by side: stage seconds per iteration and staging overhead.

Usage: ``python -m bench.before_after --before REV --after REV [--set credit.mode=flow_grpo] [--iterations 3]
[--before-set KEY=VALUE] [--after-set KEY=VALUE]`` (per-side overrides, after ``--set``: e.g. the same commit with
``--before-set credit.mode=tp --after-set credit.mode=flow_grpo`` gives the TP / Flow-GRPO cost ratio).
For each commit (its files from ``git archive`` under --work: its own code, model and params.yaml): a fresh project with
the overrides, train.iterations N, 8 held-out prompts and eval.every 0 (only the baseline is evaluated; with
``--eval-as-params`` params.yaml's eval instead), then
``tpgrpo run`` timed. Prints per commit: the mean per-iteration ``wall_seconds`` of rollout, probe, credit and
update (from each stage's JSON; 0 where a stage did not run), the ``tpgrpo run`` wall, the sum of every
stage's ``wall_seconds``, and their ratio (the staging overhead: process start-up, imports, DVC); the
``dvc repro`` window (the stage server's start to the last ``dvc.lock`` write) and its ratio (the issue's
measure); the summary stage's own seconds where the commit logs them (and the window's ratio counting them as
stage compute); the final ``dvc.lock`` size. The two runs are sequential (``--parallel``: at the same time, so other load on the machine weighs on both alike), on the
same machine, with the same thread count.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import yaml

from bench.common import REPO  # noqa: E402 - the checkout
STAGES = ("rollout", "probe", "credit", "update")


def project(name: str, work: Path, overrides: dict, iterations: int, eval_as_params: bool = False,
            rev: str | None = None) -> Path:
    """``rev``'s files (git archive, in a fresh git repo; ``rev`` defaults to ``name``) under ``work/name``
    with its params.yaml overridden; DVC initialised by ``tpgrpo run``."""
    rev = rev or name
    folder = work / name
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", rev], cwd=REPO, capture_output=True, check=True).stdout
    subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    subprocess.run(["git", "init", "-q"], cwd=folder, check=True)  # older commits' `tpgrpo run` needs git
    params = yaml.safe_load((folder / "params.yaml").read_text())
    short_eval = {} if eval_as_params else {"eval.every": 0, "eval.num_prompts": 8}
    for dotted, value in {**overrides, "train.iterations": iterations, **short_eval}.items():
        section, key = dotted.split(".")
        params[section][key] = value
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return folder


def measure(folder: Path, iterations: int, threads: int, pure_yaml: bool = False) -> dict:
    path = str(folder)
    if pure_yaml:  # a module that shadows ruamel.yaml's C parser: its import fails, ruamel uses pure Python
        blocker = folder.parent / f"{folder.name}-pure-yaml"
        blocker.mkdir(exist_ok=True)
        (blocker / "_ruamel_yaml.py").write_text("raise ImportError('blocked by bench/before_after.py')\n")
        path += os.pathsep + str(blocker)
    env = dict(os.environ, PYTHONPATH=path, OMP_NUM_THREADS=str(threads), DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    start = time.perf_counter()
    done = subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=folder, env=env, capture_output=True,
                          text=True)
    wall = time.perf_counter() - start
    if done.returncode:
        raise SystemExit(f"{folder}: tpgrpo run failed: {done.stderr.strip()[-500:]}")
    logs = [json.loads(p.read_text()) for p in (folder / "data" / "iters").glob("**/*.json")
            if p.name not in ("summary.json", "summary_log.json")]
    folders = sorted(p for p in (folder / "data" / "iters").iterdir() if p.name.isdigit())  # numbered from 0 or 1
    assert len(folders) == iterations, folders
    from tpgrpo.io.stage_logs import log_seconds  # the sidecar, or the log itself at an older commit

    per_stage = {s: sum(log_seconds(f / f"{s}.json") for f in folders
                        if (f / f"{s}.json").is_file()) / iterations for s in STAGES}
    stage_sum = sum(m.get("wall_seconds", 0.0) for m in logs)
    # The summary stage logs its own seconds since the code manifests (it samples two policies for the
    # figures); older commits do not, so the ratios leave it out on both sides and "repro_ratio_with_summary"
    # counts it as stage compute where it is known.
    summary_log = folder / "data" / "iters" / "summary_log.json"
    summary = json.loads(summary_log.read_text())["wall_seconds"] if summary_log.is_file() else None
    repro = repro_window(folder)
    return {"per_iteration": per_stage, "run_wall": wall, "stage_sum": stage_sum, "ratio": wall / stage_sum,
            "repro_window": repro, "repro_ratio": None if repro is None else repro / stage_sum,
            "summary_seconds": summary,
            "repro_ratio_with_summary": None if summary is None or repro is None else repro / (stage_sum + summary),
            "lock_bytes": (folder / "dvc.lock").stat().st_size}


def passes_per_trajectory(folder: Path) -> dict:
    """Transformer passes per trajectory and iteration, from the stages' JSON: rollout and probe (mean)."""
    folders = sorted(p for p in (folder / "data" / "iters").iterdir() if p.name.isdigit())
    out = {}
    for stage in ("rollout", "probe"):
        logs = [json.loads((f / f"{stage}.json").read_text()) for f in folders if (f / f"{stage}.json").is_file()]
        n = [json.loads((f / "rollout.json").read_text())["trajectories"] for f in folders]
        out[stage] = sum(m.get("forward_passes", 0) for m in logs) / max(sum(n), 1)
    return out


def repro_window(folder: Path) -> float | None:
    """Seconds from the stage server's start (its log file's birth) to the last ``dvc.lock`` write: the
    ``dvc repro`` part of ``tpgrpo run``, without DVC's first-run init and the final relink. None without
    a server log or where the filesystem keeps no birth time."""
    log = folder / ".dvc" / "tmp" / "stage_server.log"
    if not log.is_file():
        return None
    born = subprocess.run(["stat", "-c", "%W", str(log)], capture_output=True, text=True).stdout.strip()
    if not born.isdigit() or int(born) == 0:
        return None
    return (folder / "dvc.lock").stat().st_mtime - int(born)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default="HEAD")
    ap.add_argument("--set", dest="sets", action="append", default=["credit.mode=flow_grpo"])
    ap.add_argument("--before-set", dest="before_sets", action="append", default=[], help="before side only")
    ap.add_argument("--after-set", dest="after_sets", action="append", default=[], help="after side only")
    ap.add_argument("--iterations", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tpgrpo_before_after"))
    ap.add_argument("--parallel", action="store_true", help="run both at once (each with --threads threads)")
    ap.add_argument("--eval-as-params", action="store_true", help="keep params.yaml's eval (every, prompts)")
    ap.add_argument("--pure-yaml-before", action="store_true",
                    help="the before side without ruamel.yaml's C parser (a dependency only since 8f403ec)")
    args = ap.parse_args()
    parse = lambda sets: {k: yaml.safe_load(v) for k, v in (s.split("=", 1) for s in sets)}  # noqa: E731
    overrides = {"before": {**parse(args.sets), **parse(args.before_sets)},
                 "after": {**parse(args.sets), **parse(args.after_sets)}}
    args.work.mkdir(parents=True, exist_ok=True)
    rows = {}

    def one(label: str, rev: str) -> None:
        sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True, text=True).stdout
        folder = project(f"{label}-{sha.strip()}", args.work, overrides[label], args.iterations, args.eval_as_params,
                         rev=rev)
        rows[label] = measure(folder, args.iterations, args.threads, args.pure_yaml_before and label == "before")
        rows[label]["passes_per_trajectory"] = passes_per_trajectory(folder)
        print(label, sha.strip(), json.dumps({"overrides": overrides[label], **rows[label]}), flush=True)

    load_at_start = Path("/proc/loadavg").read_text().strip()
    sides = (("before", args.before), ("after", args.after))
    if args.parallel:  # both at once: whatever else loads the machine loads both alike
        with ThreadPoolExecutor(2) as pool:
            list(pool.map(lambda side: one(*side), sides))
    else:
        for side in sides:
            one(*side)
    rows = {label: rows[label] for label, _ in sides}
    b, a = rows["before"], rows["after"]
    print("| | " + " | ".join(f"{s} s/iter" for s in STAGES)
          + " | train s/iter | run wall s | stage sum s | ratio | repro window s | its ratio | summary s"
          + " | repro ratio, summary counted as a stage | dvc.lock KB |")
    print("|---|" + "---|" * (len(STAGES) + 9))
    for label, r in rows.items():
        train = sum(r["per_iteration"].values())
        print(f"| {label} | " + " | ".join(f"{r['per_iteration'][s]:.1f}" for s in STAGES)
              + f" | {train:.1f} | {r['run_wall']:.0f} | {r['stage_sum']:.0f} | {r['ratio']:.2f} | "
              + (f"{r['repro_window']:.0f} | {r['repro_ratio']:.3f} | " if r["repro_window"] else "- | - | ")
              + (f"{r['summary_seconds']:.1f} | {r['repro_ratio_with_summary']:.3f}"
                 if r["repro_ratio_with_summary"] else "- | -")
              + f" | {r['lock_bytes'] / 1000:.0f} |")
    print(f"train s/iter after / before: {sum(a['per_iteration'].values()) / sum(b['per_iteration'].values()):.2f}")
    for label, r in rows.items():
        print(f"{label}: passes per trajectory and iteration {r['passes_per_trajectory']}")
    print(f"load average at the start: {load_at_start}; at the end: {Path('/proc/loadavg').read_text().strip()}")


if __name__ == "__main__":
    main()
