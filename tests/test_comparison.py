"""The mode comparison: run folders, resume, collection, paired differences, verdicts, report.

Fast tests build run folders by hand (the stage JSONs and per-image eval tables the pipeline writes);
the slow test trains 2 modes x 2 seeds x 2 iterations of the tiny model through the real CLI.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml
from conftest import tiny_params

from tpgrpo.comparison import runs as cmp
from tpgrpo.comparison import variants
from tpgrpo.comparison.stats import EVAL_TABLE_COLUMNS
from tpgrpo.comparison.claims import collect
from tpgrpo.comparison.results import Pair, collect_curves, compare_pair, by_variant, paired_difference, verdict
from tpgrpo.config import ConfigError
from tpgrpo.errors import PipelineError

PROMPTS, SAMPLES = 6, 2
SECONDS = {"rollout": 1.0, "probe": 2.0, "credit": 0.5, "update": 1.5}  # per iteration; eval 10 s, left out
# What a fake run trained on (tpgrpo.comparison.provenance): one machine and one code for every fake run unless
# a test says otherwise.
FAKE_MACHINE = {"cpu_model": "Test CPU", "cpu_id": "Vendor/6/1/1", "numeric_flags": ["avx2", "fma"],
                "machine": "x86_64", "torch": "2.13.0", "threads": 1, "time": "2026-12-03 00:00:00"}
FAKE_CODE = {"files": {"stages/probe.py": "0" * 32, "tpgrpo/algo/credit.py": "1" * 32}, "libraries": {"torch": "2.13.0"}}


def write_provenance(folder: Path, machines: list[dict] | None, code: dict | None) -> None:
    """``machine.json`` (one record per attempt) and the numeric kinds' code manifests; None leaves one out."""
    from tpgrpo.comparison.provenance import MACHINE_FILE, NUMERIC_KINDS

    if machines is not None:
        (folder / MACHINE_FILE).write_text(json.dumps(machines))
    if code is not None:
        (folder / "data" / "code").mkdir(parents=True, exist_ok=True)
        for kind in NUMERIC_KINDS:
            (folder / "data" / "code" / f"{kind}.json").write_text(json.dumps({"kind": kind, **code}))


def eval_table(values) -> pd.DataFrame:
    """A per-image eval table (PROMPTS x SAMPLES rows) with the given eval_reward values."""
    values = np.asarray(values, dtype=float)
    ids = [f"p{i}" for i in range(PROMPTS) for _ in range(SAMPLES)]
    return pd.DataFrame({
        "prompt_id": ids, "prompt": [f"prompt {i}" for i in ids], "sample": np.tile(np.arange(SAMPLES), PROMPTS),
        "seed": np.arange(PROMPTS * SAMPLES) + 100, "eval_reward": values, "eval_strict": values > 0.5,
        "train_reward": values, "train_strict": values > 0.5}).astype(EVAL_TABLE_COLUMNS)


def fake_run(out: Path, variant: str, mode: str, seed: int, rewards: dict[int, np.ndarray], budget: int,
             planned: int | None = None, family: str = "main", reference: str = "", scale: float = 1.0,
             overrides: dict | None = None, machines: list[dict] | None = [FAKE_MACHINE],
             code: dict | None = FAKE_CODE) -> Path:
    """A finished run folder: run.json, params.yaml, baseline (iteration 0) and iterations 1..max(rewards)
    with stage JSONs (train seconds = scale x SECONDS) and eval tables (evaluated where ``rewards`` has
    the iteration), trained on ``machines`` with ``code`` (:func:`write_provenance`)."""
    folder = out / variant / f"seed{seed}"
    params = tiny_params(credit={"mode": mode}, train={"seed": seed, "iterations": planned or budget})
    for key, value in (overrides or {}).items():
        section, _, name = key.partition(".")
        params[section][name] = value
    iters = folder / "data" / "iters"
    iters.mkdir(parents=True)
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    meta = {"variant": variant, "mode": mode, "seed": seed, "family": family, "reference": reference,
            "overrides": overrides or {}, "budget": budget}
    (folder / "run.json").write_text(json.dumps(meta))
    base = rewards[0]
    eval_table(base).to_parquet(iters / "baseline_eval.parquet")
    (iters / "baseline_eval.json").write_text(json.dumps({"eval_reward": float(np.mean(base)),
                                                         "eval_strict_accuracy": float(np.mean(base > 0.5))}))
    for i in range(1, max(rewards) + 1):
        d = iters / f"{i:04d}"
        d.mkdir()
        for stage, s in SECONDS.items():
            if stage == "probe" and mode == "flow_grpo":
                continue  # Flow-GRPO's credit needs no probe: dvc.yaml has no probe stage for it
            extra = {"rollout": {"mean_reward": 0.1 * i}, "credit": {"turning_point_rate": 0.2,
                     "turning_point_rate_per_step": [0.3, 0.1, 0.0] if mode.startswith("tp") else [0.0] * 3},
                     "update": {"approx_kl_after": 1e-4}, "probe": {}}[stage]
            (d / f"{stage}.json").write_text(json.dumps({"wall_seconds": s * scale, **extra}))
        evaluated = i in rewards
        table = eval_table(rewards[i]) if evaluated else eval_table(np.zeros(PROMPTS * SAMPLES)).iloc[:0]
        table.to_parquet(d / "eval.parquet")
        metrics = {"wall_seconds": 10.0, "evaluated": evaluated}
        if evaluated:
            metrics.update(eval_reward=float(np.mean(rewards[i])),
                           eval_strict_accuracy=float(np.mean(rewards[i] > 0.5)))
        (d / "eval.json").write_text(json.dumps(metrics))
        (d / "policy").mkdir()
    write_provenance(folder, machines, code)
    return folder


