"""Equal-wall pairs (never reversed; only extended seeds; with model loading taken out), the headline
(iterations to Flow-GRPO's best), more seeds added to an archive, and the model-load measurement."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
from conftest import make_tiny_project
from test_comparison import PROMPTS, SAMPLES, fake_run, make_comparison, noisy

from tpgrpo.comparison import runs as cmp
from tpgrpo.comparison.archive import add_to_archive, write_archive
from tpgrpo.comparison.claims import collect, lookup
from tpgrpo.comparison.headline import crossing
from tpgrpo.comparison.results import Pair
from tpgrpo.errors import PipelineError


def test_an_equal_wall_pair_is_never_read_reversed():
    """B - A at equal wall would be B given the extra iterations against A: not A - B turned round."""
    pairs = pd.DataFrame([{"a": "flow_grpo", "b": "tp", "kind": kind, "reward_diff": 0.1, "reward_lo": 0.05,
                           "reward_hi": 0.15, "reward_seed_lo": 0.0, "reward_seed_hi": 0.2, "reward_boot_lo": 0.0,
                           "reward_boot_hi": 0.2, "per_seed_reward_diff": "+0.1000"}
                          for kind in ("iteration", "equal_wall", "equal_wall_net")])
    assert lookup(pairs, Pair("tp", "flow_grpo", "equal_wall")) is None
    assert lookup(pairs, Pair("tp", "flow_grpo", "equal_wall_net")) is None
    turned = lookup(pairs, Pair("tp", "flow_grpo"))
    assert (turned["reward_diff"], turned["reward_seed_lo"], turned["reward_seed_hi"]) == (-0.1, -0.2, -0.0)


def test_equal_wall_pairs_only_the_seeds_the_pass_extended(tmp_path):
    make_comparison(tmp_path)  # seeds 0, 1 of flow_grpo extended to 8 iterations
    base = noisy(0.3, 0)
    fake_run(tmp_path, "tp", "tp", 2, {0: base, 2: noisy(0.5, 30), 4: noisy(0.7, 31)}, 4, scale=2.0)
    fake_run(tmp_path, "flow_grpo", "flow_grpo", 2, {0: base, 2: noisy(0.45, 32), 4: noisy(0.5, 33)}, 4,
             scale=5 / 3)  # a later seed: not extended
    pairs = collect(tmp_path, n_boot=50)["pairs"].set_index(["a", "b", "kind"])
    assert pairs.loc[("tp", "flow_grpo", "iteration"), "seeds"] == "0,1,2"
    assert pairs.loc[("tp", "flow_grpo", "equal_wall"), "seeds"] == "0,1"


def loaded_comparison(out, load_seconds: float):
    """tp 10 s per iteration with 3 model loads (its probe ran the model), flow_grpo 5 s with 2, extended
    to 12 iterations evaluated every 2; a measured load of ``load_seconds``."""
    base = noisy(0.3, 0)
    for s in (0, 1):
        tp = fake_run(out, "tp", "tp", s, {0: base, 2: noisy(0.5, s), 4: noisy(0.7, s + 9)}, 4, scale=2.0)
        for i in range(1, 5):
            (tp / "data" / "iters" / f"{i:04d}" / "probe.json").write_text(json.dumps(
                {"wall_seconds": 4.0, "forward_passes": 10}))
        fake_run(out, "flow_grpo", "flow_grpo", s, {0: base, **{i: noisy(0.4 + 0.02 * i, s + i) for i in range(2, 13, 2)}},
                 4, planned=12, scale=5 / 3)
    (out / "load_cost.json").write_text(json.dumps({"load_seconds": load_seconds, "loads_timed": 2, "min": 1,
                                                    "max": 1, "threads": 1, "load_average_1min": 0.0,
                                                    "folder": "tp/seed0", "time": "now"}))


def test_equal_wall_without_loading_gives_flow_grpo_the_iterations_its_work_buys(tmp_path):
    loaded_comparison(tmp_path, load_seconds=1.0)
    pairs = collect(tmp_path, n_boot=50)["pairs"].set_index(["a", "b", "kind"])
    gross, net = pairs.loc[("tp", "flow_grpo", "equal_wall")], pairs.loc[("tp", "flow_grpo", "equal_wall_net")]
    # with loading: 10 s / 5 s per iteration, tp's 4 iterations = flow_grpo's 8; without: (10 - 3) / (5 - 2)
    # = 7 / 3, so 9.3 iterations: the nearest evaluated is 10
    assert (gross["iteration_b"], net["iteration_b"]) == ("8", "10")
    assert (net["seconds_a"], net["seconds_b"]) == pytest.approx((28.0, 30.0))
    claims = collect(tmp_path, n_boot=50)["claims"].set_index("claim")
    assert claims.loc["TP-GRPO beats Flow-GRPO at equal wall-clock time, model loading left out", "b"] == "flow_grpo"


def test_without_a_load_measurement_the_net_pair_says_why(tmp_path):
    make_comparison(tmp_path)
    claims = collect(tmp_path, n_boot=50)["claims"].set_index("claim")
    row = claims.loc["TP-GRPO beats Flow-GRPO at equal wall-clock time, model loading left out"]
    assert row["verdict"] == "not run" and "load-cost" in row["note"]


@pytest.mark.parametrize("ys, target, expected", [
    ([0.3, 0.6, 0.7], 0.5, 4 / 3), ([0.3, 0.4, 0.5], 0.5, 4.0), ([0.6, 0.7, 0.8], 0.5, 0.0),
    ([0.3, 0.4, 0.45], 0.5, float("nan"))])
def test_crossing_is_linear_between_evaluated_iterations(ys, target, expected):
    assert crossing([0, 2, 4], ys, target) == pytest.approx(expected, nan_ok=True)


def test_headline_iterations_and_seconds_to_flow_grpos_best(tmp_path):
    n = PROMPTS * SAMPLES
    for s, gain in ((0, 0.0), (1, 0.1)):
        fake_run(tmp_path, "flow_grpo", "flow_grpo", s, {0: np.full(n, 0.3), 2: np.full(n, 0.4), 4: np.full(n, 0.5)},
                 4, scale=5 / 3)
        fake_run(tmp_path, "tp", "tp", s, {0: np.full(n, 0.3), 2: np.full(n, 0.55 + gain), 4: np.full(n, 0.7)}, 4,
                 scale=2.0)
    head = collect(tmp_path, n_boot=50)["headline"].set_index("variant")
    tp = head.loc["tp"]
    assert (tp["target"], tp["target_iteration"]) == pytest.approx((0.5, 4))
    # mean curve 0.3, 0.6, 0.7: reaches 0.5 at 0 + 2 x 0.2 / 0.3; seeds: 2 x 0.2 / 0.25 = 1.6 and 2 x 0.2 / 0.35
    assert tp["iteration"] == pytest.approx(4 / 3) and tp["first_evaluated"] == 2
    assert tp["fraction_of_flow_iterations"] == pytest.approx(1 / 3) and tp["seconds"] == pytest.approx(40 / 3)
    per_seed = np.array([1.6, 0.4 / 0.35])
    half = 12.7062 * per_seed.std(ddof=1) / np.sqrt(2)
    assert (tp["iteration_lo"], tp["iteration_hi"]) == pytest.approx((per_seed.mean() - half, per_seed.mean() + half),
                                                                      abs=1e-3)
    assert head.loc["flow_grpo", "iteration"] == 4.0 and tp["seeds_reaching"] == 2


def longer_reference(out, tree_iterations: int) -> None:
    """flow_grpo given a budget of 8 (5 s per iteration, best 0.6 at 8) and a cheaper arm (2.5 s per
    iteration) with a budget of 4, trained to ``tree_iterations``."""
    base = noisy(0.3, 0)
    for s in (0, 1):
        flow = {0: base, **{i: noisy(0.35 + 0.03 * i, s + i) for i in range(2, 9, 2)}}
        fake_run(out, "flow_grpo", "flow_grpo", s, flow, 8, scale=5 / 3)
        tree = {0: base, **{i: noisy(0.3 + 0.02 * i, 20 + s + i) for i in range(2, tree_iterations + 1, 2)}}
        fake_run(out, "tree-tp", "tp", s, tree, 4, planned=tree_iterations, scale=0.5)


def test_a_reference_with_a_longer_budget_is_matched_at_its_own_budget(tmp_path):
    """Flow-GRPO given 8 iterations against a tree whose comparison budget is 4: the equal-wall pass buys
    the tree flow_grpo's 8 iterations of seconds (16), and the pair reads flow_grpo at 8, not at 4."""
    longer_reference(tmp_path / "plan", 4)
    record, _ = cmp.equal_wall_plan(tmp_path / "plan", "flow_grpo", "tree-tp")
    assert (record["budget"], record["target_budget"], record["iterations"]) == (8, 4, 16)
    longer_reference(tmp_path / "cmp", 16)
    tables = collect(tmp_path / "cmp", n_boot=50)
    pairs = tables["pairs"].set_index(["a", "b", "kind"])
    wall = pairs.loc[("flow_grpo", "tree-tp", "equal_wall")]
    assert (wall["iteration_a"], wall["iteration_b"]) == ("8", "16")
    assert wall["seconds_a"] == pytest.approx(wall["seconds_b"])  # 8 x 5 s against 16 x 2.5 s
    same = pairs.loc[("tree-tp", "flow_grpo", "iteration")]
    assert (same["iteration_a"], same["iteration_b"]) == ("4", "4")  # the same iteration: the smaller budget
    head = tables["headline"].set_index("variant")  # flow_grpo's best over its own budget: 0.59 at 8
    assert head.loc["tree-tp", "target_iteration"] == 8 and head.loc["tree-tp", "target"] > 0.55


