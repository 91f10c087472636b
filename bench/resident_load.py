"""Model loading per stage: from disk (each stage process loads the folder) against the stage server's held
copy (``launch.resident_model``: the server loads it once, each stage forks with it), measured side by side.

Usage: python -m bench.resident_load [FOLDER] [--kind tiny|sd3] [--dtype fp32|bf16] [--repeats 5]
       [--device cpu|cuda] [--verify]
       (FOLDER defaults to the shipped model, data/base; the real-size SD3.5-M folder is built by
       bench/real_size.py: .cache/real_size/sd35m-24blocks, --kind sd3 --dtype bf16)

What one measurement is: a process forked from this one (as the stage server forks a stage) times
``tpgrpo.models.load_backend`` for the folder, and reports the seconds. "disk": nothing held, so the child
reads the folder (page cache warm after the first repeat: the best case for a load from disk). "held": this
process holds the backend (tpgrpo.models.resident.hold), so the child's load is the key check plus a stat of
every file in the folder. The two alternate, ``--repeats`` times each; medians are printed with the load
average before and after. Per iteration a default run loads the model in rollout, update and (every
eval.every iterations) eval; the exact probe loads it too (docs/real-size.md). With ``--device cuda`` the
held copy stays on the CPU (this process never initialises CUDA) and each forked stage moves its own to the
GPU, as ``launch.resident_model`` does for GPU stages; ``--verify`` checks that it gets the weights a load
from disk gets. bench/gpu_check.py runs it on the shipped model.
"""

from __future__ import annotations

import argparse
import os
import statistics
import struct
import time
from pathlib import Path


from tpgrpo.models import load_backend, resident


def timed_child_load(args, verify: bool = False) -> tuple[float, str]:
    """Seconds of one ``load_backend`` on ``args.device`` in a forked child (as a stage forked from the stage
    server; on a GPU the copy to it is waited for), and with ``verify`` the md5 of the transformer's
    weights as loaded (after the timer), else ""."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read)
        try:
            start = time.perf_counter()
            backend = load_backend(args.kind, args.folder, args.device, args.dtype, resolution=0)
            if backend.device.type == "cuda":
                import torch

                torch.cuda.synchronize()
            seconds = time.perf_counter() - start
            digest = weights_md5(backend.transformer) if verify else ""
            os.write(write, struct.pack("d", seconds) + digest.encode().ljust(32))
        except BaseException:
            import traceback

            traceback.print_exc()
        finally:
            os._exit(0)  # the parent reads the result, or its absence
    os.close(write)
    data = b""
    while chunk := os.read(read, 64):
        data += chunk
    os.close(read)
    _, status = os.waitpid(pid, 0)
    if len(data) != 40:
        raise SystemExit(f"a forked load on {args.device} failed (exit status {status}); see its output above")
    return struct.unpack("d", data[:8])[0], data[8:].decode().strip()


def weights_md5(module) -> str:
    """md5 of every parameter and buffer's bytes, in state-dict order (as bytes on the CPU)."""
    import hashlib

    import torch

    md5 = hashlib.md5()
    for name, tensor in module.state_dict().items():
        md5.update(name.encode())
        md5.update(tensor.detach().to("cpu").contiguous().view(torch.uint8).numpy().tobytes())
    return md5.hexdigest()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("folder", nargs="?", default="data/base")
    parser.add_argument("--kind", default="tiny")
    parser.add_argument("--dtype", default="fp32")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--device", default="cpu", help="where each stage asks for the model (cuda: the held "
                        "copy stays on the CPU and each forked stage moves its own to the GPU)")
    parser.add_argument("--verify", action="store_true", help="in the first repeat, the md5 of the transformer's "
                        "weights from disk and held must be equal (exit 1 if not)")
    args = parser.parse_args()
    args.folder = str(Path(args.folder).resolve())
    print(f"folder {args.folder} ({args.kind}, {args.dtype}), stages on {args.device}; load average before "
          f"{os.getloadavg()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; CPU {cpu_model()}", flush=True)
    start = time.perf_counter()
    resident.hold(load_backend, args.kind, args.folder, "cpu", args.dtype, 0)  # never CUDA in this process
    print(f"held by this process once (first imports included): {time.perf_counter() - start:.3f} s", flush=True)
    held = resident._held.copy()
    times, digests = {"disk": [], "held": []}, {}
    for repeat in range(args.repeats):
        for way in ("disk", "held"):
            resident.release()
            if way == "held":
                resident._held.update(held)
            seconds, digest = timed_child_load(args, verify=args.verify and repeat == 0)
            times[way].append(seconds)
            digests.setdefault(way, digest)
    disk, kept = statistics.median(times["disk"]), statistics.median(times["held"])
    print(f"per stage, median of {args.repeats}: disk {disk:.3f} s, held {kept:.4f} s, ratio {kept / disk:.4f}")
    print(f"all: disk {[round(t, 3) for t in times['disk']]}, held {[round(t, 4) for t in times['held']]}")
    if args.verify:
        same = digests["disk"] == digests["held"]
        print(f"weights md5: disk {digests['disk']}, held {digests['held']}: {'equal' if same else 'DIFFERENT'}")
        if not same:
            raise SystemExit(1)
    print(f"load average after {os.getloadavg()}")


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


if __name__ == "__main__":
    main()