def noisy(mean: float, seed: int) -> np.ndarray:
    return mean + np.random.default_rng(seed).normal(0, 0.05, PROMPTS * SAMPLES)


# ---- verdicts and paired differences -------------------------------------------------------------------------

@pytest.mark.parametrize("lo, hi, direction, expected", [
    (0.01, 0.05, 1, "confirmed"), (-0.05, -0.01, 1, "refuted"), (-0.01, 0.02, 1, "not detectable"),
    (0.0, 0.0, 1, "not detectable"), (-0.05, -0.01, -1, "confirmed"), (0.01, 0.05, -1, "refuted"),
    (float("nan"), float("nan"), 1, "not run")])
def test_verdict_rule(lo, hi, direction, expected):
    assert verdict(lo, hi, direction) == expected


def test_verdict_rejects_an_inverted_interval():
    with pytest.raises(ValueError, match="lower bound above upper"):
        verdict(0.2, 0.1)


def test_a_run_against_itself_is_exactly_zero(tmp_path):
    base = noisy(0.3, 0)
    folders = [fake_run(tmp_path, "tp", "tp", s, {0: base, 1: noisy(0.5, s + 1)}, 1) for s in (0, 1)]
    side = [(f, 1) for f in folders]
    d = paired_difference(side, side, n_boot=500)
    assert (d["reward_diff"], d["reward_lo"], d["reward_hi"]) == (0.0, 0.0, 0.0)
    assert (d["strict_diff"], d["strict_lo"], d["strict_hi"]) == (0.0, 0.0, 0.0)
    assert d["per_seed_reward_diff"] == [0.0, 0.0] and d["prompts"] == PROMPTS and d["images"] == PROMPTS * SAMPLES
    assert (d["reward_seed_lo"], d["reward_seed_hi"]) == (0.0, 0.0)


def test_seeds_are_pooled_per_image_before_the_bootstrap(tmp_path):
    base = noisy(0.3, 0)
    a = [fake_run(tmp_path, "tp", "tp", s, {0: base, 1: np.full(PROMPTS * SAMPLES, v)}, 1)
         for s, v in ((0, 0.6), (1, 0.8))]
    b = [fake_run(tmp_path, "flow_grpo", "flow_grpo", s, {0: base, 1: np.full(PROMPTS * SAMPLES, 0.5)}, 1)
         for s in (0, 1)]
    d = paired_difference([(f, 1) for f in a], [(f, 1) for f in b], n_boot=200)
    # per image: mean over seeds 0.7 - 0.5 = 0.2 everywhere, so the interval has no width
    assert d["reward_diff"] == pytest.approx(0.2) and d["reward_lo"] == pytest.approx(0.2) == d["reward_hi"]
    assert d["per_seed_reward_diff"] == pytest.approx([0.1, 0.3])
    # the percentile bootstrap over seeds and prompts: a draw of seed 0 twice gives 0.1, of seed 1 twice 0.3
    assert d["reward_boot_lo"] == pytest.approx(0.1) and d["reward_boot_hi"] == pytest.approx(0.3)
    # the t interval over seeds (the prompts agree exactly): 0.2 +- t_1 x sd(0.1, 0.3) / sqrt(2) = 12.706 x 0.1
    assert (d["reward_seed_lo"], d["reward_seed_hi"]) == pytest.approx((0.2 - 1.27062, 0.2 + 1.27062), abs=1e-4)
    assert d["strict_diff"] == pytest.approx(1.0)  # both seeds strict (> 0.5) vs neither


