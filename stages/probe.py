"""Stage probe: score every stored intermediate state, Q_k (spec section 4), as ``probe.completion`` says.

Writes ``probe.parquet`` (one row per (trajectory, step), or two per edge of a tree) and ``probe.json``.
The work is :func:`tpgrpo.policy.probe_scoring.run_probe`, which picks the store's shape once: a chain's
states scored (Flow-GRPO's table of final rewards: ``final_reward_table`` there) or a tree's Q from its leaves
(:mod:`tpgrpo.rollout_shape.tree_probe`).
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.config import Config
from tpgrpo.policy.probe_scoring import run_probe


def run(cfg: Config, iteration: int, root: Path) -> dict:
    return run_probe(cfg, iteration, root)
