"""The credit table (``credit.parquet``) of a chain's probe table, and ``credit.json``'s numbers (spec sections 5-6).

DataFrames in, a DataFrame out; no model and no file. A chain's table has one row per (trajectory, window step)
(``schemas.CREDIT``); a tree's, one row per edge, is :func:`tpgrpo.algo.tree_credit.tree_credit_table`'s (the
credit stage picks one through :mod:`tpgrpo.rollout_shape`: ``chains`` / ``trees``).
"""

from __future__ import annotations

import numpy as np
import pandas as pd
import torch

from tpgrpo.algo.advantages import group_advantages
from tpgrpo.algo.credit import compute_credit


def credit_table(probe: pd.DataFrame, cfg) -> pd.DataFrame:
    """From a chain's long probe table (rows (trajectory, step 0..K), checked against ``schemas.PROBE``) to the
    credit table (steps 0..K-1, ``schemas.CREDIT``) under ``cfg.credit`` (``cfg`` a ``tpgrpo.config.Config``:
    only its section is read, so the maths imports no config)."""
    probe = probe.sort_values(["trajectory", "step"], kind="stable")
    N = probe["trajectory"].nunique()
    K1 = len(probe) // N
    rewards = torch.tensor(probe["reward"].to_numpy().reshape(N, K1), dtype=torch.float64)
    heads = probe[probe.step == 0].reset_index(drop=True)
    group_ids = torch.tensor(pd.factorize(heads["prompt_id"])[0], dtype=torch.int64)
    c = compute_credit(rewards, group_ids, mode=cfg.credit.mode, balance=cfg.credit.balance)
    adv = group_advantages(c.step_reward, group_ids, global_std=cfg.credit.global_std, clip=cfg.credit.adv_clip)
    K = K1 - 1
    rep = lambda col: np.repeat(heads[col].to_numpy(), K)  # noqa: E731 - one value per trajectory
    return pd.DataFrame({
        "trajectory": rep("trajectory"), "prompt_id": rep("prompt_id"), "sample": rep("sample"),
        "step": np.tile(np.arange(K), N),
        "incremental": c.incremental.reshape(-1).numpy().astype(np.float64),
        "aggregated": c.aggregated.reshape(-1).numpy().astype(np.float64),
        "trend": np.repeat(c.trend.numpy().astype(np.float64), K),
        "turning_point": c.turning_point.reshape(-1).numpy().astype(bool),
        "step_reward": c.step_reward.reshape(-1).numpy().astype(np.float64),
        "advantage": adv.reshape(-1).numpy().astype(np.float64),
    })


def credit_metrics(cfg, counted: pd.DataFrame) -> dict:
    """``credit.json``'s numbers from the credit rows the update trains (``counted``: the shape's
    ``trained_rows`` of the credit table): turning-point rates (overall and per window step), the fraction of
    zero increments, trends, mean |increment|."""
    tp_by_step = counted.groupby("step")["turning_point"].mean()
    return {
        "mode": cfg.credit.mode, "turning_point_rate": float(counted["turning_point"].mean()),
        "turning_point_rate_per_step": [float(x) for x in tp_by_step],
        "zero_increment_fraction": float((counted["incremental"] == 0).mean()),
        "tp_positive_trend": int((counted["turning_point"] & (counted["trend"] > 0)).sum()),
        "tp_negative_trend": int((counted["turning_point"] & (counted["trend"] < 0)).sum()),
        "trend_mean": float(counted.groupby("trajectory")["trend"].first().mean()),
        "incremental_abs_mean": float(counted["incremental"].abs().mean()),
        "forward_passes": 0,
    }