def test_a_seed_that_reverses_the_difference_widens_only_the_seed_interval(tmp_path):
    base, n = noisy(0.3, 0), PROMPTS * SAMPLES
    gains = (0.2, 0.2, -0.15)  # seed 2 goes the other way: every prompt agrees within a seed
    a = [fake_run(tmp_path, "tp", "tp", s, {0: base, 1: 0.5 + g + noisy(0.0, s)}, 1) for s, g in enumerate(gains)]
    b = [fake_run(tmp_path, "flow_grpo", "flow_grpo", s, {0: base, 1: 0.5 + noisy(0.0, s)}, 1) for s in range(3)]
    d = paired_difference([(f, 1) for f in a], [(f, 1) for f in b], n_boot=2000)
    assert d["reward_lo"] > 0.05  # over prompts alone the pooled gain looks certain
    assert d["reward_seed_lo"] < 0 < d["reward_seed_hi"] and verdict(d["reward_seed_lo"], d["reward_seed_hi"]) \
        == "not detectable"


def test_the_seed_prompt_bootstrap_with_one_seed_is_the_prompt_bootstrap():
    from tpgrpo.comparison.stats import paired_bootstrap, seed_prompt_bootstrap

    rng = np.random.default_rng(3)
    a, b, ids = rng.normal(0.5, 0.1, 40), rng.normal(0.45, 0.1, 40), np.repeat(np.arange(10), 4)
    assert seed_prompt_bootstrap((a - b)[None], ids, n_boot=300) == pytest.approx(paired_bootstrap(a, b, ids, 300))
    with pytest.raises(ValueError, match="diffs must be"):
        seed_prompt_bootstrap(np.zeros((2, 39)), ids)


def test_runs_scored_on_other_images_are_not_paired(tmp_path):
    base = noisy(0.3, 0)
    a = fake_run(tmp_path, "tp", "tp", 0, {0: base, 1: noisy(0.5, 1)}, 1)
    b = fake_run(tmp_path, "flow_grpo", "flow_grpo", 0, {0: base, 1: noisy(0.5, 2)}, 1)
    table = pd.read_parquet(b / "data/iters/0001/eval.parquet")
    table.assign(seed=table["seed"] + 1).to_parquet(b / "data/iters/0001/eval.parquet")
    with pytest.raises(PipelineError, match="different held-out images"):
        paired_difference([(a, 1)], [(b, 1)], n_boot=10)


# ---- collection ----------------------------------------------------------------------------------------------

def test_curves_cumulate_training_seconds_and_stop_at_the_first_unfinished_iteration(tmp_path):
    folder = fake_run(tmp_path, "tp", "tp", 0, {0: noisy(0.3, 0), 2: noisy(0.4, 1), 3: noisy(0.5, 2)}, 3)
    (folder / "data/iters/0003/update.json").unlink()  # iteration 3 unfinished
    curves, rates = collect_curves(cmp.discover(tmp_path))
    assert list(curves["iteration"]) == [0, 1, 2]
    assert list(curves["cum_seconds"]) == [0.0, 5.0, 10.0]  # 1 + 2 + 0.5 + 1.5 per iteration, eval left out
    assert np.isnan(curves["eval_reward"].iloc[1])
    assert curves["eval_reward"].iloc[2] == pytest.approx(noisy(0.4, 1).mean())
    assert len(rates) == 2 * 3 and set(rates["step"]) == {0, 1, 2}


