"""What hashing while writing (``launch.hash_while_writing``) costs the rollout, against the md5 pass it spares
DVC, at the paper's trajectory bytes: side by side in one run.

    python -m bench.hash_while_writing                # 288 trajectories (a quarter of an iteration), 3 rounds
    python -m bench.hash_while_writing --scale 1      # the paper's 1,152 (about 5.5 GB in memory, twice)

Each round, in a throw-away DVC project, alternating the order: the real ``write_zarr`` of a store of N
trajectories (``states``: 10 SD3.5-M latents of 16 x 64 x 64 float32, and 9 per-step arrays of the same shape,
the bytes of the exact probe's velocities; random normal values, which compress like latents: hardly) with the
knob off, then on; and DVC's own md5 of the files of the store written without it (``dvc_data``'s
``file_md5``, one thread, what ``dvc repro`` does on a machine whose ``checksum_jobs`` is 1). Prints the seconds
and the ratio (extra write seconds) / (DVC's md5 pass): 0 means the hashing was free for the writer, 1 that it
moved DVC's pass into the stage unchanged. The writer's extra time depends on a spare core: state the load.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

from bench.common import REPO

LATENT = (16, 64, 64)
STEPS, WINDOW = 10, 9  # the paper's T and its window of SDE steps: 10 stored states, 9 per-step arrays


def paper_store(n: int, seed: int = 0) -> tuple[dict, dict]:
    """The rollout's arrays and attributes for ``n`` trajectories at the paper's latent shape (x0 estimates
    stand for the velocities: the same shape, dtype and count)."""
    rng = np.random.default_rng(seed)
    arrays = {"states": rng.normal(size=(n, WINDOW + 1, *LATENT)).astype(np.float32),
              "x0_estimates": rng.normal(size=(n, WINDOW, *LATENT)).astype(np.float32),
              "log_probs": rng.normal(size=(n, WINDOW)).astype(np.float32),
              "sigmas": np.tile(np.linspace(1, 0.1, WINDOW + 1, dtype=np.float32), (n, 1)),
              "seeds": np.arange(n), "prompt_index": np.arange(n) // 24, "sample": np.arange(n) % 24,
              "final_reward": rng.normal(size=n), "final_strict": np.zeros(n, bool)}
    attrs = {"prompts": [{"id": str(i)} for i in range((n + 23) // 24)],
             "schedule_sigmas": np.linspace(1, 0, STEPS + 1).tolist(), "group_size": 24, "num_steps": STEPS,
             "shift": 3.0, "window_start": 0, "window_size": WINDOW, "step_kind": "sde", "noise_level": 0.7,
             "guidance_scale": 4.5, "reward": "jpeg_compressibility"}
    return arrays, attrs


def dvc_md5_pass(folder: Path) -> float:
    """Seconds DVC's own file hash takes over every file of ``folder``, one after another."""
    from dvc_data.hashfile.hash import file_md5

    start = time.perf_counter()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        file_md5(str(path))
    return time.perf_counter() - start


def main() -> None:
    from tpgrpo.io.trajectories import write_zarr

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=0.25, help="fraction of the paper's 1,152 trajectories")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "hash_while_writing")
    args = ap.parse_args()
    n = 24 * max(1, round(48 * args.scale))  # whole groups of 24
    shutil.rmtree(args.work, ignore_errors=True)
    args.work.mkdir(parents=True)
    env = {**os.environ, "DVC_NO_ANALYTICS": "1"}
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=args.work, env=env, check=True)
    arrays, attrs = paper_store(n)
    print(f"{n} trajectories, {sum(a.nbytes for a in arrays.values()) / 1e9:.2f} GB of arrays; "
          f"load average {' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    rows = []
    try:
        for r in range(args.rounds):
            seconds = {}
            for flag in ((False, True) if r % 2 == 0 else (True, False)):
                path = args.work / f"round{r}-{flag}.zarr"
                start = time.perf_counter()
                handed = write_zarr(path, arrays, attrs, hash_for_dvc=flag)
                seconds[flag] = time.perf_counter() - start
                if flag:
                    assert handed > 0, "no md5 was handed to DVC"
            md5 = dvc_md5_pass(args.work / f"round{r}-False.zarr")
            for flag in (False, True):
                shutil.rmtree(args.work / f"round{r}-{flag}.zarr")
            rows.append((seconds[False], seconds[True], md5))
            print(f"round {r}: write {seconds[False]:.2f} s without, {seconds[True]:.2f} s with hashing; "
                  f"DVC's md5 pass {md5:.2f} s; extra / pass = {(seconds[True] - seconds[False]) / md5:.2f}; "
                  f"load {' '.join(Path('/proc/loadavg').read_text().split()[:3])}", flush=True)
    finally:
        shutil.rmtree(args.work, ignore_errors=True)
    off, on, md5 = (float(np.median(c)) for c in zip(*rows))
    print(f"median: write {off:.2f} s without, {on:.2f} s with; DVC's md5 pass {md5:.2f} s; "
          f"the writer pays {(on - off) / md5:.2f} of the pass it spares DVC")


if __name__ == "__main__":
    main()
