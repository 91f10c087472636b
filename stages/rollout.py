"""Stage rollout: sample the iteration's prompts with the current policy, as chains or as trees.

Writes ``trajectories.zarr`` and ``rollout.json``. The shape comes from the params (``tree.enabled``); the work
is :mod:`tpgrpo.rollout_shape.chain_rollout` (``prompts_per_iter x group_size`` trajectories over the SDE
window) or :mod:`tpgrpo.rollout_shape.tree_rollout` (ODE-anchored trees, one row per edge).
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo import rollout_shape
from tpgrpo.config import Config
from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.rollout_shape import chain_rollout, tree_rollout


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    rollout = rollout_shape.implementation("rollout", cfg, paths, chain=chain_rollout.run, tree=tree_rollout.run)
    return rollout(cfg, iteration, root)
