"""Model loading per stage: from disk (each stage process loads the folder) against the stage server's held
copy (``launch.resident_model``: the server loads it once, each stage forks with it), measured side by side.

Usage: python bench/resident_load.py [FOLDER] [--kind tiny|sd3] [--dtype fp32|bf16] [--repeats 5]
       (FOLDER defaults to the shipped model, data/base; the real-size SD3.5-M folder is built by
       bench/real_size.py: .cache/real_size/sd35m-24blocks, --kind sd3 --dtype bf16)

What one measurement is: a process forked from this one (as the stage server forks a stage) times
``tpgrpo.models.load_backend`` for the folder, and reports the seconds. "disk": nothing held, so the child
reads the folder (page cache warm after the first repeat: the best case for a load from disk). "held": this
process holds the backend (tpgrpo.models.resident.hold), so the child's load is the key check plus a stat of
every file in the folder. The two alternate, ``--repeats`` times each; medians are printed with the load
average before and after. Per iteration a default run loads the model in rollout, update and (every
eval.every iterations) eval; the exact probe loads it too (docs/real-size.md). Not measured: GPUs (the stage
server is CPU-only; docs/long-runs.md).
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from tpgrpo.models import load_backend, resident  # noqa: E402


def timed_child_load(args) -> float:
    """Seconds of one ``load_backend`` in a forked child (as a stage forked from the stage server)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        start = time.perf_counter()
        load_backend(args.kind, args.folder, "cpu", args.dtype, resolution=0)
        os.write(write, struct.pack("d", time.perf_counter() - start))
        os._exit(0)
    os.close(write)
    data = os.read(read, 8)
    os.close(read)
    os.waitpid(pid, 0)
    return struct.unpack("d", data)[0]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", default="data/base")
    parser.add_argument("--kind", default="tiny")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    args.folder = str(Path(args.folder).resolve())
    print(f"folder {args.folder} ({args.kind}, {args.dtype}); load average before {os.getloadavg()}; "
          f"OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; CPU {cpu_model()}", flush=True)
    start = time.perf_counter()
    resident.hold(load_backend, args.kind, args.folder, "cpu", args.dtype, 0)
    print(f"held by this process once (first imports included): {time.perf_counter() - start:.3f} s", flush=True)
    held = resident._held.copy()
    times = {"disk": [], "held": []}
    for _ in range(args.repeats):
        resident.release()
        times["disk"].append(timed_child_load(args))
        resident._held.update(held)
        times["held"].append(timed_child_load(args))
    disk, kept = statistics.median(times["disk"]), statistics.median(times["held"])
    print(f"per stage, median of {args.repeats}: disk {disk:.3f} s, held {kept:.4f} s, ratio {kept / disk:.4f}")
    print(f"all: disk {[round(t, 3) for t in times['disk']]}, held {[round(t, 4) for t in times['held']]}")
    print(f"load average after {os.getloadavg()}")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
