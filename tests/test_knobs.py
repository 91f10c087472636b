"""Execution knobs (tpgrpo.stage_params.EXECUTION_KNOBS) are read but not recorded: DVC re-runs nothing when
one changes, so each must leave every artifact's bytes alone (tables byte-identical at equal torch thread
counts: these tests run torch on 1 thread) and move the update's adapter by float round-off at most.
The batch sizes are not knobs: batched passes round differently at some batch shapes (docs/parameters.md),
so they stay inputs; a test here keeps them declared. Nor is update.micro_batch (AdamW amplifies
its round-off on the shipped model to 1.9e-3); a test here keeps the size measured on the test model."""

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
from tpgrpo.config import load_config
from tpgrpo.stage_params import EXECUTION_KNOBS, MODEL_PARAMS, STAGE_PARAMS

# Values each knob takes in the "other" config: any value the loader accepts (a CUDA device string is a
# string; nothing here runs on it).
OTHER = {"model.device": "cuda:1", "reward_models.device": "cuda:1", "update.gradient_checkpointing": True,
         "launch.hash_while_writing": False, "launch.cache_while_writing": False}
KEPT_INPUTS = {"rollout.batch_size": ("rollout", "eval", "eval_prompts", "baseline"), "probe.batch_size": ("probe",),
               "reward_models.batch_size": ("rollout", "probe", "eval", "baseline"), "update.micro_batch": ("update",)}
# update.micro_batch 8 -> 3 on the tiny model, 1 thread, lr 1e-2: the adapter moved by 2.8e-7 (weights up to
# 0.18). The loss and gradient are the same means summed in another order; AdamW divides each weight's step by
# its gradient's own size, so round-off in a near-zero gradient can move that weight by up to lr per step.
# 1e-5 is ~35x the measured difference and 1e-3 of lr: a real change of the maths (a lost micro-batch, a
# wrong weighting) moves weights by about lr.
MICRO_BATCH_ATOL = 1e-5


@pytest.fixture
def one_thread():
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


def covered(key: str, declared: list[str]) -> bool:
    return any(key == d or key.startswith(d + ".") for d in declared)


def set_params(root: Path, values: dict) -> None:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    for dotted, value in values.items():
        section, key = dotted.split(".")
        raw[section][key] = value
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def run_ok(root: Path, name: str, iteration: int | None = None) -> None:
    args = ["stage", name, "--params", str(root / "params.yaml")]
    args += [] if iteration is None else ["--iter", str(iteration)]
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, result.output


def test_every_knob_is_a_params_key_that_no_stage_declares_nor_hashes(tiny_project):
    from tpgrpo.config import param_fields
    from tpgrpo.pipeline.rendering.dvcfile import dvc_yaml_text
    from tpgrpo.pipeline.status import stage_params
    from tpgrpo.policy.eval_embeds import chunk_key

    assert set(EXECUTION_KNOBS) == set(OTHER) and set(EXECUTION_KNOBS) <= set(param_fields())
    params = tiny_project / "params.yaml"
    cfg = load_config(params)
    other = load_config(params, overrides=OTHER)
    rendered = yaml.safe_load(dvc_yaml_text(cfg, tiny_project))["stages"]
    for knob in EXECUTION_KNOBS:
        for stage, keys in STAGE_PARAMS.items():
            assert not covered(knob, keys), f"{stage} declares {knob}"
        for name, entry in rendered.items():
            assert not covered(knob, entry.get("params", [])), f"dvc.yaml's {name} lists {knob}"
    for stage, keys in STAGE_PARAMS.items():  # provenance()'s config_hash, per stage
        assert cfg.params_hash(keys) == other.params_hash(keys), stage
        assert not set(stage_params(params, stage)) & set(EXECUTION_KNOBS), stage  # what a stage notes it read
    assert chunk_key(cfg, ["a"]) == chunk_key(other, ["a"])  # the cached embeddings' key
    assert cfg.params_hash(MODEL_PARAMS) == other.params_hash(MODEL_PARAMS)
    # ...while a key that is an input does change them (the comparison can fail)
    dtype = load_config(params, overrides={"model.dtype": "bf16"})
    assert all(cfg.params_hash(STAGE_PARAMS[s]) != dtype.params_hash(STAGE_PARAMS[s]) for s in ("rollout", "update"))


def test_the_batch_sizes_stay_inputs_of_the_stages_they_change():
    for key, stages in KEPT_INPUTS.items():
        assert key not in EXECUTION_KNOBS
        for stage in stages:
            assert covered(key, STAGE_PARAMS[stage]), f"{stage} must declare {key}"


def _tree(root: Path) -> dict[str, bytes]:
    """Every artifact file under data/iters (JSON logs without wall_seconds), by relative path."""
    files = {}
    for path in sorted((root / "data" / "iters").rglob("*")):
        if not path.is_file():
            continue
        data = path.read_bytes()
        if path.suffix == ".json" and path.parent.name != "policy" and path.parent.parent.name != "policy":
            values = json.loads(data)
            values.pop("wall_seconds", None)
            data = json.dumps(values, sort_keys=True).encode()
        files[str(path.relative_to(root))] = data
    return files


