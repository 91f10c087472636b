"""Keep a comparison's results without its artifacts, small enough to commit: a compact archive.

A comparison root (:mod:`tpgrpo.comparison.runs`) holds gigabytes: trajectories, adapters, the model, DVC's cache.
The report reads only a few kilobytes per iteration of it: the stage JSON logs (and their timing sidecars,
where the stages' seconds are), the per-image eval tables, each run's ``run.json``, ``params.yaml``,
``machine.json`` and numeric code manifests, and the root's ``commands.txt``, ``equal_wall.json`` and code
``SNAPSHOT.json``. An archive keeps exactly those: the run files in two Parquet tables
(:mod:`tpgrpo.comparison.compact`, read back by the same paths through :mod:`tpgrpo.comparison.store`), the
root's files as they are, so ``report --results ARCHIVE`` recomputes the same tables and figures as ``report
--results ROOT`` did, long after the run folders are gone (they are machine-local and git-ignored). An archive
cannot be trained further: ``ARCHIVE.json`` at its top marks it, and ``run`` / ``equal-wall`` refuse it. More
seeds of the same comparison, trained later in another root, join it with :func:`add_to_archive` (their params
must match, but for the seed, and so must the machine and the code that computes numbers:
:mod:`tpgrpo.comparison.provenance`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

import pandas as pd

from tpgrpo.comparison import store
from tpgrpo.comparison.provenance import mismatch
from tpgrpo.comparison.runs import ITER_FILES, discover
from tpgrpo.errors import PipelineError

MARKER = "ARCHIVE.json"
POOLED_KEYS = {"train.seed", "train.iterations"}  # runs that differ in nothing else pool as seeds of one variant


def is_archive(root: Path) -> bool:
    return (Path(root) / MARKER).is_file()


def refuse_archive(root: Path) -> None:
    """One-line error where a command would train in an archive (it has no model, data or code)."""
    if is_archive(root):
        raise PipelineError(f"{root}: an archive of a comparison ({MARKER}): results only, nothing can be trained "
                            "there; train in the original root or a new one")


def copy_snapshot(root: Path, dest: Path) -> None:
    """Copy ``root``'s code/SNAPSHOT.json to ``dest``, its source an absolute path (older snapshots) made
    relative to ``root``: an archive records no machine's paths."""
    record = json.loads((Path(root) / "code" / "SNAPSHOT.json").read_text())
    if os.path.isabs(record.get("source", "")):
        record["source"] = os.path.relpath(record["source"], Path(root).resolve())
    dest.write_text(json.dumps(record, indent=2) + "\n")


def write_archive(root: Path, dest: Path) -> dict:
    """Write ``root``'s results as a compact archive at ``dest`` (:mod:`tpgrpo.comparison.compact`; replaced
    whole, through a temporary sibling, so a failed write leaves no half archive), after checking that every
    result file reads back from it unchanged; returns the ``ARCHIVE.json`` record (source, time, runs, files,
    bytes: the result files' count and size as files). ``root`` may be an archive in the older per-file layout:
    it is converted, its record kept, with ``compacted`` added."""
    from tpgrpo.comparison import compact
    from tpgrpo.comparison.store import is_compact
    from tpgrpo.io.artifacts import atomic_path

    root, dest = Path(root), Path(dest)
    if is_compact(root):
        raise PipelineError(f"{root}: already a compact archive; copy the folder instead")
    runs = discover(root)
    if not runs:
        raise PipelineError(f"{root}: no run folders (*/seed*/run.json): nothing to archive")
    if dest.resolve() == root.resolve() or root.resolve() in dest.resolve().parents:
        raise PipelineError(f"--to {dest}: inside the comparison root {root}; choose a folder outside it")
    files = compact.result_files(root)
    tables = compact.tables_of(root)
    now = time.strftime("%Y-%m-%d %H:%M:%S")
    if is_archive(root):  # the older layout: its own record stands, the conversion is added to it
        record = {**json.loads((root / MARKER).read_text()), "compacted": {"from": str(root), "time": now}}
    else:
        record = {"source": str(root), "time": now, "runs": len(runs), "files": len(files),
                  "bytes": sum((root / rel).stat().st_size for rel in files),
                  "base_model": compact.base_model(root, runs)}
    with atomic_path(dest) as tmp:
        tmp.mkdir()
        compact.write_tables(tmp, *tables)
        compact.copy_text_files(root, tmp)
        if (root / "code" / "SNAPSHOT.json").is_file() and not is_archive(root):
            copy_snapshot(root, tmp / "code" / "SNAPSHOT.json")
        (tmp / MARKER).write_text(json.dumps({**record, "layout": "compact"}, indent=2, sort_keys=True) + "\n")
        compact.check_same(root, tmp, files)
        if compact.held_files(tmp) != sorted(files):
            raise PipelineError(f"{dest}: would hold other result files than {root}: nothing written")
    store.forget()  # dest's paths may have been read as plain folders before
    return record


