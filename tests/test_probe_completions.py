"""The common-grid (grid:M) and second-order (heun:M) probe completions."""

from __future__ import annotations

import json

import pytest
import torch
import yaml

from conftest import make_tiny_project, tiny_params
from test_probe_modes import Counting
from tpgrpo.algo.probe_modes import Completion, completion_passes, parse_completion, visits
from tpgrpo.config import config_from_dict


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    from tpgrpo.models import load_backend

    return load_backend("tiny", tiny_model_dir)


def test_grid_states_share_every_node_after_their_first_step():
    grid = parse_completion("grid:3")  # T = 10: nodes 0, 3, 7, 10
    assert [visits(grid, j, 10) for j in (0, 1, 2, 3, 4, 7, 8, 9)] == [
        [0, 3, 7, 10], [1, 3, 7, 10], [2, 3, 7, 10], [3, 7, 10], [4, 7, 10], [7, 10], [8, 10], [9, 10]]
    assert visits(parse_completion("heun:2"), 3, 8) == visits(parse_completion("ode:2"), 3, 8) == [3, 6, 8]
    assert visits(parse_completion("grid:10"), 4, 10) == visits(Completion("exact"), 4, 10) == list(range(4, 11))
    with pytest.raises(ValueError, match="start = 10"):
        visits(grid, 10, 10)


def test_pass_formulas_at_the_defaults():
    starts = list(range(9))  # T = 10, K = 9: one trajectory
    count = lambda name, given=True: completion_passes(starts, 10, parse_completion(name), given)  # noqa: E731
    assert (count("exact", False), count("exact")) == (54, 45)
    assert (count("ode:1"), count("ode:2"), count("heun:2"), count("heun:3")) == (0, 9, 18, 34)
    assert count("grid:3") == 2 + 2 + 2 + 1 + 1 + 1 + 1 + 0 + 0
    assert count("heun-grid:3") == 4 + 4 + 4 + 2 + 2 + 2 + 2 + 0 + 0  # 3, 3, 3, 2, 2, 2, 2, 1, 1 Heun steps
    assert count("x0") == 0


@pytest.mark.parametrize("completion", ["grid:2", "grid:3", "heun:1", "heun:2", "heun:3", "heun-grid:2"])
@pytest.mark.parametrize("given", [False, True])
def test_each_new_mode_makes_the_passes_its_formula_says(backend, completion, given):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import complete_window_states

    T, start, N, K = 6, 1, 3, 4
    mode = parse_completion(completion)
    counting = Counting(backend)
    embeds = backend.encode_prompts(["a red cube", "two blue balls", "a green cone"])
    states = torch.randn((N, K + 1, 3, 32, 32), generator=torch.Generator().manual_seed(0))
    v = torch.randn((N, K, 3, 32, 32), generator=torch.Generator().manual_seed(1)) if given else None
    _, passes = complete_window_states(counting, states, embeds, flow_sigmas(T, 1.0), start, 4.5, batch_size=5,
                                       velocities=v, completion=mode)
    assert counting.rows == passes == completion_passes([start + k for k in range(K)] * N, T, mode, given)


def test_heun_takes_a_trapezoid_step_then_euler_to_zero(backend):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import ode_complete, velocity_at

    T, start = 8, 3  # heun:2 visits 3, 6, 8: a Heun step s_3 -> s_6, then Euler s_6 -> 0
    sigmas = flow_sigmas(T, 1.0)
    embeds = backend.encode_prompts(["a red cube", "two blue balls"])
    x = torch.randn((2, 3, 32, 32), generator=torch.Generator().manual_seed(2))
    got, passes = ode_complete(backend, x, torch.full((2,), start), sigmas, embeds, 4.5, 8,
                               completion=parse_completion("heun:2"))
    s3, s6 = float(sigmas[3]), float(sigmas[6])
    v1 = velocity_at(backend, x, s3, embeds, 4.5)
    v2 = velocity_at(backend, x + v1 * (s6 - s3), s6, embeds, 4.5)
    mid = x + (v1 + v2) / 2 * (s6 - s3)
    want = mid + velocity_at(backend, mid, s6, embeds, 4.5) * (0.0 - s6)
    assert passes == 2 * 3
    torch.testing.assert_close(got, want, rtol=0, atol=1e-5)


def test_grid_steps_each_state_to_the_next_node_then_along_the_nodes(backend):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import ode_complete, velocity_at

    T = 6  # grid:2 nodes 0, 3, 6: a state at step 1 goes s_1 -> s_3 -> 0, one at step 4 goes s_4 -> 0
    sigmas = flow_sigmas(T, 1.0)
    embeds = backend.encode_prompts(["a red cube", "two blue balls"])
    x = torch.randn((2, 3, 32, 32), generator=torch.Generator().manual_seed(3))
    got, passes = ode_complete(backend, x, torch.tensor([1, 4]), sigmas, embeds, 4.5, 8,
                               completion=parse_completion("grid:2"))
    s1, s3, s4 = (float(sigmas[i]) for i in (1, 3, 4))
    a = x[:1] + velocity_at(backend, x[:1], s1, embeds.select([0]), 4.5) * (s3 - s1)
    a = a + velocity_at(backend, a, s3, embeds.select([0]), 4.5) * (0.0 - s3)
    b = x[1:] + velocity_at(backend, x[1:], s4, embeds.select([1]), 4.5) * (0.0 - s4)
    assert passes == 3
    torch.testing.assert_close(got, torch.cat([a, b]), rtol=0, atol=1e-5)


@pytest.mark.parametrize("completion, per_trajectory", [("grid:2", 1 + 1 + 0), ("heun:2", 2 + 2 + 2)])
def test_probe_stage_runs_the_new_modes_with_the_stored_velocities(tmp_path, tiny_model_dir, completion,
                                                                   per_trajectory):
    """T = 4, window 0..2 (z_0..z_2 at steps 0, 1, 2): grid:2 nodes 0, 2, 4; heun:2 on 4, 3, 2 steps left."""
    import stages.probe
    import stages.rollout

    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    cfg = config_from_dict(tiny_params(probe={"completion": completion}))
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(probe={"completion": completion})))
    stages.rollout.run(cfg, 1, root)
    stages.probe.run(cfg, 1, root)
    metrics = json.loads((root / "data" / "iters" / "0001" / "probe.json").read_text())
    assert metrics["completion"] == completion and metrics["first_steps_reused"] is True
    assert metrics["forward_passes"] == 12 * per_trajectory
