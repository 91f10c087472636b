"""Read a comparison's result files by their paths, from run folders on disk or from a compact archive.

A comparison root keeps each run's results as small files (``VARIANT/seedK/data/iters/NNNN/credit.json``, its
``eval.parquet``, ``run.json`` ...). A *compact archive* (:mod:`tpgrpo.comparison.compact`) keeps the same
results in two Parquet tables at its top, beside its small text files (``ARCHIVE.json``, ``commands.txt``,
``equal_wall.json``, ``code/SNAPSHOT.json``):

- ``runs.parquet``: one row per (variant, seed, iteration), iteration 0 the base model's evaluation. A column
  per result file, named as the file (``rollout.json``, ``credit.timing.json``, ``eval.json`` ...), holds
  the file's text as it was written, so every number reads back bit for bit; the iteration-0 row also holds
  the run's own files (``run.json``, ``params.yaml``, ``machine.json``, ``data/code/<kind>.json``,
  ``data/metrics/summary.json``). ``eval_rows`` is the row count of the iteration's eval table (null where
  there was none) and ``eval_meta`` its ``tpgrpo.*`` Parquet metadata (JSON). Typed columns
  (``eval_reward``, ``train_seconds`` ...) are the report's curves, for reading with pandas.
- ``evals.parquet``: every per-image eval row, with the run's ``variant``, ``train_seed`` and ``iteration``.

The comparison's readers call :func:`is_file`, :func:`read_text`, :func:`read_table` and :func:`run_files`
with the paths a root would have (``results/NAME/tp/seed0/data/iters/0003/credit.json``); a path inside a
compact archive is answered from its tables, any other from the disk. So the report, the equal-wall
planning and the studies read both layouts with one code path, and name the same paths in their messages.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pandas as pd

from tpgrpo.errors import PipelineError
from tpgrpo.io.stage_logs import timing_path
from tpgrpo.stage_params import BASELINE_LOG, BASELINE_TABLE

RUNS_TABLE, EVALS_TABLE = "runs.parquet", "evals.parquet"
MARKER = "ARCHIVE.json"  # also tpgrpo.comparison.archive.MARKER: what makes a folder an archive
RUN_KEYS = ("variant", "seed", "iteration")
EVAL_KEYS = ("variant", "train_seed", "iteration")  # the eval table has its own "seed" (the eval seed)
# a run's files at iteration 0 (the base model's evaluation): the baseline stage's, named in its record
BASELINE_FILES = {"eval.parquet": BASELINE_TABLE, "eval.json": BASELINE_LOG,
                  "eval.timing.json": str(timing_path(Path(BASELINE_LOG)))}
EVAL_TABLE = "eval.parquet"


class Compact:
    """A compact archive's tables, indexed by the relative paths of the files they stand for."""

    def __init__(self, root: Path):
        self.root = root
        runs = pd.read_parquet(root / RUNS_TABLE)
        self.texts: dict[str, str] = {}
        self.tables: dict[str, tuple] = {}  # relative path -> (variant, seed, iteration) of its eval rows
        self.iterations: dict[str, list[int]] = {}  # run folder -> its iterations (0 included)
        self.variants = set(runs["variant"])
        files = [c for c in runs.columns if c.endswith((".json", ".yaml"))]
        for row in runs[[*RUN_KEYS, "eval_rows", *files]].itertuples(index=False):
            variant, seed, iteration, rows = row[0], int(row[1]), int(row[2]), row[3]
            run = f"{variant}/seed{seed}"
            self.iterations.setdefault(run, []).append(iteration)
            for name, text in zip(files, row[4:]):
                if isinstance(text, str):
                    self.texts[relative(run, iteration, name)] = text
            if pd.notna(rows):
                self.tables[relative(run, iteration, EVAL_TABLE)] = (variant, seed, iteration)
        self._evals: dict[tuple, pd.DataFrame] | None = None

    def eval_table(self, rel: str) -> pd.DataFrame:
        if self._evals is None:
            evals = pd.read_parquet(self.root / EVALS_TABLE)
            columns = [c for c in evals.columns if c not in EVAL_KEYS]
            self._evals = {(v, int(s), int(i)): g[columns].reset_index(drop=True)
                           for (v, s, i), g in evals.groupby(list(EVAL_KEYS), sort=False)}
            self._empty = evals[columns].iloc[:0].reset_index(drop=True)
        return self._evals.get(self.tables[rel], self._empty).copy()


def relative(run: str, iteration: int, name: str) -> str:
    """The path, relative to the archive, of the file ``name`` of ``run`` (``VARIANT/seedK``) at ``iteration``
    (0: the base model's evaluation, and the run's own files)."""
    if iteration == 0:
        if name in BASELINE_FILES:
            return f"{run}/{BASELINE_FILES[name]}"
        return f"{run}/{name}"
    return f"{run}/data/iters/{iteration:04d}/{name}"


_OPEN: dict[str, Compact] = {}
_ROOTS: dict[str, str | None] = {}  # folder -> the compact archive it lies in (None: none); see forget()


def is_compact(root: Path) -> bool:
    root = Path(root)
    return (root / RUNS_TABLE).is_file() and (root / MARKER).is_file()


def forget() -> None:
    """Drop what this process remembers of archives: after one is written where a path was read before."""
    _OPEN.clear()
    _ROOTS.clear()


