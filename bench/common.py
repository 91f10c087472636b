"""What the bench scripts share: where the checkout is, timing a command, the machine's load, running a stage.

Every script runs from the repository root as ``python -m bench.NAME``, so ``tpgrpo``, ``bench`` and
``stages`` import as packages and no script edits ``sys.path`` (``tests/test_bench_layout.py`` checks it).
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]  # the checkout these scripts belong to
BENCH = REPO / "bench"
TESTS = REPO / "tests"


def load_average() -> str:
    """``/proc/loadavg``'s first three fields (1, 5 and 15 minutes), for the record beside a timing."""
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timed_run(cmd: list[str], **kwargs) -> tuple[float, subprocess.CompletedProcess]:
    """``subprocess.run(cmd, **kwargs)`` (check=True unless given) and its wall seconds."""
    kwargs.setdefault("check", True)
    start = time.perf_counter()
    done = subprocess.run(cmd, **kwargs)
    return time.perf_counter() - start, done


def run_stage(name: str, cfg, iteration: int | None, root: Path) -> dict:
    """Run stage ``name`` in this process on ``cfg`` (no DVC, no code check): the stage runner's door to the
    stage modules (:func:`tpgrpo.pipeline.execution.stage_runner.run_stage_module`), so no bench script imports them."""
    from tpgrpo.pipeline.execution.stage_runner import run_stage_module

    return run_stage_module(name, cfg, iteration, root)


def tests_helpers_env(extra: list[Path] = ()) -> dict[str, str]:
    """This environment with ``tests/`` (and ``extra``) first on ``PYTHONPATH``: the tests' helper modules
    import each other by their bare names (as pytest puts ``tests/`` first), so a child that uses them is
    started with it rather than this process editing its own path."""
    paths = [str(p) for p in (*extra, TESTS, REPO)]
    old = os.environ.get("PYTHONPATH")
    return {**os.environ, "PYTHONPATH": os.pathsep.join(paths + ([old] if old else []))}


def reexec_with_tests_helpers(module: str, helper: str) -> None:
    """Start ``python -m module`` again with :func:`tests_helpers_env` unless ``helper`` (a tests/ module
    name) already imports here; returns only when it does."""
    import importlib.util

    if importlib.util.find_spec(helper) is not None:
        return
    os.execve(sys.executable, [sys.executable, "-m", module, *sys.argv[1:]], tests_helpers_env())
