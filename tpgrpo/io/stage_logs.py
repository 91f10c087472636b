"""A stage's JSON log, split in two: what the stage computed (tracked by DVC) and how this run went (not).

A log DVC tracks (``data/iters/NNNN/<stage>.json``, ``baseline_eval.json``, ``eval_prompts.json``) must be
the same bytes whenever the stage runs on the same inputs, or a stage re-run by hand changes an output and
DVC re-runs it and everything after it. The fields that differ between identical runs
(:data:`RUN_KEYS`: the stage's wall seconds, the processes that shared the work, the Python and torch
versions) go to a sidecar beside the log, ``<stage>.timing.json`` (``rollout.json`` ->
``rollout.timing.json``), written atomically after the log and listed in ``.gitignore``; no DVC stage lists
it. Readers take the sidecar's fields over the log's, so logs written before the split (their
``wall_seconds`` inside, as in the older archives' runs under ``results/``) still give their seconds.
"""

from __future__ import annotations

import json
import platform
from pathlib import Path
from typing import Any

from tpgrpo.errors import PipelineError
from tpgrpo.io.artifacts import read_json, write_json

RUN_KEYS = ("wall_seconds", "processes")  # measured by the run, not computed from the stage's inputs
TIMING_SUFFIX = ".timing.json"


def timing_path(log: Path) -> Path:
    """The sidecar of a stage log: ``NNNN/credit.json`` -> ``NNNN/credit.timing.json``."""
    return log.with_name(log.stem + TIMING_SUFFIX)


def versions() -> dict[str, str]:
    """The interpreter's and torch's versions (recorded by the code manifests too; here for reading)."""
    from importlib.metadata import version

    return {"python_version": platform.python_version(), "torch_version": version("torch")}  # no torch import


def write_log(path: Path, metrics: dict[str, Any]) -> None:
    """Write ``metrics`` less :data:`RUN_KEYS` to ``path`` (the tracked log, sorted JSON) and those keys plus
    :func:`versions` to its sidecar (:func:`timing_path`); each atomically. ``metrics`` is left whole."""
    write_json(path, {k: v for k, v in metrics.items() if k not in RUN_KEYS})
    write_json(timing_path(path), {**{k: metrics[k] for k in RUN_KEYS if k in metrics}, **versions()})


def read_timing(path: Path) -> dict[str, Any]:
    """The sidecar's fields of log ``path`` ({} when there is none or it is not readable JSON: timings are
    never an input, so a damaged sidecar only loses its seconds)."""
    side = timing_path(path)
    try:
        data = json.loads(side.read_text()) if side.is_file() else {}
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):
        return {}
    return data if isinstance(data, dict) else {}


def read_log(path: Path, what: str) -> dict[str, Any]:
    """A stage log with its sidecar's fields merged in (the sidecar wins: a log written before the split
    keeps its own ``wall_seconds``). A missing log is one line naming ``what`` (:func:`read_json`)."""
    return {**read_json(path, what), **read_timing(path)}


def log_seconds(path: Path) -> float:
    """The wall seconds of the stage that wrote log ``path``: the sidecar's, else the log's own (older
    runs); a one-line error naming the file when neither has them."""
    seconds = read_log(path, f"stage log {path}").get("wall_seconds")
    if seconds is None:
        raise PipelineError(f"{path}: no wall_seconds in it or in {timing_path(path).name}")
    return float(seconds)
