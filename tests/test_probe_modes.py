"""probe.completion (exact | ode:M | x0) and the model-free probe of credit.mode flow_grpo."""

from __future__ import annotations

import json
import subprocess
import sys

import numpy as np
import pandas as pd
import pyarrow.parquet as pq
import pytest
import torch
import yaml
from typer.testing import CliRunner

from conftest import REPO, make_tiny_project, tiny_params
from tpgrpo.config import ConfigError, config_from_dict
from tpgrpo.algo.probe_modes import completion_passes, parse_completion, respaced_steps

FIRST = 1  # the first iteration's number


class Counting:
    """A backend wrapper that counts transformer passes (rows through ``velocity``) and logs each call."""

    def __init__(self, inner):
        self.inner, self.rows, self.calls = inner, 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def velocity(self, x, sigma, embeds, guidance_scale):
        v = self.inner.velocity(x, sigma, embeds, guidance_scale)
        self.rows += x.shape[0]
        self.calls.append((x.clone(), v.clone()))
        return v


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    from tpgrpo.models import load_backend

    return load_backend("tiny", tiny_model_dir)


def _states(n: int, seed: int = 0) -> torch.Tensor:
    return torch.randn((n, 3, 32, 32), generator=torch.Generator().manual_seed(seed))


# ---------------------------------------------------------------------------------------------
# The schedule and the pass count
# ---------------------------------------------------------------------------------------------

def test_respaced_schedule_keeps_both_ends_is_increasing_and_is_exact_from_m_equal_remaining():
    for remaining in range(1, 41):
        assert respaced_steps(remaining, None) == list(range(remaining + 1))
        for m in range(1, 45):
            offsets = respaced_steps(remaining, m)
            assert len(offsets) == min(m, remaining) + 1
            assert offsets[0] == 0 and offsets[-1] == remaining
            assert all(b > a for a, b in zip(offsets, offsets[1:]))
            if m >= remaining:
                assert offsets == list(range(remaining + 1))
    assert respaced_steps(9, 2) == [0, 5, 9] and respaced_steps(5, 2) == [0, 3, 5]


@pytest.mark.parametrize("completion", ["exact", "ode:1", "ode:2", "ode:3", "ode:50"])
def test_each_mode_makes_the_passes_its_formula_says(backend, completion):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import complete_window_states

    T, start, N, K = 6, 1, 3, 4  # states z_0..z_3 at schedule steps 1..4: 5, 4, 3, 2 steps left
    mode = parse_completion(completion)
    counting = Counting(backend)
    embeds = backend.encode_prompts(["a red cube", "two blue balls", "a green cone"])
    states = _states(N * (K + 1)).reshape(N, K + 1, 3, 32, 32)
    _, passes = complete_window_states(counting, states, embeds, flow_sigmas(T, 1.0), start, 4.5, batch_size=5,
                                       completion=mode)
    left = [T - (start + k) for k in range(K)]
    expected = N * sum(left if mode.kind == "exact" else [min(mode.max_steps, r) for r in left])
    assert counting.rows == passes == expected
    assert completion_passes([start + k for k in range(K)] * N, T, mode) == expected


def test_ode_with_m_equal_to_the_remaining_steps_is_exact_bit_for_bit(backend):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import complete_window_states

    T, start, N, K = 5, 0, 2, 4
    embeds = backend.encode_prompts(["a red cube", "two blue balls"])
    states = _states(N * (K + 1), seed=1).reshape(N, K + 1, 3, 32, 32)
    run = lambda m: complete_window_states(backend, states, embeds, flow_sigmas(T, 1.0), start, 4.5,  # noqa: E731
                                           batch_size=3, completion=ode(m))[0]
    exact = run(None)
    assert torch.equal(run(T - start), exact)  # M = the remaining steps of z_0, the most any state has
    assert not torch.allclose(run(1), exact, atol=1e-3)  # fewer steps do change the completion


