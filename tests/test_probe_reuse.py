"""The probe's completions take their first step with the rollout's stored velocity.

Each exact (and ode:M) completion of z_k starts with the Euler step z_k + (s_{k+1} - s_k) v(z_k), and the
rollout has already computed that guided v(z_k): it stores it (``velocities`` in trajectories.zarr) and the
probe saves K passes per trajectory. Q_k must not change beyond float round-off (the batch a velocity is
computed in differs); a store without the array (written before) is probed the old way.
"""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import yaml
import zarr

from conftest import make_tiny_project, tiny_params
from test_integrity import flip_bytes
from test_probe_modes import Counting
from tiny_pipelines import make_pipeline_project
from tpgrpo.algo.probe_modes import completion_passes, parse_completion
from tpgrpo.config import config_from_dict
from tpgrpo.errors import PipelineError

FIRST = 1
# Measured on this CPU (AMD EPYC, 1 thread): every Q_k bit for bit equal, in the tiny model's fp32 (T = 4,
# 12 trajectories, exact and ode:2) and on the tiny SD3 pipeline in bf16 (T = 3, 4 trajectories); the final
# latents too (SD3 pipeline, T = 10, 8 trajectories, fp32 and bf16: max gap 0). The slack allows for a
# device or thread count where a pass's numbers depend on its batch's composition: probe.batch_size moved
# probe rewards by up to 2.6e-3 at 2 threads (its config note); a wrong velocity moves them far more.
TOLERANCE = 5e-3  # reward units (rewards in [0, 1])


def _store(root):
    return root / "data" / "iters" / f"{FIRST:04d}" / "trajectories.zarr"


def _probe(root) -> tuple[pd.DataFrame, dict]:
    import stages.probe

    cfg = config_from_dict(yaml.safe_load((root / "params.yaml").read_text()))
    stages.probe.run(cfg, FIRST, root)
    d = root / "data" / "iters" / f"{FIRST:04d}"
    return pd.read_parquet(d / "probe.parquet").sort_values(["trajectory", "step"]), \
        json.loads((d / "probe.json").read_text())


def _as_old_store(root) -> None:
    """The store as the rollout wrote it before it stored velocities: no velocities, no velocities_kept attribute."""
    group = zarr.open_group(str(_store(root)), mode="r+")
    del group["velocities"]
    attrs = dict(group.attrs)
    attrs.pop("velocities_kept")
    group.attrs.clear()
    group.attrs.update(attrs)


def _rolled_out(tmp_path, model_dir, kind: str, completion: str):
    """A project after one rollout with ``probe.completion = completion``; returns (root, cfg)."""
    import stages.rollout

    if kind == "tiny":
        root = make_tiny_project(tmp_path / "project", model_dir)
        (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(probe={"completion": completion})))
    else:
        root = make_pipeline_project(tmp_path / "project", model_dir, "sd3", model={"dtype": "bf16"},
                                     probe={"completion": completion})
    cfg = config_from_dict(yaml.safe_load((root / "params.yaml").read_text()))
    stages.rollout.run(cfg, FIRST, root)
    return root, cfg


@pytest.mark.parametrize("kind, completion", [("tiny", "exact"), ("tiny", "ode:2"), ("sd3", "exact")])
def test_reusing_the_rollouts_velocity_saves_k_passes_and_keeps_every_q_k(tmp_path, tiny_model_dir, request,
                                                                          kind, completion):
    model_dir = tiny_model_dir if kind == "tiny" else request.getfixturevalue("sd3_model_dir")
    root, cfg = _rolled_out(tmp_path, model_dir, kind, completion)
    assert zarr.open_group(str(_store(root)), mode="r").attrs["velocities_kept"] is True
    after, after_json = _probe(root)
    _as_old_store(root)
    before, before_json = _probe(root)  # the old path: every completion's first step is a pass
    N, K = after.trajectory.nunique(), cfg.sampling.window_size
    assert (after_json["first_steps_reused"], before_json["first_steps_reused"]) == (True, False)
    assert before_json["forward_passes"] - after_json["forward_passes"] == N * K  # exactly K per trajectory
    pd.testing.assert_frame_equal(after.drop(columns=["reward", "strict"]), before.drop(columns=["reward", "strict"]))
    gap = np.abs(after["reward"].to_numpy() - before["reward"].to_numpy())
    print(f"{kind} {completion}: max |dQ_k| {gap.max():.3g}, equal {np.mean(gap == 0):.3f}")
    assert gap.max() <= TOLERANCE, f"max |Q_k after - Q_k before| = {gap.max():.3g}"
    assert (gap[after.step.to_numpy() == K] == 0).all()  # Q_K is R_fin, untouched


