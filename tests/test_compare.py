"""Paired bootstrap over prompts, and pairing two per-image eval tables."""

from __future__ import annotations

import numpy as np
import pandas as pd
import pytest

from tpgrpo.comparison.stats import EVAL_TABLE_COLUMNS, compare_tables, paired_bootstrap, read_eval_table
from tpgrpo.errors import PipelineError


def scores(num_prompts=20, seeds=4, seed=0):
    rng = np.random.default_rng(seed)
    ids = np.repeat([f"p{i:02d}" for i in range(num_prompts)], seeds)
    prompt_effect = np.repeat(rng.normal(0.5, 0.2, num_prompts), seeds)  # images of a prompt correlate
    return prompt_effect + rng.normal(0, 0.05, len(ids)), ids


def test_a_run_against_itself_is_exactly_zero():
    a, ids = scores()
    assert paired_bootstrap(a, a.copy(), ids, n_boot=500, seed=3) == (0.0, 0.0, 0.0)


def test_a_known_shift_lies_inside_the_interval():
    a, ids = scores()
    rng = np.random.default_rng(1)
    b = a - 0.1 + rng.normal(0, 0.02, len(a))
    mean, lo, hi = paired_bootstrap(a, b, ids, n_boot=2000, seed=0)
    assert lo < 0.1 < hi and lo <= mean <= hi and 0 < hi - lo < 0.05
    assert mean == pytest.approx(np.mean(a - b))


def test_same_seed_same_interval_other_seed_other_interval():
    a, ids = scores()
    b, _ = scores(seed=5)
    first, again = (paired_bootstrap(a, b, ids, n_boot=300, seed=7) for _ in range(2))
    assert first == again
    assert paired_bootstrap(a, b, ids, n_boot=300, seed=8)[1:] != first[1:]


def test_whole_prompts_are_resampled():
    # Every image of a prompt has the same difference: the interval is that of P prompt means, not
    # of P * seeds independent images (which would be half as wide with 4 seeds).
    ids = np.repeat(np.arange(10), 4)
    diff = np.repeat(np.linspace(-1, 1, 10), 4)
    _, lo, hi = paired_bootstrap(diff, np.zeros_like(diff), ids, n_boot=4000, seed=0)
    se = np.std(np.linspace(-1, 1, 10)) / np.sqrt(10)
    assert (hi - lo) == pytest.approx(2 * 1.96 * se, rel=0.15)


@pytest.mark.parametrize("bad", [
    dict(b=np.zeros(3)), dict(prompt_ids=np.zeros(3)), dict(a=np.array([np.nan, 0, 0, 0])), dict(n_boot=0),
    dict(a=np.zeros(0), b=np.zeros(0), prompt_ids=np.zeros(0))])
def test_bad_input_is_a_value_error(bad):
    args = dict(a=np.zeros(4), b=np.zeros(4), prompt_ids=np.arange(4), n_boot=10)
    with pytest.raises(ValueError):
        paired_bootstrap(**{**args, **bad})


def table(rewards, seeds=(11, 12)):
    n = len(rewards)
    return pd.DataFrame({
        "prompt_id": [f"p{i // 2}" for i in range(n)], "prompt": [f"prompt {i // 2}" for i in range(n)],
        "sample": [i % 2 for i in range(n)], "seed": [seeds[i % 2] + 100 * (i // 2) for i in range(n)],
        "eval_reward": rewards, "eval_strict": [r > 0.5 for r in rewards],
        "train_reward": rewards, "train_strict": [False] * n}).astype(EVAL_TABLE_COLUMNS)


def test_compare_tables_pairs_rows_by_prompt_sample_and_seed():
    a = table([0.1, 0.2, 0.3, 0.4])
    b = a.iloc[::-1].assign(eval_reward=lambda t: t.eval_reward - 0.05)  # other row order, same images
    out = compare_tables(a, b, "eval_reward", n_boot=100)
    assert out["mean_diff"] == pytest.approx(0.05) and out["images"] == 4 and out["prompts"] == 2
    assert compare_tables(a, a, "eval_strict", n_boot=100)[("mean_diff")] == 0.0


def test_tables_on_other_eval_noise_are_not_paired():
    with pytest.raises(PipelineError, match="not paired"):
        compare_tables(table([0.1, 0.2]), table([0.1, 0.2], seeds=(13, 14)), n_boot=10)


def test_read_eval_table_names_the_file_and_the_problem(tmp_path):
    bad = tmp_path / "eval.parquet"
    bad.write_text("prompt_id,eval_reward\np0,0.5\n")
    with pytest.raises(PipelineError, match="eval.parquet: not a readable Parquet"):
        read_eval_table(bad)
    table([0.1, 0.2]).drop(columns="seed").to_parquet(bad)
    with pytest.raises(PipelineError, match=r"missing columns \['seed'\]"):
        read_eval_table(bad)
    with pytest.raises(PipelineError, match="missing eval table"):
        read_eval_table(tmp_path / "none.parquet")
