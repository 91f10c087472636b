"""Paired comparison of two runs scored on the same eval noise (the eval stage's per-image tables).

The eval stage writes ``eval.parquet`` (one row per held-out prompt and eval seed): two runs evaluated
with the same ``eval`` params share every (prompt, seed), so their difference is measured image by image
and its uncertainty by a bootstrap over prompts (whole prompts are resampled with all their seeds, because
the images of one prompt are not independent).
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np

from tpgrpo.errors import PipelineError

# The per-image eval table: one row per (prompt, eval seed), in prompt order then sample order.
EVAL_TABLE_COLUMNS = {
    "prompt_id": "object", "prompt": "object", "sample": "int64", "seed": "int64",
    "eval_reward": "float64", "eval_strict": "bool", "train_reward": "float64", "train_strict": "bool",
}
PAIR_KEYS = ["prompt_id", "sample", "seed"]


def paired_bootstrap(a: Sequence[float], b: Sequence[float], prompt_ids: Sequence, n_boot: int = 10_000,
                     seed: int = 0, level: float = 0.95) -> tuple[float, float, float]:
    """Mean paired difference ``mean(a - b)`` over images and its bootstrap interval over prompts.

    Args:
        a, b: per-image scores (N,) of two runs on the same images' noise, row i of each the same
            (prompt, seed).
        prompt_ids: (N,) the prompt of each row; a bootstrap draw picks P prompts (P = distinct prompts)
            with replacement and averages ``a - b`` over all their rows.
        n_boot: bootstrap draws; seed: their random generator's seed (same seed, same interval).
        level: coverage of the percentile interval.

    Returns:
        ``(mean_diff, lo, hi)``, floats in the scores' units; a run against itself gives exactly (0, 0, 0).
    """
    a, b = np.asarray(a, dtype=np.float64), np.asarray(b, dtype=np.float64)
    ids = np.asarray(prompt_ids)
    if not a.shape == b.shape == ids.shape or a.ndim != 1 or len(a) == 0:
        raise ValueError(f"a, b and prompt_ids must be equally long non-empty 1-D sequences, got shapes "
                         f"{a.shape}, {b.shape}, {ids.shape}")
    if not (np.isfinite(a).all() and np.isfinite(b).all()):
        raise ValueError("a and b must be finite (found NaN or inf)")
    return seed_prompt_bootstrap((a - b)[None], ids, n_boot=n_boot, seed=seed, level=level)  # one "seed"


def _draw_counts(draws: np.ndarray, n: int) -> np.ndarray:
    """(B, K) indices in [0, n) -> (B, n) float counts: how often each index was drawn in each row."""
    offsets = draws + n * np.arange(len(draws))[:, None]
    return np.bincount(offsets.ravel(), minlength=n * len(draws)).reshape(len(draws), n).astype(np.float64)


def seed_prompt_bootstrap(diffs, prompt_ids: Sequence, n_boot: int = 10_000, seed: int = 0,
                          level: float = 0.95) -> tuple[float, float, float]:
    """Mean paired difference over training seeds and images, and a two-level bootstrap interval that
    resamples the training seeds as well as the prompts (the prompt-only interval of
    :func:`paired_bootstrap` leaves out how much another training seed would change the result).

    Args:
        diffs: (S, N) per training seed s (A's and B's runs of seed s) the per-image differences A - B,
            column i the same (prompt, eval seed) in every row.
        prompt_ids: (N,) the prompt of each column. A draw picks P prompts (drawn first, exactly as
            ``paired_bootstrap`` draws them, so S = 1 gives its interval) and S seeds, with replacement,
            and averages the chosen seeds' differences over all images of the chosen prompts.

    Returns:
        ``(mean_diff, lo, hi)``. With few seeds (3) the seed draw sees at most S distinct values: the
        interval is then still too narrow for the spread between training seeds, not too wide.
    """
    d = np.asarray(diffs, dtype=np.float64)
    ids = np.asarray(prompt_ids)
    if d.ndim != 2 or d.shape[0] < 1 or d.shape[1] != len(ids) or len(ids) == 0:
        raise ValueError(f"diffs must be (S, N) with N = len(prompt_ids) > 0, got {d.shape} and {ids.shape}")
    if not np.isfinite(d).all():
        raise ValueError("diffs must be finite (found NaN or inf)")
    if n_boot < 1 or not 0.0 < level < 1.0:
        raise ValueError(f"need n_boot >= 1 and 0 < level < 1, got n_boot={n_boot}, level={level}")
    _, prompt = np.unique(ids, return_inverse=True)
    n_prompts, n_seeds = prompt.max() + 1, d.shape[0]
    sums = np.stack([np.bincount(prompt, weights=row, minlength=n_prompts) for row in d])  # (S, P)
    counts = np.bincount(prompt, minlength=n_prompts).astype(np.float64)
    rng = np.random.default_rng(seed)
    prompt_draws = rng.integers(0, n_prompts, size=(n_boot, n_prompts))
    seed_draws = rng.integers(0, n_seeds, size=(n_boot, n_seeds)) if n_seeds > 1 else np.zeros((n_boot, 1), int)
    prompt_weights, seed_weights = _draw_counts(prompt_draws, n_prompts), _draw_counts(seed_draws, n_seeds)
    boot = ((seed_weights @ sums) * prompt_weights).sum(axis=1) / (n_seeds * (prompt_weights @ counts))
    tail = (1.0 - level) / 2.0
    lo, hi = np.quantile(boot, [tail, 1.0 - tail])
    return float(d.mean()), float(lo), float(hi)


def verdict(lo: float, hi: float, direction: int = 1) -> str:
    """The claim "A beats B" (``direction`` +1) or "B beats A" (-1) from the interval of A - B:
    confirmed if it excludes 0 on the claimed side, refuted if it excludes 0 on the other, else
    not detectable. NaN bounds (no data) -> not run."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "not run"
    if lo > hi:
        raise ValueError(f"interval [{lo}, {hi}]: lower bound above upper bound")
    lo, hi = (lo, hi) if direction > 0 else (-hi, -lo)
    if lo > 0:
        return "confirmed"
    if hi < 0:
        return "refuted"
    return "not detectable"


