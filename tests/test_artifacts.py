"""Artifacts read back are validated: a bad file is one line naming it and what is wrong, nothing written.

Each case below is something a user does with pandas or by hand between two stages; the stage that reads
the file must stop with a one-line error (non-zero exit through the CLI) and leave no output behind.
"""

from __future__ import annotations

import shutil

import numpy as np
import pandas as pd
import pytest
from typer.testing import CliRunner

from tpgrpo.cli import app

OUTPUTS = {  # what each stage writes into its iteration folder
    "rollout": ("trajectories.zarr", "prompt_embeds.safetensors", "rollout.json"),
    "probe": ("probe.parquet", "probe.json"),
    "credit": ("credit.parquet", "credit.json"),
    "update": ("policy", "update.json"),
}
N, K = 12, 3  # the tiny project's trajectories and window steps


@pytest.fixture(scope="module")
def finished(tmp_path_factory, tiny_model_dir):
    """A tiny project after iteration 0's rollout, probe and credit (copied per case)."""
    from conftest import make_tiny_project

    root = make_tiny_project(tmp_path_factory.mktemp("artifacts") / "project", tiny_model_dir)
    for name in ("rollout", "probe", "credit"):
        result = CliRunner().invoke(app, ["stage", name, "--iter", "1", "--params", str(root / "params.yaml")])
        assert result.exit_code == 0, result.output
    return root


def edit_table(path, change) -> None:
    """Read a Parquet table with pandas, change it, write it back (as a user would)."""
    frame = pd.read_parquet(path)
    change(frame).to_parquet(path)


