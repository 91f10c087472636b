"""Running the model stages on several processes (started by :mod:`tpgrpo.pipeline.execution.launch`: accelerate,
torchrun, or srun + torchrun over SLURM nodes), with artifacts that do not depend on the process count.

How the work is split (pure functions below, none depends on the process count):

- ``row_chunks``: the rows of a stage (trajectories, images) are cut into fixed chunks of consecutive
  rows, at most ``max_rows`` per chunk: whole prompt groups when a group fits, else pieces that cut across
  groups (no stage computes group statistics from a chunk: credit sees the whole table). So any process
  count up to the number of rows finds work once the batch sizes are small enough. A chunk is computed
  with the same tensor shapes on 1 or N processes, so its numbers are bit-identical (at the same number of
  threads per process).
- ``round_robin``: chunk ``c`` runs on process ``c % P``.
- ``run_chunks``: each process writes the arrays of its chunks as part files in a hidden temp folder next to
  the artifact (on a filesystem every node shares); after a barrier the main process reads every part, checks
  that none is missing, and merges them in chunk order (``merge_parts``): the canonical order of a 1-process
  run. The stage then writes the artifact atomically; a failed process leaves only the temp folder, which the
  next run empties.
- ``even_slice`` / ``sum_gradients``: the update splits each optimizer step's transitions into P
  contiguous near-equal slices; every process weights its losses by ``1 / (transitions of the step)``
  and the gradients are summed over processes, so each step's gradient is the mean over the same global
  set of transitions on any process count.

One process (no ``WORLD_SIZE`` > 1 in the environment) needs neither accelerate nor torch.distributed:
``current()`` is then a plain single-process ``Dist``. Once launched, ``init`` builds the process group with
accelerate from the launcher's environment (gloo on the CPU, NCCL on GPUs) and a timeout, so a process whose
peer died fails at its next barrier or all-reduce within ``timeout_s`` instead of waiting forever.
"""

from __future__ import annotations

import os
import re
import shutil
import signal
import time
from contextlib import contextmanager
from dataclasses import dataclass
from datetime import timedelta
from pathlib import Path
from typing import Callable, Iterator, Mapping

import numpy as np

from tpgrpo.io.artifacts import atomic_path
from tpgrpo.errors import PipelineError

DEFAULT_TIMEOUT_S = 1800.0
PARTS_WAIT_S = 90.0  # how long the main process waits for a part file a process of another node wrote
# Test hook, set only by tests/test_distributed_stages.py: "RANK:N" makes process RANK SIGKILL itself right
# after writing its N-th chunk part (a crash); "RANK:N:stall" makes it sleep instead (a hung process).
FAIL_HOOK_ENV = "TPGRPO_TEST_FAIL_AFTER_CHUNKS"


