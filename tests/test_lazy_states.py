"""The update reads the states a micro-batch needs from trajectories.zarr when it runs.

A tiny project's rollout, probe and credit run once; the update stage then reads its states lazily
(``tpgrpo.policy.states.LazyStates``): no read holds more than the micro-batch's trajectories x states, the
adapter and optimizer state are byte for byte those of the materialised tensor (the code before), and a
damaged chunk or a non-finite state read lazily is one line.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from tpgrpo.cli import app
from tpgrpo.errors import PipelineError
from tpgrpo.io.trajectories import read_trajectories
from tpgrpo.io.schemas import ArtifactError

MICRO_BATCH = 2


def _stage(root: Path, name: str):
    return CliRunner().invoke(app, ["stage", name, "--iter", "1", "--params", str(root / "params.yaml")])


@pytest.fixture(scope="module")
def ready(tmp_path_factory, tiny_model_dir) -> Path:
    """A tiny project after iteration 1's rollout, probe and credit; the update's micro-batch is 2."""
    from conftest import make_tiny_project

    root = make_tiny_project(tmp_path_factory.mktemp("lazy") / "project", tiny_model_dir)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["update"]["micro_batch"] = MICRO_BATCH
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for name in ("rollout", "probe", "credit"):
        result = _stage(root, name)
        assert result.exit_code == 0, result.output
    return root


def _update(root: Path, monkeypatch, materialise: bool) -> dict:
    """Run the update stage in this process; returns the batch it trained on and the files it wrote."""
    import stages.update as stage
    from tpgrpo.policy import update as update_module

    seen = {}
    real = update_module.train_iteration

    def spy(inputs, *args, **kwargs):
        seen["batch"] = inputs.batch
        return real(inputs, *args, **kwargs)

    monkeypatch.setattr(stage, "train_iteration", spy)
    if materialise:  # the code before: every state in memory, one tensor
        from tpgrpo.rollout_shape import chain_update

        monkeypatch.setattr(chain_update, "states", lambda arrays, num_prompts: _Materialised(arrays["states"]))
    policy = root / "data" / "iters" / "0001" / "policy"
    shutil.rmtree(policy, ignore_errors=True)
    result = _stage(root, "update")
    assert result.exit_code == 0, result.output
    files = {p.relative_to(policy).as_posix(): p.read_bytes() for p in sorted(policy.rglob("*")) if p.is_file()}
    report = json.loads((root / "data" / "iters" / "0001" / "update.json").read_text())
    return {"batch": seen["batch"], "files": files, "report": report}


class _Materialised:
    """What the stage built before: ``torch.from_numpy`` of the whole states array (its ``verify`` a no-op)."""

    def __init__(self, array):
        self.tensor = torch.from_numpy(array[:])
        self.shape = tuple(self.tensor.shape)

    def verify(self) -> torch.Tensor:
        return self.tensor


def test_the_update_reads_only_each_micro_batchs_states(ready, monkeypatch):
    """Fails on the code before this change: the stage handed the update every state as one tensor."""
    from tpgrpo.policy.states import LazyStates

    latents = _update(ready, monkeypatch, materialise=False)["batch"].latents
    assert isinstance(latents, LazyStates)
    n, k1, *state = latents.shape
    state_bytes = 4 * int(np.prod(state))
    assert latents.reads > 0
    # at most 2 states per transition of a micro-batch at once; the whole array is n x k1 states
    assert latents.peak_read_bytes <= 2 * MICRO_BATCH * state_bytes < n * k1 * state_bytes


def test_lazy_states_give_the_materialised_adapter_byte_for_byte(ready, monkeypatch):
    lazy = _update(ready, monkeypatch, materialise=False)
    eager = _update(ready, monkeypatch, materialise=True)
    assert isinstance(eager["batch"].latents, torch.Tensor)
    assert "pytorch_lora_weights.safetensors" in lazy["files"] and "training_state.pt" in lazy["files"]
    assert lazy["files"] == eager["files"]
    drop = ("seconds", "wall")
    same = {k: v for k, v in lazy["report"].items() if not any(d in k for d in drop)}
    assert same == {k: v for k, v in eager["report"].items() if not any(d in k for d in drop)}
    assert same["forward_passes"] > 0


@pytest.mark.parametrize("world", [1, 2, 3])
def test_each_process_share_gives_the_same_gradient_bit_for_bit(ready, world):
    """A chunk's share on each of ``world`` processes (``accumulate_step``): lazy and materialised states
    give bit-identical gradients and statistics."""
    from test_update import K, UPD, make_policy, rollout, sampling

    import zarr

    from tpgrpo.io.trajectories import CheckedArray, _chunk_codecs
    from tpgrpo.distributed import Dist
    from tpgrpo.policy.lora import lora_parameters
    from tpgrpo.policy.states import LazyStates
    from tpgrpo.policy.update import LOSS_KEYS, LossStats, UpdateInputs, accumulate_step, select_transitions

    backend, embeds = make_policy()
    batch = rollout(backend, embeds, "sde")
    n = batch.latents.shape[0]
    # the states in a store chunked (3 trajectories a chunk) and checksummed as the rollout's
    group = zarr.open_group(str(ready.parent / f"share{world}.zarr"), mode="w")
    arr = group.create_array("states", data=batch.latents.numpy(), chunks=(3, *batch.latents.shape[1:]),
                             compressors=_chunk_codecs())
    lazy = LazyStates(CheckedArray(arr, "share.zarr", "states")).verify()
    adv = torch.randn(n, K, generator=torch.Generator().manual_seed(5))
    n_idx, k_idx = select_transitions(adv, seed=1)

    def share(latents, rank: int):
        backend.transformer.zero_grad(set_to_none=True)
        b = type(batch)(latents, batch.old_log_probs, batch.sigmas, batch.prompt_index, batch.sigma_at_one)
        inputs = UpdateInputs(backend, embeds, b, adv, sampling(), UPD, Dist(rank=rank, world=world))
        stats = LossStats(LOSS_KEYS)
        accumulate_step(inputs, n_idx, k_idx, stats, torch.full((K,), -1.0))
        return [None if p.grad is None else p.grad.clone() for _, p in lora_parameters(backend)], stats.sums

    for rank in range(world):
        (want, want_stats), (got, got_stats) = share(batch.latents, rank), share(lazy, rank)
        assert got_stats == want_stats
        assert all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, want))
    assert lazy.reads > 0


def test_a_damaged_chunk_read_lazily_is_one_line(ready, tmp_path):
    from test_integrity import flip_bytes

    from tpgrpo.policy.states import LazyStates

    store = shutil.copytree(ready / "data" / "iters" / "0001" / "trajectories.zarr", tmp_path / "t.zarr")
    states = LazyStates(read_trajectories(store, lazy=("states",))[0]["states"]).verify()  # sound when opened
    # then damaged before a micro-batch reads: every byte of the file flipped, so every state in it fails
    flip_bytes(store / "states" / "c.0.0.0.0.0", count=10**9)
    with pytest.raises(ArtifactError) as info:
        states.pairs(torch.tensor([3, 0]), torch.tensor([1, 0]))
    message = str(info.value)
    assert "\n" not in message and str(store) in message
    assert "array 'states' is damaged: chunk states/c.0.0.0.0.0 fails its checksum" in message


def test_a_non_finite_state_a_micro_batch_uses_stops_the_update(ready, tmp_path):
    """Never verified (``update_policy``'s own check is bypassed): the micro-batch's read refuses it."""
    import zarr

    from tpgrpo.policy.states import LazyStates

    store = shutil.copytree(ready / "data" / "iters" / "0001" / "trajectories.zarr", tmp_path / "t.zarr")
    zarr.open_group(str(store), mode="a")["states"][5, 2, 0, 1, 1] = np.nan
    states = LazyStates(read_trajectories(store, lazy=("states",))[0]["states"])
    x, _ = states.pairs(torch.tensor([4, 6]), torch.tensor([1, 2]))  # does not touch trajectory 5
    assert bool(torch.isfinite(x).all())
    with pytest.raises(PipelineError, match=r"t\.zarr.*'states' has 1 non-finite value\(s\) in the states one "
                                            r"micro-batch read \(first at trajectory 5, state 2\)"):
        states.pairs(torch.tensor([4, 5]), torch.tensor([0, 1]))  # (5, 1) -> (5, 2)
    with pytest.raises(ArtifactError, match=r"'states' has 1 non-finite values \(first at \[5, 2, 0, 1, 1\]"):
        states.verify()  # what the stage runs before any model work: the whole store, chunk by chunk


def test_a_micro_batch_decodes_only_the_states_it_uses(ready, tmp_path):
    """Each (trajectory, state) is compressed on its own inside its file (a zarr shard): damage to one state
    fails only the reads that use it (and ``verify``, which reads all)."""
    from tpgrpo.policy.states import LazyStates

    store = shutil.copytree(ready / "data" / "iters" / "0001" / "trajectories.zarr", tmp_path / "t.zarr")
    shard = store / "states" / "c.0.0.0.0.0"
    states = LazyStates(read_trajectories(store, lazy=("states",))[0]["states"])
    k1 = states.shape[1]
    data = bytearray(shard.read_bytes())
    n_inner = states.array.chunk_rows * k1  # the shard's index at its end: (offset, nbytes) per state, crc32c
    index = np.frombuffer(bytes(data[-(16 * n_inner + 4):-4]), dtype="<u8").reshape(n_inner, 2)
    offset, nbytes = (int(v) for v in index[5 * k1 + 2])  # trajectory 5, state 2
    data[offset:offset + nbytes] = bytes(b ^ 0xFF for b in data[offset:offset + nbytes])
    shard.write_bytes(bytes(data))
    x, x_next = states.pairs(torch.tensor([4, 5, 6]), torch.tensor([1, 0, 2]))  # never state (5, 2)
    assert x.shape[0] == x_next.shape[0] == 3
    with pytest.raises(ArtifactError, match="array 'states' is damaged: chunk states/c.0.0.0.0.0"):
        states.pairs(torch.tensor([4, 5]), torch.tensor([0, 1]))  # (5, 1) -> (5, 2)
    with pytest.raises(ArtifactError, match="array 'states' is damaged"):
        states.verify()


def test_a_missing_states_file_is_one_line(ready, tmp_path):
    """The file count of a sharded array is its shards (zarr counts the chunks inside them)."""
    store = shutil.copytree(ready / "data" / "iters" / "0001" / "trajectories.zarr", tmp_path / "t.zarr")
    assert read_trajectories(store, lazy=("states",))[0]["states"].chunk_rows == 12  # one file: 12 trajectories
    (store / "states" / "c.0.0.0.0.0").unlink()
    with pytest.raises(ArtifactError, match=r"array 'states' has 0 of its 1 chunk files \(states/c\.0\.0\.0\.0\.0 \.\.\.\)"):
        read_trajectories(store, lazy=("states",))