def truncate(path):
    data = path.read_bytes()
    path.write_bytes(data[: len(data) // 2])


def drop_zarr_array(path, name):
    import zarr

    group = zarr.open_group(str(path), mode="a")
    del group[name]


def set_zarr_value(path, name, index, value):
    import zarr

    zarr.open_group(str(path), mode="a")[name][index] = value


def break_jsonl_line(path, lineno):
    lines = path.read_text().splitlines(keepends=True)
    lines[lineno - 1] = lines[lineno - 1][: len(lines[lineno - 1]) // 2] + "\n"
    path.write_text("".join(lines))


PROBE, CREDIT, TRAJ = "probe.parquet", "credit.parquet", "trajectories.zarr"
CASES = {  # case: (file, how to break it, stage that reads it, words the one-line error must hold)
    "truncated probe parquet": (PROBE, truncate, "credit", ["not a readable Parquet file"]),
    "csv under the parquet name": (
        PROBE, lambda p: pd.read_parquet(p).to_csv(p, index=False), "credit", ["not a readable Parquet file"]),
    "probe without reward": (
        PROBE, lambda p: edit_table(p, lambda f: f.drop(columns="reward")), "credit", ["missing column 'reward'"]),
    "probe missing one row": (
        PROBE, lambda p: edit_table(p, lambda f: f.drop(index=f.index[(f.trajectory == 3) & (f.step == 2)])),
        "credit", ["no row for (trajectory 3, step 2)"]),
    "probe with a repeated row": (
        PROBE, lambda p: edit_table(p, lambda f: pd.concat([f, f.iloc[[7]]])), "credit",
        ["2 rows for (trajectory 1, step 3)"]),
    "probe reward as strings": (
        PROBE, lambda p: edit_table(p, lambda f: f.assign(reward=f.reward.astype(str))), "credit",
        ["column 'reward'", "expected float"]),
    "probe reward NaN": (
        PROBE, lambda p: edit_table(p, lambda f: f.assign(reward=f.reward.where(f.index != 5))), "credit",
        ["column 'reward'", "non-finite"]),
    "probe prompt_id changing within a trajectory": (
        PROBE, lambda p: edit_table(p, lambda f: f.assign(prompt_id=f.prompt_id.where(f.index != 6, "x"))), "credit",
        ["column 'prompt_id'", "trajectory 1"]),
    "broken prompt line": (
        "data/prompts/compositional_train.jsonl", lambda p: break_jsonl_line(p, 5), "rollout",
        ["compositional_train.jsonl:5", "invalid JSON"]),
    "repeated prompt id": (
        "data/prompts/compositional_train.jsonl",
        lambda p: p.write_text(p.read_text() + p.read_text().splitlines(keepends=True)[2]), "rollout",
        ["compositional_train.jsonl:", "already on line 3"]),
    "trajectories without log_probs": (
        TRAJ, lambda p: drop_zarr_array(p, "log_probs"), "probe", ["missing array 'log_probs'"]),
    "trajectories with NaN log-prob": (
        TRAJ, lambda p: set_zarr_value(p, "log_probs", (2, 1), np.nan), "update", ["'log_probs'", "non-finite"]),
    "not a trajectory store": (
        TRAJ, lambda p: (shutil.rmtree(p), p.write_text("x")), "probe", ["not a readable Zarr group"]),
    "credit without advantage": (
        CREDIT, lambda p: edit_table(p, lambda f: f.drop(columns="advantage")), "update",
        ["missing column 'advantage'"]),
    "credit with half its rows": (
        CREDIT, lambda p: edit_table(p, lambda f: f[f.trajectory < N // 2]), "update",
        [f"{N // 2} trajectories", f"{N} in {TRAJ}"]),
    "credit advantage NaN": (
        CREDIT, lambda p: edit_table(p, lambda f: f.assign(advantage=f.advantage.where(f.index != 4))), "update",
        ["column 'advantage'", "non-finite"]),
    "credit sample not the trajectory's": (
        CREDIT, lambda p: edit_table(p, lambda f: f.assign(sample=(f["sample"] + 1) % 4)), "update",
        ["column 'sample'", TRAJ]),
}


@pytest.mark.parametrize("case", list(CASES))
def test_bad_artifact_is_one_line_and_nothing_is_written(finished, tmp_path, case):
    name, corrupt, stage_name, words = CASES[case]
    root = shutil.copytree(finished, tmp_path / "project")
    folder = root / "data" / "iters" / "0001"
    target = root / name if name.startswith("data/") else folder / name
    corrupt(target)
    for out in OUTPUTS[stage_name]:  # so that "nothing written" is visible
        path = folder / out
        shutil.rmtree(path) if path.is_dir() else path.unlink(missing_ok=True)
    result = CliRunner().invoke(app, ["stage", stage_name, "--iter", "1", "--params", str(root / "params.yaml")])
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1, result.output
    assert lines[0].startswith("error: ") and target.name in lines[0], lines[0]
    for word in words:
        assert word in lines[0], lines[0]
    assert not [out for out in OUTPUTS[stage_name] if (folder / out).exists()]
    assert not [p.name for p in folder.iterdir() if ".tmp-" in p.name]


def probe_frame(n: int = 4, k1: int = 3) -> pd.DataFrame:
    """A valid probe table: n trajectories (2 prompt groups), steps 0..k1-1."""
    traj = np.repeat(np.arange(n), k1)
    return pd.DataFrame({
        "trajectory": traj, "prompt_id": [f"p{t // 2}" for t in traj], "prompt": [f"prompt {t // 2}" for t in traj],
        "sample": traj % 2, "seed": traj + 100, "step": np.tile(np.arange(k1), n),
        "sigma": np.tile(np.linspace(1, 0, k1), n), "reward": np.linspace(0, 1, n * k1), "strict": traj % 3 == 0})


def test_tables_round_trip_in_their_declared_form(tmp_path):
    """What a user saves with pandas in another row order or float width reads back canonical."""
    from tpgrpo.io.artifacts import read_table, write_table
    from tpgrpo.io.schemas import PROBE

    frame = probe_frame()
    write_table(tmp_path / "probe.parquet", frame, PROBE, {"stage": "probe"}, trajectories=4, steps=3)
    shuffled = frame.sample(frac=1.0, random_state=0).astype({"reward": np.float32, "seed": np.int32})
    shuffled.assign(note="mine").to_parquet(tmp_path / "edited.parquet")
    back = read_table(tmp_path / "edited.parquet", PROBE, "test")
    assert list(back.columns) == PROBE.names and back["reward"].dtype == np.float64
    assert back["seed"].dtype == np.int64
    pd.testing.assert_frame_equal(back, read_table(tmp_path / "probe.parquet", PROBE, "test"), check_exact=False)


@pytest.mark.parametrize("change, words", [
    (lambda f: f.assign(extra=1), "unexpected column 'extra'"),
    (lambda f: f.assign(step=f.step.where(f.index != 2, 0)), "2 rows for (trajectory 0, step 0)"),
    (lambda f: f.assign(trajectory=f.trajectory + 1), "expected 4 in trajectories.zarr"),
    (lambda f: f.assign(strict=f.strict.astype(int)), "column 'strict' has dtype int64; expected bool"),
    (lambda f: f.assign(prompt_id=f.prompt_id.where(f.index != 0, None)), "column 'prompt_id' has 1 missing"),
])
def test_writing_a_table_off_its_schema_is_refused_and_writes_nothing(tmp_path, change, words):
    from tpgrpo.io.artifacts import write_table
    from tpgrpo.io.schemas import PROBE, ArtifactError

    with pytest.raises(ArtifactError) as err:
        write_table(tmp_path / "probe.parquet", change(probe_frame()), PROBE, {}, trajectories=4, steps=3)
    assert words in str(err.value) and "probe.parquet (being written)" in str(err.value)
    assert not list(tmp_path.iterdir())


def trajectory_arrays(n: int = 4, k: int = 2) -> tuple[dict, dict]:
    arrays = {"states": np.zeros((n, k + 1, 3, 4, 4), np.float32), "log_probs": np.zeros((n, k), np.float32),
              "sigmas": np.ones((n, k + 1), np.float32), "seeds": np.arange(n), "prompt_index": np.arange(n) // 2,
              "sample": np.arange(n) % 2, "final_reward": np.zeros(n), "final_strict": np.zeros(n, bool)}
    attrs = {"prompts": [{"id": "a"}, {"id": "b"}], "schedule_sigmas": [1.0, 0.5, 0.0], "group_size": 2,
             "num_steps": k, "shift": 1.0, "window_start": 0, "window_size": k, "step_kind": "sde",
             "noise_level": 0.7, "guidance_scale": 1.0, "reward": "r"}
    return arrays, attrs


def test_trajectory_store_is_written_in_declared_dtypes_and_read_back_checked(tmp_path):
    import zarr

    from tpgrpo.io.trajectories import CheckedArray, read_trajectories, write_zarr
    from tpgrpo.io.schemas import TRAJECTORY_ARRAYS

    arrays, attrs = trajectory_arrays()
    write_zarr(tmp_path / "trajectories.zarr", arrays, attrs)  # prompt_index / sample given as int64
    group = zarr.open_group(str(tmp_path / "trajectories.zarr"), mode="r")
    for spec in TRAJECTORY_ARRAYS:
        if spec.optional and spec.name not in arrays:  # e.g. x0_estimates: only with probe.completion x0
            assert spec.name not in group
            continue
        assert group[spec.name].dtype == np.dtype(spec.dtype) and group[spec.name].attrs["dims"] == list(spec.dims)
    back, back_attrs = read_trajectories(tmp_path / "trajectories.zarr", lazy=("states",))
    assert isinstance(back["states"], CheckedArray) and back_attrs["group_size"] == 2  # read when sliced
    np.testing.assert_array_equal(back["states"][1:3], arrays["states"][1:3])
    np.testing.assert_array_equal(back["prompt_index"], arrays["prompt_index"])


@pytest.mark.parametrize("change, words", [
    (lambda a, t: a.update(log_probs=a["log_probs"][:3]), "'log_probs' has 3 along 'trajectory'; 'states' has 4"),
    (lambda a, t: a.update(prompt_index=a["prompt_index"] + 1), "'prompt_index' has values 1..2; expected 0..1"),
    (lambda a, t: t.update(window_size=3), "attribute window_size is 3"),
    (lambda a, t: t.pop("group_size"), "missing attribute 'group_size'"),
    (lambda a, t: a.update(seeds=a["seeds"].astype(float)), "array 'seeds' is float64"),
    (lambda a, t: a.update(final_reward=np.full(4, np.inf)), "'final_reward' has 4 non-finite"),
    (lambda a, t: a["states"].__setitem__((1, 2, 0, 0, 0), np.nan), "'states' has 1 non-finite values (first at [1, 2"),
    (lambda a, t: a["states"].__setitem__((3, 0, 1, 1, 1), -1e6), "'states' has 1 values beyond +-10000"),
])
def test_bad_trajectory_stores_are_refused_on_write(tmp_path, change, words):
    from tpgrpo.io.trajectories import write_zarr
    from tpgrpo.io.schemas import ArtifactError

    arrays, attrs = trajectory_arrays()
    change(arrays, attrs)
    with pytest.raises(ArtifactError) as err:
        write_zarr(tmp_path / "trajectories.zarr", arrays, attrs)
    assert words in str(err.value)
    assert not list(tmp_path.iterdir())


def test_prompt_embeddings_file_is_checked(tmp_path):
    import json

    import torch

    from tpgrpo.io.artifacts import read_embeddings, write_embeddings
    from tpgrpo.io.schemas import ArtifactError

    key = {"prompts": json.dumps(["a", "b"]), "model": "h"}
    tensors = {"embeds": torch.ones(2, 5, 8), "uncond_embeds": torch.zeros(1, 5, 8)}
    path = tmp_path / "prompt_embeds.safetensors"
    write_embeddings(path, tensors, key)
    assert torch.equal(read_embeddings(path, key)["embeds"], tensors["embeds"])
    assert read_embeddings(path, {**key, "model": "other"}) is None  # another model's: encode again
    with pytest.raises(ArtifactError, match="tensor 'embeds' has shape \\[3, 5, 8\\]; expected 2 rows"):
        write_embeddings(tmp_path / "x.safetensors", {**tensors, "embeds": torch.ones(3, 5, 8)}, key)
    path.write_bytes(path.read_bytes()[:40])
    with pytest.raises(ArtifactError, match="prompt_embeds.safetensors: not a readable safetensors file"):
        read_embeddings(path, key)
