"""Named timers for ``bench/paper_bytes.py`` (installed by ``sitecustomize.py``; see there).

On the main thread each part gets its EXCLUSIVE wall seconds: a wrapped call's time less that of the wrapped
calls inside it, so the parts add up to no more than the process's wall time (time the main thread waits on
DVC's hashing threads counts in the part it waits in). Calls on other threads (DVC hashes the large files of
a directory in a thread pool) add to ``threads``: the busy wall time of the part there, from the first call
entering to the last one leaving, so overlapping calls count once.
"""

from __future__ import annotations

import atexit
import functools
import json
import os
import threading
import time

# The modules a DVC process runs as: DVC's own CLI, and the wrapper ``tpgrpo run`` and sealing
# call (DVC's CLI with its lock writes made atomic; tpgrpo.pipeline.dvc_atomic before tpgrpo/pipeline/ had wings).
# Missing the wrapper left every DVC part at 0 s.
DVC_MODULES = ("dvc", "tpgrpo.pipeline.dvc_integration.dvc_atomic", "tpgrpo.pipeline.dvc_atomic")


def is_dvc_argv(argv: list[str]) -> bool:
    """Whether a process's argv is a DVC process (``python -m dvc ...`` or the atomic-write wrapper)."""
    module = argv[argv.index("-m") + 1] if "-m" in argv[:-1] else ""
    return module in DVC_MODULES


_LOCK = threading.Lock()
_MAIN = threading.main_thread()
_STACK: list[list] = []  # main thread: [part, start, seconds of wrapped children]
_EXCL: dict[str, float] = {}
_ACTIVE: dict[str, int] = {}
_SINCE: dict[str, float] = {}
_THREADS: dict[str, float] = {}
_CALLS: dict[str, int] = {}
_STAGE = ["(no stage)"]  # the DVC stage running now (main thread): parts are also kept per stage
_BY_STAGE: dict[str, dict[str, float]] = {}


def _enter_thread(part: str) -> None:
    with _LOCK:
        if not _ACTIVE.get(part):
            _SINCE[part] = time.perf_counter()
        _ACTIVE[part] = _ACTIVE.get(part, 0) + 1


def _leave_thread(part: str) -> None:
    with _LOCK:
        _ACTIVE[part] -= 1
        if not _ACTIVE[part]:
            _THREADS[part] = _THREADS.get(part, 0.0) + time.perf_counter() - _SINCE[part]


def _wrap(part: str, fn):
    @functools.wraps(fn)
    def timed(*args, **kwargs):
        _CALLS[part] = _CALLS.get(part, 0) + 1
        if threading.current_thread() is not _MAIN:
            _enter_thread(part)
            try:
                return fn(*args, **kwargs)
            finally:
                _leave_thread(part)
        frame = [part, time.perf_counter(), 0.0]
        _STACK.append(frame)
        try:
            return fn(*args, **kwargs)
        finally:
            _STACK.pop()
            elapsed = time.perf_counter() - frame[1]
            _EXCL[part] = _EXCL.get(part, 0.0) + elapsed - frame[2]
            mine = _BY_STAGE.setdefault(_STAGE[0], {})
            mine[part] = mine.get(part, 0.0) + elapsed - frame[2]
            if _STACK:
                _STACK[-1][2] += elapsed

    return timed


def _patch(part: str, owner, name: str, *also) -> None:
    wrapped = _wrap(part, getattr(owner, name))
    for target in (owner, *also):
        setattr(target, name, wrapped)


def _dump_at_exit(t0: float, argv: list[str]) -> None:
    folder = os.environ.get("PAPER_BYTES_TIMERS")
    if not folder:
        return

    def dump():
        record = {"argv": argv, "start": t0, "wall": time.time() - t0, "busy": _EXCL, "threads": _THREADS,
                  "by_stage": _BY_STAGE,
                  "calls": _CALLS}
        with open(os.path.join(folder, f"{os.getpid()}.json"), "w") as f:
            json.dump(record, f)

    atexit.register(dump)


