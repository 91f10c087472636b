"""Stage credit: a pure function of ``probe.parquet`` and the ``credit`` params (spec sections 5-6).

Needs no model, so every credit mode can be recomputed offline in seconds. For ``credit.mode: flow_grpo``
the probe stage wrote a table whose every ``Q_k`` is ``R_fin`` (spec section 5's flow_grpo row).
Writes ``credit.parquet``: one row per (trajectory, window step).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from tpgrpo.algo.advantages import group_advantages
from tpgrpo.io.artifacts import IterationPaths, read_table, write_table
from tpgrpo.io.stage_logs import write_log
from tpgrpo.config import Config
from tpgrpo.algo.credit import compute_credit
from tpgrpo.stage_common import check_finite, provenance, stopwatch
from tpgrpo import rollout_shape
from tpgrpo.io.schemas import CREDIT, PROBE, PROBE_TREE


def read_probe(cfg: Config, paths: IterationPaths):
    """``(shape, table)``: the rollout's shape as the probe table declares it, checked against its columns and
    ``tree.enabled`` (``rollout_shape.checked_probe_table``), and the table, checked against that shape's
    schema (``PROBE``, or ``PROBE_TREE`` with its two steps per edge); for Flow-GRPO the probe stage wrote
    ``Q_k = R_fin`` from the rollout."""
    shape = rollout_shape.checked_probe_table(paths.probe, cfg)
    if shape == rollout_shape.TREE:
        return shape, read_table(paths.probe, PROBE_TREE, "probe.parquet: run the probe stage first", steps=2)
    return shape, read_table(paths.probe, PROBE, "probe.parquet: run the probe stage first")


def credit_table(probe: pd.DataFrame, cfg: Config, shape: str = rollout_shape.CHAIN) -> pd.DataFrame:
    """From the long probe table (rows (trajectory, step 0..K), checked against ``schemas.PROBE``, or
    ``PROBE_TREE`` for ``shape`` tree) to the credit table (steps 0..K-1, ``schemas.CREDIT``)."""
    if shape == rollout_shape.TREE:  # one row per edge, K = 1
        from tpgrpo.algo.tree_credit import tree_credit_table

        c = cfg.credit
        return tree_credit_table(probe, c.mode, c.balance, c.global_std, c.adv_clip, baseline=cfg.tree.baseline)
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


def trained_rows(table: pd.DataFrame, probe: pd.DataFrame, shape: str) -> pd.DataFrame:
    """The credit rows the metrics count: every row of a chain; a tree's SDE edges only (an ODE edge has no
    policy: its increment is 0 by construction and it is never trained, so counting it would halve the rates
    at m = 1 and fill zero_increment_fraction with zeros that say nothing about the reward)."""
    if shape == rollout_shape.CHAIN:
        return table
    sde = probe.groupby("trajectory")["sde"].first()
    return table[table["trajectory"].map(sde).to_numpy(dtype=bool)]


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    with stopwatch(metrics):
        shape, probe = read_probe(cfg, paths)
        table = credit_table(probe, cfg, shape)
        check_finite("advantage", table["advantage"], f"credit of iteration {iteration}")
        N, K1 = probe["trajectory"].nunique(), probe["step"].nunique()
        write_table(paths.credit, table, CREDIT, provenance(cfg, iteration, "credit"), trajectories=N, steps=K1 - 1)
    counted = trained_rows(table, probe, shape)
    tp_by_step = counted.groupby("step")["turning_point"].mean()
    metrics.update({
        "mode": cfg.credit.mode, "turning_point_rate": float(counted["turning_point"].mean()),
        "turning_point_rate_per_step": [float(x) for x in tp_by_step],
        "zero_increment_fraction": float((counted["incremental"] == 0).mean()),
        "tp_positive_trend": int((counted["turning_point"] & (counted["trend"] > 0)).sum()),
        "tp_negative_trend": int((counted["turning_point"] & (counted["trend"] < 0)).sum()),
        "trend_mean": float(counted.groupby("trajectory")["trend"].first().mean()),
        "incremental_abs_mean": float(counted["incremental"].abs().mean()),
        "forward_passes": 0,
    })
    write_log(paths.credit_metrics, metrics)
    return metrics
