"""bench/eval_at.py: a run's stored policies re-scored under other eval params, paired with the base model."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pandas as pd
from conftest import REPO
from test_eval_stage import run_ok, train_one_iteration

from tpgrpo.comparison.stats import read_eval_table
from tpgrpo.config import load_config


def eval_at_module():
    spec = importlib.util.spec_from_file_location("eval_at", REPO / "bench" / "eval_at.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_rescoring_under_the_runs_own_params_gives_the_eval_stages_tables(tiny_project):
    root = tiny_project
    train_one_iteration(root)
    run_ok(root, "baseline")
    run_ok(root, "eval", 1)
    cfg = load_config(root / "params.yaml")
    eval_at = eval_at_module()
    iters = root / "data" / "iters"
    same = {"check_dtype": False}  # Parquet reads text columns back as pandas' string dtype
    pd.testing.assert_frame_equal(eval_at.scored_table(cfg, root, 0), read_eval_table(iters / "baseline_eval.parquet"),
                                  **same)
    pd.testing.assert_frame_equal(eval_at.scored_table(cfg, root, 1), read_eval_table(iters / "0001" / "eval.parquet"),
                                  **same)

    before = sorted(p for p in root.rglob("*"))
    out = root.parent / "rescored"
    res = subprocess.run([sys.executable, str(REPO / "bench" / "eval_at.py"), "--run", str(root), "--iterations", "1",
                          "--set", "eval.num_steps=2", "--out", str(out), "--threads", "1"],
                         capture_output=True, text=True)
    assert res.returncode == 0, res.stderr
    assert sorted(p for p in root.rglob("*")) == before  # nothing written in the run folder
    two_steps = pd.read_parquet(out / "iter_0000.parquet")
    base = read_eval_table(iters / "baseline_eval.parquet")
    assert list(two_steps["seed"]) == list(base["seed"])  # the same images' noise, another sampler
    assert not two_steps["eval_reward"].equals(base["eval_reward"]) or not two_steps["train_reward"].equals(
        base["train_reward"])
    assert "iteration   1: held-out" in res.stdout and "vs base" in res.stdout


def test_a_misspelt_override_is_one_line_naming_the_key(tiny_project):
    res = subprocess.run([sys.executable, str(REPO / "bench" / "eval_at.py"), "--run", str(tiny_project),
                          "--set", "eval.num_stepz=10"], capture_output=True, text=True)
    assert res.returncode != 0 and res.stderr.strip().count("\n") == 0 and "eval.num_stepz" in res.stderr
