"""The stages through the real CLI on a tiny project: artifacts, invariants, errors, determinism."""

from __future__ import annotations

import json

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
from typer.testing import CliRunner

from tpgrpo.cli import app

runner = CliRunner()


def stage(root, name, iteration=None):
    args = ["stage", name, "--params", str(root / "params.yaml")]
    if iteration is not None:
        args += ["--iter", str(iteration)]
    return runner.invoke(app, args)


def run_ok(root, name, iteration=None):
    result = stage(root, name, iteration)
    assert result.exit_code == 0, result.output
    return result


def iteration_dir(root, i):
    return root / "data" / "iters" / f"{i:04d}"


def run_iteration(root, i, names=("rollout", "probe", "credit", "update", "eval")):
    for name in names:
        run_ok(root, name, i)


def test_one_iteration_writes_documented_artifacts(tiny_project):
    import zarr

    root = tiny_project
    run_iteration(root, 1)
    d = iteration_dir(root, 1)
    store = zarr.open_group(str(d / "trajectories.zarr"), mode="r")
    N, K = 12, 3
    assert store["states"].shape == (N, K + 1, 3, 32, 32)
    assert store["log_probs"].shape == (N, K) and store["sigmas"].shape == (N, K + 1)
    assert store["states"].attrs["dims"][0] == "trajectory" and store.attrs["iteration"] == "1"
    assert len(set(store["seeds"][:].tolist())) == N  # every sample its own seed

    probe = pd.read_parquet(d / "probe.parquet")
    assert {"prompt_id", "prompt", "sample", "step", "sigma", "reward"} <= set(probe.columns)
    assert len(probe) == N * (K + 1)
    # Step K holds the rollout's own final reward (not scored twice).
    last = probe[probe.step == K].sort_values("trajectory")["reward"].to_numpy()
    np.testing.assert_array_equal(last, store["final_reward"][:])
    # Sigmas of the stored states are the schedule's, in order.
    first = probe[probe.trajectory == 0].sort_values("step")["sigma"].to_numpy()
    assert first[0] == 1.0 and np.all(np.diff(first) < 0)

    credit = pd.read_parquet(d / "credit.parquet")
    assert {"prompt_id", "sample", "step", "incremental", "aggregated", "trend", "turning_point",
            "step_reward", "advantage"} <= set(credit.columns)
    assert len(credit) == N * K
    # Advantages have zero mean within each (prompt group, step).
    assert credit.groupby(["prompt_id", "step"])["advantage"].mean().abs().max() < 1e-6

    update = json.loads((d / "update.json").read_text())
    assert update["first_pass_ratio_max_dev"] < 1e-5  # fresh data: ratio 1
    assert update["approx_kl_after"] > 0  # the policy moved
    assert (d / "policy" / "pytorch_lora_weights.safetensors").is_file()
    assert (d / "policy" / "training_state.pt").is_file()
    evaluation = json.loads((d / "eval.json").read_text())
    assert evaluation["evaluated"] and 0 <= evaluation["eval_reward"] <= 1


def test_probe_q0_is_the_ode_completion_of_the_trajectorys_own_noise(tiny_project):
    """Spec section 4: Q_0 completes z_0 = x_T of the same trajectory (not fresh noise)."""
    from tpgrpo.config import load_config
    from tpgrpo.models import load_backend
    from tpgrpo.policy.generate import sample_ode
    from tpgrpo.tasks.rewards import get_reward

    root = tiny_project
    run_iteration(root, 1, ("rollout", "probe"))
    probe = pd.read_parquet(iteration_dir(root, 1) / "probe.parquet")
    cfg = load_config(root / "params.yaml")
    backend = load_backend("tiny", root / "data" / "base")
    heads = probe[probe.step == 0].sort_values("trajectory").head(3)
    images = sample_ode(backend, heads["prompt"].tolist(), [int(s) for s in heads["seed"]],
                        num_steps=cfg.sampling.num_steps, guidance_scale=cfg.sampling.guidance_scale)
    metas = [{"task": "compositional"}] * len(heads)
    expected = get_reward(cfg.task.reward)(images, metas).reward
    np.testing.assert_allclose(heads["reward"].to_numpy(), expected, atol=1e-6)


def test_two_clean_runs_give_byte_identical_tables(tiny_project, tmp_path):
    import shutil

    other = tmp_path / "other"
    shutil.copytree(tiny_project, other)
    for root in (tiny_project, other):
        run_iteration(root, 1, ("rollout", "probe", "credit"))
    for name in ("probe.parquet", "credit.parquet"):
        a = (iteration_dir(tiny_project, 1) / name).read_bytes()
        b = (iteration_dir(other, 1) / name).read_bytes()
        assert a == b, name


