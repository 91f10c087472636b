"""The probe stage for a tree store (``tree.enabled``): every Q from the leaves, no model.

Each edge's child already has its exact ``Q(child)`` in the store (``final_reward``: the reward of the leaf its
ODE children reach). ``Q(parent)`` is the ``final_reward`` of the prompt's edge whose ``tree_leaf`` is the
edge's ``tree_parent_leaf`` (every leaf is some edge's ODE leaf; a root's leaf is its depth-0 ODE edge's).
Writes ``probe.parquet`` in the chain's contract with K = 1 (step 0 = Q(parent), step 1 = Q(child) =
``final_reward``) plus ``schemas.PROBE_TREE``'s tree columns; metadata ``tpgrpo.completion = tree``. The chain's
probe is ``tpgrpo.policy.probe_scoring.run_chain_probe``; ``stages/probe.py`` picks one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tpgrpo.config import Config
from tpgrpo.distributed import current
from tpgrpo.io.artifacts import IterationPaths, write_table
from tpgrpo.io.stage_logs import write_log
from tpgrpo.io.schemas import PROBE_COMPLETION_KEY, PROBE_TREE, ArtifactError
from tpgrpo.io.trajectories import read_trajectories
from tpgrpo.rollout_shape import TREE
from tpgrpo.stage_common import provenance, stopwatch


def parent_rows(arrays: dict, source: str) -> tuple[np.ndarray, np.ndarray]:
    """``(E,)`` row of each edge's parent edge (-1 below a root) and ``(E,)`` row of an edge whose child
    reaches the parent's leaf (whose ``final_reward`` is Q(parent)), both global rows of the store."""
    group = arrays["prompt_index"].astype(np.int64)
    E_prompt = int(np.bincount(group).max())
    base = group * E_prompt  # prompts are contiguous, E_prompt edges each (check_trajectories)
    parent = arrays["tree_parent"].astype(np.int64)
    parent_row = np.where(parent >= 0, base + parent, -1)
    leaves_per_prompt = int(arrays["tree_leaf"].max()) + 1
    by_leaf = np.full(group.max() * leaves_per_prompt + leaves_per_prompt, -1, dtype=np.int64)
    by_leaf[group * leaves_per_prompt + arrays["tree_leaf"]] = np.arange(group.size)
    q_parent_row = by_leaf[group * leaves_per_prompt + arrays["tree_parent_leaf"]]
    if (q_parent_row < 0).any():
        e = int(np.argmax(q_parent_row < 0))
        raise ArtifactError(f"{source}: edge {e}'s parent leaf {int(arrays['tree_parent_leaf'][e])} is no edge's "
                            "leaf (tree_leaf): the tree arrays are damaged")
    return parent_row, q_parent_row


def tree_probe_table(arrays: dict, metas: list[dict], source: str):
    """The long ``PROBE_TREE`` table of a tree store (module docstring), rows (edge, step 0..1)."""
    import pandas as pd

    parent_row, q_row = parent_rows(arrays, source)
    reward = np.stack([arrays["final_reward"][q_row], arrays["final_reward"]], 1)
    strict = np.stack([arrays["final_strict"][q_row], arrays["final_strict"]], 1)
    linked = parent_row >= 0  # an edge's parent Q is its parent edge's child Q: the same leaf, the same number
    if not np.array_equal(reward[linked, 0], arrays["final_reward"][parent_row[linked]]):
        raise ArtifactError(f"{source}: Q(parent) from tree_parent_leaf differs from the parent edge's reward")
    E = parent_row.size
    per_edge = lambda a: np.repeat(np.asarray(a), 2)  # noqa: E731
    prompt_index = arrays["prompt_index"].astype(np.int64)
    return pd.DataFrame({
        "trajectory": per_edge(np.arange(E)), "prompt_id": per_edge([metas[p]["id"] for p in prompt_index]),
        "prompt": per_edge([metas[p]["prompt"] for p in prompt_index]),
        "sample": per_edge(arrays["sample"].astype(np.int64)), "seed": per_edge(arrays["seeds"].astype(np.int64)),
        "step": np.tile(np.arange(2), E), "sigma": np.asarray(arrays["sigmas"]).reshape(-1).astype(np.float64),
        "reward": reward.reshape(-1), "strict": strict.reshape(-1).astype(bool),
        "parent_trajectory": per_edge(parent_row), "depth": per_edge(arrays["tree_depth"].astype(np.int64)),
        "sde": per_edge(arrays["tree_sde"].astype(bool)),
    })


def run(cfg: Config, iteration: int, root: Path) -> dict:
    """The probe of a tree (module docstring): main process only, no model, no pass; returns ``probe.json``'s
    metrics."""
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration, "completion": TREE, "forward_passes": 0, "decodes": 0,
                     "reward_calls": 0}
    if not current().is_main:
        return metrics
    with stopwatch(metrics):
        arrays, attrs = read_trajectories(paths.trajectories, lazy=("node_states",))
        frame = tree_probe_table(arrays, attrs["prompts"], str(paths.trajectories))
        meta = {**provenance(cfg, iteration, "probe"), PROBE_COMPLETION_KEY: TREE}
        write_table(paths.probe, frame, PROBE_TREE, meta, trajectories=len(arrays["sample"]), steps=2)
    sde = arrays["tree_sde"].astype(bool)
    d = arrays["final_reward"] - frame.loc[frame.step == 0, "reward"].to_numpy()
    metrics.update({"states": int(sde.size), "zero_increment_fraction": float((d[sde] == 0).mean()),
                    "mean_q0": float(frame.loc[(frame.step == 0) & (frame.depth == 0), "reward"].mean())})
    write_log(paths.probe_metrics, metrics)
    return metrics
