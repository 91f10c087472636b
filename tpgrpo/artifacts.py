"""Where each iteration's artifacts live, and writing them atomically (temp path, then rename).

Layout under the project root::

    data/iters/0003/trajectories.zarr   rollout: latents, log-probs, sigmas, seeds
    data/iters/0003/prompt_embeds.safetensors  rollout: the iteration's prompt embeddings (probe/update read them)
    data/iters/0003/rollout.json        rollout metrics
    data/iters/0003/probe.parquet       probe: one row per (trajectory, step)
    data/iters/0003/credit.parquet      credit: one row per (trajectory, window step)
    data/iters/0003/policy/             update: LoRA adapter + optimizer state for iteration 4
    data/iters/0003/eval.json           eval metrics
"""

from __future__ import annotations

import json
import os
import shutil
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Iterator

from tpgrpo.errors import PipelineError


@dataclass(frozen=True)
class IterationPaths:
    """Paths of one iteration's artifacts."""

    root: Path
    iteration: int

    @property
    def folder(self) -> Path:
        return self.root / "data" / "iters" / f"{self.iteration:04d}"

    def _file(self, name: str) -> Path:
        return self.folder / name

    trajectories = property(lambda self: self._file("trajectories.zarr"))
    prompt_embeds = property(lambda self: self._file("prompt_embeds.safetensors"))
    rollout_metrics = property(lambda self: self._file("rollout.json"))
    probe = property(lambda self: self._file("probe.parquet"))
    probe_metrics = property(lambda self: self._file("probe.json"))
    credit = property(lambda self: self._file("credit.parquet"))
    credit_metrics = property(lambda self: self._file("credit.json"))
    policy = property(lambda self: self._file("policy"))
    update_metrics = property(lambda self: self._file("update.json"))
    eval_metrics = property(lambda self: self._file("eval.json"))

    def previous(self) -> "IterationPaths | None":
        return IterationPaths(self.root, self.iteration - 1) if self.iteration > 0 else None


def require(path: Path, what: str) -> Path:
    """Fail with one line if an input artifact is missing (e.g. a stage run out of order)."""
    if not path.exists():
        raise PipelineError(f"missing input {path} ({what})")
    return path


def _temp_sibling(path: Path) -> Path:
    return path.with_name(f".{path.name}.tmp-{uuid.uuid4().hex[:8]}")


@contextmanager
def atomic_path(path: Path) -> Iterator[Path]:
    """Yield a temporary sibling of ``path`` to write into; on success replace ``path`` with it.

    On any error the temporary file or folder is removed and ``path`` is left as it was, so a killed or
    failed stage never leaves a half-written artifact under the final name.
    """
    path.parent.mkdir(parents=True, exist_ok=True)
    for stale in path.parent.glob(f".{path.name}.tmp-*"):  # left behind by a killed run
        shutil.rmtree(stale) if stale.is_dir() else stale.unlink()
    tmp = _temp_sibling(path)
    try:
        yield tmp
        if path.is_dir():
            shutil.rmtree(path)
        elif path.exists():
            path.unlink()
        os.replace(tmp, path)
    finally:
        if tmp.is_dir():
            shutil.rmtree(tmp, ignore_errors=True)
        elif tmp.exists():
            tmp.unlink()


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as sorted, indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def read_json(path: Path, what: str) -> dict[str, Any]:
    return json.loads(require(path, what).read_text())
