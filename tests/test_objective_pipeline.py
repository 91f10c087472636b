"""update.objective nft / awm through the real stages on the tiny project: the clean samples in the store, the
slow adapter (NFT's old policy, AWM's EMA) as the update's output the next rollout reads, hand re-runs byte for
byte, `tpgrpo run` then `dvc status` clean (slow), and a grpo project listing and hashing what it did."""

from __future__ import annotations

import subprocess
import sys

import pytest
import torch
import yaml
from conftest import make_tiny_project
from test_pipeline_stages import iteration_dir, run_iteration

from tpgrpo.config import load_config
from tpgrpo.io.trajectories import read_trajectories
from tpgrpo.policy.lora import lora_state_dict, read_adapter_weights
from tpgrpo.policy.slow_adapter import SLOW_FOLDER

TREE = {"enabled": True, "split_steps": "0,1", "children": 1, "roots": 2}


def objective_project(root, model_dir, objective: str, tree: bool = False, **update):
    root = make_tiny_project(root, model_dir)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["update"].update({"objective": objective, **update})
    raw["credit"]["mode"] = "incremental" if tree else "flow_grpo"
    if tree:
        raw["tree"].update(TREE)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


def policy_files(root, i: int) -> dict[str, bytes]:
    folder = iteration_dir(root, i) / "policy"
    return {p.relative_to(folder).as_posix(): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


def initial_lora(root) -> dict[str, torch.Tensor]:
    """The LoRA the update of iteration 1 starts from (seeded; lora_B = 0): the slow adapter's start."""
    from tpgrpo.policy.loading import load_policy

    return lora_state_dict(load_policy(load_config(root / "params.yaml"), root, 1, trainable=True))


@pytest.fixture(scope="module")
def nft_chain(tmp_path_factory, tiny_model_dir):
    """Two nft iterations on chains; the old adapter moves all the way back (d = 1) or not at all (d = 0)."""
    root = objective_project(tmp_path_factory.mktemp("nft") / "project", tiny_model_dir, "nft",
                             nft_decay_rate=0.125, nft_decay_max=1.0)
    for i in (1, 2):
        run_iteration(root, i, ("rollout", "probe", "credit", "update"))
    return root


def test_the_rollout_keeps_the_final_latents_and_the_update_writes_the_slow_adapter(nft_chain):
    """The stored latents are the ones the reward scored: decoded and scored again they give final_reward."""
    import numpy as np

    from tpgrpo.policy.loading import load_policy
    from tpgrpo.tasks.rewards import build_reward

    arrays, attrs = read_trajectories(iteration_dir(nft_chain, 1) / "trajectories.zarr")
    assert arrays["final_latents"].shape == (12, *arrays["states"].shape[2:])
    cfg = load_config(nft_chain / "params.yaml")
    images = load_policy(cfg, nft_chain, 1).decode(torch.from_numpy(arrays["final_latents"]))
    scored = build_reward(cfg.task.reward, cfg, nft_chain)(images, [attrs["prompts"][p] for p in arrays["prompt_index"]])
    np.testing.assert_allclose(scored.reward, arrays["final_reward"], rtol=0, atol=1e-12)
    assert "slow/pytorch_lora_weights.safetensors" in policy_files(nft_chain, 1)


def test_nft_old_adapter_is_the_decayed_blend_of_old_and_current(nft_chain):
    """After iteration 1 (2 optimizer steps in all): d = min(0.125 x 2, 1) = 0.25, old_1 = 0.25 old_0 + 0.75
    theta_1; after iteration 2 (4 steps): d = 0.5, old_2 = 0.5 old_1 + 0.5 theta_2."""
    import json

    start = initial_lora(nft_chain)
    for i, (d, before) in enumerate([(0.25, start), (0.5, None)], start=1):
        log = json.loads((iteration_dir(nft_chain, i) / "update.json").read_text())
        assert log["old_decay"] == pytest.approx(d)
        before = before if before is not None else read_adapter_weights(iteration_dir(nft_chain, 1) / "policy" / SLOW_FOLDER)
        theta = read_adapter_weights(iteration_dir(nft_chain, i) / "policy")
        slow = read_adapter_weights(iteration_dir(nft_chain, i) / "policy" / SLOW_FOLDER)
        for key, value in slow.items():
            assert torch.allclose(value, d * before[key] + (1 - d) * theta[key], atol=1e-7), key
        assert any(not torch.equal(slow[k], theta[k]) for k in slow)


def test_the_nft_rollout_samples_with_the_old_adapter(nft_chain):
    from tpgrpo.policy.loading import load_policy
    from tpgrpo.policy.slow_adapter import load_sampling_adapter

    cfg = load_config(nft_chain / "params.yaml")
    backend = load_policy(cfg, nft_chain, 2)
    load_sampling_adapter(cfg, nft_chain, 2, backend)
    old = read_adapter_weights(iteration_dir(nft_chain, 1) / "policy" / SLOW_FOLDER)
    assert all(torch.equal(v, old[k]) for k, v in lora_state_dict(backend).items())


def test_a_hand_rerun_of_an_objective_update_rewrites_the_policy_byte_for_byte(nft_chain):
    before, log = policy_files(nft_chain, 2), (iteration_dir(nft_chain, 2) / "update.json").read_bytes()
    run_iteration(nft_chain, 2, ("update",))
    assert policy_files(nft_chain, 2) == before
    assert (iteration_dir(nft_chain, 2) / "update.json").read_bytes() == log


def test_awm_ema_follows_each_optimizer_step_and_trees_keep_their_leaves(tmp_path, tiny_model_dir):
    """One optimizer step per iteration, d = min(0.2 x 1, 0.3) = 0.2: ema_1 = 0.2 ema_0 + 0.8 theta_1. The tree
    store keeps 4 leaves per root, prompt-major."""
    import json

    root = objective_project(tmp_path / "project", tiny_model_dir, "awm", tree=True, optimizer_steps_per_iter=1,
                             awm_ema_decay_rate=0.2, split_levels=True)
    run_iteration(root, 1, ("rollout", "probe", "credit", "update"))
    arrays, _ = read_trajectories(iteration_dir(root, 1) / "trajectories.zarr")
    assert arrays["leaf_latents"].shape[0] == 3 * 2 * 4 and int(arrays["tree_leaf"].max()) == 2 * 4 - 1
    start, theta = initial_lora(root), read_adapter_weights(iteration_dir(root, 1) / "policy")
    ema = read_adapter_weights(iteration_dir(root, 1) / "policy" / SLOW_FOLDER)
    for key, value in ema.items():
        assert torch.allclose(value, 0.2 * start[key] + 0.8 * theta[key], atol=1e-7), key
    log = json.loads((iteration_dir(root, 1) / "update.json").read_text())
    # 6 depth-0 SDE edges at 1 level of the awm candidates (s_1 only on a 4-step schedule), 12 depth-1 ones
    # at levels <= their split's sigma (s_1 again): one noising each
    assert log["num_samples"] == 18 and log["num_noisings"] == 18 and log["optimizer_steps"] == 1


def test_a_grpo_project_lists_and_hashes_no_objective_key(tiny_project):
    from tpgrpo.stage_common import provenance
    from tpgrpo.stage_params import OBJECTIVE_KEYS, stage_inputs

    cfg = load_config(tiny_project / "params.yaml")
    other = load_config(tiny_project / "params.yaml", overrides={"update.nft_beta": 0.5, "update.awm_p": 1.0})
    for stage in ("rollout", "update", "eval"):
        assert not set(OBJECTIVE_KEYS) & set(stage_inputs(stage, cfg)), stage
        assert provenance(cfg, 1, stage)["config_hash"] == provenance(other, 1, stage)["config_hash"], stage
    nft = load_config(tiny_project / "params.yaml", overrides={"update.objective": "nft"})
    assert set(OBJECTIVE_KEYS) <= set(stage_inputs("update", nft))
    assert "update.clip_range" not in stage_inputs("update", nft)  # the PPO clip is unread under nft
    assert "update.objective" in stage_inputs("rollout", nft)


def test_an_update_under_nft_refuses_a_store_sampled_under_grpo(tmp_path, tiny_model_dir):
    from test_pipeline_stages import stage

    root = objective_project(tmp_path / "project", tiny_model_dir, "grpo")
    run_iteration(root, 1, ("rollout", "probe", "credit"))
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["update"]["objective"] = "nft"
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    result = stage(root, "update", 1)
    assert result.exit_code != 0 and "no array 'final_latents'" in result.output and "re-run the rollout" in result.output


@pytest.mark.slow
@pytest.mark.parametrize("objective, tree", [("nft", False), ("awm", False), ("nft", True), ("awm", True)])
def test_tpgrpo_run_under_an_objective_then_a_hand_rerun_leaves_dvc_status_clean(tmp_path, tiny_model_dir,
                                                                                  objective, tree):
    from test_dvc_pipeline import env, tpgrpo_run

    root = objective_project(tmp_path / "project", tiny_model_dir, objective, tree=tree, split_levels=tree)
    first = tpgrpo_run(root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (iteration_dir(root, 2) / "policy" / SLOW_FOLDER / "pytorch_lora_weights.safetensors").is_file()
    for name in ("rollout", "update"):
        run_iteration(root, 2, (name,))
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, env=env(), capture_output=True,
                            text=True)
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr
    second = tpgrpo_run(root)
    assert second.returncode == 0 and "Running stage" not in second.stdout, second.stdout[-3000:]
