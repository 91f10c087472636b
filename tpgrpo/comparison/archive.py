"""Keep a comparison's results without its artifacts, small enough to commit beside the report.

A comparison root (:mod:`tpgrpo.comparison.runs`) holds gigabytes: trajectories, adapters, the model, DVC's cache.
The report reads only a few kilobytes per iteration of it: the stage JSON logs (and their timing sidecars,
where the stages' seconds are), the per-image eval tables,
each run's ``run.json``, ``params.yaml``, ``machine.json`` and numeric code manifests, and the root's ``commands.txt``, ``equal_wall.json`` and code
``SNAPSHOT.json``. An archive is a copy of the root pruned to exactly those files, in the same layout, so
``report --results ARCHIVE`` recomputes the same tables and figures as ``report --results ROOT`` did, long
after the run folders are gone (they are machine-local and git-ignored). An archive cannot be trained further:
``ARCHIVE.json`` at its top marks it, and ``run`` / ``equal-wall`` refuse it. More seeds of the same comparison,
trained later in another root, join it with :func:`add_to_archive` (their params must match, but for the seed,
and so must the machine and the code that computes numbers: :mod:`tpgrpo.comparison.provenance`).
"""

from __future__ import annotations

import json
import os
import shutil
import time
from pathlib import Path

from tpgrpo.comparison.provenance import MACHINE_FILE, NUMERIC_KINDS, mismatch
from tpgrpo.comparison.runs import ITER_FILES, SUMMARY, discover
from tpgrpo.io.stage_logs import timing_path
from tpgrpo.pipeline.code_manifest import manifest_path
from tpgrpo.errors import PipelineError

MARKER = "ARCHIVE.json"
ROOT_FILES = ("commands.txt", "equal_wall.json", "load_cost.json", "code/SNAPSHOT.json")
POOLED_KEYS = {"train.seed", "train.iterations"}  # runs that differ in nothing else pool as seeds of one variant
RUN_FILES = ("run.json", "params.yaml", str(SUMMARY), "data/iters/baseline_eval.json",
             "data/iters/baseline_eval.timing.json", "data/iters/baseline_eval.parquet", MACHINE_FILE,
             *(manifest_path(k) for k in NUMERIC_KINDS))
# What finishes an iteration, the probe log where there is one, and each log's timing sidecar: the stages'
# seconds live there (tpgrpo.io.stage_logs), and an archive must keep them for the equal-wall numbers.
_LOGS = (*ITER_FILES, "probe.json")
ITERATION_FILES = (*_LOGS, *(timing_path(Path(f)).name for f in _LOGS if f.endswith(".json")))


def is_archive(root: Path) -> bool:
    return (Path(root) / MARKER).is_file()


def refuse_archive(root: Path) -> None:
    """One-line error where a command would train in an archive (it has no model, data or code)."""
    if is_archive(root):
        raise PipelineError(f"{root}: an archive of a comparison ({MARKER}): results only, nothing can be trained "
                            "there; train in the original root or a new one")


def archived_files(root: Path) -> list[Path]:
    """The files of ``root`` (relative paths) an archive keeps: see the module docstring."""
    root = Path(root)
    files = [Path(f) for f in ROOT_FILES if (root / f).is_file()]
    for run in discover(root):
        folder = Path(run["folder"])
        rel = folder.relative_to(root)
        files += [rel / f for f in RUN_FILES if (folder / f).is_file()]
        for iteration in sorted((folder / "data" / "iters").glob("[0-9][0-9][0-9][0-9]")):
            files += [rel / iteration.relative_to(folder) / f for f in ITERATION_FILES if (iteration / f).is_file()]
    return files


def copy_snapshot(root: Path, dest: Path) -> None:
    """Copy ``root``'s code/SNAPSHOT.json to ``dest``, its source an absolute path (older snapshots) made
    relative to ``root``: an archive records no machine's paths."""
    record = json.loads((Path(root) / "code" / "SNAPSHOT.json").read_text())
    if os.path.isabs(record.get("source", "")):
        record["source"] = os.path.relpath(record["source"], Path(root).resolve())
    dest.write_text(json.dumps(record, indent=2) + "\n")