def test_ode_m_takes_euler_steps_on_the_states_own_respaced_schedule(backend):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import ode_complete, velocity_at

    T, start = 8, 3  # 5 steps left; ode:2 visits offsets 0, 3, 5: s_3 -> s_6 -> s_8 = 0
    sigmas = flow_sigmas(T, 1.0)
    embeds = backend.encode_prompts(["a red cube", "two blue balls"])
    x = _states(2, seed=2)
    got, passes = ode_complete(backend, x, torch.full((2,), start), sigmas, embeds, 4.5, 8, completion=ode(2))
    s3, s6 = float(sigmas[3]), float(sigmas[6])
    mid = x + velocity_at(backend, x, s3, embeds, 4.5) * (s6 - s3)
    want = mid + velocity_at(backend, mid, s6, embeds, 4.5) * (0.0 - s6)
    assert passes == 4
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("bad", ["ode:0", "ode:", "ode:1.5", "ode:-1", "ode", "ode:²", "X0", "exact ", "none", 2,
                                 "grid:0", "grid", "heun:-2", "heun:2.0", "Heun:2", "exact:3", "x0:1"])
def test_a_bad_probe_completion_is_a_one_line_error(bad):
    with pytest.raises(ConfigError) as info:
        config_from_dict(tiny_params(probe={"completion": bad}))
    assert "probe.completion" in str(info.value) and "\n" not in str(info.value)
    assert config_from_dict(tiny_params(probe={"completion": "ode:12"})).probe.completion == "ode:12"


def test_a_bad_probe_completion_fails_the_stage_with_one_line(tiny_project):
    from tpgrpo.cli import app

    (tiny_project / "params.yaml").write_text(yaml.safe_dump(tiny_params(probe={"completion": "ode:0"})))
    result = CliRunner().invoke(app, ["stage", "probe", "--iter", str(FIRST), "--params",
                                      str(tiny_project / "params.yaml")])
    assert result.exit_code == 2
    assert result.output.strip() == ("error: params: probe.completion = 'ode:0': expected exact, x0, ode:M, "
                                     "grid:M, heun:M or heun-grid:M with an integer M >= 1")


# ---------------------------------------------------------------------------------------------
# x0: the rollout's own one-step estimates
# ---------------------------------------------------------------------------------------------

def test_rollout_keeps_z_minus_s_v_with_its_own_velocity_and_nothing_else_changes(backend):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import SamplerSpec, rollout

    spec = SamplerSpec(flow_sigmas(5, 1.0), window_start=1, window_size=3, step_kind="sde", noise_level=0.7,
                       guidance_scale=4.5)
    embeds = backend.encode_prompts(["a red cube", "two blue balls", "a green cone"])
    counting = Counting(backend)
    kept = rollout(counting, embeds, [3, 4, 5], spec, keep_x0=True)
    plain = rollout(backend, embeds, [3, 4, 5], spec)
    assert plain.x0_estimates is None and kept.x0_estimates.shape == (3, 3, 3, 32, 32)
    for name in ("states", "log_probs", "final"):
        assert torch.equal(getattr(kept, name), getattr(plain, name)), name
    for k in range(3):
        x, v = counting.calls[spec.window_start + k]  # the pass of schedule step window_start + k
        assert torch.equal(x, kept.states[:, k])
        assert torch.equal(kept.x0_estimates[:, k], x - float(spec.sigmas[spec.window_start + k]) * v)


# ---------------------------------------------------------------------------------------------
# The probe stage in every mode, on one rollout
# ---------------------------------------------------------------------------------------------

def _cfg(**sections):
    return config_from_dict(tiny_params(**sections))


def _iteration(root):
    return root / "data" / "iters" / f"{FIRST:04d}"


@pytest.fixture(scope="module")
def rolled_out(tmp_path_factory, tiny_model_dir):
    """A tiny project after one rollout kept the x0 estimates (states are the same in every mode)."""
    import stages.rollout

    root = make_tiny_project(tmp_path_factory.mktemp("modes") / "project", tiny_model_dir)
    stages.rollout.run(_cfg(probe={"completion": "x0"}), FIRST, root)
    return root


