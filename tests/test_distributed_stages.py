"""The model stages under `accelerate launch` (started by `tpgrpo stage` itself) with 2 CPU processes (gloo)
against 1 process.

Both sides run with one torch thread per process (OMP_NUM_THREADS=1): a chunk is then computed with the same
shapes and the same thread count on either side, so rollout, probe, credit and eval artifacts are bitwise equal;
the update sums gradients over processes in another order, so its adapter matches to float tolerance only.
Slow (about two minutes: every stage start loads torch, twice over with the launcher).
"""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_project

from tpgrpo.config import load_config
from tpgrpo.distributed import FAIL_HOOK_ENV, parts_folder
from tpgrpo.io.stage_logs import read_log
from tpgrpo.pipeline.rendering.dvcfile import stage_command

pytestmark = pytest.mark.slow

# 3 prompt groups of 4 samples, 3 window steps. Rollout: 3 chunks of one group (rank 0: chunks 0 and 2,
# rank 1: chunk 1); probe: 12 states per group > 8, so chunks of 2 trajectories (6 states) cut the groups,
# 6 chunks; eval: 3 prompts x 2 samples in chunks of at most 4 images (2 whole prompts), so 2 chunks.
OVERRIDES = {"rollout": {"batch_size": 4}, "probe": {"batch_size": 8}, "eval": {"num_prompts": 3}}
STAGES = ("baseline", "rollout", "probe", "credit", "update", "eval")


