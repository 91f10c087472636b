"""How a model stage starts its processes: the ``launch`` params, read when the stage starts, not dvc.yaml.

dvc.yaml runs ``tpgrpo stage rollout --iter 3`` whatever the process count or launcher. That command, when
the ``launch`` params ask for more than one process and it is not itself one of them, replaces itself
(``exec``) by the launcher, which starts the stage's processes, each running the same command:

- one process (``accelerate`` or ``torchrun`` with ``launch.num_processes`` 1): the stage runs right here;
- ``accelerate``: ``accelerate launch --multi_gpu --num_processes N --gpu_ids all`` on this machine, with a config
  file of ours so that the user's default accelerate config is never read (``own_accelerate_config``), or
  ``accelerate launch --config_file FILE`` (DeepSpeed, a hand-started multi-node run);
- ``torchrun``: ``torchrun --standalone --nproc-per-node N`` on this machine (c10d rendezvous on localhost);
- ``slurm``: ``srun --nodes M --ntasks-per-node 1 torchrun --nnodes M --nproc-per-node N --rdzv-backend c10d
  --rdzv-endpoint HOST:PORT``: one torchrun agent per node of the allocation ``tpgrpo run`` runs in, which
  start N processes each; HOST is this machine (the first node, where an sbatch script and DVC run), PORT a
  free port of it. Node count and GPUs per node come from SLURM's environment.

Why ``exec`` and not a child: the launcher then gets DVC's signals (a Ctrl-C, a kill) directly, and the
stage's exit status is the launcher's. Why outside dvc.yaml: the process count changes no artifact, so it
must change no stage either (a new command would make DVC re-run every finished stage).
"""

from __future__ import annotations

import os
import shutil
import socket
import sys
import tempfile
from importlib.util import find_spec
from pathlib import Path
from typing import Mapping

import yaml

from tpgrpo.config import Config, ConfigError, LaunchConfig
from tpgrpo.errors import PipelineError

LAUNCHED_ENV = "TPGRPO_LAUNCHED"  # set for the launched processes: they run the stage, never launch again
# What ``accelerate launch`` reads instead of the user's default config when launch.config_file is "": one machine,
# every GPU (CUDA_VISIBLE_DEVICES still applies), no mixed precision (the stages choose their dtypes themselves).
OWN_ACCELERATE_CONFIG = {"compute_environment": "LOCAL_MACHINE", "distributed_type": "MULTI_GPU", "num_machines": 1,
                         "machine_rank": 0, "gpu_ids": "all", "mixed_precision": "no", "use_cpu": False,
                         "debug": False}
OWN_CONFIG_PATH = Path(".dvc") / "tmp" / "tpgrpo_accelerate.yaml"


def launched(env: Mapping[str, str]) -> bool:
    """Whether this process is one a launcher started (ours, or a hand-run ``accelerate launch`` / ``torchrun``
    of ``-m tpgrpo stage ...``, which sets ``WORLD_SIZE``)."""
    return LAUNCHED_ENV in env or "WORLD_SIZE" in env


def single(launch: LaunchConfig) -> bool:
    """Whether a stage runs in one process, with no launcher (the stage server can serve it)."""
    return launch.launcher != "slurm" and launch.num_processes == 1 and not launch.config_file


def launch_argv(cfg: Config, root: Path, args: list[str], env: Mapping[str, str] = os.environ) -> list[str] | None:
    """The command that starts a model stage's processes, each running ``python -m tpgrpo ARGS``; None: run the
    stage in this process. Raises ``ConfigError`` / ``PipelineError`` (one line) when the launcher is missing
    or the SLURM allocation does not fit the params."""
    launch = cfg.launch
    if launched(env) or single(launch):
        return None
    stage = ["-m", "tpgrpo", *args]
    if launch.launcher == "accelerate":
        return [*_module("accelerate", "accelerate.commands.launch"), *_accelerate_how(launch, root), *stage]
    if launch.launcher == "torchrun":
        return [*_torchrun(), "--standalone", "--nnodes", "1", "--nproc-per-node", str(launch.num_processes),
                *_rendezvous_conf(launch), *stage]
    nodes, per_node = slurm_shape(launch, cfg.model.device, env)
    if shutil.which("srun", path=env.get("PATH")) is None:
        raise PipelineError("launch.launcher = slurm: `srun` not found on PATH (expected SLURM's srun on the node "
                            "`tpgrpo run` runs on)")
    port = free_port()
    srun = ["srun", f"--nodes={nodes}", f"--ntasks={nodes}", "--ntasks-per-node=1", "--kill-on-bad-exit=1",
            "--export=ALL"]
    return [*srun, *_torchrun(), "--nnodes", str(nodes), "--nproc-per-node", str(per_node),
            "--rdzv-backend", "c10d", "--rdzv-endpoint", f"{socket.gethostname()}:{port}",
            "--rdzv-id", f"{env['SLURM_JOB_ID']}-{port}", *_rendezvous_conf(launch), *stage]


