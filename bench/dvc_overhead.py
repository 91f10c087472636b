"""Where `dvc repro`'s own time goes between the stages: wall timers around DVC's per-stage pieces.

Usage: ``python -m bench.dvc_overhead [--rev REV[:pure] ...] [--iterations 4] [--threads 1] [--work DIR]``
(``:pure``: that commit with ruamel.yaml's pure-Python parser, as before ``ruamel.yaml.clib`` was a
dependency).

For each commit: a fresh project of its files with default params, ``train.iterations`` N, the baseline on
8 held-out prompts and no eval (``bench/before_after.py``'s project), DVC initialised, the stage server
started as ``tpgrpo run`` starts it, then ``dvc repro`` in a process that wraps DVC's functions with wall
timers (no profiler: its overhead would swamp the YAML parser's many small calls), with DVC patched as
``tpgrpo run``'s DVC is where the commit has ``tpgrpo.pipeline.dvc_integration.dvc_atomic`` (or, before
tpgrpo/pipeline/ had wings, ``tpgrpo.pipeline.dvc_atomic``):

- ``stage commands``: the stage processes (``cmd_run``), including each stage's client start, fork and
  whatever the stage does outside its own stopwatch;
- ``lock dump``: rewriting ``dvc.lock`` after each stage (``Lockfile.dump_stages``);
- ``stage.save`` (hashing deps and outs, the run-cache entry), ``stage.commit`` (outs to the cache),
  the run-cache restore check, ``params.yaml`` reads (inside those).

Prints per commit the seconds of each piece, the repro wall, the sum of the stages' own ``wall_seconds``
and the summary stage's (where the commit logs it). Several commits run one after the other.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from bench.before_after import REPO, project

# Runs inside the `dvc repro` process: wrap, run DVC's CLI, print the totals as one JSON line on stderr.
TIMED_DVC = r'''
import atexit, collections, json, os, sys, time
if os.environ.get("BENCH_PURE_YAML"):
    sys.modules["_ruamel_yaml"] = None  # ruamel.yaml then finds no C parser
tot, cnt = collections.Counter(), collections.Counter()
def wrap(obj, name, label):
    f = getattr(obj, name)
    def g(*a, **k):
        t = time.perf_counter()
        try:
            return f(*a, **k)
        finally:
            tot[label] += time.perf_counter() - t
            cnt[label] += 1
    setattr(obj, name, g)
try:  # DVC as `tpgrpo run` runs it (atomic writes; a stage's lock block only), where the commit has it
    try:
        from tpgrpo.pipeline.dvc_integration import dvc_atomic
    except ImportError:  # a commit before tpgrpo/pipeline/ had wings
        from tpgrpo.pipeline import dvc_atomic
    dvc_atomic.install()
except ImportError:
    pass
import dvc.dependency.param as pm, dvc.dvcfile as df, dvc.stage as st, dvc.stage.cache as sc, dvc.stage.run as sr
for obj, name, label in ((sr, "cmd_run", "stage commands"), (df.Lockfile, "dump_stages", "lock dump"),
                         (st.Stage, "save", "stage.save"), (st.Stage, "commit", "stage.commit"),
                         (sc.StageCache, "restore", "run-cache restore check"),
                         (pm.ParamsDependency, "read_params", "params.yaml reads")):
    wrap(obj, name, label)
t0 = time.perf_counter()
atexit.register(lambda: print("TIMED " + json.dumps({"wall": time.perf_counter() - t0, "seconds": tot,
                                                     "calls": cnt}), file=sys.stderr))
from dvc.cli import main
sys.exit(main(["repro"]))
'''


def measure(folder: Path, threads: int, pure_yaml: bool = False) -> dict:
    """DVC init as ``tpgrpo run`` does it, the stage server, and the timed ``dvc repro``."""
    env = dict(os.environ, PYTHONPATH=str(folder), OMP_NUM_THREADS=str(threads), DVC_NO_ANALYTICS="1",
               DVC_STUDIO_OFFLINE="true", BENCH_PURE_YAML="1" if pure_yaml else "")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env["PATH"]
    code = ("import sys, subprocess, yaml; from pathlib import Path; from tpgrpo.config import load_config\n"
            "try:\n"
            "    from tpgrpo.pipeline.execution import stage_server\n"
            "    from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml\n"
            "    from tpgrpo.pipeline.long_runs.sealing import dvc_env\n"
            "except ImportError:  # a commit before tpgrpo/pipeline/ had wings\n"
            "    from tpgrpo.pipeline import stage_server\n"
            "    from tpgrpo.pipeline.dvcfile import write_dvc_yaml\n"
            "    from tpgrpo.pipeline.sealing import dvc_env\n"
            "root = Path('.').resolve(); cfg = load_config('params.yaml'); write_dvc_yaml(cfg, root)\n"
            "with stage_server.running(root, stage_server.wanted(cfg)) as senv:\n"
            "    sys.exit(subprocess.run([sys.executable, '-c', sys.argv[1]], env={**dvc_env(), **senv}).returncode)")
    if not (folder / ".dvc").is_dir():
        subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=folder, env=env, check=True)
    done = subprocess.run([sys.executable, "-c", code, TIMED_DVC], cwd=folder, env=env, capture_output=True,
                          text=True)
    timed = [line for line in done.stderr.splitlines() if line.startswith("TIMED ")]
    if done.returncode or not timed:
        raise SystemExit(f"{folder}: dvc repro failed: {done.stderr.strip()[-800:]}")
    result = json.loads(timed[-1][6:])
    logs = [json.loads(p.read_text()) for p in (folder / "data" / "iters").glob("**/*.json")
            if p.name != "summary_log.json"]
    result["stage_sum"] = sum(m.get("wall_seconds", 0.0) for m in logs)
    summary = folder / "data" / "iters" / "summary_log.json"
    result["summary_seconds"] = json.loads(summary.read_text())["wall_seconds"] if summary.is_file() else None
    result["stages_run"] = result["calls"].get("stage commands", 0)
    result["lock_bytes"] = (folder / "dvc.lock").stat().st_size
    return result


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--rev", action="append", help="commit(s) to measure (default HEAD)")
    ap.add_argument("--iterations", type=int, default=4)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tpgrpo_dvc_overhead"))
    args = ap.parse_args()
    args.work.mkdir(parents=True, exist_ok=True)
    print(f"threads per stage {args.threads}; load average {os.getloadavg()[0]:.1f} at start; cpus {os.cpu_count()}")
    pieces = ("stage commands", "lock dump", "stage.save", "stage.commit", "run-cache restore check",
              "params.yaml reads")
    print("| commit | stages | repro wall s | " + " | ".join(f"{p} s" for p in pieces)
          + " | stages' own wall_seconds | summary s | DVC outside the stage commands s | dvc.lock KB |")
    print("|---|---|---|" + "---|" * (len(pieces) + 4))
    for spec in args.rev or ["HEAD"]:
        rev, _, how = spec.partition(":")
        sha = subprocess.run(["git", "rev-parse", "--short", rev], cwd=REPO, capture_output=True,
                             text=True).stdout.strip()
        started = time.perf_counter()
        folder = project(sha, args.work / (how or "c"), {}, args.iterations)
        r = measure(folder, args.threads, pure_yaml=how == "pure")
        sha += " (pure-Python YAML)" if how == "pure" else ""
        s = r["seconds"]
        summary = "-" if r["summary_seconds"] is None else f"{r['summary_seconds']:.1f}"
        print(f"| {sha} | {r['stages_run']} | {r['wall']:.1f} | " + " | ".join(f"{s.get(p, 0.0):.2f}" for p in pieces)
              + f" | {r['stage_sum']:.1f} | {summary} | {r['wall'] - s.get('stage commands', 0.0):.1f} "
              f"| {r['lock_bytes'] / 1e3:.0f} |", flush=True)
        print(f"  ({time.perf_counter() - started:.0f} s with set-up; calls {json.dumps(r['calls'])})", flush=True)


if __name__ == "__main__":
    main()
