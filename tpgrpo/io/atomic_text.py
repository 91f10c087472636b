"""Text files written whole or not at all: a temporary sibling named after its writer, fsynced, renamed over.

Used for the files DVC writes (:mod:`tpgrpo.pipeline.dvc_integration.dvc_atomic`) and those tpgrpo writes beside
them (:func:`tpgrpo.pipeline.long_runs.blocks.write_text_atomic`: dvc.yaml, dvc.lock, the seal files). A run killed
inside a write leaves the old file and a temporary one, which
:func:`tpgrpo.pipeline.dvc_integration.dvc_atomic.sweep_stale_temps` removes once its writer is gone.
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Callable, TextIO

# Temporary files are ".NAME.tpgrpo-tmp-PID-XXXXXXXX" beside their target (.gitignore: ".*.tpgrpo-tmp-*"): the
# writer's PID lets a later run remove only the parts of writers that are gone; the random part keeps two
# threads of one process apart.
TMP_MARK = ".tpgrpo-tmp-"


def temporary_sibling(path: Path) -> Path:
    """A new temporary file name beside ``path`` for this process (see ``TMP_MARK``)."""
    return path.with_name(f".{path.name}{TMP_MARK}{os.getpid()}-{os.urandom(4).hex()}")


def atomic_write_text(path: str | os.PathLike, write: Callable[[TextIO], object], keep_mode: bool = True) -> None:
    """Write ``path`` (UTF-8 text) through ``write(stream)`` into a temporary file beside it, fsync it and
    rename it over ``path``. The file's permission bits are ``path``'s when it exists and ``keep_mode`` (as
    DVC's write in place keeps them), else 0o666 less the umask (as ``open`` creates a file: 0o644 under the
    usual umask 022, readable by the other members of a shared project). On any error the target is untouched
    and the temporary file removed."""
    path = Path(path)
    tmp = temporary_sibling(path)
    try:
        with open(tmp, "x", encoding="utf-8") as fd:
            write(fd)
            fd.flush()
            os.fsync(fd.fileno())
        if keep_mode and path.exists():
            os.chmod(tmp, path.stat().st_mode & 0o7777)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