def row_chunks(num_rows: int, group_rows: int, max_rows: int) -> list[tuple[int, int]]:
    """Chunks ``[(first_row, end_row), ...]`` of consecutive rows covering ``num_rows`` rows that come in
    groups of ``group_rows`` (a prompt group's samples).

    When a group fits in ``max_rows``, each chunk holds ``max_rows // group_rows`` whole groups (the last may
    hold fewer); otherwise chunks of ``max_rows`` rows cut across groups (a group's statistics are computed by
    credit, which sees the whole table). Never more than ``max_rows`` rows, and a function of the params only,
    never of the process count: each chunk is the same computation on 1 or N processes.
    """
    if num_rows < 0 or group_rows < 1 or max_rows < 1:
        raise ValueError(f"row_chunks: need num_rows >= 0, group_rows >= 1, max_rows >= 1; got "
                         f"{num_rows}, {group_rows}, {max_rows}")
    per = (max_rows // group_rows) * group_rows or max_rows
    return [(a, min(a + per, num_rows)) for a in range(0, num_rows, per)]


def round_robin(num_chunks: int, world: int, rank: int) -> list[int]:
    """The chunk indices process ``rank`` of ``world`` computes: ``rank, rank + world, ...``."""
    if not 0 <= rank < world:
        raise ValueError(f"round_robin: rank {rank} outside [0, {world})")
    return list(range(rank, num_chunks, world))


def even_slice(n: int, world: int, rank: int) -> slice:
    """Process ``rank``'s contiguous part of ``n`` items split into ``world`` near-equal parts.

    The first ``n % world`` parts are one item longer (as ``torch.tensor_split``); parts may be empty.
    """
    if not 0 <= rank < world:
        raise ValueError(f"even_slice: rank {rank} outside [0, {world})")
    base, extra = divmod(n, world)
    start = rank * base + min(rank, extra)
    return slice(start, start + base + (1 if rank < extra else 0))


def merge_parts(parts: Mapping[int, Mapping[str, np.ndarray]], num_chunks: int,
                what: str = "artifact") -> dict[str, np.ndarray]:
    """Concatenate chunk parts ``{chunk: {name: array}}`` along axis 0 in chunk order ``0..num_chunks-1``.

    Raises ``PipelineError`` (one line) if a chunk is missing or the parts hold different arrays.
    """
    missing = [c for c in range(num_chunks) if c not in parts]
    if missing:
        raise PipelineError(f"{what}: {len(missing)} of {num_chunks} chunk parts missing (first: chunk "
                            f"{missing[0]}); a process failed before writing it")
    if num_chunks == 0:
        return {}
    names = list(parts[0])
    for c in range(num_chunks):
        if list(parts[c]) != names:
            raise PipelineError(f"{what}: chunk {c} holds arrays {list(parts[c])}, expected {names}")
    return {name: np.concatenate([np.asarray(parts[c][name]) for c in range(num_chunks)]) for name in names}


@dataclass(frozen=True)
class Dist:
    """This process's place among the stage's processes (``rank`` 0 of 1 when not launched)."""

    rank: int = 0
    world: int = 1
    local_rank: int = 0
    device: str = "cpu"  # where tensors handed to collectives live (cpu for gloo, cuda:i for NCCL)

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def _lost(self, what: str, exc: BaseException) -> PipelineError:
        first = re.sub(r"^\[[^\]]*\]\s*", "", (str(exc).splitlines() or [""])[0]).split(". ")[0][:160]
        return PipelineError(f"{what}: process {self.rank} of {self.world} lost contact with the others "
                             f"(another process failed or timed out): {first}")

    def barrier(self, what: str) -> None:
        """Wait for every process; a dead or stuck peer raises ``PipelineError`` naming ``what``."""
        if self.world == 1:
            return
        import torch.distributed as td

        try:
            td.barrier()
        except (RuntimeError, ValueError) as exc:  # gloo: "Connection closed by peer", timeouts
            raise self._lost(what, exc) from None

    def reduce(self, tensor, op: str = "sum", what: str = "all-reduce"):
        """``tensor`` summed (``op="sum"``) or maxed (``"max"``) over processes (a new tensor)."""
        if self.world == 1:
            return tensor.clone()
        from accelerate.utils import reduce

        try:
            return reduce(tensor.to(self.device), reduction=op).to(tensor.device)
        except (RuntimeError, ValueError) as exc:
            raise self._lost(what, exc) from None


_CURRENT: Dist | None = None


def local_device(device: str, dist: Dist) -> str:
    """The model device of this process: ``cuda`` / ``cuda:N`` become ``cuda:<local rank>`` when
    several processes run (one GPU each); anything else is returned unchanged."""
    if dist.world > 1 and device.split(":")[0] == "cuda":
        return f"cuda:{dist.local_rank}"
    return device


def reward_device(device: str) -> str:
    """This process's device for the reward models (``reward_models.device``), resolved as ``model.device`` is:
    read as written, ``cuda:1`` put every rank's reward models on GPU 1 (8 copies on one GPU, beside its own
    policy). Uses the ``Dist`` the CLI set up (one process when none, as in ``tpgrpo serve-reward``)."""
    return local_device(device, current())


def init(device: str = "cpu", timeout_s: float = DEFAULT_TIMEOUT_S, label: str = "stage") -> Dist:
    """Set up this process's ``Dist`` from the environment the launcher provides (accelerate, torchrun).

    ``device`` is the model device (``cpu`` -> gloo, ``cuda`` -> NCCL); ``timeout_s`` bounds every
    barrier and all-reduce (accelerate's ``InitProcessGroupKwargs(timeout=...)``). When one process dies,
    ``accelerate launch`` (torchrun) sends SIGTERM to the others: each then prints one line naming
    ``label`` and exits at once (parts stay in the temp folder; only the main process's rename after
    every part is in makes the artifact).
    """
    global _CURRENT
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        _CURRENT = Dist()
        return _CURRENT
    from accelerate import PartialState
    from accelerate.utils import InitProcessGroupKwargs

    cpu = device.split(":")[0] != "cuda"
    handler = InitProcessGroupKwargs(timeout=timedelta(seconds=timeout_s), **({"backend": "gloo"} if cpu else {}))
    state = PartialState(cpu=cpu, **handler.to_kwargs())
    _CURRENT = Dist(rank=state.process_index, world=state.num_processes, local_rank=state.local_process_index,
                    device=str(state.device) if not cpu else "cpu")
    _exit_on_sigterm(_CURRENT, label)
    return _CURRENT


def _exit_on_sigterm(dist: Dist, label: str) -> None:
    """SIGTERM (the launcher stopping the survivors of a failed stage): one line, then exit 143."""
    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        os.write(2, (f"error: {label}: process {dist.rank} of {dist.world} stopped by SIGTERM (another process "
                     "of this stage failed, or the run was interrupted)\n").encode())
        os._exit(128 + signum)

    signal.signal(signal.SIGTERM, handler)


def current() -> Dist:
    """The ``Dist`` set up by ``init`` (the CLI calls it before a model stage); one process otherwise."""
    return _CURRENT if _CURRENT is not None else init()


def is_main_process() -> bool:
    """Whether this is the main process, without joining a process group: the set-up ``Dist`` if any, else
    ``RANK`` from the launcher (a stage that fails before ``init`` must still be noted by one process only)."""
    if _CURRENT is not None:
        return _CURRENT.is_main
    return os.environ.get("RANK", "0").strip() in ("", "0")


def shutdown() -> None:
    """Tear the process group down (no-op for one process)."""
    global _CURRENT
    import sys

    if "torch" in sys.modules:
        import torch.distributed as td

        if td.is_available() and td.is_initialized():
            td.destroy_process_group()
    _CURRENT = None


def sum_gradients(params, dist: Dist) -> None:
    """Sum the ``.grad`` of ``params`` over processes in place (one all-reduce of the flattened
    gradients). A parameter without a gradient on this process counts as zero."""
    if dist.world == 1:
        return
    import torch

    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    flat = dist.reduce(torch.cat([p.grad.reshape(-1) for p in params]), "sum", "gradient all-reduce")
    offset = 0
    for p in params:
        p.grad.copy_(flat[offset:offset + p.numel()].view_as(p.grad))
        offset += p.numel()


def parts_folder(artifact: Path) -> Path:
    """The hidden temp folder of an artifact's chunk parts (``.NAME.parts`` next to it)."""
    return artifact.with_name(f".{artifact.name}.parts")


def _write_part(path: Path, arrays: Mapping[str, np.ndarray]) -> None:
    with atomic_path(path) as tmp, open(tmp, "wb") as f:
        np.savez(f, **{k: np.asarray(v) for k, v in arrays.items()})


def _read_part(path: Path) -> dict[str, np.ndarray]:
    with np.load(path, allow_pickle=False) as data:
        return {name: data[name] for name in data.files}


def _fail_hook(rank: int, done: int) -> None:
    """Test hook (``FAIL_HOOK_ENV``): crash (SIGKILL) or hang this process after its N-th chunk."""
    spec = os.environ.get(FAIL_HOOK_ENV, "").split(":")
    if spec[:2] == [str(rank), str(done)]:
        if spec[2:] == ["stall"]:
            time.sleep(3600)
        os.kill(os.getpid(), signal.SIGKILL)


def _wait_for(paths, timeout_s: float) -> None:
    """Wait up to ``timeout_s`` for files another node renamed into place: every process has passed the
    barrier after its rename, but an NFS client may still answer a lookup from its cache (attribute caching,
    ``acdirmax``, 60 s by default) for a while."""
    deadline = time.monotonic() + timeout_s
    missing = [p for p in paths if not p.is_file()]
    while missing and time.monotonic() < deadline:
        time.sleep(0.5)
        missing = [p for p in missing if not p.is_file()]


def run_chunks(dist: Dist, artifact: Path, num_chunks: int, compute: Callable[[int], Mapping[str, np.ndarray]],
               what: str, progress: Callable[[int, int], None] | None = None) -> dict[str, np.ndarray] | None:
    """Compute ``compute(c)`` for every chunk ``c`` round-robin over processes; merge on the main process.

    ``compute(c)`` returns arrays whose axis 0 runs over chunk ``c``'s items. Parts go to
    ``parts_folder(artifact)``; after all processes have written theirs, the main process returns the
    merged arrays (``merge_parts``, chunk order) and removes the folder; other processes return None.
    ``progress(done, total)`` is called on the main process after each of its chunks.
    """
    folder = parts_folder(artifact)
    if dist.is_main:  # parts of an earlier, failed run go; the folder stays (other nodes may cache its handle)
        folder.mkdir(parents=True, exist_ok=True)
        for stale in folder.iterdir():
            shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    dist.barrier(f"{what}: start")
    folder.mkdir(parents=True, exist_ok=True)  # the main process made it; another node may not see it yet
    mine = round_robin(num_chunks, dist.world, dist.rank)
    for done, c in enumerate(mine, 1):
        _write_part(folder / f"chunk-{c:05d}.npz", compute(c))
        _fail_hook(dist.rank, done)
        if progress is not None and dist.is_main:
            progress(done, len(mine))
    dist.barrier(f"{what}: parts written")
    if not dist.is_main:
        return None
    paths = {c: folder / f"chunk-{c:05d}.npz" for c in range(num_chunks)}
    _wait_for(paths.values(), PARTS_WAIT_S if dist.world > 1 else 0.0)
    parts = {c: _read_part(path) for c, path in paths.items() if path.is_file()}
    merged = merge_parts(parts, num_chunks, what)
    shutil.rmtree(folder, ignore_errors=True)
    return merged


def warn_if_idle(dist: Dist, num_chunks: int, knob: str) -> None:
    """One line on the main process when some processes get no chunk (fewer chunks than processes)."""
    if dist.is_main and num_chunks < dist.world:
        import sys

        print(f"warning: {num_chunks} chunk(s) for {dist.world} processes: {dist.world - num_chunks} process(es) "
              f"idle (lower {knob} for more, smaller chunks)", file=sys.stderr)


@contextmanager
def chunk_bar(dist: Dist, desc: str, unit: str = "chunk") -> Iterator[Callable[[int, int], None]]:
    """A tqdm bar shown by the main process only; yields ``progress(done, total)`` for ``run_chunks``."""
    from tqdm import tqdm

    bar = tqdm(desc=desc, unit=unit, disable=not dist.is_main)

    def progress(done: int, total: int) -> None:
        bar.total = total
        bar.update(done - bar.n)

    try:
        yield progress
    finally:
        bar.close()
