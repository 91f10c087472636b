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
from tpgrpo.io.eval_table import EVAL_TABLE_COLUMNS  # noqa: F401 - the eval stage's table; re-exported

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
        ``(mean_diff, lo, hi)``. With few seeds (3) the seed draw sees at most S distinct values and its
        quantiles are normal-like where a t with S - 1 degrees of freedom applies: under no true difference
        the 95% interval excludes 0 in about 1 draw in 4 at S = 3 (bench/compare_intervals.py). Kept to show
        that; verdicts use :func:`seed_prompt_t_interval`.
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


_NODES, _WEIGHTS = np.polynomial.legendre.leggauss(128)  # the t CDF's integral from 0 to x: exact to ~1e-15


def t_quantile(q: float, dof: float) -> float:
    """Student's t quantile at probability ``q`` in [0.5, 1) for ``dof`` > 0 degrees of freedom (inf: the
    normal). No scipy here: Newton's method on the CDF 0.5 + int_0^x density, the integral by Gauss-Legendre
    quadrature; from the normal quantile it climbs monotonically (the CDF is concave for x > 0)."""
    import math
    from statistics import NormalDist

    if not 0.5 <= q < 1.0 or not dof > 0:
        raise ValueError(f"t_quantile: need 0.5 <= q < 1 and dof > 0, got q={q}, dof={dof}")
    x = NormalDist().inv_cdf(q)
    if math.isinf(dof):
        return x
    scale = math.exp(math.lgamma((dof + 1) / 2) - math.lgamma(dof / 2)) / math.sqrt(dof * math.pi)
    density = lambda t: scale * (1.0 + t * t / dof) ** (-(dof + 1) / 2)  # noqa: E731
    for _ in range(200):
        step = (0.5 + x / 2 * float(density(x * (_NODES + 1) / 2) @ _WEIGHTS) - q) / density(x)
        x -= step
        if abs(step) < 1e-12 * max(1.0, x):
            break
    return float(x)


def t_interval_of_cells(cells, level: float = 0.95):
    """The interval of :func:`seed_prompt_t_interval` from the cell means, vectorised over leading axes.

    Args:
        cells: (..., S, P) per training seed and prompt the mean difference A - B over that prompt's images.
        level: coverage of the two-sided interval.

    Returns:
        ``(mean, lo, hi)``, arrays of the leading shape (floats for a 2-D input): mean over cells +- the
        half width sqrt(t_{S-1}^2 var_s / S + t_{P-1}^2 var_p / P), var_s the variance (ddof 1) of the seed
        means and var_p that of the prompt means; a term only where there are 2 or more.
    """
    c = np.asarray(cells, dtype=np.float64)
    n_seeds, n_prompts = c.shape[-2:]
    q = 0.5 + level / 2.0
    half2 = np.zeros(c.shape[:-2])
    if n_prompts > 1:
        half2 = half2 + t_quantile(q, n_prompts - 1) ** 2 * c.mean(axis=-2).var(axis=-1, ddof=1) / n_prompts
    if n_seeds > 1:
        half2 = half2 + t_quantile(q, n_seeds - 1) ** 2 * c.mean(axis=-1).var(axis=-1, ddof=1) / n_seeds
    mean, half = c.mean(axis=(-2, -1)), np.sqrt(half2)
    out = (mean, mean - half, mean + half)
    return tuple(float(x) for x in out) if c.ndim == 2 else out


def seed_prompt_t_interval(diffs, prompt_ids: Sequence, level: float = 0.95) -> tuple[float, float, float]:
    """Mean paired difference over training seeds and images, and an interval that holds at 3-5 seeds.

    The grand mean has two sampling sources, estimated apart: the training seeds, from the spread of the
    per-seed means (each over all prompts), and the prompts, from the spread of the per-prompt means (each
    over its images and all seeds: a prompt that A handles better in every seed is a shared effect that no
    spread of seed means shows). Each gets its own Student t quantile, t_{S-1} and t_{P-1} (4.30 at S = 3,
    where the percentile bootstrap's normal-like quantiles made its interval too narrow), combined as
    Banerjee's (1961) interval for a sum of two variance estimates: at least the nominal coverage, with no
    degrees of freedom to estimate (Welch-Satterthwaite's are liberal at S = 3). Both spreads also carry
    the seed x prompt and image noise, so it errs on the wide side. Null simulation:
    tests/test_comparison_intervals.py; side by side with the bootstrap: bench/compare_intervals.py.

    Args:
        diffs: (S, N) per training seed the per-image differences A - B, column i the same (prompt, eval
            seed) in every row (as :func:`seed_prompt_bootstrap`).
        prompt_ids: (N,) the prompt of each column.
        level: coverage of the two-sided interval.

    Returns:
        ``(mean_diff, lo, hi)`` in the scores' units: the mean over images, the interval centred on the mean
        of the (seed, prompt) cells (the same where every prompt has as many images). S = 1: the prompt
        term alone (no seed variance can be seen: :func:`verdict` then says a hint).
    """
    d = np.asarray(diffs, dtype=np.float64)
    ids = np.asarray(prompt_ids)
    if d.ndim != 2 or d.shape[0] < 1 or d.shape[1] != len(ids) or len(ids) == 0:
        raise ValueError(f"diffs must be (S, N) with N = len(prompt_ids) > 0, got {d.shape} and {ids.shape}")
    if not np.isfinite(d).all() or not 0.0 < level < 1.0:
        raise ValueError(f"diffs must be finite and 0 < level < 1 (level={level})")
    _, prompt = np.unique(ids, return_inverse=True)
    counts = np.bincount(prompt)
    cells = np.stack([np.bincount(prompt, weights=row, minlength=len(counts)) for row in d]) / counts  # (S, P)
    _, lo, hi = t_interval_of_cells(cells, level)
    return float(d.mean()), lo, hi


def verdict(lo: float, hi: float, direction: int = 1, seeds: int = 2) -> str:
    """The claim "A beats B" (``direction`` +1) or "B beats A" (-1) from the interval of A - B:
    confirmed if it excludes 0 on the claimed side, refuted if it excludes 0 on the other, else
    not detectable. From one training seed (``seeds`` = 1) an excluded 0 is only "one seed: a hint
    for" / "... against": one seed's interval has no seed variance in it. NaN bounds (no data) -> not run."""
    if not (np.isfinite(lo) and np.isfinite(hi)):
        return "not run"
    if lo > hi:
        raise ValueError(f"interval [{lo}, {hi}]: lower bound above upper bound")
    lo, hi = (lo, hi) if direction > 0 else (-hi, -lo)
    if lo > 0 or hi < 0:
        if seeds < 2:
            return f"one seed: a hint {'for' if lo > 0 else 'against'}"
        return "confirmed" if lo > 0 else "refuted"
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