def _params_mismatch(run: dict, existing: list[dict]) -> str:
    """Why ``run`` would not pool with the archive's runs of its variant ("" if it does)."""
    from tpgrpo.comparison.runs import NEUTRAL_KEYS, flatten
    from tpgrpo.config import param_fields

    same = [r for r in existing if r["variant"] == run["variant"]]
    if not same:
        return f"variant {run['variant']} is not in the archive"
    new, old = flatten(run["params"]), flatten(same[0]["params"])
    # A key one side lacks was added to params.yaml after that run's code: it ran with the key's default.
    defaults = {key: spec.default for key, spec in param_fields().items()}
    differ = sorted(k for k in set(new) | set(old) if k not in POOLED_KEYS | NEUTRAL_KEYS
                    and new.get(k, defaults.get(k)) != old.get(k, defaults.get(k)))
    return f"{run['variant']}/seed{run['seed']}: {', '.join(differ)} differ from the archived runs" if differ else ""


def _provenance_refusal(runs: list[dict], existing: list[dict], accept: str) -> str:
    """Why the new runs may not join the archived ones on provenance ("" if they may, or ``accept`` gives the
    reason they are joined anyway): another machine, code that computes numbers differently, or no record."""
    status, why = mismatch([Path(r["folder"]) for r in [*existing, *runs]])
    if not status or accept:
        return ""
    hint = "pass --accept 'REASON' to add them anyway (the report then shows the reason)"
    if status == "unknown":
        return f"cannot check the machine and code of every run ({why}); {hint}"
    return f"{why}: their numbers are not comparable; {hint}"


