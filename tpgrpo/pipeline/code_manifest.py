"""Code manifests: one small file per stage kind that names the code the kind runs and its hashes.

Why: each stage used to list its ~15 code files and folders as DVC dependencies, and DVC rewrites the
whole ``dvc.lock`` after every stage it runs; those entries were 40% of the lock (59 of 143 KB in a
12-iteration run), so every rewrite parsed and wrote them again, a cost that grows with the run. Now one
``code`` stage depends on all the code and writes ``data/code/<kind>.json`` (path -> md5 of every file of
that kind's code); each iteration stage depends on its kind's manifest only. A code change re-runs the
``code`` stage, rewrites the manifests whose files changed, and DVC re-runs exactly the stages whose
manifest changed: the same stages as before, with one dependency each instead of ~15.

Projects whose ``dvc.lock`` was written with code files as stage dependencies keep that layout
(:func:`uses_code_files`): switching would change every stage's dependencies and DVC would re-run them all.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

CODE_DIR = "data/code"
MODEL_CODE = ["tpgrpo/models", "tpgrpo/algo/trajectory.py", "tpgrpo/algo/sampling.py", "tpgrpo/algo/schedule.py",
              "tpgrpo/stage_common.py", "tpgrpo/policy/lora.py", "tpgrpo/io/artifacts.py", "tpgrpo/io/schemas.py",
              "tpgrpo/algo/probe_modes.py"]
EVAL_CODE = ["stages/eval.py", "tpgrpo/comparison/stats.py", "tpgrpo/policy/generate.py"]
REWARD_CODE = ["tpgrpo/tasks", "tpgrpo/rewards"]
CREDIT_CODE = ["stages/credit.py", "tpgrpo/algo/credit.py", "tpgrpo/algo/advantages.py", "tpgrpo/io/artifacts.py",
               "tpgrpo/io/schemas.py"]

# The code each kind of stage runs (files, or folders taken whole). `credit_from_rollout` is Flow-GRPO's
# credit stage, which reads the final rewards from the rollout's Zarr through stages/probe.py; `eval`
# serves the baseline too.
KIND_CODE: dict[str, list[str]] = {
    "rollout": ["stages/rollout.py", *MODEL_CODE, *REWARD_CODE],
    "probe": ["stages/probe.py", "tpgrpo/algo/probe_modes.py", *MODEL_CODE, *REWARD_CODE],
    "credit": CREDIT_CODE,
    "credit_from_rollout": [*CREDIT_CODE, "stages/probe.py"],
    "update": ["stages/update.py", "tpgrpo/policy/update.py", "tpgrpo/algo/loss.py", *MODEL_CODE],
    "eval": [*EVAL_CODE, *MODEL_CODE, *REWARD_CODE],
    # the summary's figures sample the base and last policies: the model code and generate.py (tasks: prompts)
    "summary": ["stages/summary.py", "tpgrpo/reports/figures.py", "tpgrpo/reports/plots.py", "tpgrpo/policy/generate.py", *MODEL_CODE,
                "tpgrpo/tasks"],
}
KIND_CODE = {kind: list(dict.fromkeys(paths)) for kind, paths in KIND_CODE.items()}  # each path once
ALL_CODE = sorted({p for paths in KIND_CODE.values() for p in paths} | {"tpgrpo/pipeline/code_manifest.py"})


def manifest_path(kind: str) -> str:
    """The manifest a stage of ``kind`` depends on, relative to the project root."""
    return f"{CODE_DIR}/{kind}.json"


def code_deps(kind: str, manifests: bool) -> list[str]:
    """A stage's code dependencies: its kind's manifest, or (``manifests`` False: a project of the older
    layout) the code paths themselves."""
    return [manifest_path(kind)] if manifests else list(KIND_CODE[kind])


def _files(root: Path, path: str) -> list[str]:
    """The files behind a code path: itself, or every file under the folder (no byte-code caches)."""
    full = root / path
    if full.is_file():
        return [path]
    if not full.is_dir():
        raise FileNotFoundError(f"code path {path}: not found under {root} (a code file the stages run)")
    return sorted(p.relative_to(root).as_posix() for p in full.rglob("*")
                  if p.is_file() and "__pycache__" not in p.parts and p.suffix != ".pyc")


def manifest(root: Path, kind: str) -> dict:
    """``{"kind": kind, "files": {path: md5}}`` for every file of the kind's code (sorted paths)."""
    files = [f for path in KIND_CODE[kind] for f in _files(root, path)]
    return {"kind": kind, "files": {f: hashlib.md5((root / f).read_bytes()).hexdigest() for f in sorted(set(files))}}


def write_manifests(root: Path) -> list[Path]:
    """Write every kind's manifest under ``root/data/code`` (all computed first, then each written to a
    temporary file and renamed); returns them. A manifest's bytes change exactly when a file of its kind's
    code changes."""
    texts = {kind: json.dumps(manifest(root, kind), indent=1, sort_keys=True) + "\n" for kind in KIND_CODE}
    from tpgrpo.io.artifacts import atomic_path

    written = []
    for kind, text in texts.items():
        with atomic_path(root / manifest_path(kind)) as tmp:
            tmp.write_text(text)
        written.append(root / manifest_path(kind))
    return written


def code_stage() -> dict:
    """The dvc.yaml stage that writes the manifests from all the code."""
    return {"cmd": "tpgrpo stage code", "deps": ALL_CODE,
            "outs": [manifest_path(kind) for kind in KIND_CODE]}


def uses_code_files(lock: dict) -> bool:
    """Whether a ``dvc.lock`` (as a mapping) comes from the older layout: a stage lists a file under
    ``stages/`` as a dependency (every stage did, its own module)."""
    for entry in (lock.get("stages") or {}).values():
        if entry.get("cmd") != code_stage()["cmd"] and any(
                str(dep.get("path", "")).startswith("stages/") for dep in entry.get("deps") or []):
            return True
    return False