def test_rollout_keeps_the_velocity_of_each_window_pass_and_nothing_else_changes(tiny_model_dir):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import SamplerSpec, rollout
    from tpgrpo.models import load_backend

    backend = load_backend("tiny", tiny_model_dir)
    spec = SamplerSpec(flow_sigmas(5, 1.0), window_start=1, window_size=3, step_kind="sde", noise_level=0.7,
                       guidance_scale=4.5)
    embeds = backend.encode_prompts(["a red cube", "two blue balls"])
    counting = Counting(backend)
    kept = rollout(counting, embeds, [3, 4], spec, keep_x0=True, keep_velocities=True)
    plain = rollout(backend, embeds, [3, 4], spec)
    assert plain.velocities is None and kept.velocities.shape == (2, 3, 3, 32, 32)
    for name in ("states", "log_probs", "final"):
        assert torch.equal(getattr(kept, name), getattr(plain, name)), name
    for k in range(3):
        x, v = counting.calls[spec.window_start + k]
        assert torch.equal(x, kept.states[:, k]) and torch.equal(kept.velocities[:, k], v)


def test_the_completion_from_a_given_first_velocity_is_the_recomputed_one(tiny_model_dir):
    """Algorithm level, same batch composition for the first pass: bit for bit equal."""
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import complete_window_states, velocity_at
    from tpgrpo.models import load_backend

    backend = load_backend("tiny", tiny_model_dir)
    T, N, K = 5, 2, 4
    sigmas = flow_sigmas(T, 1.0)
    embeds = backend.encode_prompts(["a red cube", "two blue balls"])
    states = torch.randn((N, K + 1, 3, 32, 32), generator=torch.Generator().manual_seed(5))
    v = torch.stack([velocity_at(backend, states[:, k], float(sigmas[k]), embeds, 4.5) for k in range(K)], 1)
    for m in (None, 2):
        mode = parse_completion("exact" if m is None else f"ode:{m}")
        plain, p0 = complete_window_states(backend, states, embeds, sigmas, 0, 4.5, 64, completion=mode)
        reused, p1 = complete_window_states(backend, states, embeds, sigmas, 0, 4.5, 64, completion=mode, velocities=v)
        assert p0 - p1 == N * K
        assert p1 == completion_passes(list(range(K)) * N, T, mode, first_step_given=True)
        torch.testing.assert_close(reused, plain, rtol=0, atol=1e-5)


def test_a_damaged_or_deleted_velocities_array_is_one_line_naming_the_store_and_what_to_do(tmp_path,
                                                                                           tiny_model_dir):
    root, _ = _rolled_out(tmp_path, tiny_model_dir, "tiny", "exact")
    pristine = tmp_path / "pristine.zarr"
    shutil.copytree(_store(root), pristine)
    flip_bytes(_store(root) / "velocities" / "c.0.0.0.0.0", seed=3)
    with pytest.raises(PipelineError) as info:
        _probe(root)
    message = str(info.value)
    assert "\n" not in message and "trajectories.zarr" in message and "array 'velocities' is damaged" in message
    assert message.endswith("rerun its rollout (tpgrpo stage rollout --iter 1)")
    shutil.rmtree(_store(root))
    shutil.copytree(pristine, _store(root))
    shutil.rmtree(_store(root) / "velocities")  # deleted by hand; the attribute still says it was stored
    with pytest.raises(PipelineError) as info:
        _probe(root)
    message = str(info.value)
    assert "\n" not in message and f"{_store(root)}: array 'velocities' is missing" in message
    assert message.endswith("rerun its rollout (tpgrpo stage rollout --iter 1)")
    assert not (root / "data" / "iters" / f"{FIRST:04d}" / "probe.parquet").exists()