def add_to_archive(root: Path, dest: Path, accept: str = "") -> dict:
    """Add the runs of ``root`` to the archive ``dest`` (replaced through a temporary copy): more training seeds
    of the archived comparison, trained later. Refused with one line where ``dest`` is no archive, already has
    one of the runs, a run is unfinished, a run's params differ from its variant's archived runs in more than
    the seed and the iteration count, or (unless ``accept`` gives a reason, recorded) any run differs from the
    archived ones in machine or numeric code, or has no record of them. ``root``'s command lines are appended
    to commands.txt and its code snapshot kept as ``code/SNAPSHOT-<k>.json`` (k = 2, 3, ...); ``ARCHIVE.json``
    lists the addition under ``added``."""
    from tpgrpo.io.artifacts import atomic_path

    from tpgrpo.comparison import compact

    root, dest = Path(root), Path(dest)
    runs = _addable_runs(root, dest, accept)
    record = json.loads((dest / MARKER).read_text())
    files, held = compact.result_files(root), compact.held_files(dest)
    new_runs, new_evals = compact.tables_of(root)
    with atomic_path(dest) as tmp:
        shutil.copytree(dest, tmp)
        _append_tables(tmp, dest, new_runs, new_evals)
        _append_commands(tmp, root)
        snapshot = _keep_snapshot(tmp, root, record)
        for rel in ("load_cost.json",):  # measured on the added root where the archive has none
            if (root / rel).is_file() and not (tmp / rel).is_file():
                shutil.copy2(root / rel, tmp / rel)
        added = {"source": str(root), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": len(runs),
                 "files": len(files), "bytes": sum((root / rel).stat().st_size for rel in files),
                 "snapshot": str(snapshot.relative_to(tmp)), **({"accepted": accept} if accept else {})}
        record["added"] = [*record.get("added", []), added]
        (tmp / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
        compact.check_same(root, tmp, files)
        if compact.held_files(tmp) != sorted([*held, *files]):
            raise PipelineError(f"{dest}: would hold other result files than it and {root}: nothing added")
    store.forget()
    return added


def _addable_runs(root: Path, dest: Path, accept: str) -> list[dict]:
    """``root``'s runs, after the checks :func:`add_to_archive` makes before it writes anything (each refusal
    one line)."""
    from tpgrpo.comparison.store import is_compact

    if not is_archive(dest):
        raise PipelineError(f"--to {dest}: not an archive ({MARKER} missing): archive a root there first")
    if not is_compact(dest):
        raise PipelineError(f"--to {dest}: an archive in the older per-file layout: convert it first "
                            f"(tpgrpo compare archive --results {dest} --to NEW)")
    runs, existing = discover(root), discover(dest)
    if not runs:
        raise PipelineError(f"{root}: no run folders (*/seed*/run.json): nothing to add")
    have = {(r["variant"], r["seed"]) for r in existing}
    for run in runs:
        done, planned = archived_iterations(Path(run["folder"])), int(run["params"]["train"]["iterations"])
        why = f"{run['variant']}/seed{run['seed']} is already in {dest}" if (run["variant"], run["seed"]) in have \
            else f"{run['variant']}/seed{run['seed']}: {done} of {planned} iterations (finish it or leave it out)" \
            if done < planned else _params_mismatch(run, existing)
        if why:
            raise PipelineError(f"{why}: nothing added")
    why = _provenance_refusal(runs, existing, accept)
    if why:
        raise PipelineError(f"{why}: nothing added")
    return runs


def _append_tables(tmp: Path, dest: Path, new_runs: pd.DataFrame, new_evals: pd.DataFrame) -> None:
    """Write into ``tmp`` the archive ``dest``'s run and eval tables with the new rows appended (the runs'
    rows sorted by variant, seed and iteration)."""
    from tpgrpo.comparison import compact
    from tpgrpo.comparison.store import EVALS_TABLE, RUNS_TABLE

    old_runs, old_evals = (pd.read_parquet(dest / name) for name in (RUNS_TABLE, EVALS_TABLE))
    compact.write_tables(tmp, pd.concat([old_runs, new_runs], ignore_index=True).sort_values(
        ["variant", "seed", "iteration"], kind="stable", ignore_index=True),
        pd.concat([old_evals, new_evals], ignore_index=True))


def _append_commands(tmp: Path, root: Path) -> None:
    """Append to ``tmp``'s commands.txt the command lines of ``root``'s that it does not have yet."""
    lines = (tmp / "commands.txt").read_text().splitlines() if (tmp / "commands.txt").is_file() else []
    lines += [x for x in (root / "commands.txt").read_text().splitlines() if x not in lines] \
        if (root / "commands.txt").is_file() else []
    (tmp / "commands.txt").write_text("\n".join(lines) + "\n")


def _keep_snapshot(tmp: Path, root: Path, record: dict) -> Path:
    """Copy ``root``'s code snapshot (if any) to ``tmp``'s next ``code/SNAPSHOT-<k>.json``; returns that path
    (recorded even where ``root`` had no snapshot)."""
    snapshot = tmp / "code" / f"SNAPSHOT-{len(record.get('added', [])) + 2}.json"
    if (root / "code" / "SNAPSHOT.json").is_file():
        snapshot.parent.mkdir(exist_ok=True)
        copy_snapshot(root, snapshot)
    return snapshot


def archived_iterations(folder: Path) -> int:
    """Iterations 1..k of an archived run whose result files are all there (its policies are not kept, so
    ``comparison.run_state`` would call every archived run new)."""
    from tpgrpo.comparison.store import is_file

    done = 0
    while all(is_file(Path(folder) / "data" / "iters" / f"{done + 1:04d}" / f) for f in ITER_FILES):
        done += 1
    return done