def test_more_seeds_join_an_archive_and_pool_with_its_runs(tmp_path):
    first, later, dest = tmp_path / "cmp", tmp_path / "more", tmp_path / "docs" / "cmp"
    make_comparison(first)
    (first / "code").mkdir()
    (first / "code" / "SNAPSHOT.json").write_text(json.dumps({"source": str(tmp_path), "commit": "abc", "time": "t"}))
    write_archive(first, dest)
    assert json.loads((dest / "code" / "SNAPSHOT.json").read_text())["source"] == ".."  # no machine path
    base = noisy(0.3, 0)
    fake_run(later, "tp", "tp", 2, {0: base, 2: noisy(0.5, 40), 4: noisy(0.7, 41)}, 4, scale=2.0)
    fake_run(later, "flow_grpo", "flow_grpo", 2, {0: base, 2: noisy(0.45, 42), 4: noisy(0.5, 43)}, 4, scale=5 / 3)
    (later / "commands.txt").write_text("python bench/compare_modes.py run --out more --seeds 2\n")
    added = add_to_archive(later, dest)
    assert added["runs"] == 2 and {(r["variant"], r["seed"]) for r in cmp.discover(dest)} >= {("tp", 2), ("tp", 0)}
    assert "--seeds 2" in (dest / "commands.txt").read_text()
    assert collect(dest, n_boot=50)["pairs"].set_index(["a", "b", "kind"]).loc[("tp", "flow_grpo", "iteration"),
                                                                               "seeds"] == "0,1,2"
    with pytest.raises(PipelineError, match="already in"):
        add_to_archive(later, dest)
    other = tmp_path / "other"
    fake_run(other, "tp", "tp", 3, {0: base, 4: noisy(0.7, 44)}, 4, overrides={"update.lr": 0.1})
    with pytest.raises(PipelineError, match="update.lr differ"):
        add_to_archive(other, dest)
    unfinished = tmp_path / "unfinished"
    fake_run(unfinished, "tp", "tp", 4, {0: base, 2: noisy(0.5, 45)}, 4, planned=4)
    with pytest.raises(PipelineError, match="tp/seed4: 2 of 4 iterations"):
        add_to_archive(unfinished, dest)


