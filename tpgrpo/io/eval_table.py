"""The eval stages' per-image table: its file names, columns and the empty table of an iteration not evaluated.

The eval stage writes ``eval.parquet`` and the baseline the same table for the base model
(:data:`tpgrpo.stage_params.BASELINE_TABLE`): one row per (held-out prompt, eval seed), prompt order then
sample order. Two runs evaluated with the same ``eval`` params share every (prompt, seed), so
:mod:`tpgrpo.comparison.stats` pairs them image by image; it reads these columns from here (the comparison
depends on the eval's table, never the other way round).
"""

from __future__ import annotations

EVAL_TABLE = "eval.parquet"  # beside eval.json: one row per (held-out prompt, eval seed)

# Column -> pandas dtype, in the table's order.
EVAL_TABLE_COLUMNS = {
    "prompt_id": "object", "prompt": "object", "sample": "int64", "seed": "int64",
    "eval_reward": "float64", "eval_strict": "bool", "train_reward": "float64", "train_strict": "bool",
}


def empty_table():
    """The per-image table of an iteration that is not evaluated (a DVC output must exist): no rows."""
    import pandas as pd

    return pd.DataFrame({c: pd.Series(dtype=t) for c, t in EVAL_TABLE_COLUMNS.items()})