def read_eval_table(path: Path):
    """An eval stage's per-image table, checked: one-line ``PipelineError`` naming the file if it is not one."""
    import pandas as pd

    path = Path(path)
    if not path.is_file():
        raise PipelineError(f"missing eval table {path} (run the eval or baseline stage)")
    try:
        frame = pd.read_parquet(path)
    except Exception as exc:  # noqa: BLE001 - any unreadable file is the same user error
        raise PipelineError(f"{path}: not a readable Parquet table ({type(exc).__name__})") from None
    missing = [c for c in EVAL_TABLE_COLUMNS if c not in frame.columns]
    if missing:
        raise PipelineError(f"{path}: missing columns {missing} (expected {list(EVAL_TABLE_COLUMNS)})")
    if frame.duplicated(PAIR_KEYS).any():
        raise PipelineError(f"{path}: repeated (prompt_id, sample, seed) rows (expected one row per image)")
    return frame


def compare_tables(a, b, column: str = "eval_reward", n_boot: int = 10_000, seed: int = 0,
                   level: float = 0.95) -> dict:
    """``paired_bootstrap`` of ``column`` between two eval tables (DataFrames) on the same images.

    The tables must hold the same (prompt_id, sample, seed) rows: runs evaluated on other prompts or
    other eval seeds are not paired, and comparing them is a one-line error.
    """
    if column not in EVAL_TABLE_COLUMNS or column in PAIR_KEYS or column == "prompt":
        raise ValueError(f"column {column!r} is not a score column of the eval table")
    keys_a, keys_b = (set(map(tuple, t[PAIR_KEYS].astype(str).to_numpy())) for t in (a, b))
    if keys_a != keys_b or len(a) != len(b):
        raise PipelineError(f"the two eval tables are not paired: {len(keys_a ^ keys_b)} (prompt_id, sample, "
                            "seed) rows in one only (evaluate both with the same eval params)")
    merged = a[PAIR_KEYS + [column]].merge(b[PAIR_KEYS + [column]], on=PAIR_KEYS, suffixes=("_a", "_b"))
    mean, lo, hi = paired_bootstrap(merged[f"{column}_a"].astype(float), merged[f"{column}_b"].astype(float),
                                    merged["prompt_id"], n_boot=n_boot, seed=seed, level=level)
    return {"column": column, "images": len(merged), "prompts": int(merged["prompt_id"].nunique()),
            "mean_diff": mean, "lo": lo, "hi": hi, "level": level, "n_boot": n_boot}
