"""The eval stages' text-encoder load before and after the eval-prompt cache side by side.

    python -m bench.studies.eval_text_load --before dacfbc3 --repeats 3 [--model FOLDER] [--threads 2]

For each commit (``--before``, and ``--after``, default the working tree): a fresh project with that commit's
code (``git archive``; the working tree's files for the working tree) on an SD3 pipeline folder (``--model``,
in ``--dtype``; default the tiny random pipeline tests/tiny_pipelines.py builds, saved once under ``--work``),
eval on 4 held-out prompts x 2 seeds at 2 steps, 64 px. Where the commit has the ``eval_prompts`` stage it
runs first (not timed: once per run). Then ``tpgrpo stage baseline`` runs under the commit's own
``bench/stage_timer.py``, alternating before and after ``--repeats`` times, and the bench prints per commit the
median of ``text_load_s`` (the first load of the text encoders), ``load_s`` (transformer + VAE) and the stage's
wall seconds, and whether the two baseline tables are byte-identical. The baseline is the eval of the base model:
every eval stage runs the same code (``tpgrpo.policy.evaluation.eval_images``).
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

REPO = Path(__file__).resolve().parents[2]
EVAL = {"num_prompts": 4, "samples_per_prompt": 2, "num_steps": 2, "every": 1}


def tiny_sd3(work: Path) -> Path:
    """The tiny random SD3 pipeline of the tests, saved once under ``work``."""
    folder = work / "tiny_sd3"
    if not (folder / "model_index.json").is_file():
        from bench.common import tests_helpers_env

        # tests/tiny_pipelines.py is a tests helper (tests/ on the child's path, as pytest gives it)
        subprocess.run([sys.executable, "-c", "import sys; from pathlib import Path; "
                        "from tiny_pipelines import build_sd3_pipeline, save_pipeline; "
                        "save_pipeline(build_sd3_pipeline(seed=0), Path(sys.argv[1]))", str(folder)],
                       env=tests_helpers_env(), check=True)
    return folder


def project(rev: str | None, work: Path, model: Path, dtype: str) -> Path:
    """``rev``'s code (None: the working tree's) with a params.yaml for ``model``."""
    folder = work / (rev or "worktree")
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    if rev is None:
        for name in ("stages", "tpgrpo", "data/prompts", "params.yaml", "bench/stage_timer.py"):
            copy = shutil.copytree if (REPO / name).is_dir() else shutil.copy
            (folder / name).parent.mkdir(parents=True, exist_ok=True)
            copy(REPO / name, folder / name)
    else:
        archive = subprocess.run(["git", "archive", rev, "stages", "tpgrpo", "data/prompts", "params.yaml",
                                  "bench/stage_timer.py"], cwd=REPO, capture_output=True, check=True).stdout
        subprocess.run(["tar", "-x", "-C", str(folder)], input=archive, check=True)
    raw = yaml.safe_load((folder / "params.yaml").read_text())
    raw["model"].update({"kind": "sd3", "path": str(model), "resolution": 64, "dtype": dtype})
    raw["task"].update({"reward": "jpeg_compressibility", "eval_reward": "jpeg_compressibility"})
    raw["sampling"].update({"num_steps": 3, "window_size": 2, "shift": 3.0})
    raw["rollout"]["batch_size"] = 4
    raw["eval"].update(EVAL)
    (folder / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


def run(folder: Path, threads: int, *args: str, timer: Path | None = None) -> float:
    """``tpgrpo ARGS`` in ``folder`` on its own code; returns the wall seconds."""
    env = dict(os.environ, PYTHONPATH=str(folder), OMP_NUM_THREADS=str(threads), DVC_NO_ANALYTICS="1")
    cmd = [sys.executable, *([str(folder / "bench/stage_timer.py"), "--timings", str(timer)] if timer else
                             ["-m", "tpgrpo"]), *args]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=folder, env=env, capture_output=True, text=True)
    if done.returncode != 0:
        sys.exit(f"{folder.name}: tpgrpo {' '.join(args)} failed: {done.stderr.strip()[-800:]}")
    return time.perf_counter() - start


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--before", required=True)
    ap.add_argument("--after", default=None, help="a commit; default the working tree")
    ap.add_argument("--model", type=Path, default=None, help="an SD3 pipeline folder; default the tiny one")
    ap.add_argument("--dtype", default="fp32", help="model.dtype (bf16 for bench/real_size.py's folders)")
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--work", type=Path, default=Path(tempfile.gettempdir()) / "eval_text_load")
    args = ap.parse_args()
    model = args.model.resolve() if args.model else tiny_sd3(args.work)
    folders = {label: project(rev, args.work, model, args.dtype)
               for label, rev in (("before", args.before), ("after", args.after))}
    for folder in folders.values():
        if (folder / "stages" / "eval_prompts.py").is_file():
            run(folder, args.threads, "stage", "eval_prompts")
    rows: dict[str, list[dict]] = {label: [] for label in folders}
    tables: dict[str, bytes] = {}
    for _ in range(args.repeats):
        for label, folder in folders.items():
            timer = folder / "timings.json"
            wall = run(folder, args.threads, "stage", "baseline", timer=timer)
            rows[label].append({**json.loads(timer.read_text()), "wall_s": wall})
            tables[label] = (folder / "data/iters/baseline_eval.parquet").read_bytes()
    load = os.getloadavg()
    print(f"model {model} ({args.dtype}), {args.threads} threads, {args.repeats} repeats alternating, load average "
          f"{load[0]:.2f} / {load[1]:.2f} / {load[2]:.2f}; medians:")
    print(f"{'':8} {'text_load_s':>12} {'load_s':>8} {'import_s':>9} {'wall_s':>8}")
    for label, runs in rows.items():
        med = {k: statistics.median(r[k] for r in runs) for k in ("text_load_s", "load_s", "import_s", "wall_s")}
        print(f"{label:8} {med['text_load_s']:12.3f} {med['load_s']:8.3f} {med['import_s']:9.3f} {med['wall_s']:8.3f}")
    print("baseline_eval.parquet byte-identical before/after:", tables["before"] == tables["after"])


if __name__ == "__main__":
    main()
