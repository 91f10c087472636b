"""DVC with atomic writes of its own files: ``python -m tpgrpo.pipeline.dvc_integration.dvc_atomic ARGS`` is
``dvc ARGS``.

Why: DVC 3.67 rewrites dvc.lock and dvc.yaml (``dvc.utils.serialize._common._dump_data``, opened ``"w+"``) and
its repository lock ``.dvc/tmp/rwlock`` (``dvc.rwlock._edit_rwlock``, opened ``"w"``) in place: truncated
first, then written. A run killed inside that write (SIGKILL, the OOM killer, a lost node) leaves a part of the
file, and the next ``tpgrpo run`` stops with "'./dvc.lock' validation failed" (docs/up-to-date.md, harness
sequence 600000) or "RWLock-file ... format error". Here each such write on the local disk goes to a temporary
file beside its target, is flushed and fsynced, and replaces the target by a rename: a reader, or the next
run after a kill, sees the old file or the new one, never a part. Writes to other file systems (a Git revision
read by ``dvc exp``) keep DVC's own code. tests/test_dvc_atomic.py kills DVC inside these writes.
"""

from __future__ import annotations

import json
import os
import sys
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path

from tpgrpo.io.atomic_text import TMP_MARK, atomic_write_text, temporary_sibling  # noqa: F401 - re-exported

_SERIALIZERS = ("_common", "_yaml", "_json", "_toml", "_py")  # modules holding a reference to _dump_data


def sweep_stale_temps(root: Path) -> list[Path]:
    """Remove the temporary files that a killed writer left beside the files DVC and tpgrpo write here
    (``root``'s dvc.yaml and dvc.lock, ``.dvc/tmp``'s rwlock and seal stamps, the seal files and the sealed
    blocks' pipeline and lock files), whose PID is gone or a zombie; returns what was removed."""
    from tpgrpo.pipeline.long_runs.blocks import SEALS
    from tpgrpo.pipeline.dvc_integration.dvclock import pid_state
    from tpgrpo.pipeline.long_runs.seal_cache import CACHE

    seals = root / SEALS
    folders = [root, root / ".dvc" / "tmp", root / CACHE, seals]
    folders += sorted(p for p in seals.iterdir() if p.is_dir()) if seals.is_dir() else []
    removed = []
    for folder in folders:
        for tmp in folder.glob(f".*{TMP_MARK}*") if folder.is_dir() else ():
            pid = tmp.name.rpartition(TMP_MARK)[2].split("-")[0]
            if pid.isdigit() and pid_state(int(pid)) in (None, "Z") and tmp.is_file():
                tmp.unlink(missing_ok=True)
                removed.append(tmp)
    return removed


def _is_local(fs) -> bool:
    from dvc.fs import LocalFileSystem

    return fs is None or isinstance(fs, LocalFileSystem)


def _make_dump_data(original):
    def _dump_data(path, data, dumper, fs=None, **dumper_args):
        if not _is_local(fs):
            return original(path, data, dumper, fs=fs, **dumper_args)
        atomic_write_text(path, lambda fd: dumper(data, fd, **dumper_args))
    return _dump_data


@contextmanager
def _edit_rwlock(lock_dir, fs, hardlink):
    """``dvc.rwlock._edit_rwlock`` of DVC 3.67.1 with the write made atomic on the local disk."""
    from voluptuous import Invalid

    from dvc import rwlock

    path = fs.join(lock_dir, rwlock.RWLOCK_FILE)
    guard = rwlock.make_lock(fs.join(lock_dir, rwlock.RWLOCK_LOCK), tmp_dir=lock_dir, hardlink_lock=hardlink)
    with guard:
        try:
            with fs.open(path, encoding="utf-8") as fobj:
                lock = rwlock.SCHEMA(json.load(fobj))
        except FileNotFoundError:
            lock = rwlock.SCHEMA({})
        except json.JSONDecodeError as exc:
            raise rwlock.RWLockFileCorruptedError(path) from exc
        except Invalid as exc:
            raise rwlock.RWLockFileFormatError(path) from exc
        lock["read"] = defaultdict(list, lock["read"])
        lock["write"] = defaultdict(dict, lock["write"])
        yield lock
        if _is_local(fs):
            atomic_write_text(path, lambda fobj: json.dump(lock, fobj))
        else:
            with fs.open(path, "w", encoding="utf-8") as fobj:
                json.dump(lock, fobj)


def install() -> None:
    """Patch this process's DVC so that its lock, pipeline and rwlock files are written atomically. Refused
    (:class:`tpgrpo.io.dvc_versions.DvcVersionError`, one line) on a DVC other than the one verified."""
    import importlib

    from tpgrpo.pipeline.dvc_integration import lock_blocks
    from tpgrpo.io.dvc_versions import require_verified

    require_verified()  # before DVC is imported: a refusal costs no DVC start-up
    from dvc import rwlock

    common = importlib.import_module("dvc.utils.serialize._common")
    original = getattr(common, "_dump_data")
    if getattr(original, "__module__", "") == __name__:
        return  # installed already
    atomic = _make_dump_data(original)
    for name in _SERIALIZERS:
        module = importlib.import_module(f"dvc.utils.serialize.{name}")
        getattr(module, "_dump_data")  # present, or DVC changed: fail loudly
        setattr(module, "_dump_data", atomic)
    getattr(rwlock, "_edit_rwlock")
    rwlock._edit_rwlock = _edit_rwlock
    lock_blocks.install(atomic_write_text)  # a stage's lock write rewrites its own block only


# how tpgrpo runs a DVC command that writes
COMMAND = (sys.executable, "-m", "tpgrpo.pipeline.dvc_integration.dvc_atomic")


def dvc_env() -> dict[str, str]:
    """DVC's environment for tpgrpo: no analytics or Studio calls, and this interpreter's scripts folder first
    on PATH (stage commands call ``tpgrpo``)."""
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def run_dvc(root: Path, *args: str) -> None:
    """Run one DVC command in ``root`` through this module; a failure is one PipelineError line naming it."""
    import subprocess

    from tpgrpo.errors import PipelineError

    done = subprocess.run([*COMMAND, *args], cwd=root, env=dvc_env(), capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise PipelineError(f"dvc {' '.join(args)} failed (exit {done.returncode}): {last}")


def main(argv: list[str]) -> int:
    from tpgrpo.io.dvc_versions import DvcVersionError

    try:
        install()
    except DvcVersionError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    sweep_stale_temps(Path.cwd())
    from dvc.cli import main as dvc_main

    return dvc_main(argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
