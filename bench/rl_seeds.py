"""Does the default run raise held-out reward by more than seed noise? Run it with several seeds.

    python bench/rl_seeds.py --seeds 0 1 2 --parallel 2 [--set credit.mode=flow_grpo ...]

Each seed trains in its own copy of the project (params.yaml with ``train.seed`` changed, the shipped
base model and prompts) through the real ``tpgrpo run`` (dvc repro), then the script prints base vs final
held-out rewards per seed, the mean gain and the spread between seeds, and writes them as JSON.
With ``--parallel N`` each run gets 2 / N torch threads (this machine has 2 cores).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def make_project(folder: Path, seed: int, settings: list[str]) -> Path:
    folder.mkdir(parents=True)
    for name in ("stages", "tpgrpo"):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "data" / "prompts", folder / "data" / "prompts")
    shutil.copytree(REPO / "data" / "base", folder / "data" / "base")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["train"]["seed"] = seed
    for item in settings:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        raw[section][name] = yaml.safe_load(value)
    (folder / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


def launch(folder: Path, threads: int) -> subprocess.Popen:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE")
    # The run uses its own copy of the code, not the (editable-installed) working tree, which may change.
    env["PYTHONPATH"] = str(folder)
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    log = open(folder / "run.log", "w")
    return subprocess.Popen([sys.executable, "-m", "tpgrpo", "run"], cwd=folder, env=env, stdout=log,
                            stderr=subprocess.STDOUT)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seeds", type=int, nargs="+", default=[0, 1, 2])
    parser.add_argument("--parallel", type=int, default=1)
    parser.add_argument("--set", dest="settings", action="append", default=[], help="section.key=value")
    parser.add_argument("--threads", type=int, default=None, help="torch threads per run (default 2 / parallel)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tpgrpo-seeds"))
    parser.add_argument("--collect", type=Path, nargs="+", default=None,
                        help="only report finished runs found under these workdirs (seed-N folders)")
    parser.add_argument("--out", type=Path, default=REPO / "data" / "reports" / "rl_seeds.json")
    args = parser.parse_args()
    if args.collect:
        report(collect(args.collect), args)
        return
    shutil.rmtree(args.workdir, ignore_errors=True)
    threads = args.threads or max(1, 2 // args.parallel)
    pending = [(s, make_project(args.workdir / f"seed-{s}", s, args.settings)) for s in args.seeds]
    running, results = [], {}
    while pending or running:
        while pending and len(running) < args.parallel:
            seed, folder = pending.pop(0)
            running.append((seed, folder, launch(folder, threads), time.time()))
        time.sleep(5)
        for item in [r for r in running if r[2].poll() is not None]:
            seed, folder, proc, start = item
            running.remove(item)
            if proc.returncode != 0:
                sys.exit(f"seed {seed} failed (exit {proc.returncode}); see {folder / 'run.log'}")
            summary = json.loads((folder / "data" / "metrics" / "summary.json").read_text())
            results[seed] = {**summary, "wall_minutes": round((time.time() - start) / 60, 1)}
            print(f"seed {seed}: {json.dumps(results[seed])}", flush=True)
    report(results, args)


def collect(workdirs: list[Path]) -> dict:
    """Summaries of finished runs under ``workdirs`` (their wall time is unknown here: None)."""
    results = {}
    for workdir in workdirs:
        for folder in sorted(workdir.glob("seed-*")):
            summary = json.loads((folder / "data" / "metrics" / "summary.json").read_text())
            results[int(folder.name.split("-")[1])] = {**summary, "wall_minutes": None}
    return results


def report(results: dict, args) -> None:
    gains = {k: [r[f"final_{k}"] - r[f"base_{k}"] for r in results.values()]
             for k in ("eval_reward", "train_reward", "strict_accuracy")}
    out = {"settings": args.settings, "seeds": results,
           **{f"mean_gain_{k}": statistics.mean(v) for k, v in gains.items()},
           **{f"min_gain_{k}": min(v) for k, v in gains.items()},
           "spread_final_train_reward": (max(r["final_train_reward"] for r in results.values())
                                         - min(r["final_train_reward"] for r in results.values()))}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print("| seed | base geneval | final geneval | base geneval_soft | final geneval_soft | base strict | "
          "final strict | minutes |\n|---|---|---|---|---|---|---|---|")
    for seed, r in sorted(results.items()):
        print(f"| {seed} | {r['base_eval_reward']:.3f} | {r['final_eval_reward']:.3f} | {r['base_train_reward']:.3f} | "
              f"{r['final_train_reward']:.3f} | {r['base_strict_accuracy']:.3f} | {r['final_strict_accuracy']:.3f} | "
              f"{r['wall_minutes']} |")
    print(json.dumps({k: v for k, v in out.items() if k != "seeds"}, indent=1))


if __name__ == "__main__":
    main()
