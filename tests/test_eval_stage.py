"""The eval stage: which weights it scores (EMA), and its per-image table."""

from __future__ import annotations

import json

import pytest
import yaml
from typer.testing import CliRunner

from conftest import tiny_params
from tpgrpo.cli import app

runner = CliRunner()


def run_ok(root, name, iteration=None):
    args = ["stage", name, "--params", str(root / "params.yaml")]
    if iteration is not None:
        args += ["--iter", str(iteration)]
    result = runner.invoke(app, args)
    assert result.exit_code == 0, result.output
    return result


def set_params(root, **sections):
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(**sections), sort_keys=False))


def train_one_iteration(root):
    for name in ("rollout", "probe", "credit", "update"):
        run_ok(root, name, 1)


@pytest.fixture
def ema_project(tiny_project):
    # 8 optimizer steps: the EMA (updated every 8th step) moves away from the initial weights at once.
    set_params(tiny_project, update={"ema": True, "optimizer_steps_per_iter": 8, "micro_batch": 4, "lr": 5e-2})
    train_one_iteration(tiny_project)
    return tiny_project


def _direct_eval(root, tmp_path, ema: bool) -> dict:
    """Evaluate iteration 1's policy without the stage: the raw adapter, or the EMA adapter loaded by hand."""
    from tpgrpo.policy.evaluation import evaluate
    from tpgrpo.config import load_config
    from tpgrpo.policy.export import adapter_folder
    from tpgrpo.policy.loading import load_policy
    from tpgrpo.policy.lora import load_lora_weights, read_adapter_weights

    cfg = load_config(root / "params.yaml")
    backend = load_policy(cfg, root, 2)  # what iteration 2 samples from: policy 1
    if ema:
        load_lora_weights(backend, read_adapter_weights(adapter_folder(root, 1, ema=True)))
    return evaluate(cfg, root, backend, "direct", tmp_path / f"direct-{ema}.json")


def test_eval_scores_the_ema_weights_when_update_ema_is_on(ema_project, tmp_path):
    root = ema_project
    run_ok(root, "eval", 1)
    stage = json.loads((root / "data" / "iters" / "0001" / "eval.json").read_text())
    raw, ema = _direct_eval(root, tmp_path, ema=False), _direct_eval(root, tmp_path, ema=True)
    assert raw["train_reward"] != ema["train_reward"]  # the EMA weights really are other weights
    assert stage["train_reward"] == ema["train_reward"]
    assert stage["eval_reward"] == ema["eval_reward"]
    assert stage["weights"] == "ema"


def test_eval_scores_the_raw_adapter_when_update_ema_is_off(tiny_project, tmp_path):
    root = tiny_project
    train_one_iteration(root)
    run_ok(root, "eval", 1)
    stage = json.loads((root / "data" / "iters" / "0001" / "eval.json").read_text())
    assert stage["weights"] == "adapter"
    assert stage["train_reward"] == _direct_eval(root, tmp_path, ema=False)["train_reward"]


def test_eval_with_ema_on_but_a_policy_without_ema_is_a_one_line_error(tiny_project):
    root = tiny_project
    train_one_iteration(root)  # update.ema false: no policy/ema
    set_params(root, update={"ema": True})
    result = runner.invoke(app, ["stage", "eval", "--iter", "1", "--params", str(root / "params.yaml")])
    assert result.exit_code != 0
    assert "update.ema is true" in result.output and "policy/ema" in result.output
    assert [line.startswith("error:") for line in result.output.splitlines() if line.strip()] == [True]
    assert not (root / "data" / "iters" / "0001" / "eval.json").exists()


def test_eval_and_baseline_write_paired_per_image_tables(tiny_project):
    import pandas as pd
    import pyarrow.parquet as pq

    from tpgrpo.comparison.stats import EVAL_TABLE_COLUMNS, compare_tables, read_eval_table

    root = tiny_project
    train_one_iteration(root)
    run_ok(root, "eval", 1)
    run_ok(root, "baseline")
    iters = root / "data" / "iters"
    tables = {name: read_eval_table(iters / f) for name, f in
              (("iter", "0001/eval.parquet"), ("base", "baseline_eval.parquet"))}
    metrics = {"iter": json.loads((iters / "0001" / "eval.json").read_text()),
               "base": json.loads((iters / "baseline_eval.json").read_text())}
    for name, table in tables.items():
        assert list(table.columns) == list(EVAL_TABLE_COLUMNS)
        assert len(table) == 4 == metrics[name]["images"]  # 2 prompts x 2 seeds
        assert table["seed"].is_unique and table["sample"].tolist() == [0, 1, 0, 1]
        assert table["eval_reward"].mean() == pytest.approx(metrics[name]["eval_reward"], abs=1e-12)
        assert table["train_reward"].mean() == pytest.approx(metrics[name]["train_reward"], abs=1e-12)
        assert table["eval_strict"].mean() == pytest.approx(metrics[name]["eval_strict_accuracy"], abs=1e-12)
    keys = ["prompt_id", "prompt", "sample", "seed"]
    pd.testing.assert_frame_equal(tables["iter"][keys], tables["base"][keys])  # the same eval noise
    meta = pq.read_schema(iters / "0001" / "eval.parquet").metadata
    assert meta[b"tpgrpo.stage"] == b"eval" and meta[b"tpgrpo.weights"] == b"adapter"
    assert pq.read_schema(iters / "baseline_eval.parquet").metadata[b"tpgrpo.stage"] == b"baseline"
    gain = compare_tables(tables["iter"], tables["base"], "train_reward", n_boot=200)
    assert gain["mean_diff"] == pytest.approx(metrics["iter"]["train_reward"] - metrics["base"]["train_reward"])
    assert gain["lo"] <= gain["mean_diff"] <= gain["hi"]


def test_an_iteration_not_evaluated_writes_an_empty_table(tiny_project):
    from tpgrpo.comparison.stats import EVAL_TABLE_COLUMNS, read_eval_table

    root = tiny_project
    set_params(root, eval={"every": 2})
    train_one_iteration(root)
    run_ok(root, "eval", 1)
    table = read_eval_table(root / "data" / "iters" / "0001" / "eval.parquet")
    assert len(table) == 0 and list(table.columns) == list(EVAL_TABLE_COLUMNS)
    assert not json.loads((root / "data" / "iters" / "0001" / "eval.json").read_text())["evaluated"]
