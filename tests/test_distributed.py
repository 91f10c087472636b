"""Sharding and merging for multi-process stages (pure functions, fast, one process).

The multi-process runs themselves (accelerate launch, gloo) are in test_distributed_stages.py.
"""

from __future__ import annotations

import copy

import numpy as np
import pytest
import torch
import yaml

from tpgrpo.config import ConfigError, config_from_dict, load_config
from tpgrpo.distributed import (Dist, even_slice, merge_parts, parts_folder, round_robin, row_chunks,
                                run_chunks, sum_gradients)
from tpgrpo.errors import PipelineError


@pytest.mark.parametrize("num_groups,group_size,max_items", [(8, 8, 64), (8, 8, 32), (3, 4, 4), (5, 4, 8),
                                                             (3, 4, 3), (7, 1, 3), (0, 4, 8), (1, 24, 8),
                                                             (2, 4, 3), (2, 4, 1)])
def test_row_chunks_cover_every_row_in_order_within_the_batch_size(num_groups, group_size, max_items):
    n = num_groups * group_size
    chunks = row_chunks(n, group_size, max_items)
    assert [r for a, b in chunks for r in range(a, b)] == list(range(n))  # every row once, in order
    assert all(0 < b - a <= max_items for a, b in chunks)  # a group larger than max_items is cut
    if group_size <= max_items:  # whole groups, as many as fit (the layout before groups could be cut)
        per = max_items // group_size
        assert [(a, b) for a, b in chunks] == [(g * group_size, min(g + per, num_groups) * group_size)
                                             for g in range(0, num_groups, per)]
    else:  # pieces of max_items rows across groups: up to one chunk per row
        assert all(b - a == max_items for a, b in chunks[:-1])
    # fixed layout: nothing of the process count in it; 2 groups of 4 in chunks of 3 give 3 processes work
    assert row_chunks(8, 4, 3) == [(0, 3), (3, 6), (6, 8)]


def test_row_chunks_rejects_bad_sizes():
    with pytest.raises(ValueError, match="group_rows >= 1"):
        row_chunks(3, 0, 8)


@pytest.mark.parametrize("num_chunks", [0, 1, 2, 5, 8])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_round_robin_gives_each_chunk_to_exactly_one_process(num_chunks, world):
    owned = [round_robin(num_chunks, world, r) for r in range(world)]
    assert sorted(c for part in owned for c in part) == list(range(num_chunks))
    assert all(c % world == r for r, part in enumerate(owned) for c in part)
    sizes = [len(p) for p in owned]
    assert max(sizes) - min(sizes) <= 1  # balanced to one chunk
    with pytest.raises(ValueError, match="rank 3 outside"):
        round_robin(num_chunks, 3, 3)


@pytest.mark.parametrize("n", [0, 1, 7, 18, 64])
@pytest.mark.parametrize("world", [1, 2, 3, 8])
def test_even_slice_partitions_like_tensor_split(n, world):
    slices = [even_slice(n, world, r) for r in range(world)]
    items = torch.arange(n)
    assert torch.equal(torch.cat([items[s] for s in slices]), items)  # contiguous, disjoint, complete
    assert [s.stop - s.start for s in slices] == [t.numel() for t in torch.tensor_split(items, world)]


def test_merge_parts_uses_chunk_order_not_arrival_order():
    parts = {2: {"x": np.array([5, 6])}, 0: {"x": np.array([1, 2])}, 1: {"x": np.array([3, 4])}}
    np.testing.assert_array_equal(merge_parts(parts, 3)["x"], [1, 2, 3, 4, 5, 6])


def test_merge_parts_refuses_missing_or_mismatched_chunks():
    with pytest.raises(PipelineError, match="1 of 3 chunk parts missing \\(first: chunk 1\\)") as info:
        merge_parts({0: {"x": np.zeros(1)}, 2: {"x": np.zeros(1)}}, 3, "rollout of iteration 0")
    assert "\n" not in str(info.value) and "rollout of iteration 0" in str(info.value)
    with pytest.raises(PipelineError, match="chunk 1 holds arrays"):
        merge_parts({0: {"x": np.zeros(1)}, 1: {"y": np.zeros(1)}}, 2)


def test_run_chunks_single_process_merges_and_cleans_up(tmp_path):
    artifact = tmp_path / "out.zarr"
    stale = parts_folder(artifact)
    stale.mkdir()
    (stale / "chunk-00007.npz").write_bytes(b"left by a killed run")
    seen = []
    merged = run_chunks(Dist(), artifact, 3, lambda c: {"x": np.full((2,), c), "flag": np.array([c == 1] * 2)},
                        "test", progress=lambda done, total: seen.append((done, total)))
    np.testing.assert_array_equal(merged["x"], [0, 0, 1, 1, 2, 2])
    assert merged["flag"].dtype == bool
    assert seen == [(1, 3), (2, 3), (3, 3)]
    assert not stale.exists() and not artifact.exists()  # parts gone; the stage writes the artifact itself


