"""Process lifetimes and the code a long-lived process runs (the stage server's; standard library only).

A process that imports once and forks many times (``tpgrpo.pipeline.execution.stage_server``) runs the modules as they
were when it imported them: :class:`CodeState` notes what they came from, so the process can tell when its
imports went stale. :func:`die_with_parent` ties a process's life to its parent's, so a killed run leaves no
process of its own behind.
"""

from __future__ import annotations

import contextlib
import os
import sys


class CodeState:
    """What a long-lived process's imports came from: every file under ``folders`` (size,
    mtime, inode; on a stat change the md5 decides, so a touch is no change) and the distributions on
    ``sys.path`` (name and stat of each ``*.dist-info`` / ``*.egg-info`` / ``*.pth`` entry: an upgrade or
    a reinstall replaces them). About 10 ms for this project, start or check."""

    def __init__(self, folders: list[str]) -> None:
        self.folders = sorted(set(folders))
        self.stats = _code_stats(self.folders)
        self.md5s = {path: _md5(path) for path, st in self.stats.items() if not st[1]}

    def changed(self) -> str:
        """The first path added, removed or edited since the start, or ""."""
        now = _code_stats(self.folders)
        for path in sorted(set(now) | set(self.stats)):
            then, current = self.stats.get(path), now.get(path)
            if then == current:
                continue
            if then is None or current is None or then[:2] != current[:2] or then[1]:
                return path  # appeared, gone, resized, or a distribution's entry replaced
            if _md5(path) != self.md5s[path]:
                return path
            self.stats[path] = current  # touched only: the next check is a stat again
        return ""


def _code_stats(folders: list[str]) -> dict[str, tuple]:
    """``{path: (size, is_dir, mtime_ns, inode)}`` of the files under ``folders`` and the distributions' entries."""
    paths = []
    for folder in folders:
        for dirpath, dirs, names in os.walk(folder):
            dirs[:] = [d for d in dirs if d != "__pycache__"]
            paths += [os.path.join(dirpath, name) for name in names if not name.endswith(".pyc")]
    for entry in dict.fromkeys(p for p in sys.path if p and os.path.isdir(p)):
        paths += [item.path for item in os.scandir(entry)
                  if item.name.endswith((".dist-info", ".egg-info", ".pth", ".egg-link"))]
    found = {}
    for path in paths:
        with contextlib.suppress(FileNotFoundError):  # removed meanwhile: missing from the state, a change
            st = os.stat(path)
            found[path] = (st.st_size, os.path.isdir(path), st.st_mtime_ns, st.st_ino)
    return found


def _md5(path: str) -> str:
    import hashlib

    try:
        with open(path, "rb") as f:
            return hashlib.md5(f.read()).hexdigest()
    except OSError:
        return ""  # gone: differs from any md5


def die_with_parent(signum: int) -> None:
    """Linux ``prctl(PR_SET_PDEATHSIG, signum)``: this process gets ``signum`` when its parent dies."""
    import ctypes

    ctypes.CDLL(None, use_errno=True).prctl(1, signum, 0, 0, 0)
