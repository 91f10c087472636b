"""Stage probe: score every stored intermediate state, Q_k (spec section 4), as ``probe.completion`` says.

Writes ``probe.parquet`` (one row per (trajectory, step), or two per edge of a tree) and ``probe.json``. The
shape comes from the store's ``shape`` attribute; the work is a chain's states scored
(:func:`tpgrpo.policy.probe_scoring.run_chain_probe`; Flow-GRPO's table of final rewards: ``final_reward_table``
there) or a tree's Q from its leaves (:mod:`tpgrpo.rollout_shape.tree_probe`).
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo import rollout_shape
from tpgrpo.config import Config
from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.policy.probe_scoring import run_chain_probe
from tpgrpo.rollout_shape import tree_probe


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    probe = rollout_shape.implementation("probe", cfg, paths, chain=run_chain_probe, tree=tree_probe.run)
    return probe(cfg, iteration, root)