def test_sum_gradients_fills_missing_grads_and_writes_back():
    class TwoIdentical(Dist):
        def reduce(self, tensor, op="sum", what=""):
            return tensor * 2  # as if a second process held the same gradients

    a, b = torch.nn.Parameter(torch.ones(2, 3)), torch.nn.Parameter(torch.ones(4))
    a.grad = torch.arange(6.0).reshape(2, 3)
    sum_gradients([a, b], TwoIdentical(world=2))
    assert torch.equal(a.grad, 2 * torch.arange(6.0).reshape(2, 3))
    assert torch.equal(b.grad, torch.zeros(4))  # a process without transitions contributes zeros
    a.grad = torch.ones(2, 3)
    sum_gradients([a], Dist())  # one process: untouched
    assert torch.equal(a.grad, torch.ones(2, 3))


@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("chunk_size", [7, 24])
def test_sharded_chunk_gradients_sum_to_the_one_process_gradient(world, chunk_size):
    """Uneven shares (7 = 4 + 3 or 3 + 2 + 2) are weighted by 1 / chunk size, not by 1 / share size."""
    from test_update import K, UPD, make_policy, rollout, sampling

    from tpgrpo.policy.lora import lora_parameters
    from tpgrpo.policy.update import LOSS_KEYS, LossStats, UpdateInputs, accumulate_step, select_transitions

    backend, embeds = make_policy()
    batch = rollout(backend, embeds, "sde")
    adv = torch.randn(8, K, generator=torch.Generator().manual_seed(5))
    n_idx, k_idx = select_transitions(adv, seed=1)
    chunk = (n_idx[:chunk_size], k_idx[:chunk_size])

    def share(rank: int, world: int):
        backend.transformer.zero_grad(set_to_none=True)
        inputs = UpdateInputs(backend, embeds, batch, adv, sampling(), UPD, Dist(rank=rank, world=world))
        stats = LossStats(LOSS_KEYS)
        accumulate_step(inputs, *chunk, stats, torch.full((K,), -1.0))
        grads = [torch.zeros_like(p) if p.grad is None else p.grad.clone() for _, p in lora_parameters(backend)]
        return grads, stats

    whole, whole_stats = share(0, 1)
    shares = [share(r, world) for r in range(world)]
    summed = [sum(g[i] for g, _ in shares) for i in range(len(whole))]
    assert any(float(g.abs().max()) > 0 for g in whole)
    for got, want in zip(summed, whole):
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-9)
    assert sum(s.count for _, s in shares) == whole_stats.count == chunk_size
    for key in LOSS_KEYS:
        assert sum(s.sums[key] for _, s in shares) == pytest.approx(whole_stats.sums[key], rel=1e-5, abs=1e-12)


def _raw() -> dict:
    from conftest import tiny_params

    return tiny_params()


@pytest.mark.parametrize("launch, expected", [
    ({"num_processes": -1}, "launch.num_processes = -1: expected a value >= 0"),
    ({"num_processes": 2, "config_file": "acc.yaml"}, "launch.num_processes = 2 with launch.config_file set"),
    ({"timeout_s": -1}, "launch.timeout_s = -1.0: expected a value > 0"),
    ({"procs": 2}, "unknown key launch.procs"),
    ({"num_processes": 0, "launcher": "torchrun"}, "launch.num_processes = 0 with launch.launcher = torchrun"),
    ({"launcher": "ray"}, "launch.launcher = 'ray': expected one of accelerate, torchrun, slurm"),
    ({"launcher": "slurm", "config_file": "a.yaml"}, "launch.config_file = 'a.yaml' with launch.launcher = slurm"),
])
def test_bad_launch_params_give_one_line_errors(tmp_path, launch, expected):
    raw = copy.deepcopy(_raw())
    raw["launch"].update(launch)
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_stage_commands_carry_no_launch_params():
    """dvc.yaml is the same whatever the launch params: a model stage starts its processes itself."""
    from tpgrpo.pipeline.rendering.dvcfile import render, stage_command

    raw = _raw()
    one = config_from_dict(raw)
    assert stage_command(one, "rollout", 3) == "tpgrpo stage rollout --iter 3"
    for launch in ({"num_processes": 4}, {"launcher": "torchrun", "num_processes": 3},
                   {"launcher": "slurm", "num_processes": 0, "num_nodes": 2},
                   {"config_file": "configs/my accelerate.yaml"}, {"timeout_s": 60, "stage_server": False}):
        raw = _raw()
        raw["launch"].update(launch)
        other = config_from_dict(raw)
        assert render(other) == render(one), launch
        assert stage_command(other, "probe", 3) == "tpgrpo stage probe --iter 3"
        assert stage_command(other, "baseline") == "tpgrpo stage baseline"


def test_launch_params_change_no_artifact_hash(tmp_path):
    """The config hash artifacts carry must not depend on the process count (byte-identical tables)."""
    from tpgrpo.pipeline.rendering.dvcfile import STAGE_PARAMS

    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(_raw()))
    a = load_config(path)
    b = load_config(path, overrides={"launch.num_processes": 8, "launch.timeout_s": 60, "launch.launcher": "torchrun"})
    for stage, keys in STAGE_PARAMS.items():
        assert a.params_hash(keys) == b.params_hash(keys), stage
