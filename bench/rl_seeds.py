"""Does the default run raise held-out reward by more than seed noise? Run it with several seeds.

    python -m bench.rl_seeds --seeds 0 1 2 --parallel 2 [--set credit.mode=flow_grpo ...]

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
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]


def make_project(folder: Path, seed: int, settings: list[str], base: Path = REPO / "data" / "base") -> Path:
    folder.mkdir(parents=True)
    for name in ("stages", "tpgrpo"):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    shutil.copytree(REPO / "data" / "prompts", folder / "data" / "prompts")
    shutil.copytree(base, folder / "data" / "base")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["train"]["seed"] = seed
    for item in settings:
        key, _, value = item.partition("=")
        section, _, name = key.partition(".")
        raw[section][name] = yaml.safe_load(value)
    (folder / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


def launch(folder: Path, threads: int) -> subprocess.Popen:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true", OMP_NUM_THREADS=str(threads),
               OMP_WAIT_POLICY="PASSIVE")
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
    parser.add_argument("--base", type=Path, default=REPO / "data" / "base", help="the base model folder to copy")
    parser.add_argument("--collect", type=Path, nargs="+", default=None,
                        help="only report finished runs found under these workdirs (seed-N folders)")
    parser.add_argument("--out", type=Path, default=REPO / "data" / "reports" / "rl_seeds.json")
    parser.add_argument("--extra-eval-seeds", type=int, nargs="*", default=[],
                        help="after training, also score base and final policies on these eval.seed values")
    args = parser.parse_args()
    results, folders = collect(args.collect) if args.collect else train_seeds(args)
    if args.extra_eval_seeds:
        extra_evaluations(results, folders, args.extra_eval_seeds)
    report(results, args)


def train_seeds(args) -> tuple[dict, dict]:
    """Train one project copy per seed (``--parallel`` at a time); returns (summaries, folders) by seed."""
    shutil.rmtree(args.workdir, ignore_errors=True)
    threads = args.threads or max(1, 2 // args.parallel)
    folders = {s: make_project(args.workdir / f"seed-{s}", s, args.settings, args.base) for s in args.seeds}
    pending, running, results = list(folders.items()), [], {}
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
            results[seed] = {**run_result(folder), "wall_minutes": round((time.time() - start) / 60, 1)}
            print(f"seed {seed}: {json.dumps(results[seed])}", flush=True)
    return results, folders


def collect(workdirs: list[Path]) -> tuple[dict, dict]:
    """Summaries and folders of finished runs under ``workdirs`` (wall time unknown here: None)."""
    results, folders = {}, {}
    for workdir in workdirs:
        for folder in sorted(workdir.glob("seed-*")):
            seed = int(folder.name.split("-")[1])
            results[seed], folders[seed] = {**run_result(folder), "wall_minutes": None}, folder
    return results, folders


def extra_evaluations(results: dict, folders: dict, eval_seeds: list[int]) -> None:
    """Score each run's base and final policy again on other eval seeds (216 more images per seed with the
    defaults), in this process on its threads, and add ``extra_eval`` {eval seed: [base, final]} to the run.

    The base score depends on the eval seed only, so it is computed once per eval seed.
    """
    from tpgrpo.policy.evaluation import evaluate
    from tpgrpo.config import load_config
    from tpgrpo.policy.loading import load_policy

    scratch = Path(tempfile.mkdtemp()) / "eval.json"  # where evaluate() keeps its part files
    base: dict[int, float] = {}
    for seed, folder in sorted(folders.items()):
        extra = {}
        for eval_seed in eval_seeds:
            cfg = load_config(folder / "params.yaml", overrides={"eval.seed": eval_seed})
            if eval_seed not in base:
                base[eval_seed] = evaluate(cfg, folder, load_policy(cfg, folder, 1), "base",
                                           scratch)["eval_reward"]
            policy = load_policy(cfg, folder, cfg.train.iterations + 1)  # the final policy N
            final = evaluate(cfg, folder, policy, "final", scratch)["eval_reward"]
            extra[eval_seed] = [base[eval_seed], final]
            print(f"seed {seed}, eval seed {eval_seed}: base {base[eval_seed]:.3f} final {final:.3f}", flush=True)
        results[seed]["extra_eval"] = extra


def run_result(folder: Path) -> dict:
    """A finished run's summary plus base and final held-out numbers read from its eval logs:
    ``{base,final}_{eval_reward,train_reward,strict_accuracy}`` (``train_reward``: the training reward on
    the held-out prompts), the base from ``baseline_eval.json``, the final from the last ``eval.json``."""
    iters = folder / "data" / "iters"
    summary = json.loads((folder / "data" / "metrics" / "summary.json").read_text())
    base = json.loads((iters / "baseline_eval.json").read_text())
    final = json.loads(sorted(iters.glob("[0-9]*/eval.json"))[-1].read_text())
    flat = {f"{side}_{key}": log[name] for side, log in (("base", base), ("final", final))
            for key, name in (("eval_reward", "eval_reward"), ("train_reward", "train_reward"),
                              ("strict_accuracy", "eval_strict_accuracy"))}
    return {**summary, **flat}


def gain_over_eval_seeds(run: dict) -> float:
    """Held-out geneval gain averaged over the run's own eval and any ``extra_eval`` seeds."""
    pairs = [(run["base_eval_reward"], run["final_eval_reward"]), *run.get("extra_eval", {}).values()]
    return statistics.mean(final - base for base, final in pairs)


def report(results: dict, args) -> None:
    gains = {k: [r[f"final_{k}"] - r[f"base_{k}"] for r in results.values()]
             for k in ("eval_reward", "train_reward", "strict_accuracy")}
    pooled = [gain_over_eval_seeds(r) for r in results.values()]
    out = {"settings": args.settings, "seeds": results,
           **{f"mean_gain_{k}": statistics.mean(v) for k, v in gains.items()},
           **{f"min_gain_{k}": min(v) for k, v in gains.items()},
           "spread_gain_eval_reward": max(gains["eval_reward"]) - min(gains["eval_reward"]),
           "eval_seeds": 1 + len(args.extra_eval_seeds),
           "mean_gain_all_eval_seeds": statistics.mean(pooled),
           "spread_gain_all_eval_seeds": max(pooled) - min(pooled)}
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps(out, indent=2) + "\n")
    print("| seed | base geneval | final geneval | base geneval_soft | final geneval_soft | base strict | "
          "final strict | gain, all eval seeds | minutes |\n|---|---|---|---|---|---|---|---|---|")
    for seed, r in sorted(results.items()):
        print(f"| {seed} | {r['base_eval_reward']:.3f} | {r['final_eval_reward']:.3f} | {r['base_train_reward']:.3f} | "
              f"{r['final_train_reward']:.3f} | {r['base_strict_accuracy']:.3f} | {r['final_strict_accuracy']:.3f} | "
              f"{gain_over_eval_seeds(r):+.3f} | {r['wall_minutes']} |")
    print(json.dumps({k: v for k, v in out.items() if k != "seeds"}, indent=1))

if __name__ == "__main__":
    main()