def test_a_key_the_archived_runs_predate_pools_at_its_default_only(tmp_path):
    """Runs archived before a params key existed ran with its default: a later run at the default pools with
    them (the jpeg seeds of 2026-12-02 carry launch.launcher/num_nodes, added later, at their defaults),
    one at another value does not. Fails on a check that counts a missing key as a difference."""
    import yaml

    first, dest = tmp_path / "cmp", tmp_path / "docs" / "cmp"
    make_comparison(first)
    for params_file in first.glob("*/seed*/params.yaml"):  # as written by code without the launch keys
        params = yaml.safe_load(params_file.read_text())
        params["launch"] = {k: v for k, v in params["launch"].items() if k not in ("launcher", "num_nodes")}
        params_file.write_text(yaml.safe_dump(params, sort_keys=False))
    write_archive(first, dest)
    base = noisy(0.3, 0)
    later = tmp_path / "more"
    fake_run(later, "tp", "tp", 2, {0: base, 2: noisy(0.5, 40), 4: noisy(0.7, 41)}, 4, scale=2.0)
    assert add_to_archive(later, dest)["runs"] == 1
    other = tmp_path / "other"
    fake_run(other, "tp", "tp", 3, {0: base, 2: noisy(0.5, 42), 4: noisy(0.7, 43)}, 4,
             overrides={"launch.launcher": "torchrun"})
    with pytest.raises(PipelineError, match="launch.launcher differ"):
        add_to_archive(other, dest)


def test_load_cost_times_the_model_load_in_a_run_folder(tmp_path, tiny_model_dir):
    from tpgrpo.comparison.loadcost import measure

    folder = make_tiny_project(tmp_path / "run", tiny_model_dir)
    record = measure(folder, [1], repeats=2, threads=1)
    assert record["loads_timed"] == 4 and 0 < record["min"] <= record["load_seconds"] <= record["max"]
    with pytest.raises(PipelineError, match="no policy adapter for iterations \\[3\\]"):
        measure(folder, [3], repeats=1, threads=1)


def test_no_headline_where_flow_grpo_never_rises_above_the_base_model(tmp_path):
    n = PROMPTS * SAMPLES
    for s in (0, 1):
        fake_run(tmp_path, "flow_grpo", "flow_grpo", s, {0: np.full(n, 0.4), 2: np.full(n, 0.35), 4: np.full(n, 0.38)}, 4)
        fake_run(tmp_path, "tp", "tp", s, {0: np.full(n, 0.4), 2: np.full(n, 0.45), 4: np.full(n, 0.5)}, 4)
    assert collect(tmp_path, n_boot=50)["headline"].empty
