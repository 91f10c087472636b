"""The probe table (``probe.parquet``) of a chain, built from its scores.

A chain's table has one row per (trajectory, step), step 0..K (``schemas.PROBE``); a tree's, built by
:mod:`tpgrpo.rollout_shape.tree_probe`, two rows per edge (``schemas.PROBE_TREE``). The credit stage reads
either back through its shape's ``read_probe`` (:mod:`tpgrpo.rollout_shape`: ``chains`` / ``trees``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd


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