def open_compact(root: Path) -> Compact:
    """The archive at ``root``, read once per process (:func:`forget` after writing one)."""
    key = os.path.abspath(root)
    held = _OPEN.get(key)
    if held is None:
        try:
            held = _OPEN[key] = Compact(Path(key))
        except (OSError, ValueError, KeyError) as exc:
            raise PipelineError(f"{Path(key) / RUNS_TABLE}: not a readable compact archive table "
                                f"({type(exc).__name__}: {exc})") from None
    return held


def _root_of(folder: str) -> str | None:
    """The compact archive ``folder`` (an absolute path) lies in or is, else None; remembered per folder,
    since the comparison reads thousands of files."""
    if folder not in _ROOTS:
        parent = os.path.dirname(folder)
        _ROOTS[folder] = folder if is_compact(Path(folder)) else None if parent == folder else _root_of(parent)
    return _ROOTS[folder]


def _locate(path: Path) -> tuple[Compact, str] | None:
    """(archive, path relative to it) where ``path`` lies inside a compact archive's run folders."""
    path = os.path.abspath(path)
    root = _root_of(os.path.dirname(path))
    if root is None:
        return None
    archive, rel = open_compact(root), path[len(root) + 1:].replace(os.sep, "/")
    # the archive's own files (commands.txt, code/SNAPSHOT.json, its report's tables) are real files
    return (archive, rel) if rel.split("/", 1)[0] in archive.variants else None


def is_file(path: Path) -> bool:
    hit = _locate(path)
    if hit is None:
        return Path(path).is_file()
    archive, rel = hit
    return rel in archive.texts or rel in archive.tables


def read_text(path: Path) -> str:
    hit = _locate(path)
    if hit is None:
        return Path(path).read_text()
    archive, rel = hit
    if rel not in archive.texts:
        raise FileNotFoundError(f"{path}: not in the compact archive {archive.root}")
    return archive.texts[rel]


def read_json(path: Path) -> Any:
    return json.loads(read_text(path))


def read_table(path: Path) -> pd.DataFrame:
    """A per-image eval table (as its file held it: same columns, dtypes and row order)."""
    hit = _locate(path)
    if hit is None:
        return pd.read_parquet(path)
    archive, rel = hit
    if rel not in archive.tables:
        raise FileNotFoundError(f"{path}: not in the compact archive {archive.root}")
    return archive.eval_table(rel)


def run_files(root: Path) -> list[Path]:
    """The ``VARIANT/seedK/run.json`` paths under a comparison root or archive, sorted."""
    root = Path(root)
    if is_compact(root):
        archive = open_compact(root)
        return sorted(root / run / "run.json" for run in archive.iterations if f"{run}/run.json" in archive.texts)
    return sorted(root.glob("*/seed*/run.json"))


def run_iterations(folder: Path) -> list[int]:
    """The iterations (>= 1) that have a folder ``data/iters/NNNN`` in the run ``folder``, sorted."""
    hit = _locate(Path(folder) / "run.json")
    if hit is None:
        return sorted(int(p.name) for p in (Path(folder) / "data" / "iters").glob("[0-9][0-9][0-9][0-9]"))
    archive, rel = hit
    return sorted(i for i in archive.iterations.get(rel.rsplit("/", 1)[0], []) if i > 0)


def read_eval_table(path: Path) -> pd.DataFrame:
    """:func:`tpgrpo.comparison.stats.read_eval_table` (a per-image eval table, checked: one line naming the
    path where it is not one) for a file or a table in a compact archive."""
    from tpgrpo.comparison.stats import EVAL_TABLE_COLUMNS, PAIR_KEYS
    from tpgrpo.comparison.stats import read_eval_table as read_file

    if _locate(path) is None:
        return read_file(path)
    if not is_file(path):
        raise PipelineError(f"missing eval table {path} (run the eval or baseline stage)")
    frame = read_table(path)
    missing = [c for c in EVAL_TABLE_COLUMNS if c not in frame.columns]
    if missing or frame.duplicated(PAIR_KEYS).any():
        raise PipelineError(f"{path}: missing columns {missing} or repeated (prompt_id, sample, seed) rows")
    return frame


def seed_folders(arm: Path) -> list[Path]:
    """The run folders ``ARM/seedK`` of one arm of a comparison root or archive, by seed."""
    return sorted({f.parent for f in run_files(Path(arm).parent) if f.parent.parent.name == Path(arm).name},
                  key=lambda f: int(f.name[4:]))


def stage_seconds(iteration_folder: Path, stage: str) -> float:
    """A stage's own wall seconds: from its log's untracked sidecar (``<stage>.timing.json``), else from the
    log itself (runs made before the sidecar, the archived ones among them), as
    :func:`tpgrpo.io.stage_logs.log_seconds` reads them, from a run folder or a compact archive; 0 for a
    probe that is not there (flow_grpo has none)."""
    from tpgrpo.io.stage_logs import timing_path

    path = Path(iteration_folder) / f"{stage}.json"
    if not is_file(path):
        if stage == "probe":
            return 0.0
        raise PipelineError(f"stage log {path}: missing (run the stage first)")
    try:
        side = read_json(timing_path(path)) if is_file(timing_path(path)) else {}
    except (json.JSONDecodeError, UnicodeDecodeError, OSError):  # timings are never an input: a damaged
        side = {}                                                 # sidecar only loses its seconds
    seconds = {**read_json(path), **(side if isinstance(side, dict) else {})}.get("wall_seconds")
    if seconds is None:
        raise PipelineError(f"{path}: no wall_seconds in it or in {timing_path(path).name}")
    return float(seconds)