def test_device_strings_leave_every_artifact_byte_identical(tiny_project, tmp_path, one_thread):
    """On a CPU only the CPU exists: "cpu" and "cpu:0" are the same device under two strings, so every artifact
    must come out with the same bytes (before the device was a knob, each table's config_hash differed)."""
    root = tiny_project
    other = shutil.copytree(root, tmp_path / "cpu0")
    set_params(other, {"model.device": "cpu:0", "reward_models.device": "cpu:0"})
    for project in (root, other):
        run_ok(project, "eval_prompts")
        for name in ("rollout", "probe", "credit", "update", "eval"):
            run_ok(project, name, 1)
    a, b = _tree(root), _tree(other)
    assert a.keys() == b.keys() and len(a) > 10
    assert [k for k in a if a[k] != b[k]] == []


def _update_both(root: Path, tmp_path: Path, values: dict) -> tuple[Path, Path]:
    """Iteration 1 to its credit once; the update run on it as is and with ``values`` set."""
    for name in ("rollout", "probe", "credit"):
        run_ok(root, name, 1)
    other = shutil.copytree(root, tmp_path / "other")
    set_params(other, values)
    for project in (root, other):
        run_ok(project, "update", 1)
    return root, other


def _weights(root: Path) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(root / "data/iters/0001/policy/pytorch_lora_weights.safetensors")


def test_gradient_checkpointing_leaves_the_policy_byte_identical(tiny_project, tmp_path, one_thread):
    plain, checkpointed = _update_both(tiny_project, tmp_path, {"update.gradient_checkpointing": True})
    a, b = _tree(plain), _tree(checkpointed)
    assert any(v.abs().max() > 0 for k, v in _weights(plain).items() if "lora_B" in k)  # the update did something
    assert a.keys() == b.keys() and [k for k in a if a[k] != b[k]] == []  # adapter, optimizer state, update.json


def test_micro_batch_moves_the_adapter_by_float_round_off_only(tiny_project, tmp_path, one_thread):
    eight, three = _update_both(tiny_project, tmp_path, {"update.micro_batch": 3})
    assert load_config(eight / "params.yaml").update.micro_batch == 8
    a, b = _weights(eight), _weights(three)
    assert a.keys() == b.keys()
    assert max(float(a[k].abs().max()) for k in a if "lora_B" in k) > 100 * MICRO_BATCH_ATOL  # it moved
    worst = max(float((a[k] - b[k]).abs().max()) for k in a)
    assert worst <= MICRO_BATCH_ATOL, worst
    logs = [json.loads((p / "data/iters/0001/update.json").read_text()) for p in (eight, three)]
    for key, value in logs[0].items():  # the same counts; the same figures to round-off
        if key != "wall_seconds":
            np.testing.assert_allclose(np.asarray(logs[1][key], dtype=float), np.asarray(value, dtype=float),
                                       rtol=1e-3, atol=1e-7, err_msg=key)
    tables = [_tree(p) for p in (eight, three)]
    same = [k for k in tables[0] if "policy" not in k and not k.endswith("update.json")]
    assert same and all(tables[0][k] == tables[1][k] for k in same)


@pytest.mark.slow
def test_dvc_sees_no_change_when_every_knob_changes_after_a_run(tiny_project):
    """What a user does after an out-of-memory: lower a knob and run on. DVC itself (not our list) must find
    the recorded run up to date; a batch size, an input, is seen (the check can fail)."""
    import subprocess
    import sys

    root = tiny_project
    set_params(root, {"train.iterations": 1})
    result = CliRunner().invoke(app, ["run", "--params", str(root / "params.yaml")])
    assert result.exit_code == 0, result.output

    def changed() -> set[str]:
        done = subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True,
                              text=True, check=True)
        return set(json.loads(done.stdout or "{}"))

    assert changed() == set()
    set_params(root, {"model.device": "cpu:0", "reward_models.device": "cpu:0", "update.gradient_checkpointing": True,
                      "launch.hash_while_writing": False, "launch.cache_while_writing": False})
    assert changed() == set()
    set_params(root, {"update.micro_batch": 3})  # recorded: the update is out of date
    assert changed() == {"update-0001"}
    set_params(root, {"update.micro_batch": 8})
    set_params(root, {"probe.batch_size": 4})
    assert changed() == {"probe-0001"}


def test_a_knob_is_a_flag_on_its_params_declaration():
    """``param(..., knob=KIND)`` is the one place a key is said to change how the work runs and no number:
    EXECUTION_KNOBS (stage-read, unrecorded) and the comparison's NEUTRAL_KEYS derive from it."""
    from tpgrpo.comparison.runs import NEUTRAL_KEYS
    from tpgrpo.config import param, param_fields

    with pytest.raises(ValueError, match="param knob 'fast'"):
        param(0, "a key", knob="fast")
    kinds = {key: f.metadata["knob"] for key, f in param_fields().items() if f.metadata["knob"]}
    assert {k for k, kind in kinds.items() if kind != "bookkeeping"} == set(EXECUTION_KNOBS)
    bookkeeping = {k for k, kind in kinds.items() if kind == "bookkeeping"}
    assert {"train.block_size", "launch.stage_server", "retention.keep_trajectories"} <= bookkeeping
    for stage, keys in STAGE_PARAMS.items():  # orchestration reads them; no stage does
        assert not any(covered(key, keys) for key in bookkeeping), stage
    assert NEUTRAL_KEYS == {k for k, kind in kinds.items() if kind != "placement"}
    assert "model.device" not in NEUTRAL_KEYS  # another device rounds differently: runs are not pooled across it
