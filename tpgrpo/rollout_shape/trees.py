"""The tree's tables (the credit stage's part of :mod:`tpgrpo.rollout_shape`'s interface, ``ShapeTables``).

A tree's ``probe.parquet`` has two rows per edge, Q(parent) and Q(child) (``schemas.PROBE_TREE``, written by
:mod:`tpgrpo.rollout_shape.tree_probe`); its credit table is
:func:`tpgrpo.algo.tree_credit.tree_credit_table` (one row per edge, step 0). DataFrames in, DataFrames out.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tpgrpo.algo.tree_credit import tree_credit_table
from tpgrpo.io.artifacts import read_table
from tpgrpo.io.schemas import PROBE_TREE

PROBE_HINT = "probe.parquet: run the probe stage first"


def read_probe(path: Path) -> pd.DataFrame:
    """The tree probe table at ``path``, checked against ``schemas.PROBE_TREE`` (two steps per edge)."""
    return read_table(path, PROBE_TREE, PROBE_HINT, steps=2)


def credit_table(probe: pd.DataFrame, cfg) -> pd.DataFrame:
    """``schemas.CREDIT`` rows (edge, step 0) from the probe table under ``cfg.credit`` and ``tree.baseline``."""
    c = cfg.credit
    return tree_credit_table(probe, c.mode, c.balance, c.global_std, c.adv_clip, baseline=cfg.tree.baseline)


def trained_rows(table: pd.DataFrame, probe: pd.DataFrame) -> pd.DataFrame:
    """The credit rows of the SDE edges only: an ODE edge has no policy (its increment is 0 by construction and
    it is never trained), so counting it would halve the rates at m = 1 and fill zero_increment_fraction with
    zeros that say nothing about the reward."""
    sde = probe.groupby("trajectory")["sde"].first()
    return table[table["trajectory"].map(sde).to_numpy(dtype=bool)]
