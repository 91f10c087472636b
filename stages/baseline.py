"""Stage baseline: evaluate the base model once, the starting point of the reward curves.

The work is :func:`tpgrpo.policy.evaluation.run_baseline` (the eval stage's, with no adapter).
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.config import Config
from tpgrpo.policy.evaluation import run_baseline


def run(cfg: Config, iteration: int | None, root: Path) -> dict:  # noqa: ARG001 - once per run
    return run_baseline(cfg, root)
