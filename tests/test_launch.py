"""How a model stage starts its processes (tpgrpo.pipeline.execution.launch): the launcher commands, the one-line errors
for a missing launcher or an allocation that does not fit, and that nothing of it reaches dvc.yaml (fast).

The launched runs themselves (torchrun, srun over simulated nodes) are in test_cluster.py (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, tiny_params
from fake_srun import install

from tpgrpo.config import ConfigError, config_from_dict
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.execution import stage_server
from tpgrpo.pipeline.rendering.code_manifest import RENDER_PARAMS, kind_code
from tpgrpo.pipeline.rendering.dvcfile import MULTI_PROCESS_STAGES, STAGE_PARAMS
from tpgrpo.pipeline.execution.launch import LAUNCHED_ENV, OWN_CONFIG_PATH, launch_argv, slurm_shape

ARGS = ["stage", "rollout", "--iter", "3", "--params", "params.yaml"]
ALLOCATION = {"SLURM_JOB_ID": "77", "SLURM_NNODES": "2", "SLURM_JOB_NODELIST": "localhost"}


def cfg_with(**launch):
    raw = tiny_params()
    raw["launch"].update(launch)
    return config_from_dict(raw)


def test_one_process_and_launched_processes_run_the_stage_here(tmp_path):
    assert launch_argv(cfg_with(), tmp_path, ARGS, {}) is None  # the default: no launcher at all
    assert launch_argv(cfg_with(launcher="torchrun", num_processes=1), tmp_path, ARGS, {}) is None
    for env in ({LAUNCHED_ENV: "1"}, {"WORLD_SIZE": "2"}):  # ours, or a hand-run accelerate launch / torchrun
        assert launch_argv(cfg_with(num_processes=4), tmp_path, ARGS, env) is None
        assert launch_argv(cfg_with(launcher="slurm"), tmp_path, ARGS, env) is None


def test_accelerate_and_torchrun_commands(tmp_path):
    (tmp_path / ".dvc").mkdir()  # our accelerate config then goes under .dvc/tmp, not the system temp folder
    argv = launch_argv(cfg_with(num_processes=4), tmp_path, ARGS, {})
    assert argv[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert argv[argv.index("--num_processes") + 1] == "4" and argv[-8:] == ["-m", "tpgrpo", *ARGS]
    (tmp_path / "two nodes.yaml").write_text("num_machines: 2\n")
    argv = launch_argv(cfg_with(config_file="two nodes.yaml"), tmp_path, ARGS, {})
    assert argv[argv.index("--config_file") + 1] == str(tmp_path / "two nodes.yaml") and "--num_processes" not in argv
    with pytest.raises(ConfigError, match="launch.config_file = 'gone.yaml': file not found"):
        launch_argv(cfg_with(config_file="gone.yaml"), tmp_path, ARGS, {})

    argv = launch_argv(cfg_with(launcher="torchrun", num_processes=3), tmp_path, ARGS, {})
    assert argv[:3] == [sys.executable, "-m", "torch.distributed.run"] and "--standalone" in argv
    assert argv[argv.index("--nproc-per-node") + 1] == "3" and argv[-8:] == ["-m", "tpgrpo", *ARGS]


def test_slurm_command_spans_the_allocation(tmp_path):
    bin_dir = install(tmp_path / "bin")
    env = {**ALLOCATION, "PATH": str(bin_dir)}
    argv = launch_argv(cfg_with(launcher="slurm"), tmp_path, ARGS, env)
    assert argv[0] == "srun" and "--nodes=2" in argv and "--ntasks-per-node=1" in argv
    run = argv.index(sys.executable)
    assert argv[run:run + 3] == [sys.executable, "-m", "torch.distributed.run"]
    assert argv[argv.index("--nnodes") + 1] == "2" and argv[argv.index("--nproc-per-node") + 1] == "1"
    assert argv[argv.index("--rdzv-backend") + 1] == "c10d" and argv[argv.index("--rdzv-id") + 1].startswith("77-")
    host, port = argv[argv.index("--rdzv-endpoint") + 1].rsplit(":", 1)
    assert host and int(port) > 0 and argv[-8:] == ["-m", "tpgrpo", *ARGS]
    one_node = launch_argv(cfg_with(launcher="slurm", num_nodes=1), tmp_path, ARGS, env)
    assert "--nodes=1" in one_node and one_node[one_node.index("--nnodes") + 1] == "1"


# Default accelerate configs a user may have (`accelerate config` on another machine): gpu_ids '0' failed every
# multi-process stage; '0,1' hides GPUs (and turns debug mode on); a value accelerate cannot parse stops it.
HOSTILE = {
    "one gpu": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "gpu_ids": "0",
                "num_processes": 7, "num_machines": 1, "mixed_precision": "fp16"},
    "two gpus": {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "gpu_ids": "0,1",
                 "num_processes": 7, "num_machines": 1, "mixed_precision": "fp16", "debug": True,
                 "main_training_function": "nope"},
    "unparsable": {"distributed_type": "NOT_A_TYPE", "gpu_ids": "0"},
}
# Run in every launched process (Python imports sitecustomize from PYTHONPATH): what the launcher gave it.
SPY = """import json, os
if "LOCAL_RANK" in os.environ:
    keys = ("CUDA_VISIBLE_DEVICES", "ACCELERATE_MIXED_PRECISION", "ACCELERATE_DEBUG_MODE", "WORLD_SIZE")
    with open(os.path.join(os.environ["SPY_DIR"], os.environ["LOCAL_RANK"] + ".json"), "w") as f:
        json.dump({k: os.environ.get(k) for k in keys}, f)
