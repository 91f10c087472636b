"""Writing an artifact so that no reader, and no kill, ever sees half of it under its final name: the writer
fills a temporary sibling (``.NAME.tmp-PID-XXXXXXXX``), which then takes the final name in one step
(:func:`swap_in`); what a killed writer left is cleaned up by the next writer of that name (:func:`recover`).
"""

from __future__ import annotations

import functools
import os
import shutil
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Iterator


def _temp_sibling(path: Path) -> Path:
    # the writer's PID in the name: a later writer removes only the temporaries of writers that are gone
    return path.with_name(f".{path.name}.tmp-{os.getpid()}-{uuid.uuid4().hex[:8]}")


def _writer_alive(temporary: Path, mark: str = ".tmp-") -> bool:
    """Whether the process named in ``.NAME.tmp-PID-XXXXXXXX`` (``mark``: ``.old-`` for a copy moved aside)
    still runs (a zombie does not; an older name without a PID counts as gone)."""
    pid = temporary.name.rsplit(mark, 1)[1].split("-")[0]
    if not pid.isdigit():
        return False
    try:
        os.kill(int(pid), 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True  # no /proc (macOS): kill(0) found it


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write into; on success swap it in for ``path``
    (:func:`swap_in`).

    On any error the temporary file or folder is removed and ``path`` is left as it was, so a killed or
    failed stage never leaves a half-written artifact under the final name. A killed writer's temporary files
    are removed, and an old copy it had moved aside is put back where nothing replaced it (:func:`recover`).
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    recover(path)
    tmp = _temp_sibling(path)
    try:
        yield tmp
        swap_in(tmp, path)
    except OSError as exc:
        if exc.filename is None:  # a failed write (a full disk) names no file: name the artifact
            exc.filename = str(path)
        raise
    finally:
        _remove(tmp)


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    elif path.exists() or path.is_symlink():
        path.unlink(missing_ok=True)


def recover(path: Path) -> list[Path]:
    """Clean up after writers of ``path`` that are gone (killed): remove their temporary files; put an old copy
    one of them had moved aside (``.NAME.old-PID-XXXXXXXX``, :func:`swap_in`) back under ``path`` when it was
    killed before the new one took its place, else remove it. Returns the leftovers handled."""
    found = []
    for stale in sorted(path.parent.glob(f".{path.name}.tmp-*")):  # not those of a writer running now
        if not _writer_alive(stale):
            _remove(stale)
            found.append(stale)
    for aside in sorted(path.parent.glob(f".{path.name}.old-*")):
        if _writer_alive(aside, ".old-"):
            continue
        if not path.exists() and not path.is_symlink():
            os.replace(aside, path)  # killed between its two renames: the old artifact, whole
        else:
            _remove(aside)
        found.append(aside)
    return found


def swap_in(new: Path, path: Path) -> None:
    """Put ``new`` (a file or a folder) under the name ``path`` so that a kill at any moment leaves ``path``
    either the old artifact or the new one, whole. A file over a file is one rename. A folder is exchanged with
    the old one in one step where the system can (Linux ``renameat2(RENAME_EXCHANGE)``), the old one then
    deleted under ``new``'s name; elsewhere the old one is renamed aside first (``.NAME.old-PID-XXXXXXXX``),
    then ``new`` renamed in, then the old one deleted: a kill between the renames leaves ``path`` missing and
    the old one aside, which :func:`recover` puts back."""
    old_kind = "dir" if path.is_dir() and not path.is_symlink() else (
        "file" if path.exists() or path.is_symlink() else None)
    new_is_dir = new.is_dir() and not new.is_symlink()
    if old_kind is None or (old_kind == "file" and not new_is_dir):
        os.replace(new, path)
        return
    if _exchange(new, path):
        _remove(new)  # the old artifact, under the temporary name
        return
    aside = path.with_name(f".{path.name}.old-{os.getpid()}-{uuid.uuid4().hex[:8]}")
    os.replace(path, aside)
    os.replace(new, path)
    _remove(aside)


def _exchange(a: Path, b: Path) -> bool:
    """Swap the names ``a`` and ``b`` atomically (``renameat2`` with ``RENAME_EXCHANGE``); False where the
    system or the file system cannot (the caller then renames in two steps)."""
    libc = _libc()
    if libc is None:
        return False
    at_fdcwd, rename_exchange = -100, 2
    if libc.renameat2(at_fdcwd, os.fsencode(a), at_fdcwd, os.fsencode(b), rename_exchange) == 0:
        return True
    import ctypes

    errno = ctypes.get_errno()
    if errno in (22, 38, 95):  # EINVAL, ENOSYS, EOPNOTSUPP: no exchange here
        return False
    raise OSError(errno, os.strerror(errno), str(b))


@functools.lru_cache(maxsize=1)
def _libc():
    """glibc with ``renameat2`` (2.28 and later), or None (another libc, another system)."""
    import ctypes
    import ctypes.util
    import sys

    if not sys.platform.startswith("linux"):
        return None
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        libc.renameat2.argtypes = [ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_uint]
    except (OSError, AttributeError):
        return None
    return libc