def _probe(root, monkeypatch, **sections):
    """Run the probe stage; returns (table, probe.json, completion metadata, transformer passes seen)."""
    import stages.probe
    from tpgrpo.models.tiny import TinyBackend

    seen = []
    original = TinyBackend.velocity
    monkeypatch.setattr(TinyBackend, "velocity", lambda self, x, *a: seen.append(x.shape[0]) or original(self, x, *a))
    stages.probe.run(_cfg(**sections), FIRST, root)
    d = _iteration(root)
    meta = pq.read_schema(d / "probe.parquet").metadata[b"tpgrpo.completion"].decode()
    table = pd.read_parquet(d / "probe.parquet").sort_values(["trajectory", "step"])
    return table, json.loads((d / "probe.json").read_text()), meta, sum(seen)


@pytest.mark.parametrize("completion, per_trajectory", [("exact", 4 + 3 + 2), ("ode:1", 3), ("ode:2", 6),
                                                        ("ode:4", 9), ("x0", 0)])
def test_probe_stage_counts_passes_names_its_mode_and_keeps_r_fin(rolled_out, monkeypatch, completion,
                                                                  per_trajectory):
    import zarr

    table, metrics, meta, seen = _probe(rolled_out, monkeypatch, probe={"completion": completion})
    N, K = 12, 3  # T = 4 steps, window 0..2: z_0..z_2 have 4, 3, 2 steps left
    assert seen == metrics["forward_passes"] == N * per_trajectory
    assert meta == metrics["completion"] == completion and metrics["reward_calls"] == N * K
    final = zarr.open_group(str(_iteration(rolled_out) / "trajectories.zarr"), mode="r")["final_reward"][:]
    np.testing.assert_array_equal(table[table.step == K]["reward"].to_numpy(), final)


def test_probe_ode_m_at_the_longest_remaining_schedule_writes_the_exact_table(rolled_out, monkeypatch):
    exact = _probe(rolled_out, monkeypatch, probe={"completion": "exact"})[0]
    ode = _probe(rolled_out, monkeypatch, probe={"completion": "ode:4"})[0]
    pd.testing.assert_frame_equal(exact, ode, check_exact=True)


def test_x0_probe_scores_the_decoded_rollout_estimates(rolled_out, monkeypatch):
    import zarr

    from tpgrpo.models.tiny import TinyBackend
    from tpgrpo.tasks.rewards import get_reward

    table, metrics, _, seen = _probe(rolled_out, monkeypatch, probe={"completion": "x0"})
    assert seen == 0 and metrics["forward_passes"] == 0
    store = zarr.open_group(str(_iteration(rolled_out) / "trajectories.zarr"), mode="r")
    x0 = torch.from_numpy(store["x0_estimates"][:])  # (N, K, C, H, W) = z_k - s_k v_k of the rollout
    images = TinyBackend.decode(None, x0.reshape(-1, 3, 32, 32))
    metas = [store.attrs["prompts"][p] for p in np.repeat(store["prompt_index"][:], 3)]
    want = get_reward(_cfg().task.reward)(images, metas).reward.reshape(12, 3)
    np.testing.assert_array_equal(table["reward"].to_numpy().reshape(12, 4)[:, :3], want)


def test_x0_probe_without_the_estimates_is_a_one_line_error(tiny_project):
    import stages.probe
    import stages.rollout
    from tpgrpo.errors import PipelineError

    stages.rollout.run(_cfg(), FIRST, tiny_project)  # exact: no x0_estimates kept
    with pytest.raises(PipelineError, match=r"has no x0_estimates: .*rerun the rollout with probe.completion x0$"):
        stages.probe.run(_cfg(probe={"completion": "x0"}), FIRST, tiny_project)
    assert not (_iteration(tiny_project) / "probe.parquet").exists()


# ---------------------------------------------------------------------------------------------
# flow_grpo: a probe that loads no model
# ---------------------------------------------------------------------------------------------