def test_flow_grpo_runs_have_no_probe_stage(tmp_path):
    folder = fake_run(tmp_path, "flow_grpo", "flow_grpo", 0, {0: noisy(0.3, 0), 2: noisy(0.4, 1)}, 2)
    assert not (folder / "data/iters/0001/probe.json").exists()
    curves, _ = collect_curves(cmp.discover(tmp_path))
    assert list(curves["cum_seconds"]) == [0.0, 3.0, 6.0]  # rollout 1 + credit 0.5 + update 1.5
    assert cmp.train_seconds(folder, 2) == [3.0, 3.0]
    summary = folder / cmp.SUMMARY
    summary.parent.mkdir(parents=True)
    summary.write_text(json.dumps({"iterations": 2}))
    assert cmp.run_state(folder) == ("done", 2, 2)


def make_comparison(out: Path, extended: bool = True) -> None:
    """tp (2x the seconds) beats flow_grpo by 0.2 at iteration 4; flow_grpo extended to 8 iterations; an
    incremental run of one seed only; a noise ablation of tp."""
    base = noisy(0.3, 0)
    for s in (0, 1):
        fake_run(out, "tp", "tp", s, {0: base, 2: noisy(0.5, s), 4: noisy(0.7, s + 9)}, 4, scale=2.0)
        fl = {0: base, 2: noisy(0.45, s + 3), 4: noisy(0.5, s + 4)}
        if extended:
            fl.update({6: noisy(0.55, s + 5), 8: noisy(0.6, s + 6)})
        fake_run(out, "flow_grpo", "flow_grpo", s, fl, 4, planned=8 if extended else 4, scale=5 / 3)  # 5 s/it
    fake_run(out, "incremental", "incremental", 0, {0: base, 2: noisy(0.5, 7), 4: noisy(0.5, 8)}, 4)
    fake_run(out, "tp-noise0.4", "tp", 0, {0: base, 2: noisy(0.5, 10), 4: noisy(0.5, 11)}, 4, family="ablation",
             reference="tp", overrides={"sampling.noise_level": 0.4})


def test_pairs_at_the_same_iteration_and_at_equal_wall_clock(tmp_path):
    make_comparison(tmp_path)
    runs = by_variant(cmp.discover(tmp_path))
    curves, _ = collect_curves(cmp.discover(tmp_path))
    same = compare_pair(Pair("tp", "flow_grpo"), runs, curves, n_boot=500)
    assert (same["iteration_a"], same["iteration_b"], same["seeds"]) == ("4", "4", "0,1")
    assert same["reward_diff"] == pytest.approx(0.2, abs=0.03) and same["reward_lo"] > 0.1
    wall = compare_pair(Pair("tp", "flow_grpo", "equal_wall"), runs, curves, n_boot=500)
    # tp: 4 iterations x 10 s = 40 s; flow_grpo: 5 s per iteration, nearest evaluated at 40 s is iteration 8
    assert (wall["iteration_a"], wall["iteration_b"], wall["seconds_a"], wall["seconds_b"]) == ("4", "8", 40.0, 40.0)
    assert wall["reward_diff"] == pytest.approx(0.1, abs=0.03)
    one_seed = compare_pair(Pair("incremental", "flow_grpo"), runs, curves, n_boot=100)
    assert one_seed["seeds"] == "0"


def test_equal_wall_pairs_by_the_budget_runs_rate_not_by_seconds_recorded_under_other_load(tmp_path):
    make_comparison(tmp_path)
    for s in (0, 1):  # flow_grpo's extension ran while the machine was busy: 4x the seconds per iteration
        for i in range(5, 9):
            for stage in ("rollout", "credit", "update"):
                path = tmp_path / "flow_grpo" / f"seed{s}" / "data" / "iters" / f"{i:04d}" / f"{stage}.json"
                log = json.loads(path.read_text())
                path.write_text(json.dumps({**log, "wall_seconds": 4 * log["wall_seconds"]}))
    runs, curves = by_variant(cmp.discover(tmp_path)), collect_curves(cmp.discover(tmp_path))[0]
    wall = compare_pair(Pair("tp", "flow_grpo", "equal_wall"), runs, curves, n_boot=100)
    # over the budget (iterations 1-4) tp takes 10 s per iteration and flow_grpo 5 s: tp's 4 cost flow_grpo's 8
    assert (wall["iteration_a"], wall["iteration_b"]) == ("4", "8")


