"""The update stage's peak memory and wall time with every state in memory (before) and with the states
read per micro-batch (after, ``tpgrpo.policy.states``), side by side in one run.

    python -m bench.studies.update_memory --prompts 64 --group-size 16 --micro-batch 8 --json .cache/update_memory/run.json

Builds a tiny-model project under ``--workdir`` (``data/base``, ``credit.mode: flow_grpo`` so the probe loads no
model), runs iteration 1's rollout, probe and credit once, then runs ``tpgrpo stage update --iter 1``
alternately with the code of ``--before`` (a git revision extracted with ``git archive``: the update that held
every state) and of this checkout, ``--repeats`` times each, under ``/usr/bin/time`` (peak RSS = the
process's maximum resident set, its VmHWM; with ``--processes 2`` the largest process's). Torch threads:
``--threads`` per process (OMP_NUM_THREADS). Every run's policy folder is hashed: the adapters and optimizer
states must be byte-identical. It also prints the states' bytes on paper for SD3.5-M (16 latent channels,
R/8 x R/8) at the paper's 1,152 trajectories x 10 states, what one lazy read decodes there, and times one
micro-batch's read at 512 px from a store in the old and the new layout (``paper_reads``).
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

REPO = Path(__file__).resolve().parents[2]
CHUNK_ROWS = 64  # trajectories per stored chunk (tpgrpo.io.trajectories.write_zarr)


def make_project(root: Path, prompts: int, group_size: int, micro_batch: int, processes: int) -> Path:
    """A project folder with the embedded tiny model, the repo's prompts and params with the bench's sizes."""
    shutil.rmtree(root, ignore_errors=True)
    (root / "data").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "prompts", root / "data" / "prompts")
    shutil.copytree(REPO / "data" / "base", root / "data" / "base")
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    overrides = {"task": {"reward": "jpeg_compressibility"}, "credit": {"mode": "flow_grpo"},
                 "rollout": {"prompts_per_iter": prompts, "group_size": group_size},
                 "update": {"micro_batch": micro_batch}, "launch": {"num_processes": processes},
                 "tree": {"enabled": False}}  # a chain's update memory (pinned, whatever the default)
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


def paper_reads(workdir: Path, micro_batch: int, trajectories: int = 128, reads: int = 10) -> dict:
    """Seconds one micro-batch's lazy read takes at SD3.5-M's 512 px (16 x 64 x 64 fp32 states, 10 per
    trajectory) from a store in each layout: one chunk per 64 whole trajectories (before, 168 MB decoded a
    chunk) and each state its own chunk inside that file (``write_zarr`` now). Random normal states (they do
    not compress, like real latents); ``micro_batch`` random transitions a read, the same in both."""
    import numpy as np
    import torch
    import zarr

    from tpgrpo.io.trajectories import CheckedArray, _chunk_codecs
    from tpgrpo.policy.states import LazyStates

    shape = (trajectories, 10, 16, 64, 64)
    data = np.random.default_rng(0).standard_normal(shape, dtype=np.float32)
    group = zarr.open_group(str(workdir / "paper.zarr"), mode="w")
    layouts = {"chunk_per_64_trajectories": {"chunks": (64, *shape[1:])},
               "chunk_per_state_in_shards": {"shards": (64, *shape[1:]), "chunks": (1, 1, *shape[2:])}}
    gen = torch.Generator().manual_seed(0)
    picks = [(torch.randint(0, trajectories, (micro_batch,), generator=gen),
              torch.randint(0, 9, (micro_batch,), generator=gen)) for _ in range(reads)]
    out = {}
    for name, layout in layouts.items():
        arr = group.create_array(name, data=data, **layout, compressors=_chunk_codecs())
        states = LazyStates(CheckedArray(arr, name, "states"))
        start = time.perf_counter()
        for n, k in picks:
            x, x_next = states.pairs(n, k)
            assert torch.equal(x, torch.from_numpy(data[n.numpy(), k.numpy()]))
        out[name] = {"s_per_micro_batch": round((time.perf_counter() - start) / reads, 4),
                     "bytes_kept_per_micro_batch_mb": round(states.peak_read_bytes / 1e6, 2)}
    shutil.rmtree(workdir / "paper.zarr")
    return out


def states_memory(store: Path, how: str, micro_batch: int, reads: int = 40) -> dict:
    """In this process: the states' share of the update's host memory at a real state size, without the
    model. ``before``: the whole array read (as ``read_trajectories`` did) and indexed per micro-batch;
    ``after``: ``LazyStates.verify()`` then ``pairs`` per micro-batch. MiB of VmRSS / VmHWM over the start."""
    import torch

    from tpgrpo.io.trajectories import CheckedArray
    from tpgrpo.policy.states import LazyStates, state_pairs

    def status() -> dict:
        text = Path("/proc/self/status").read_text()
        return {k: int(text.split(k + ":")[1].split()[0]) / 1024 for k in ("VmRSS", "VmHWM")}

    import zarr

    arr = zarr.open_group(str(store), mode="r")["states"]
    start = status()
    checked = CheckedArray(arr, str(store), "states")
    states = torch.from_numpy(checked[:]) if how == "before" else LazyStates(checked).verify()
    gen = torch.Generator().manual_seed(0)
    for _ in range(reads):
        n = torch.randint(0, arr.shape[0], (micro_batch,), generator=gen)
        x, x_next = state_pairs(states, n, torch.randint(0, arr.shape[1] - 1, (micro_batch,), generator=gen))
    end = status()
    return {"rss_mib": round(end["VmRSS"] - start["VmRSS"], 1), "peak_mib": round(end["VmHWM"] - start["VmRSS"], 1)}


def paper_memory(workdir: Path, micro_batch: int, trajectories: int = 256) -> dict:
    """``states_memory`` before and after, each in a fresh process, on a store of SD3.5-M's 512 px states
    (``trajectories`` x 10 x 16 x 64 x 64 fp32, random normal) in the layout ``write_zarr`` writes."""
    import numpy as np
    import zarr

    from tpgrpo.io.trajectories import _chunk_codecs

    shape = (trajectories, 10, 16, 64, 64)
    store = workdir / "paper_memory.zarr"
    group = zarr.open_group(str(store), mode="w")
    arr = group.create_array("states", shape=shape, dtype="float32", shards=(64, *shape[1:]),
                             chunks=(1, 1, *shape[2:]), compressors=_chunk_codecs())
    rng = np.random.default_rng(0)
    for start in range(0, trajectories, 64):
        arr[start:start + 64] = rng.standard_normal((64, *shape[1:]), dtype=np.float32)
    out = {"states_mib": round(arr.nbytes / 2**20, 1)}
    for how in ("before", "after"):
        done = subprocess.run([sys.executable, __file__, "--states-memory", how, str(store),
                               "--paper-micro-batch", str(micro_batch)], capture_output=True, text=True, check=True)
        out[how] = json.loads(done.stdout.strip().splitlines()[-1])
    shutil.rmtree(store)
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
    ap.add_argument("--paper-micro-batch", type=int, default=2, help="transitions per micro-batch at 512 px")
    ap.add_argument("--repeats", type=int, default=1)
    ap.add_argument("--before", default="dacfbc3", help="git revision whose update held every state")
    ap.add_argument("--workdir", type=Path, default=REPO / ".cache" / "update_memory")
    ap.add_argument("--json", type=Path)
    ap.add_argument("--only-paper", action="store_true", help="only the 512 px read and memory figures")
    ap.add_argument("--states-memory", nargs=2, metavar=("HOW", "STORE"), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.states_memory:  # one side of paper_memory, in its own process
        print(json.dumps(states_memory(Path(args.states_memory[1]), args.states_memory[0], args.paper_micro_batch)))
        return
    result = {"args": {k: str(v) for k, v in vars(args).items()}, "uptime_start": uptime()}
    if args.only_paper:
        args.workdir.mkdir(parents=True, exist_ok=True)
        result.update(paper_reads=paper_reads(args.workdir, args.paper_micro_batch),
                      paper_memory=paper_memory(args.workdir, args.paper_micro_batch), uptime_end=uptime())
        print(json.dumps(result, indent=1))
        return
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
                  on_paper=on_paper(args.paper_micro_batch),
                  paper_reads=paper_reads(args.workdir, args.paper_micro_batch),
                  paper_memory=paper_memory(args.workdir, args.paper_micro_batch), uptime_end=uptime())
    print(json.dumps({k: result[k] for k in ("identical", "on_paper", "paper_reads", "paper_memory", "uptime_start",
                                             "uptime_end")}, indent=1))
    if args.json:
        args.json.parent.mkdir(parents=True, exist_ok=True)
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
