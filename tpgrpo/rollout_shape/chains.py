"""The chain's tables (the credit stage's part of :mod:`tpgrpo.rollout_shape`'s interface, ``ShapeTables``).

A chain's ``probe.parquet`` has one row per (trajectory, step), step 0..K (``schemas.PROBE``); its credit table
is :func:`tpgrpo.algo.credit_table.credit_table` (one row per (trajectory, window step)); every row is trained.
DataFrames in, DataFrames out; no model.
"""

from __future__ import annotations

from pathlib import Path

import pandas as pd

from tpgrpo.algo.credit_table import credit_table as chain_credit_table
from tpgrpo.io.artifacts import read_table
from tpgrpo.io.schemas import PROBE

PROBE_HINT = "probe.parquet: run the probe stage first"


def read_probe(path: Path) -> pd.DataFrame:
    """The chain probe table at ``path``, checked against ``schemas.PROBE`` (for Flow-GRPO the probe stage
    wrote ``Q_k = R_fin`` from the rollout)."""
    return read_table(path, PROBE, PROBE_HINT)


def credit_table(probe: pd.DataFrame, cfg) -> pd.DataFrame:
    """``schemas.CREDIT`` rows (trajectory, window step) from the probe table under ``cfg.credit``."""
    return chain_credit_table(probe, cfg)


def trained_rows(table: pd.DataFrame, probe: pd.DataFrame) -> pd.DataFrame:
    """Every row of a chain's credit table: each window step has a policy (``probe`` unused)."""
    return table