def install_dvc(t0: float, argv: list[str]) -> None:
    """DVC's parts: stage commands, hashing (md5 of bytes; deps+outs saving), cache commits, locks, run cache."""
    if not os.environ.get("PAPER_BYTES_TIMERS"):
        return
    import dvc.output
    import dvc.stage
    import dvc.stage.cache
    import dvc.stage.run
    import dvc_data.hashfile.hash
    from dvc.dvcfile import Lockfile

    _patch("stage command", dvc.stage.run, "cmd_run")
    _track_stage(dvc.stage.Stage)
    _patch("md5 of bytes", dvc_data.hashfile.hash, "file_md5")
    _patch("save (hash deps+outs, run cache)", dvc.stage.Stage, "save")
    _patch("run cache entry", dvc.stage.cache.StageCache, "save")
    _patch("commit (copy to cache, relink)", dvc.stage.Stage, "commit")
    _patch("transfer to cache", dvc.output, "otransfer")
    _patch("checkout", dvc.output, "checkout")
    _patch("up-to-date check", dvc.stage.Stage, "changed")
    _patch("lock write", Lockfile, "dump")
    _patch("lock write", Lockfile, "dump_stages")
    _time_lock_blocks(Lockfile)
    _dump_at_exit(t0, argv)


def _time_lock_blocks(lockfile_class) -> None:
    """The DVC wrapper replaces ``Lockfile.dump_stages`` by
    ``tpgrpo.pipeline.dvc_integration.lock_blocks``' after this module wrapped it: time the replacement as "lock
    write" too (a paper-bytes run that missed this put its lock writes under "dvc repro: the rest")."""
    try:
        from tpgrpo.pipeline.dvc_integration import lock_blocks
    except ImportError:
        try:  # a commit before tpgrpo/pipeline/ had wings
            from tpgrpo.pipeline import lock_blocks
        except ImportError:  # a commit before lock_blocks
            return
    real_install = lock_blocks.install

    def install(*args, **kwargs):
        real_install(*args, **kwargs)
        _patch("lock write", lockfile_class, "dump_stages")

    lock_blocks.install = install


def _track_stage(stage_class) -> None:
    """Parts inside ``Stage.reproduce`` (its checks, command, saving, commit) and ``Stage.dump`` (its lock
    write, right after) count for that stage too."""
    for name in ("reproduce", "dump"):
        method = getattr(stage_class, name)

        def tracked(self, *args, _method=method, **kwargs):
            before, _STAGE[0] = _STAGE[0], getattr(self, "addressing", str(self))
            try:
                return _method(self, *args, **kwargs)
            finally:
                _STAGE[0] = before

        setattr(stage_class, name, functools.wraps(method)(tracked))


def install_standin() -> None:
    """``load_backend`` returns the stand-in for a folder with ``standin.json``."""
    import tpgrpo.models as models

    real = models.load_backend

    @functools.wraps(real)
    def load_backend(kind, path, device="cpu", dtype="fp32", resolution=None):
        from standin import StandinBackend, is_standin

        if is_standin(path):
            return StandinBackend(device=device, dtype=models.parse_dtype(dtype))
        return real(kind, path, device, dtype, resolution)

    models.load_backend = load_backend


def install_tpgrpo_run(t0: float, argv: list[str]) -> None:
    """``tpgrpo run``'s parts: the repro (with its checks) and sealing."""
    if not os.environ.get("PAPER_BYTES_TIMERS"):
        return
    import tpgrpo.pipeline.repro as repro
    try:
        import tpgrpo.pipeline.long_runs.sealing as sealing
    except ImportError:  # a commit before tpgrpo/pipeline/ had wings
        import tpgrpo.pipeline.sealing as sealing

    _patch("repro (dvc repro + checks)", repro, "repro_checked")
    _patch("sealing", sealing, "seal_finished")
    _dump_at_exit(t0, argv)