def test_credit_stage_is_a_pure_function_of_the_probe_table(tiny_project):
    from tpgrpo.algo.credit import compute_credit

    root = tiny_project
    run_iteration(root, 1, ("rollout", "probe", "credit"))
    d = iteration_dir(root, 1)
    probe = pd.read_parquet(d / "probe.parquet").sort_values(["trajectory", "step"])
    credit = pd.read_parquet(d / "credit.parquet").sort_values(["trajectory", "step"])
    q = torch.tensor(probe["reward"].to_numpy().reshape(12, 4), dtype=torch.float64)
    groups = torch.tensor(pd.factorize(probe[probe.step == 0]["prompt_id"])[0])
    expected = compute_credit(q, groups, mode="tp", balance="group")
    np.testing.assert_allclose(credit["step_reward"].to_numpy(), expected.step_reward.reshape(-1).numpy())
    np.testing.assert_array_equal(credit["turning_point"].to_numpy(), expected.turning_point.reshape(-1).numpy())


def test_stage_out_of_order_fails_with_one_line(tiny_project):
    result = stage(tiny_project, "credit", 1)
    assert result.exit_code != 0
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert len(lines) == 1 and "probe.parquet" in lines[0] and "missing input" in lines[0]
    assert lines[0].endswith("finished iterations: none")
    result = stage(tiny_project, "rollout", 2)  # iteration 2 needs policy 1 (iteration 1's update)
    assert result.exit_code != 0 and "policy of iteration 1" in result.output


@pytest.mark.parametrize("iteration", [0, 3, -1])
def test_iteration_outside_the_run_is_one_line_naming_the_run_iterations(tiny_project, iteration):
    result = stage(tiny_project, "credit", iteration)  # the tiny project trains iterations 1..2
    lines = [l for l in result.output.splitlines() if l.strip()]
    assert result.exit_code == 2 and len(lines) == 1
    assert f"--iter {iteration}" in lines[0] and "iterations 1..2" in lines[0] and "finished: none" in lines[0]


def test_bad_params_fail_before_anything_is_written(tiny_project):
    raw = yaml.safe_load((tiny_project / "params.yaml").read_text())
    raw["credit"]["mode"] = "turning"
    (tiny_project / "params.yaml").write_text(yaml.safe_dump(raw))
    result = stage(tiny_project, "rollout", 1)
    assert result.exit_code != 0 and "credit.mode = 'turning'" in result.output
    assert not (tiny_project / "data" / "iters").exists()


def test_nan_reward_is_refused_and_leaves_no_credit_table(tiny_project):
    root = tiny_project
    run_iteration(root, 1, ("rollout", "probe"))
    path = iteration_dir(root, 1) / "probe.parquet"
    probe = pd.read_parquet(path)
    probe.loc[5, "reward"] = np.nan
    probe.to_parquet(path)
    result = stage(root, "credit", 1)
    assert result.exit_code != 0 and "non-finite" in result.output and "column 'reward'" in result.output
    assert not (iteration_dir(root, 1) / "credit.parquet").exists()
    assert not list(iteration_dir(root, 1).glob(".credit*"))  # no temp leftovers


def test_second_iteration_samples_from_the_updated_policy(tiny_project):
    import zarr

    from tpgrpo.config import load_config
    from tpgrpo.policy.loading import load_policy

    root = tiny_project
    run_iteration(root, 1)
    run_iteration(root, 2, ("rollout",))
    a = zarr.open_group(str(iteration_dir(root, 1) / "trajectories.zarr"), mode="r")
    b = zarr.open_group(str(iteration_dir(root, 2) / "trajectories.zarr"), mode="r")
    assert a["seeds"][:].tolist() != b["seeds"][:].tolist()  # seeds depend on the iteration
    cfg = load_config(root / "params.yaml")
    base, tuned = load_policy(cfg, root, 1), load_policy(cfg, root, 2)  # what iterations 1 and 2 sample from
    x = torch.randn(2, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    sigma = torch.full((2,), 0.5)
    with torch.no_grad():
        v_base = base.velocity(x, sigma, base.encode_prompts(["a red circle"] * 2), 4.5)
        v_tuned = tuned.velocity(x, sigma, tuned.encode_prompts(["a red circle"] * 2), 4.5)
    assert not torch.allclose(v_base, v_tuned)  # iteration 2 loads iteration 1's adapter


def test_update_epochs_split_the_steps_and_later_passes_see_the_moved_policy(tiny_project):
    root = tiny_project
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["update"].update(epochs=2, optimizer_steps_per_iter=4)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    run_iteration(root, 1, ("rollout", "probe", "credit", "update"))
    update = json.loads((iteration_dir(root, 1) / "update.json").read_text())
    assert update["epochs"] == 2 and update["optimizer_steps"] == 4
    assert update["first_pass_ratio_max_dev"] < 1e-5  # the first pass still sees fresh data
    first, second = update["approx_kl_per_epoch"]
    # Each pass's approx KL is measured on its chunks before their own steps: the second pass starts from
    # the policy the whole first pass moved, so it sees a larger gap to the rollout policy.
    assert second > first > 0
    assert update["forward_passes"] >= 2 * update["num_transitions"]


def test_update_steps_not_divisible_by_epochs_is_a_one_line_error(tiny_project):
    root = tiny_project
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["update"].update(epochs=3, optimizer_steps_per_iter=4)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = stage(root, "rollout", 1)
    assert result.exit_code != 0
    assert "update.optimizer_steps_per_iter = 4" in result.output and "update.epochs" in result.output
    assert not (iteration_dir(root, 1) / "trajectories.zarr").exists()