def test_collect_writes_tables_and_marks_claims(tmp_path):
    make_comparison(tmp_path)
    tables = collect(tmp_path, n_boot=300)
    for name in ("curves", "tp_rates", "pairs", "claims"):
        assert (tmp_path / "results" / f"{name}.csv").is_file()
    curves = pd.read_parquet(tmp_path / "results" / "curves.parquet")
    assert len(curves) == 2 * (5 + 9) + 5 + 5  # tp 0..4, flow_grpo 0..8 per seed; incremental, ablation 0..4
    pairs = tables["pairs"].set_index(["a", "b", "kind"])
    assert {("tp", "flow_grpo", "iteration"), ("tp", "flow_grpo", "equal_wall"), ("incremental", "flow_grpo",
            "iteration"), ("tp-noise0.4", "tp", "iteration")} <= set(pairs.index)
    assert ("tp", "tp-noise0.4", "iteration") not in set(pairs.index)  # a claim's reverse is not repeated
    noise = tables["claims"].set_index("claim").loc["noise level 0.7 beats 0.4"]
    ablation = pairs.loc[("tp-noise0.4", "tp", "iteration")]
    assert (noise["reward_diff"], noise["reward_lo"], noise["reward_hi"]) == pytest.approx(
        (-ablation["reward_diff"], -ablation["reward_hi"], -ablation["reward_lo"]))
    claims = tables["claims"].set_index("claim")["verdict"]
    assert claims["TP-GRPO beats Flow-GRPO at the same iteration"] == "confirmed"
    # at equal wall two seeds (+0.07, +0.10) give t_1 = 12.7: no verdict, where the percentile bootstrap
    # over the same two seeds confirmed it
    wall = tables["claims"].set_index("claim").loc["TP-GRPO beats Flow-GRPO at equal wall-clock time"]
    assert (wall["verdict"], wall["verdict_bootstrap"]) == ("not detectable", "confirmed")
    assert claims["TP-GRPO w/o constraint beats Flow-GRPO at the same iteration"] == "not run"
    assert claims["noise level 0.7 beats 0.4"] == "one seed: a hint for"  # tp seed 0 at 0.7 vs 0.5: one seed only
    assert claims["cps steps beat sde steps"] == "not run"
    notes = tables["claims"].set_index("claim")["note"]
    assert notes["TP-GRPO beats Flow-GRPO at the same iteration"].startswith(f"only {PROMPTS} held-out prompts")


def test_with_a_sweep_the_claims_are_also_made_at_each_modes_best_learning_rate(tmp_path):
    """flow_grpo at lr 3e-4 has the higher training reward, so it is Flow-GRPO's best rate: the claims table
    gains tp (its only rate) against it, at the same iteration and at equal wall clock."""
    make_comparison(tmp_path)
    base = noisy(0.3, 0)
    for s in (0, 1):
        folder = fake_run(tmp_path, "flow_grpo-lr0.0003", "flow_grpo", s, {0: base, 2: noisy(0.5, s + 20),
                          4: noisy(0.7, s + 21), 6: noisy(0.7, s + 22), 8: noisy(0.75, s + 23)}, 4, planned=8,
                          family="lr_sweep", reference="flow_grpo", scale=5 / 3, overrides={"update.lr": 3e-4})
        for i in range(1, 9):
            log = folder / "data" / "iters" / f"{i:04d}" / "rollout.json"
            log.write_text(json.dumps({**json.loads(log.read_text()), "mean_reward": 1.0}))
    tables = collect(tmp_path, n_boot=300)
    claims = tables["claims"].set_index("claim")
    same = claims.loc["TP-GRPO beats Flow-GRPO at the same iteration, each at its best learning rate"]
    wall = claims.loc["TP-GRPO beats Flow-GRPO at equal wall-clock time, each at its best learning rate"]
    assert (same["a"], same["b"], wall["a"], wall["b"]) == ("tp", "flow_grpo-lr0.0003", "tp", "flow_grpo-lr0.0003")
    assert same["reward_diff"] == pytest.approx(0.0, abs=0.05)  # both 0.7 at iteration 4
    pairs = tables["pairs"].set_index(["a", "b", "kind"])
    at_wall = pairs.loc[("tp", "flow_grpo-lr0.0003", "equal_wall")]
    assert (at_wall["iteration_a"], at_wall["iteration_b"]) == ("4", "8")  # tp's 40 s buy flow_grpo 8 iterations
    assert wall["reward_diff"] == pytest.approx(-0.05, abs=0.03)
    # without the sweep variant's extra iterations the equal-wall claim is not run, and says why
    plain = collect_claims_without_extension(tmp_path)
    assert plain["verdict"] == "not run" and "equal-wall pass" in plain["note"]