def env(**extra: str) -> dict:
    e = {k: v for k, v in os.environ.items() if k != FAIL_HOOK_ENV}
    e.update(DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true", OMP_NUM_THREADS="1", **extra)
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")  # tpgrpo, accelerate
    return e


def make_project(root: Path, model_dir: Path, processes: int) -> Path:
    make_tiny_project(root, model_dir)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    for section, values in {**OVERRIDES, "launch": {"num_processes": processes}}.items():
        raw[section].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


def run_stage(root: Path, name: str, **extra_env: str) -> subprocess.CompletedProcess:
    """The stage's dvc.yaml command, `tpgrpo stage ...`: with launch.num_processes 2 it starts itself under
    `accelerate launch`."""
    cmd = stage_command(load_config(root / "params.yaml"), name, None if name == "baseline" else 1)
    return subprocess.run(shlex.split(cmd), cwd=root, env=env(**extra_env), capture_output=True, text=True,
                          timeout=600)


def iteration_dir(root: Path) -> Path:
    return root / "data" / "iters" / "0001"


def tree_bytes(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory, tiny_model_dir) -> tuple[Path, Path]:
    """One iteration (and the baseline) on 1 process and on 2 processes, from the same params."""
    base = tmp_path_factory.mktemp("processes")
    one = make_project(base / "one", tiny_model_dir, 1)
    two = make_project(base / "two", tiny_model_dir, 2)
    assert stage_command(load_config(two / "params.yaml"), "rollout", 1) == "tpgrpo stage rollout --iter 1"
    for name in STAGES:
        for root in (one, two):
            out = run_stage(root, name)
            assert out.returncode == 0, f"{root.name} {name}:\n{out.stderr[-3000:]}"
    return one, two


def test_two_processes_write_byte_identical_artifacts(runs):
    one, two = runs
    a, b = tree_bytes(iteration_dir(one) / "trajectories.zarr"), tree_bytes(iteration_dir(two) / "trajectories.zarr")
    assert a.keys() == b.keys() and a == b  # every Zarr chunk and the attributes (provenance, config hash)
    for name in ("probe.parquet", "credit.parquet"):
        assert (iteration_dir(one) / name).read_bytes() == (iteration_dir(two) / name).read_bytes(), name
    rollout = read_log(iteration_dir(two) / "rollout.json", "rollout")  # with its timing sidecar
    assert rollout["processes"] == 2 and rollout["chunks"] == 3
    assert json.loads((iteration_dir(two) / "probe.json").read_text())["chunks"] == 6
    base_one, base_two = (read_log(r / "data" / "iters" / "baseline_eval.json", "baseline") for r in runs)
    assert base_two["processes"] == 2 and base_two["images"] == 6
    for key in ("eval_reward", "eval_strict_accuracy", "train_reward", "forward_passes"):
        assert base_one[key] == base_two[key], key  # the same images, sharded over two processes
    evaluation = read_log(iteration_dir(two) / "eval.json", "eval")
    assert evaluation["evaluated"] and evaluation["processes"] == 2
    assert not list(iteration_dir(two).glob(".*"))  # no part folders or temp files left


def test_two_process_update_matches_one_process_to_float_tolerance(runs):
    """Tolerance 1e-4 on weights that move by ~1e-2: each step's gradient is the same mean over the same
    transitions, summed in another order; AdamW divides by sqrt(v) + 1e-8, which turns a round-off difference
    of ~1e-12 in a gradient entry of size ~1e-8 into up to ~lr * 1e-3 = 1e-5 in the weight (measured 1.6e-5)."""
    import torch
    from safetensors.torch import load_file

    one, two = runs
    a, b = (load_file(iteration_dir(r) / "policy" / "pytorch_lora_weights.safetensors") for r in runs)
    assert a.keys() == b.keys()
    diff = max(float((a[k] - b[k]).abs().max()) for k in a)
    moved = max(float(a[k].abs().max()) for k in a if ".lora_B." in k)  # lora_B starts at 0
    assert diff <= 1e-4, diff
    assert moved > 100 * diff, (moved, diff)  # the tolerance is far below the update itself
    u1, u2 = (read_log(iteration_dir(r) / "update.json", "update") for r in runs)
    assert u2["processes"] == 2
    for key in ("num_transitions", "num_samples", "optimizer_steps", "forward_passes"):
        assert u1[key] == u2[key], key  # the same global transitions and steps
    for key in ("policy_loss", "approx_kl", "grad_norm", "first_pass_ratio_max_dev"):
        assert u2[key] == pytest.approx(u1[key], rel=1e-2, abs=1e-9), key
    assert torch.load(iteration_dir(two) / "policy" / "training_state.pt", weights_only=True)["step"] == 2


def test_killed_process_fails_the_stage_and_the_rerun_matches(runs, tmp_path, tiny_model_dir):
    one, _ = runs
    root = make_project(tmp_path / "project", tiny_model_dir, 2)
    # Test hook: process 1 SIGKILLs itself right after writing its first chunk's part (as an OOM kill would).
    out = run_stage(root, "rollout", **{FAIL_HOOK_ENV: "1:1"})
    assert out.returncode != 0
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert errors and "process 0 of 2" in errors[0], out.stderr[-3000:]  # the survivor says why it stops
    assert "SIGKILL" in out.stderr  # accelerate launch's report names the dead process's signal
    traj = iteration_dir(root) / "trajectories.zarr"
    assert not traj.exists()  # no partial artifact under the final name
    assert parts_folder(traj).is_dir()  # the parts of the failed run are only in the temp folder

    rerun = run_stage(root, "rollout")
    assert rerun.returncode == 0, rerun.stderr[-3000:]
    assert not parts_folder(traj).exists()
    assert tree_bytes(traj) == tree_bytes(iteration_dir(one) / "trajectories.zarr")


def test_hung_process_fails_the_stage_after_the_timeout(tmp_path, tiny_model_dir):
    """A process that stops answering (not dead): the others fail at the next barrier after launch.timeout_s."""
    root = make_project(tmp_path / "project", tiny_model_dir, 2)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["launch"]["timeout_s"] = 20  # > the load imbalance between the two processes, < the 3600 s stall
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    start = time.monotonic()
    out = run_stage(root, "rollout", **{FAIL_HOOK_ENV: "1:1:stall"})
    assert out.returncode != 0
    assert time.monotonic() - start < 300  # not the 3600 s stall
    errors = [line for line in out.stderr.splitlines() if line.startswith("error: ")]
    assert any("process 0 of 2 lost contact" in e and "rollout of iteration 1" in e for e in errors), errors
    assert not (iteration_dir(root) / "trajectories.zarr").exists()
