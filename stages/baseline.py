"""Stage baseline: evaluate the base model once, the starting point of the reward curves."""

from __future__ import annotations

from pathlib import Path

from stages.eval import run_baseline
from tpgrpo.config import Config


def run(cfg: Config, iteration: int | None, root: Path) -> dict:
    return run_baseline(cfg, root)
