"""The probe table (``probe.parquet``): a chain's rows built from its scores, and either shape read back checked.

A chain's table has one row per (trajectory, step), step 0..K (``schemas.PROBE``); a tree's, built by
:mod:`tpgrpo.io.tree_probe`, two rows per edge (``schemas.PROBE_TREE``). No model is loaded here: the credit
stage reads the table with :func:`read_probe` (this module reads no trajectory store, so the credit stage's
code stays free of Zarr).
"""

from __future__ import annotations

import numpy as np
import pandas as pd

from tpgrpo import rollout_shape
from tpgrpo.config import Config
from tpgrpo.io.artifacts import IterationPaths, read_table
from tpgrpo.io.schemas import PROBE, PROBE_TREE


def probe_table(arrays: dict, metas: list[dict], rewards: np.ndarray, strict: np.ndarray) -> pd.DataFrame:
    """Long table (``schemas.PROBE``): rows (trajectory, step) for step 0..K; rewards/strict (N, K) for
    steps 0..K-1, the store's ``final_reward`` / ``final_strict`` (N,) at step K."""
    N, K1 = arrays["sigmas"].shape
    reward = np.concatenate([rewards, arrays["final_reward"][:, None]], axis=1)
    strict_all = np.concatenate([strict, arrays["final_strict"][:, None]], axis=1)
    prompt_index = arrays["prompt_index"].astype(np.int64)
    return pd.DataFrame({
        "trajectory": np.repeat(np.arange(N), K1),
        "prompt_id": np.repeat([metas[p]["id"] for p in prompt_index], K1),
        "prompt": np.repeat([metas[p]["prompt"] for p in prompt_index], K1),
        "sample": np.repeat(arrays["sample"].astype(np.int64), K1),
        "seed": np.repeat(arrays["seeds"].astype(np.int64), K1),
        "step": np.tile(np.arange(K1), N),
        "sigma": arrays["sigmas"].reshape(-1).astype(np.float64),
        "reward": reward.reshape(-1).astype(np.float64),
        "strict": strict_all.reshape(-1),
    })


def read_probe(cfg: Config, paths: IterationPaths) -> tuple[str, pd.DataFrame]:
    """``(shape, table)``: the rollout's shape as the probe table declares it, checked against its columns and
    ``tree.enabled`` (``rollout_shape.checked_probe_table``), and the table, checked against that shape's
    schema (``PROBE``, or ``PROBE_TREE`` with its two steps per edge); for Flow-GRPO the probe stage wrote
    ``Q_k = R_fin`` from the rollout."""
    shape = rollout_shape.checked_probe_table(paths.probe, cfg)
    if shape == rollout_shape.TREE:
        return shape, read_table(paths.probe, PROBE_TREE, "probe.parquet: run the probe stage first", steps=2)
    return shape, read_table(paths.probe, PROBE, "probe.parquet: run the probe stage first")
