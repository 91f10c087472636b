"""DVC's locks as tpgrpo uses them: a stale read/write lock left by a killed run, and clearing it safely;
holding DVC's lock while tpgrpo edits the lock files (:func:`dvc_lock_held`); the project's run lock while
``tpgrpo run`` or ``tpgrpo dvc-yaml`` renders (:func:`rendering`).

DVC records the PID of every running ``dvc repro`` in ``.dvc/tmp/rwlock`` and removes the entries of
processes that no longer exist (``psutil.pid_exists``). A SIGKILLed run that its parent has not yet reaped
is a zombie: its PID still "exists", so the next ``tpgrpo run`` stops with "is busy, it is being blocked
by (PID ...)" although nothing holds the lock. ``tpgrpo run`` clears the lock only when every PID in it
is gone or a zombie; a live PID (even one reused by an unrelated process) keeps it.
"""

from __future__ import annotations

import json
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

RWLOCK = Path(".dvc") / "tmp" / "rwlock"


def pid_state(pid: int) -> str | None:
    """The process state letter of ``pid`` from ``/proc/PID/stat`` ('R', 'S', 'Z', ...); None if gone."""
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
    except (FileNotFoundError, ProcessLookupError, PermissionError):
        return None
    # The command name (field 2) is in parentheses and may itself hold spaces or ')': split after the last.
    return stat.rpartition(")")[2].split()[0]


def lock_pids(lock: dict) -> list[int]:
    """Every PID a DVC rwlock dict names: ``{"write": {path: info}, "read": {path: [info, ...]}}``,
    each ``info`` being ``{"pid": int, "cmd": str}``. Sorted, without repeats."""
    infos = list(lock.get("write", {}).values())
    for readers in lock.get("read", {}).values():
        infos.extend(readers)
    return sorted({int(info["pid"]) for info in infos})


def stale_pids(lock: dict, state: Callable[[int], str | None] = pid_state) -> list[int] | None:
    """The PIDs of a lock that may be cleared, or None when it must be kept.

    Returns the (non-empty) PID list when every PID is gone (``state`` None) or a zombie (``'Z'``);
    None when the lock names no PID or any PID is alive.
    """
    pids = lock_pids(lock)
    if not pids or any(state(pid) not in (None, "Z") for pid in pids):
        return None
    return pids


def clear_stale_lock(root: Path, state: Callable[[int], str | None] = pid_state) -> str | None:
    """Remove ``root/.dvc/tmp/rwlock`` when :func:`stale_pids` allows it; return a one-line note, or None.

    An unreadable lock file is left for DVC to report.
    """
    path = Path(root) / RWLOCK
    try:
        lock = json.loads(path.read_text())
        pids = stale_pids(lock, state)
    except (FileNotFoundError, ValueError, TypeError, KeyError, AttributeError):
        return None
    if pids is None:
        return None
    path.unlink(missing_ok=True)
    return (f"removed stale DVC lock {RWLOCK} (PID {', '.join(map(str, pids))} no longer running: "
            "a killed run's leftovers)")


@contextmanager
def dvc_lock_held(root: Path):
    """Hold DVC's repository lock (``.dvc/tmp/lock``) while dvc.lock is edited outside DVC; yields DVC's
    Repo (None where ``root`` has no DVC yet). Refuses with one line while a DVC command holds that lock, or
    while ``.dvc/tmp/rwlock`` names a live process (``dvc repro`` releases the repository lock while a stage
    runs; the rwlock names it)."""
    if not (root / ".dvc").is_dir():
        yield None
        return
    from dvc.lock import LockError
    from dvc.repo import Repo

    from tpgrpo.errors import PipelineError

    repo = Repo(str(root))
    try:
        try:
            repo.lock.lock()
        except LockError:
            raise PipelineError(".dvc/tmp/lock: a DVC command is running in this project (it holds DVC's lock); "
                                "retry when it has finished") from None
        try:
            try:
                rw = json.loads((root / RWLOCK).read_text()) if (root / RWLOCK).is_file() else {}
            except ValueError:
                raise PipelineError(f"{RWLOCK}: not readable as DVC's lock (expected JSON)") from None
            live = [pid for pid in lock_pids(rw) if pid_state(pid) not in (None, "Z")]
            if live:
                raise PipelineError(f"{RWLOCK}: DVC process {', '.join(map(str, live))} is running a stage in this "
                                    "project; retry when it has finished")
            yield repo
        finally:
            repo.lock.unlock()
    finally:
        repo.close()


RUN_LOCK = Path(".dvc") / "tmp" / "tpgrpo_run.lock"


@contextmanager
def rendering(root: Path):
    """Hold the project's run lock (``.dvc/tmp/tpgrpo_run.lock``) while ``tpgrpo run`` or ``tpgrpo dvc-yaml``
    renders dvc.yaml, the block files and the manifests (``tpgrpo run``: for the whole run, its repros too).

    Refuses with one line while another ``tpgrpo run`` or ``tpgrpo dvc-yaml`` holds it, or while a DVC command
    (a ``dvc repro`` started by hand, ``dvc exp run``) holds DVC's lock or runs a stage here
    (:func:`dvc_lock_held`, taken and released: DVC's own repros need it). Without ``.dvc`` (before the first
    ``tpgrpo run`` initialises DVC) nothing can be repro'ing: nothing to hold. The lock is ``flock(2)`` on an
    open file, so a killed holder releases it with its last open descriptor (children do not inherit it)."""
    import fcntl
    import os

    from tpgrpo.errors import PipelineError

    if not (root / ".dvc").is_dir():
        yield
        return
    (root / RUN_LOCK).parent.mkdir(parents=True, exist_ok=True)
    with open(root / RUN_LOCK, "a+") as held:
        try:
            fcntl.flock(held, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            held.seek(0)
            raise PipelineError(f"{RUN_LOCK}: tpgrpo (PID {held.read().strip() or '?'}) is rendering or running this "
                                "project's pipeline; retry when it has finished") from None
        held.truncate(0)
        held.write(f"{os.getpid()}\n")
        held.flush()
        with dvc_lock_held(root):
            pass
        yield
