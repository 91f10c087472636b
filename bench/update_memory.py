"""The update stage's peak memory and wall time with every state in memory (before) and with the states
read per micro-batch (after, ``tpgrpo.policy.states``), side by side in one run (issue 22).

    python bench/update_memory.py --prompts 64 --group-size 16 --micro-batch 8 --json .cache/update_memory/run.json

Builds a tiny-model project under ``--workdir`` (``data/base``, ``credit.mode: flow_grpo`` so the probe loads no
model), runs iteration 1's rollout, probe and credit once, then runs ``tpgrpo stage update --iter 1``
alternately with the code of ``--before`` (a git revision extracted with ``git archive``: the update that held
every state) and of this checkout, ``--repeats`` times each, under ``/usr/bin/time`` (peak RSS = the
process's maximum resident set, its VmHWM; with ``--processes 2`` the largest process's). Torch threads:
``--threads`` per process (OMP_NUM_THREADS). Every run's policy folder is hashed: the adapters and optimizer
states must be byte-identical. It also prints the states' bytes on paper for SD3.5-M (16 latent channels,
R/8 x R/8) at the paper's 1,152 trajectories x 10 states, and what one lazy read decodes there.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CHUNK_ROWS = 64  # trajectories per stored chunk (tpgrpo.io.artifacts.write_zarr)


def make_project(root: Path, prompts: int, group_size: int, micro_batch: int, processes: int) -> Path:
    """A project folder with the embedded tiny model, the repo's prompts and params with the bench's sizes."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "prompts", root / "data" / "prompts")
    shutil.copytree(REPO / "data" / "base", root / "data" / "base")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    overrides = {"task": {"reward": "jpeg_compressibility"}, "credit": {"mode": "flow_grpo"},
                 "rollout": {"prompts_per_iter": prompts, "group_size": group_size},
                 "update": {"micro_batch": micro_batch}, "launch": {"num_processes": processes}}
    for section, values in overrides.items():
        raw[section].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


def extract(revision: str, dest: Path) -> Path:
    """``git archive REVISION`` (tpgrpo/ and stages/) into ``dest``: that revision's code, importable first."""
    shutil.rmtree(dest, ignore_errors=True)
    dest.mkdir(parents=True)
    archive = subprocess.run(["git", "archive", revision, "tpgrpo", "stages"], cwd=REPO, check=True,
                             capture_output=True).stdout
    tar = dest / "src.tar"
    tar.write_bytes(archive)
    with tarfile.open(tar) as f:
        f.extractall(dest, filter="data")
    tar.unlink()
    return dest


def run_stage(root: Path, name: str, src: Path, threads: int) -> dict:
    """``python -m tpgrpo stage NAME --iter 1`` with ``src``'s code first on the path; wall s and peak RSS."""
    env = dict(os.environ, PYTHONPATH=str(src), OMP_NUM_THREADS=str(threads), DVC_NO_ANALYTICS="1",
               DVC_STUDIO_OFFLINE="true", PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
    cmd = ["/usr/bin/time", "-f", "MAXRSS_KB %M", sys.executable, "-m", "tpgrpo", "stage", name, "--iter", "1",
           "--params", str(root / "params.yaml")]
    start = time.perf_counter()
    done = subprocess.run(cmd, cwd=root, env=env, capture_output=True, text=True)
    wall = time.perf_counter() - start
    if done.returncode != 0:
        raise SystemExit(f"stage {name} failed:\n{done.stderr[-3000:]}")
    rss_kb = int(done.stderr.split("MAXRSS_KB")[-1].split()[0])
    return {"wall_s": round(wall, 2), "peak_rss_mib": round(rss_kb / 1024, 1)}


def policy_hash(root: Path) -> str:
    """sha256 over the policy folder's files (names and bytes, sorted)."""
    folder = root / "data" / "iters" / "0001" / "policy"
    digest = hashlib.sha256()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        digest.update(path.relative_to(folder).as_posix().encode() + b"\0" + path.read_bytes())
    return digest.hexdigest()


def on_paper(micro_batch: int) -> dict:
    """SD3.5-M's states per update process (the paper's 1,152 trajectories x 10 states, 16 x R/8 x R/8 fp32)
    before, and what one lazy read decodes: up to ``micro_batch`` chunks of 64 trajectories x 10 states."""
    out = {}
    for res in (512, 1024):
        state = 16 * (res // 8) ** 2 * 4
        out[f"{res}px"] = {"states_per_process_gb": round(1152 * 10 * state / 1e9, 2),
                           "one_chunk_decoded_mb": round(CHUNK_ROWS * 10 * state / 1e6, 1),
                           "micro_batch_block_mb": round(micro_batch * min(2 * micro_batch, 10) * state / 1e6, 2),
                           "decoded_per_micro_batch_mb_max": round(min(micro_batch, 1152 // CHUNK_ROWS)
                                                                   * CHUNK_ROWS * 10 * state / 1e6, 1)}
    return out


def uptime() -> str:
    return subprocess.run(["uptime"], capture_output=True, text=True).stdout.strip()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--prompts", type=int, default=64)
    ap.add_argument("--group-size", type=int, default=16)
    ap.add_argument("--micro-batch", type=int, default=8)
    ap.add_argument("--processes", type=int, default=1)
    ap.add_argument("--threads", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--before", default="dacfbc3", help="git revision whose update held every state")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "update_memory")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "uptime_start": uptime()}
    root = make_project(args.workdir / "project", args.prompts, args.group_size, args.micro_batch, args.processes)
    before = extract(args.before, args.workdir / "before_src")
    for name in ("rollout", "probe", "credit"):
        result[name] = run_stage(root, name, REPO, args.threads)
        print(name, result[name], flush=True)
    runs = []
    for repeat in range(args.repeats):
        for label, src in (("before", before), ("after", REPO)):
            run = {"code": label, "repeat": repeat, **run_stage(root, "update", src, args.threads),
                   "policy_sha256": policy_hash(root)}
            runs.append(run)
            print(run, flush=True)
    result.update(runs=runs, identical=len({r["policy_sha256"] for r in runs}) == 1,
                  on_paper=on_paper(args.micro_batch), uptime_end=uptime())
    print(json.dumps({k: result[k] for k in ("identical", "on_paper", "uptime_start", "uptime_end")}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