def _accelerate_how(launch: LaunchConfig, root: Path) -> list[str]:
    if launch.config_file:
        if not (root / launch.config_file).is_file():
            raise ConfigError(f"params: launch.config_file = {launch.config_file!r}: file not found "
                              "(expected an accelerate config file, path relative to the project root)")
        return ["--config_file", str(root / launch.config_file)]
    # one machine: torchrun under accelerate (gloo on the CPU), a free port so runs can share a machine
    return ["--config_file", str(own_accelerate_config(root)), "--multi_gpu", "--num_machines", "1",
            "--num_processes", str(launch.num_processes), "--gpu_ids", "all", "--mixed_precision", "no",
            "--dynamo_backend", "no", "--main_process_port", "0"]


def own_accelerate_config(root: Path) -> Path:
    """The file ``--config_file`` names in a one-machine accelerate launch: ``OWN_ACCELERATE_CONFIG``.

    Why: without ``--config_file``, ``accelerate launch`` reads the user's default config
    (``$HF_HOME/accelerate/default_config.yaml``) for every setting the command line leaves out (gpu_ids,
    machine_rank, main_process_ip, rdzv_backend, debug, ...) and stops with a traceback on one it cannot
    parse: ``gpu_ids: '0'`` there failed every multi-process stage, ``gpu_ids: '0,1'`` would hide six GPUs of
    eight. Given a file, accelerate never opens the default. The content is constant, so one file serves every
    stage: ``.dvc/tmp/tpgrpo_accelerate.yaml`` in a DVC project (every stage DVC runs); outside one (a
    stage run by hand) a new temp file, as nothing of ours may create a ``.dvc`` folder there.
    """
    text = yaml.safe_dump(OWN_ACCELERATE_CONFIG, sort_keys=True)
    if not (root / ".dvc").is_dir():
        fd, name = tempfile.mkstemp(prefix="tpgrpo-accelerate-", suffix=".yaml")
        with os.fdopen(fd, "w") as f:
            f.write(text)
        return Path(name)
    path = root / OWN_CONFIG_PATH
    if not path.is_file() or path.read_text() != text:
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")  # renamed: a concurrent stage never reads half
        tmp.write_text(text)
        tmp.replace(path)
    return path


def _torchrun() -> list[str]:
    return _module("torch", "torch.distributed.run")


def _rendezvous_conf(launch: LaunchConfig) -> list[str]:
    """How long torchrun's agents wait for each other to join (the nodes start at slightly different times)."""
    return ["--rdzv-conf", f"join_timeout={int(launch.timeout_s)}"]


def _module(package: str, module: str) -> list[str]:
    """``python -m MODULE`` with this interpreter (the same on every node of a shared installation)."""
    if find_spec(package) is None:
        raise PipelineError(f"launch.launcher needs {package}, which is not installed in {sys.executable}")
    return [sys.executable, "-m", module]


def slurm_shape(launch: LaunchConfig, device: str, env: Mapping[str, str]) -> tuple[int, int]:
    """``(nodes, processes per node)`` of a stage under SLURM, from the allocation (``SLURM_NNODES``,
    ``SLURM_GPUS_ON_NODE``) and the params; a one-line ``PipelineError`` when they do not fit."""
    if "SLURM_JOB_ID" not in env:
        raise PipelineError("launch.launcher = slurm but SLURM_JOB_ID is not set: run `tpgrpo run` inside a SLURM "
                            "allocation (an sbatch script: docs/cluster.md)")
    have = _env_int(env, "SLURM_NNODES") or _env_int(env, "SLURM_JOB_NUM_NODES") or 1
    nodes = launch.num_nodes or have
    if nodes > have:
        raise PipelineError(f"launch.num_nodes = {nodes} but the SLURM allocation has {have} node(s) (SLURM_NNODES): "
                            "expected at most that (0 = all of them)")
    gpus = _env_int(env, "SLURM_GPUS_ON_NODE")
    per_node = launch.num_processes or gpus
    if not per_node:
        raise PipelineError("launch.num_processes = 0 takes SLURM's GPUs per node, but SLURM_GPUS_ON_NODE is not "
                            "set (no --gpus-per-node in the allocation): set launch.num_processes")
    if device.startswith("cuda") and gpus and per_node > gpus:
        raise PipelineError(f"launch.num_processes = {per_node} but the SLURM allocation has {gpus} GPU(s) per node "
                            "(SLURM_GPUS_ON_NODE): expected at most that, one process per GPU")
    return nodes, per_node


def _env_int(env: Mapping[str, str], name: str) -> int:
    """An integer SLURM variable, 0 when unset; ``SLURM_GPUS_ON_NODE`` may read ``h100:8`` on some sites."""
    value = env.get(name, "").strip().rsplit(":", 1)[-1]
    if not value:
        return 0
    if not value.isdigit():
        raise PipelineError(f"{name} = {env[name]!r}: expected a whole number (SLURM's environment)")
    return int(value)


def free_port() -> int:
    """A TCP port free on this machine now (the rendezvous binds it a moment later)."""
    with socket.socket() as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def exec_launcher(argv: list[str]) -> None:
    """Replace this process by the launcher; its processes inherit the environment plus ``LAUNCHED_ENV``."""
    sys.stdout.flush()
    sys.stderr.flush()
    os.execvpe(argv[0], argv, {**os.environ, LAUNCHED_ENV: "1"})
