"""What every stage shares and that loads nothing heavy: params paths, provenance of artifacts, the finite
check, the wall-time stopwatch.

Stages (``stages/*.py``) stay thin: they read inputs, call these helpers and the maths, and read and write
artifacts with :mod:`tpgrpo.io.artifacts` (checked against :mod:`tpgrpo.io.schemas`). The helpers that load a
model (policy, prompts, prompt embeddings) are in :mod:`tpgrpo.policy.loading`: a stage's code manifest is the
import closure of its module file by file, so they stay out of the manifests of credit and summary, which
need none of them.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tpgrpo import __version__
from tpgrpo.config import Config
from tpgrpo.errors import PipelineError


def resolve(root: Path, path: str) -> Path:
    """A params path relative to the project root (absolute paths pass through)."""
    p = Path(path)
    return p if p.is_absolute() else root / p


def provenance(cfg: Config, iteration: int, stage: str) -> dict[str, str]:
    """Metadata every artifact carries: what made it, from which params (a hash of the params the stage
    declares in dvc.yaml, and of the key that picks its code path while it picks the other one:
    :func:`tpgrpo.stage_params.hashed_inputs`). Nothing that differs between identical runs: the versions of
    the libraries the stage imports are in its code manifest (a recorded input), the Python and torch versions
    in its log's untracked sidecar (:mod:`tpgrpo.io.stage_logs`), not in the artifact, whose bytes DVC hashes."""
    from tpgrpo.stage_params import hashed_inputs

    return {"tpgrpo_version": __version__, "stage": stage, "iteration": str(iteration),
            "config_hash": cfg.params_hash(hashed_inputs(stage, cfg))}


def check_finite(name: str, values: Any, where: str) -> None:
    """Refuse NaN or infinite values with one line naming the quantity and where it came from."""
    arr = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(arr)
    if bad.any():
        first = np.argwhere(bad)[0].tolist()
        raise PipelineError(f"{name} has {int(bad.sum())} non-finite values in {where} (first at {first})")


@contextmanager
def stopwatch(metrics: dict[str, Any], key: str = "wall_seconds") -> Iterator[None]:
    """Record the wall time of the block into ``metrics[key]`` (seconds). A stage writes its log with
    :func:`tpgrpo.io.stage_logs.write_log`, which puts these seconds in the untracked sidecar."""
    start = time.perf_counter()
    yield
    metrics[key] = round(time.perf_counter() - start, 3)