"""


@pytest.mark.parametrize("hostile", sorted(HOSTILE))
def test_the_users_default_accelerate_config_changes_nothing(tmp_path, hostile):
    """A real 2-process CPU launch through our argv (each process runs `python -m tpgrpo --help`), with a
    hostile default config in HF_HOME: both processes run, on every GPU, without mixed precision or debug."""
    hf_home, spy = tmp_path / "hf", tmp_path / "spy"
    (hf_home / "accelerate").mkdir(parents=True)
    (hf_home / "accelerate" / "default_config.yaml").write_text(yaml.safe_dump(HOSTILE[hostile]))
    spy.mkdir()
    (spy / "sitecustomize.py").write_text(SPY)
    (tmp_path / ".dvc").mkdir()  # a DVC project: our config is written under .dvc/tmp
    argv = launch_argv(cfg_with(num_processes=2), tmp_path, ["--help"], {})
    assert argv[argv.index("--gpu_ids") + 1] == "all"
    assert argv[argv.index("--config_file") + 1] == str(tmp_path / OWN_CONFIG_PATH)
    env = {k: v for k, v in os.environ.items() if k not in ("WORLD_SIZE", LAUNCHED_ENV, "CUDA_VISIBLE_DEVICES")}
    env.update(HF_HOME=str(hf_home), PYTHONPATH=str(spy), SPY_DIR=str(spy), OMP_NUM_THREADS="1")
    out = subprocess.run(argv, cwd=tmp_path, env=env, capture_output=True, text=True, timeout=300)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.count("Usage:") == 2  # two processes, not the config's 7
    seen = [json.loads((spy / f"{rank}.json").read_text()) for rank in (0, 1)]
    assert seen == [{"CUDA_VISIBLE_DEVICES": None, "ACCELERATE_MIXED_PRECISION": "no",
                     "ACCELERATE_DEBUG_MODE": None, "WORLD_SIZE": "2"}] * 2


def test_our_accelerate_config_is_one_file_per_project(tmp_path):
    """Every stage of a DVC project names the same file; accelerate reads it as one machine, every GPU."""
    from accelerate.commands.config.config_args import load_config_from_file

    (tmp_path / ".dvc").mkdir()
    first = launch_argv(cfg_with(num_processes=2), tmp_path, ARGS, {})
    again = launch_argv(cfg_with(num_processes=8), tmp_path, ARGS, {})
    path = first[first.index("--config_file") + 1]
    assert again[again.index("--config_file") + 1] == path and list((tmp_path / ".dvc" / "tmp").iterdir()) == \
        [tmp_path / OWN_CONFIG_PATH]
    config = load_config_from_file(path)
    assert (config.gpu_ids, config.num_machines, config.mixed_precision, config.distributed_type.value) == \
        ("all", 1, "no", "MULTI_GPU")
    plain = tmp_path / "not a dvc project"  # a stage run by hand: a temp file, no .dvc folder made there
    plain.mkdir()
    argv = launch_argv(cfg_with(num_processes=2), plain, ARGS, {})
    elsewhere = Path(argv[argv.index("--config_file") + 1])
    assert not (plain / ".dvc").exists() and elsewhere.read_text() == Path(path).read_text()
    elsewhere.unlink()


@pytest.mark.parametrize("launch, env, expected", [
    ({}, {}, "launch.launcher = slurm but SLURM_JOB_ID is not set"),
    ({"num_nodes": 3}, ALLOCATION, "launch.num_nodes = 3 but the SLURM allocation has 2 node(s)"),
    ({"num_processes": 0}, ALLOCATION, "launch.num_processes = 0 takes SLURM's GPUs per node, but SLURM_GPUS_ON_NODE"),
    ({"num_processes": 8}, {**ALLOCATION, "SLURM_GPUS_ON_NODE": "4"},
     "launch.num_processes = 8 but the SLURM allocation has 4 GPU(s) per node"),
    ({}, {**ALLOCATION, "SLURM_NNODES": "two"}, "SLURM_NNODES = 'two': expected a whole number"),
])
def test_an_allocation_that_does_not_fit_is_one_line(launch, env, expected):
    launch = cfg_with(launcher="slurm", **launch).launch
    with pytest.raises(PipelineError) as info:
        slurm_shape(launch, "cuda", env)
    assert expected in str(info.value) and "\n" not in str(info.value)


def test_gpus_per_node_come_from_slurm():
    launch = cfg_with(launcher="slurm", num_processes=0).launch
    assert slurm_shape(launch, "cuda", {**ALLOCATION, "SLURM_GPUS_ON_NODE": "8"}) == (2, 8)
    assert slurm_shape(launch, "cuda", {**ALLOCATION, "SLURM_GPUS_ON_NODE": "h100:4"}) == (2, 4)
    assert slurm_shape(cfg_with(launcher="slurm").launch, "cpu", ALLOCATION) == (2, 1)


def test_missing_srun_is_one_line(tmp_path):
    with pytest.raises(PipelineError, match="launch.launcher = slurm: `srun` not found on PATH"):
        launch_argv(cfg_with(launcher="slurm"), tmp_path, ARGS, {**ALLOCATION, "PATH": str(tmp_path)})


def test_stage_command_refuses_a_missing_allocation_before_any_work(tiny_project):
    """`tpgrpo stage` itself, as DVC runs it: one line, exit 2, nothing written."""
    raw = yaml.safe_load((tiny_project / "params.yaml").read_text())
    raw["launch"]["launcher"] = "slurm"
    (tiny_project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    out = subprocess.run([sys.executable, "-m", "tpgrpo", "stage", "rollout", "--iter", "1"], cwd=tiny_project,
                         env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2
    assert out.stderr.strip().splitlines()[-1].startswith("error: launch.launcher = slurm but SLURM_JOB_ID")
    assert not (tiny_project / "data" / "iters" / "0001").exists() or \
        not any((tiny_project / "data" / "iters" / "0001").iterdir())


def test_launch_is_no_stage_param_and_not_rendered():
    assert not any(p == "launch" or p.startswith("launch.") for p in RENDER_PARAMS)
    assert not any(p.startswith("launch") for params in STAGE_PARAMS.values() for p in params)


def test_the_stage_server_serves_single_process_stages_only():
    assert stage_server.wanted(cfg_with()) == sys.platform.startswith("linux")
    assert not stage_server.wanted(cfg_with(launcher="torchrun", num_processes=2))
    assert not stage_server.wanted(cfg_with(launcher="slurm"))  # a stage that starts its processes: no fork


def test_the_launcher_code_is_in_no_stage_manifest_but_the_process_code_is():
    """How many processes run a stage is orchestration (the artifacts do not depend on it: test_distributed);
    how the work is split over them is stage code."""
    kinds = {"baseline": "eval"}
    for stage in MULTI_PROCESS_STAGES:
        code = kind_code(REPO, kinds.get(stage, stage))
        assert "tpgrpo/pipeline/execution/launch.py" not in code and "tpgrpo/distributed.py" in code, stage


def test_bad_launcher_values_are_one_line():
    raw = tiny_params()
    raw["launch"].update(launcher="torchrun", config_file="a.yaml")
    with pytest.raises(ConfigError, match="expected launch.launcher accelerate"):
        config_from_dict(raw)


def test_a_missing_launcher_package_is_one_line():
    from tpgrpo.pipeline.execution.launch import _module

    with pytest.raises(PipelineError, match="launch.launcher needs no_such_launcher, which is not installed"):
        _module("no_such_launcher", "no_such_launcher.run")


def test_the_main_process_waits_for_a_part_another_node_renames_late(tmp_path):
    """A shared filesystem's client may see another node's renamed part a moment after the barrier."""
    import threading
    import time

    from tpgrpo.distributed import _wait_for

    late = tmp_path / "chunk-00001.npz"
    threading.Timer(0.3, late.write_bytes, args=(b"part",)).start()
    start = time.monotonic()
    _wait_for([late], timeout_s=30)
    assert late.is_file() and time.monotonic() - start < 10  # returned once it appeared, not at the timeout
    start = time.monotonic()
    _wait_for([tmp_path / "never"], timeout_s=1.0)  # a part that never comes: merge_parts then names it
    assert 0.9 <= time.monotonic() - start < 5