def collect_claims_without_extension(out: Path):
    import shutil

    for s in (0, 1):
        folder = out / "flow_grpo-lr0.0003" / f"seed{s}"
        params = yaml.safe_load((folder / "params.yaml").read_text())
        params["train"]["iterations"] = 4
        (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        for i in range(5, 9):
            shutil.rmtree(folder / "data" / "iters" / f"{i:04d}")
    claims = collect(out, n_boot=50)["claims"].set_index("claim")
    return claims.loc["TP-GRPO beats Flow-GRPO at equal wall-clock time, each at its best learning rate"]


def test_equal_wall_is_not_run_until_flow_grpo_gets_its_extra_iterations(tmp_path):
    make_comparison(tmp_path, extended=False)
    claims = collect(tmp_path, n_boot=50)["claims"].set_index("claim")
    row = claims.loc["TP-GRPO beats Flow-GRPO at equal wall-clock time"]
    assert row["verdict"] == "not run" and "equal-wall pass" in row["note"]


def test_report_writes_markdown_and_figures(tmp_path):
    from PIL import Image

    from tpgrpo.comparison.report import ABLATION_FIGURE, FIGURES, write_report

    make_comparison(tmp_path / "cmp")
    md = write_report([tmp_path / "cmp"], tmp_path / "docs" / "replication.md", command="make it", n_boot=200)
    text = md.read_text()
    for name in (*FIGURES, ABLATION_FIGURE):
        path = tmp_path / "docs" / "replication" / f"cmp-{name}"
        with Image.open(path) as image:
            assert image.format == "PNG" and min(image.size) >= 300
        assert f"(replication/cmp-{name})" in text
    assert "| TP-GRPO beats Flow-GRPO at the same iteration |" in text and "**confirmed**" in text
    assert "`make it`" in text and "200 bootstrap resamples" in text


def test_report_says_when_the_eval_reward_has_no_strict_result(tmp_path):
    from tpgrpo.comparison.report import section

    jpeg = {"task.reward": "jpeg_compressibility", "task.eval_reward": "jpeg_compressibility"}
    for mode in ("tp", "flow_grpo"):
        for seed in (0, 1):  # rewards below 0.5 everywhere: no image is ever strictly right
            fake_run(tmp_path / "cmp", mode, mode, seed, {0: noisy(0.2, 9), 2: noisy(0.3, seed)}, 2, overrides=jpeg)
    text = "\n".join(section(tmp_path / "cmp", tmp_path / "fig", tmp_path, n_boot=50))
    assert "training reward `jpeg_compressibility`, held-out reward `jpeg_compressibility`" in text
    assert "the strict-accuracy columns below say nothing" in text
    make_comparison(tmp_path / "geneval")  # some images strictly right: no such note
    assert "say nothing" not in "\n".join(section(tmp_path / "geneval", tmp_path / "fig", tmp_path, n_boot=50))


def test_equal_wall_passes_of_two_targets_are_both_recorded_and_reported(tmp_path):
    from tpgrpo.comparison.report import section

    make_comparison(tmp_path, extended=False)
    (tmp_path / "equal_wall.json").write_text(json.dumps({"target": "old", "reference": "tp"}))  # older format
    assert cmp.equal_wall_records(tmp_path) == [{"target": "old", "reference": "tp"}]
    (tmp_path / "equal_wall.json").unlink()
    first, _ = cmp.equal_wall_plan(tmp_path, "tp", "flow_grpo")
    cmp.equal_wall_plan(tmp_path, "tp", "incremental")
    cmp.equal_wall_plan(tmp_path, "tp", "flow_grpo")  # again: replaces its own record, keeps the other
    records = cmp.equal_wall_records(tmp_path)
    assert [r["target"] for r in records] == ["incremental", "flow_grpo"] and records[1] == first
    text = "\n".join(section(tmp_path, tmp_path / "fig", tmp_path, n_boot=50))
    assert text.count("Equal wall clock: tp took") == 2 and "so incremental ran" in text


# ---- planning, folders and resume ----------------------------------------------------------------------------

def test_equal_wall_iterations_round_up_to_an_evaluated_iteration():
    assert cmp.equal_wall_iterations([10.0, 10.0], [5.0], budget=12, every=4) == 24
    assert cmp.equal_wall_iterations([7.5], [5.0], budget=12, every=4) == 20  # 18 -> 20
    assert cmp.equal_wall_iterations([5.0], [10.0], budget=12, every=4) == 12  # never fewer than the budget
    with pytest.raises(ConfigError, match="eval.every"):
        cmp.equal_wall_iterations([1.0], [1.0], budget=12, every=0)


def test_run_params_apply_overrides_and_reject_bad_ones():
    base = tiny_params()
    v = cmp.Variant("tp-lr", "tp", {"update.lr": "3e-4", "sampling.noise_level": 0.4})
    raw = cmp.run_params(base, v, seed=2, iterations=5)
    assert (raw["credit"]["mode"], raw["train"]["seed"], raw["train"]["iterations"]) == ("tp", 2, 5)
    assert raw["sampling"]["noise_level"] == 0.4 and base["sampling"]["noise_level"] == 0.7
    with pytest.raises(ConfigError, match="variant bad: override 'sampling.nosie'"):
        cmp.run_params(base, cmp.Variant("bad", "tp", {"sampling.nosie": 1}), 0, 2)
    with pytest.raises(ConfigError, match="variant wide: .*window_size"):
        cmp.run_params(base, cmp.Variant("wide", "tp", {"sampling.window_size": 4}), 0, 2)  # tiny: 4 steps, sde


def test_variants_of_the_cli_flags():
    main = variants.main_variants(["flow_grpo", "tp"], [0, 1], {"task.reward": "geneval"},
                             {"flow_grpo": {"update.lr": 3e-4}})
    assert [(v.name, v.overrides) for v in main] == [("flow_grpo", {"task.reward": "geneval", "update.lr": 3e-4}),
                                                     ("tp", {"task.reward": "geneval"})]
    sweep = variants.lr_sweep_variants(main, [1e-2], [0])
    assert [v.name for v in sweep] == ["flow_grpo-lr0.01", "tp-lr0.01"] and sweep[0].overrides["update.lr"] == 1e-2
    abl = variants.ablation_variants(main[1], ["window8", "cps"], [0])
    assert [(v.name, v.reference, v.family) for v in abl] == [("tp-window8", "tp", "ablation"),
                                                              ("tp-cps", "tp", "ablation")]
    with pytest.raises(ConfigError, match="modes"):
        variants.main_variants(["grpo"], [0])
    with pytest.raises(ConfigError, match="ablations"):
        variants.ablation_variants(main[1], ["window5"], [0])


def test_run_state_done_only_when_the_summary_is_newer_than_every_iteration(tmp_path):
    folder = fake_run(tmp_path, "tp", "tp", 0, {0: noisy(0.3, 0), 1: noisy(0.4, 0), 2: noisy(0.5, 0)}, 2)
    assert cmp.run_state(folder) == ("partial", 2, 2)  # no summary yet
    summary = folder / cmp.SUMMARY
    summary.parent.mkdir(parents=True)
    summary.write_text(json.dumps({"iterations": 2}))
    assert cmp.run_state(folder) == ("done", 2, 2)
    later = time.time() + 5
    os.utime(folder / "data/iters/0002/eval.json", (later, later))  # an iteration redone after the summary
    assert cmp.run_state(folder)[0] == "partial"
    assert cmp.run_state(tmp_path / "nowhere") == ("new", 0, 0)


def test_a_folder_made_before_an_execution_knob_existed_takes_a_longer_budget(tmp_path):
    """A run folder whose params.yaml predates ``launch.hash_while_writing`` (older code) may be given more
    iterations by a re-planned comparison; a key that changes what is computed still refuses it."""
    v = cmp.Variant("flow_grpo", "flow_grpo", {"update.lr": 3e-4}, (0,))
    spec = cmp.RunSpec(v, 0, tmp_path / "flow_grpo" / "seed0")
    old = cmp.run_params(tiny_params(), v, seed=0, iterations=12)
    del old["launch"]["hash_while_writing"]
    spec.folder.mkdir(parents=True)
    (spec.folder / "params.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    params = cmp.check_run(spec, tiny_params(), 24)
    assert params["train"]["iterations"] == 24
    other = cmp.RunSpec(cmp.Variant("flow_grpo", "flow_grpo", {"update.lr": 1e-3}, (0,)), 0, spec.folder)
    with pytest.raises(PipelineError, match="update.lr is 0.0003 there but this comparison sets 0.001"):
        cmp.check_run(other, tiny_params(), 24)