def test_flow_grpo_probe_scores_nothing_and_leaves_the_advantages_unchanged(rolled_out, monkeypatch):
    import stages.credit

    flow = {"credit": {"mode": "flow_grpo"}}
    d = _iteration(rolled_out)
    _probe(rolled_out, monkeypatch, probe={"completion": "exact"})  # flow_grpo's earlier, model-run probe
    stages.credit.run(_cfg(**flow), FIRST, rolled_out)
    before = pd.read_parquet(d / "credit.parquet")
    stages.probe.run(_cfg(**flow), FIRST, rolled_out)  # Q_k = R_fin from the rollout, no model
    probe = pd.read_parquet(d / "probe.parquet")
    finals = probe[probe.step == probe.step.max()].set_index("trajectory")["reward"]
    assert (probe["reward"].to_numpy() == finals.loc[probe["trajectory"]].to_numpy()).all()
    stages.credit.run(_cfg(**flow), FIRST, rolled_out)
    after = pd.read_parquet(d / "credit.parquet")
    for column in ("trajectory", "prompt_id", "sample", "step", "step_reward", "advantage", "turning_point"):
        pd.testing.assert_series_equal(after[column], before[column], check_exact=True)
    # What changed: no Q_k was measured (each is R_fin), so every increment, aggregate and trend is 0.
    assert (after[["incremental", "aggregated", "trend"]] == 0).all().all()
    assert json.loads((d / "probe.json").read_text())["forward_passes"] == 0


def test_every_credit_mode_renders_the_same_stages_and_the_flow_grpo_probe_imports_no_model_library(rolled_out):
    """`dvc exp run -S credit.mode=...` changes params.yaml, not dvc.yaml: every mode has the same stages and
    dependencies (only the params' values differ). The probe does not list credit.mode (it reads only whether it
    is flow_grpo, which its code manifest records); the code stage lists it, to write that record."""
    from tpgrpo.pipeline.rendering.dvcfile import render

    rendered = {mode: render(_cfg(credit={"mode": mode})) for mode in ("tp", "tp_unconstrained", "incremental",
                                                                      "flow_grpo")}
    assert all(r == rendered["tp"] for r in rendered.values())
    stages = rendered["flow_grpo"]["stages"]
    assert f"data/iters/{FIRST:04d}/probe.parquet" in stages[f"credit-{FIRST:04d}"]["deps"]
    assert "credit.mode" not in stages[f"probe-{FIRST:04d}"]["params"] and "credit.mode" in stages["code"]["params"]
    code = (
        "import sys; from pathlib import Path; sys.path.insert(0, sys.argv[1]); sys.path.insert(0, sys.argv[2])\n"
        "from conftest import tiny_params; from tpgrpo.config import config_from_dict; import stages.probe\n"
        "cfg = config_from_dict(tiny_params(credit={'mode': 'flow_grpo'}))\n"
        "stages.probe.run(cfg, int(sys.argv[3]), Path(sys.argv[4]))\n"
        "print(sorted(m for m in ('diffusers', 'transformers', 'peft', 'accelerate') if m in sys.modules))\n")
    out = subprocess.run([sys.executable, "-c", code, str(REPO), str(REPO / "tests"), str(FIRST), str(rolled_out)],
                         capture_output=True, text=True, check=True, cwd=rolled_out)
    assert out.stdout.strip() == "[]", out.stderr


def test_x0_estimates_in_the_trajectory_store_are_checked_like_the_other_arrays(tmp_path):
    from test_artifacts import trajectory_arrays

    from tpgrpo.io.trajectories import read_trajectories, write_zarr
    from tpgrpo.io.schemas import ArtifactError

    arrays, attrs = trajectory_arrays()
    n, k = arrays["log_probs"].shape
    arrays["x0_estimates"] = np.zeros((n, k + 1, *arrays["states"].shape[2:]), dtype=np.float32)
    with pytest.raises(ArtifactError, match=f"'x0_estimates' has {k + 1} along 'window_step'; 'log_probs' has {k}"):
        write_zarr(tmp_path / "bad.zarr", arrays, attrs)
    arrays["x0_estimates"] = arrays["x0_estimates"][:, :k]
    write_zarr(tmp_path / "good.zarr", arrays, attrs)
    assert read_trajectories(tmp_path / "good.zarr")[0]["x0_estimates"].shape == (n, k, *arrays["states"].shape[2:])


def ode(m: int | None):
    """``ode:m`` as a parsed completion (None: ``exact``)."""
    from tpgrpo.algo.probe_modes import Completion

    return Completion("exact") if m is None else Completion("ode", m)
