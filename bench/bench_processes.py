"""Rollout and update throughput with 1 process vs 2 processes (`accelerate launch`), side by side.

    python -m bench.bench_processes [--prompts 16] [--batch 32] [--repeats 2] [--workdir /tmp/tpgrpo-bench-processes]

Runs the real stage commands (those dvc.yaml holds: `tpgrpo stage`, which starts `accelerate launch ... -m
tpgrpo stage` itself for 2 processes) in a copy of the project (shipped base model, default params as chains,
``rollout.prompts_per_iter`` = --prompts and ``rollout.batch_size`` = --batch, so the rollout has several
chunks to share). The same cores in both settings: 1 process x ``--cores`` threads against ``--cores``
processes x 1 thread (OMP_NUM_THREADS). Reports images/s (rollout) and transitions/s (update) from the
stage's own wall time (``wall_seconds`` in rollout.json / update.json: model load, work, merge, writes; the
best of --repeats) and the command's wall time (plus interpreter start and, for 2 processes, the launcher).
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import REPO  # noqa: E402 - the checkout


def make_project(folder: Path, prompts: int, batch: int) -> Path:
    shutil.rmtree(folder, ignore_errors=True)
    folder.mkdir(parents=True)
    for name in ("stages", "tpgrpo"):
        shutil.copytree(REPO / name, folder / name, ignore=shutil.ignore_patterns("__pycache__"))
    for name in ("prompts", "base"):
        shutil.copytree(REPO / "data" / name, folder / "data" / name)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    raw["rollout"].update(prompts_per_iter=prompts, batch_size=batch)
    raw["tree"]["enabled"] = False  # chains, as docs/performance.md's figures (pinned, whatever the default)
    (folder / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


def set_processes(root: Path, processes: int) -> None:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["launch"]["num_processes"] = processes
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def run_stage(root: Path, name: str, threads: int) -> float:
    """Run the stage's dvc.yaml command for iteration 0; returns the command's wall time (s)."""
    from tpgrpo.config import load_config
    from tpgrpo.pipeline.rendering.dvcfile import stage_command

    cmd = shlex.split(stage_command(load_config(root / "params.yaml"), name, 0))
    env = dict(os.environ, OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", DVC_NO_ANALYTICS="1",
               DVC_STUDIO_OFFLINE="true")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    if out.returncode != 0:
        sys.exit(f"{' '.join(cmd)} failed:\n{out.stderr[-3000:]}")
    return time.perf_counter() - start


def measure(root: Path, processes: int, threads: int, repeats: int) -> dict:
    """Best-of-``repeats`` rollout and update throughput at this process count."""
    from tpgrpo.io.stage_logs import read_log

    set_processes(root, processes)
    d = root / "data" / "iters" / "0001"
    best: dict = {}
    for _ in range(repeats):
        cmd_s = run_stage(root, "rollout", threads)
        m = read_log(d / "rollout.json", "rollout.json")  # seconds: its timing sidecar
        if "rollout_s" not in best or m["wall_seconds"] < best["rollout_s"]:
            best.update(rollout_s=m["wall_seconds"], rollout_cmd_s=cmd_s, images=m["trajectories"],
                        chunks=m["chunks"])
    if not (d / "credit.parquet").exists():  # the update's inputs, made once (1 process)
        set_processes(root, 1)
        for name in ("probe", "credit"):
            run_stage(root, name, threads * processes)
        set_processes(root, processes)
    for _ in range(repeats):
        shutil.rmtree(d / "policy", ignore_errors=True)
        cmd_s = run_stage(root, "update", threads)
        m = read_log(d / "update.json", "update.json")
        if "update_s" not in best or m["wall_seconds"] < best["update_s"]:
            best.update(update_s=m["wall_seconds"], update_cmd_s=cmd_s, transitions=m["num_transitions"])
    return best


def report(one: dict, two: dict, cores: int) -> None:
    rows = [("rollout images/s (stage)", one["images"] / one["rollout_s"], two["images"] / two["rollout_s"]),
            ("rollout images/s (command)", one["images"] / one["rollout_cmd_s"],
             two["images"] / two["rollout_cmd_s"]),
            ("update transitions/s (stage)", one["transitions"] / one["update_s"],
             two["transitions"] / two["update_s"]),
            ("update transitions/s (command)", one["transitions"] / one["update_cmd_s"],
             two["transitions"] / two["update_cmd_s"])]
    print(f"same {cores} cores: 1 process x {cores} threads vs {cores} processes x 1 thread (OMP_NUM_THREADS)")
    print(f"rollout: {one['images']} images in {one['chunks']} chunks; update: {one['transitions']} transitions")
    print(f"{'':32s} {'1 process':>12s} {f'{cores} processes':>12s} {'ratio':>7s}")
    for label, a, b in rows:
        print(f"{label:32s} {a:12.2f} {b:12.2f} {b / a:7.2f}")
    print("stage = the stage's wall_seconds (load, work, merge, write); command = plus interpreter start and "
          "the launcher")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16, help="rollout.prompts_per_iter (x group_size 8)")
    parser.add_argument("--batch", type=int, default=32, help="rollout.batch_size: images per chunk")
    parser.add_argument("--cores", type=int, default=2, help="cores to share: processes of the N-process run")
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/tpgrpo-bench-processes"))
    args = parser.parse_args()
    root = make_project(args.workdir, args.prompts, args.batch)
    one = measure(root, 1, args.cores, args.repeats)
    many = measure(root, args.cores, 1, args.repeats)
    report(one, many, args.cores)


if __name__ == "__main__":
    main()
