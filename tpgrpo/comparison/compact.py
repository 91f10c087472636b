"""Write a comparison's results as a compact archive: two Parquet tables beside its small text files.

The layout and how it is read: :mod:`tpgrpo.comparison.store`. :func:`tables_of` reads a root (run folders,
or an archive in the older per-file layout) into the two tables; :func:`write_compact` writes them with the
root's text files and checks, before it replaces anything, that every result file reads back from the tables
as it was (the same text, the same eval rows and dtypes).
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pandas as pd
import pyarrow.parquet as pq

from tpgrpo.comparison import store
from tpgrpo.comparison.store import EVAL_KEYS, EVAL_TABLE, EVALS_TABLE, RUN_KEYS, RUNS_TABLE, relative
from tpgrpo.errors import PipelineError

# The files of a run that become columns of runs.parquet (their text); eval.parquet becomes evals.parquet rows.
ITERATION_COLUMNS = ("rollout.json", "probe.json", "credit.json", "update.json", "eval.json", "rollout.timing.json",
                     "probe.timing.json", "credit.timing.json", "update.timing.json", "eval.timing.json")
RUN_COLUMNS = ("run.json", "params.yaml", "machine.json", "data/metrics/summary.json",
               *(f"data/code/{k}.json" for k in ("rollout", "probe", "credit", "update", "eval")))
BASE_COLUMNS = ("eval.json", "eval.timing.json", *RUN_COLUMNS)
# The report's curves, kept as typed columns for pandas (derived from the texts above when the archive is made).
CURVE_COLUMNS = ("train_seconds", "eval_reward", "strict_accuracy", "train_reward", "tp_rate", "approx_kl")
TEXT_FILES = ("commands.txt", "equal_wall.json", "load_cost.json", "plan.txt")


def _eval_meta(path: Path) -> str:
    meta = pq.read_schema(path).metadata or {}
    return json.dumps({k.decode(): v.decode() for k, v in sorted(meta.items()) if k.startswith(b"tpgrpo.")},
                      sort_keys=True)


def _run_rows(root: Path, run: dict) -> tuple[list[dict], list[pd.DataFrame]]:
    """The runs.parquet rows and the eval tables (keys added) of one run folder."""
    name = f"{run['variant']}/seed{run['seed']}"
    rows, evals = [], []
    for iteration in [0, *store.run_iterations(root / name)]:
        row = {"variant": run["variant"], "seed": int(run["seed"]), "iteration": iteration, "mode": run["mode"],
               "family": run.get("family", "main")}
        for column in BASE_COLUMNS if iteration == 0 else ITERATION_COLUMNS:
            path = root / relative(name, iteration, column)
            if path.is_file():
                row[column] = path.read_text()
        table = root / relative(name, iteration, EVAL_TABLE)
        if table.is_file():
            frame = pd.read_parquet(table)
            row["eval_rows"], row["eval_meta"] = len(frame), _eval_meta(table)
            keys = pd.DataFrame({"variant": run["variant"], "train_seed": int(run["seed"]), "iteration": iteration},
                                index=frame.index)
            evals.append(pd.concat([keys, frame], axis=1))
        rows.append(row)
    return rows, evals


def tables_of(root: Path) -> tuple[pd.DataFrame, pd.DataFrame]:
    """(runs, evals): the two tables of the comparison root ``root`` (see :mod:`tpgrpo.comparison.store`)."""
    from tpgrpo.comparison.results import collect_curves
    from tpgrpo.comparison.runs import discover

    root = Path(root)
    runs = discover(root)
    if not runs:
        raise PipelineError(f"{root}: no run folders (*/seed*/run.json): nothing to archive")
    rows, evals = [], []
    for run in runs:
        r, e = _run_rows(root, run)
        rows += r
        evals += e
    frame = pd.DataFrame(rows).reindex(columns=[*RUN_KEYS, "mode", "family", "eval_rows", "eval_meta",
                                                *ITERATION_COLUMNS, *RUN_COLUMNS])
    frame["eval_rows"] = frame["eval_rows"].astype("Int64")
    curves, _ = collect_curves(runs)
    curves = curves[[*RUN_KEYS, *CURVE_COLUMNS]].astype({"seed": "int64", "iteration": "int64"})
    frame = curves.merge(frame, on=list(RUN_KEYS), how="right")
    order = [*RUN_KEYS, "mode", "family", *CURVE_COLUMNS]
    frame = frame[[*order, *(c for c in frame.columns if c not in order)]]
    evals_frame = pd.concat(evals, ignore_index=True) if evals else pd.DataFrame(columns=list(EVAL_KEYS))
    return frame.sort_values(list(RUN_KEYS), kind="stable", ignore_index=True), evals_frame


def result_files(root: Path) -> list[str]:
    """Every result file of the runs under ``root`` that the tables stand for (relative paths)."""
    from tpgrpo.comparison.runs import discover

    out = []
    for run in discover(root):
        name = f"{run['variant']}/seed{run['seed']}"
        for iteration in [0, *store.run_iterations(Path(root) / name)]:
            names = (*(BASE_COLUMNS if iteration == 0 else ITERATION_COLUMNS), EVAL_TABLE)
            out += [rel for rel in (relative(name, iteration, n) for n in names) if (Path(root) / rel).is_file()]
    return out


def check_same(source: Path, archive: Path, files: list[str]) -> None:
    """Every file of ``files`` reads back from the compact ``archive`` as ``source`` holds it; else a one-line
    error naming the first that does not."""
    for rel in files:
        if rel.endswith(".parquet"):
            want, got = pd.read_parquet(source / rel), store.read_table(archive / rel)
            if want.empty:  # an iteration eval.every skipped: no rows (its string columns then have no dtype)
                want, got = list(want.columns), list(got.columns) if got.empty else None
                if want != got:
                    raise PipelineError(f"{archive / rel}: reads back unlike the empty table {source / rel}")
                continue
            try:
                pd.testing.assert_frame_equal(got, want.reset_index(drop=True), check_exact=True)
            except AssertionError as exc:
                raise PipelineError(f"{archive / rel}: reads back unlike {source / rel} ({str(exc).splitlines()[0]})")
        elif store.read_text(archive / rel) != (source / rel).read_text():
            raise PipelineError(f"{archive / rel}: reads back unlike {source / rel}")


def held_files(archive: Path) -> list[str]:
    """The result files a compact archive stands for (relative paths)."""
    held = store.open_compact(archive)
    return sorted([*held.texts, *held.tables])


def write_tables(dest: Path, runs: pd.DataFrame, evals: pd.DataFrame) -> None:
    """Write the two tables into the folder ``dest`` (zstd; strings dictionary-encoded)."""
    runs.to_parquet(dest / RUNS_TABLE, index=False, compression="zstd")
    evals.to_parquet(dest / EVALS_TABLE, index=False, compression="zstd")


def copy_text_files(root: Path, dest: Path) -> None:
    """The root's small text files: commands, equal-wall and load-cost records, plan, code snapshots."""
    for name in TEXT_FILES:
        if (root / name).is_file():
            shutil.copy2(root / name, dest / name)
    for snapshot in sorted((root / "code").glob("SNAPSHOT*.json")):
        (dest / "code").mkdir(exist_ok=True)
        shutil.copy2(snapshot, dest / "code" / snapshot.name)


def base_model(root: Path, runs: list[dict]) -> dict:
    """What the runs trained from: ``model.path`` and, where the first run folder holds the model, the md5 of
    its weight files (``*.safetensors``, ``*.bin``, in path order): the path alone does not say which weights."""
    import hashlib

    path = str(runs[0]["params"]["model"]["path"])
    folder = Path(path) if Path(path).is_absolute() else Path(runs[0]["folder"]) / path
    weights = sorted(p for p in folder.rglob("*") if p.suffix in (".safetensors", ".bin")) if folder.is_dir() else []
    if not weights:
        return {"path": path}
    digest = hashlib.md5()
    for weight in weights:
        digest.update(weight.read_bytes())
    return {"path": path, "md5": digest.hexdigest()}
