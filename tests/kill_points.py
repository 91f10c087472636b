"""SIGKILL a Python program at its k-th change of the file system (a rename, an unlink, a rmdir) made inside
chosen functions: the kill tests' way to land at every point, or a seeded random one, of a multi-step edit
(unsealing a block, swapping an artifact in) without timing.

    python tests/kill_points.py --at K --within tpgrpo.pipeline.long_runs.sealing:unseal_changed [--point M:F] \\
        [--count FILE] -m tpgrpo run

Counts the calls of ``os.replace``, ``os.rename``, ``os.unlink``, ``os.remove``, ``os.rmdir`` (``Path.unlink``,
``shutil.rmtree`` and ``tempfile`` go through them), and of each ``--point`` function (a change made another way:
``renameat2`` through ctypes), made while one of the ``--within`` functions runs, and on
the ``K``-th (1-based) SIGKILLs its process group (when it leads one: start it with ``start_new_session``),
else itself, before the call happens. ``--count FILE``: write how many such calls it made, at exit (a run that
was never killed: how many kill points there are). ``--at 0`` never kills.
"""

from __future__ import annotations

import argparse
import atexit
import functools
import importlib
import os
import runpy
import signal
import sys
from pathlib import Path

OPS = ("replace", "rename", "unlink", "remove", "rmdir")


class Points:
    """The counter: ``inside`` > 0 while a watched function runs; ``seen`` calls counted so far."""

    def __init__(self, at: int):
        self.at, self.seen, self.inside = at, 0, 0

    def hit(self) -> None:
        if not self.inside:
            return
        self.seen += 1
        if self.seen == self.at:
            sys.stdout.flush()
            sys.stderr.flush()
            if os.getpgid(0) == os.getpid():
                os.killpg(0, signal.SIGKILL)
            os.kill(os.getpid(), signal.SIGKILL)


def _wrap(target: str, make) -> None:
    """Replace the module attribute ``module:function`` by ``make(real)`` (callers that look it up at call time
    see the wrapper)."""
    module_name, _, attr = target.partition(":")
    module = importlib.import_module(module_name)
    real = getattr(module, attr)
    setattr(module, attr, functools.wraps(real)(make(real)))


def arm(at: int, within: list[str], extra: list[str] = ()) -> Points:
    """Patch the file-system calls and each ``extra`` function to count as kill points, and wrap each
    ``module:function`` of ``within`` to open the window where they count."""
    points = Points(at)

    def counted(real):
        def op(*args, **kwargs):
            points.hit()
            return real(*args, **kwargs)
        return op

    def watched(real):
        def inside(*args, **kwargs):
            points.inside += 1
            try:
                return real(*args, **kwargs)
            finally:
                points.inside -= 1
        return inside

    for name in OPS:
        setattr(os, name, counted(getattr(os, name)))
    for target in extra:
        _wrap(target, counted)
    for target in within:
        _wrap(target, watched)
    return points


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--at", type=int, required=True)
    parser.add_argument("--within", action="append", required=True, help="module:function (repeatable)")
    parser.add_argument("--point", action="append", default=[], help="module:function, a kill point too")
    parser.add_argument("--count", type=Path, default=None)
    parser.add_argument("-m", dest="module", required=True)
    args, rest = parser.parse_known_args()
    points = arm(args.at, args.within, args.point)
    if args.count is not None:
        atexit.register(lambda: args.count.write_text(str(points.seen)))
    sys.argv = [args.module, *rest]
    runpy.run_module(args.module, run_name="__main__", alter_sys=True)


if __name__ == "__main__":
    main()