def write_archive(root: Path, dest: Path) -> dict:
    """Copy ``root``'s result files to ``dest`` (replaced whole, through a temporary sibling, so a failed copy
    leaves no half archive); returns the ``ARCHIVE.json`` record (source, time, runs, files, bytes)."""
    from tpgrpo.io.artifacts import atomic_path

    root, dest = Path(root), Path(dest)
    if is_archive(root):
        raise PipelineError(f"{root}: already an archive; copy the folder instead")
    runs = discover(root)
    if not runs:
        raise PipelineError(f"{root}: no run folders (*/seed*/run.json): nothing to archive")
    if dest.resolve() == root.resolve() or root.resolve() in dest.resolve().parents:
        raise PipelineError(f"--to {dest}: inside the comparison root {root}; choose a folder outside it")
    files = archived_files(root)
    with atomic_path(dest) as tmp:
        for rel in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, tmp / rel)
        if (root / "code" / "SNAPSHOT.json").is_file():
            copy_snapshot(root, tmp / "code" / "SNAPSHOT.json")
        record = {"source": str(root), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": len(runs),
                  "files": len(files), "bytes": sum((tmp / rel).stat().st_size for rel in files)}
        (tmp / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
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
    one of the runs, a run is unfinished, a run's params differ from its variant's archived runs in more than the seed and the
    iteration count, or (unless ``accept`` gives a reason, recorded) any run differs from the archived ones in
    machine or numeric code, or has no record of them. ``root``'s command lines are appended to commands.txt and its code snapshot kept as
    ``code/SNAPSHOT-<k>.json`` (k = 2, 3, ...); ``ARCHIVE.json`` lists the addition under ``added``."""
    from tpgrpo.io.artifacts import atomic_path

    root, dest = Path(root), Path(dest)
    if not is_archive(dest):
        raise PipelineError(f"--to {dest}: not an archive ({MARKER} missing): archive a root there first")
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
    record = json.loads((dest / MARKER).read_text())
    with atomic_path(dest) as tmp:
        shutil.copytree(dest, tmp)
        files = [f for f in archived_files(root) if str(f) not in ROOT_FILES]
        for rel in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(root / rel, tmp / rel)
        lines = (tmp / "commands.txt").read_text().splitlines() if (tmp / "commands.txt").is_file() else []
        lines += [x for x in (root / "commands.txt").read_text().splitlines() if x not in lines] \
            if (root / "commands.txt").is_file() else []
        (tmp / "commands.txt").write_text("\n".join(lines) + "\n")
        snapshot = tmp / "code" / f"SNAPSHOT-{len(record.get('added', [])) + 2}.json"
        if (root / "code" / "SNAPSHOT.json").is_file():
            copy_snapshot(root, snapshot)
        for rel in ("load_cost.json",):  # measured on the added root where the archive has none
            if (root / rel).is_file() and not (tmp / rel).is_file():
                shutil.copy2(root / rel, tmp / rel)
        added = {"source": str(root), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "runs": len(runs),
                 "files": len(files), "bytes": sum((tmp / rel).stat().st_size for rel in files),
                 "snapshot": str(snapshot.relative_to(tmp)), **({"accepted": accept} if accept else {})}
        record["added"] = [*record.get("added", []), added]
        (tmp / MARKER).write_text(json.dumps(record, indent=2, sort_keys=True) + "\n")
    return added


def archived_iterations(folder: Path) -> int:
    """Iterations 1..k of an archived run whose result files are all there (its policies are not kept, so
    ``comparison.run_state`` would call every archived run new)."""
    done = 0
    while all((Path(folder) / "data" / "iters" / f"{done + 1:04d}" / f).is_file() for f in ITER_FILES):
        done += 1
    return done
