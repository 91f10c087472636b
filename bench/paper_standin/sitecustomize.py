"""Loaded by every Python process of a ``bench/paper_bytes.py`` project (this folder is on its PYTHONPATH).

1. In tpgrpo processes: ``tpgrpo.models.load_backend`` returns the stand-in (``standin.py``) for a model folder
   holding ``standin.json``; any other folder loads as before. The project's code is not changed.
2. With ``PAPER_BYTES_TIMERS=DIR``: DVC processes (``python -m dvc ...`` or
   ``-m tpgrpo.pipeline.dvc_integration.dvc_atomic ...``) and ``tpgrpo run`` time named parts of their work (busy
   wall seconds: overlapping calls in threads count once) and write them to ``DIR/<pid>.json`` at exit, with the
   process's argv and wall seconds.
"""

import sys
import time

_T0 = time.time()
_ARGV = list(getattr(sys, "orig_argv", sys.argv))


def _install():
    import paper_timers  # beside this file: the folder is on the process's PYTHONPATH, which is how it got here

    if paper_timers.is_dvc_argv(_ARGV):
        paper_timers.install_dvc(_T0, _ARGV)
        return
    paper_timers.install_standin()
    if "run" in _ARGV[1:3] or (len(_ARGV) > 2 and _ARGV[-1] == "run"):
        paper_timers.install_tpgrpo_run(_T0, _ARGV)


try:
    _install()
except Exception as exc:  # noqa: BLE001 - a broken hook must say so, not silently measure nothing
    print(f"paper_standin/sitecustomize: {exc!r}", file=sys.stderr)
    raise
