"""Render ``dvc.yaml`` from ``params.yaml``: the four stages (plus eval) once per iteration.

DVC's ``foreach`` cannot do arithmetic (iteration i needs iteration i - 1's policy), so the iteration
list is written out here; ``tpgrpo run`` re-renders it before ``dvc repro``, so raising
``train.iterations`` adds stages and DVC runs only the new ones. Each stage lists exactly the params it
reads (a test checks this against the code) and its own code as dependencies.
"""

from __future__ import annotations

import shlex
from pathlib import Path

import yaml

from tpgrpo.config import Config, ConfigError

MODEL_CODE = ["tpgrpo/models", "tpgrpo/trajectory.py", "tpgrpo/sampling.py", "tpgrpo/schedule.py",
              "tpgrpo/pipeline.py", "tpgrpo/policy.py"]
REWARD_CODE = ["tpgrpo/tasks", "tpgrpo/rewards"]
REWARD_PARAMS = ["reward_models", "remote_reward"]  # read by every stage that scores images

# The params each stage reads (DVC re-runs a stage when one of these changes). No stage reads `launch`:
# the process count never changes an artifact (nor the config hash artifacts carry); the CLI reads
# launch.timeout_s and the commands below carry launch.num_processes / launch.config_file.
STAGE_PARAMS = {
    "rollout": ["model", "task.train_prompts", "task.reward", "sampling", "rollout",
                "update.lora_rank", "update.lora_alpha", "train.seed", *REWARD_PARAMS],
    "probe": ["model", "probe", "update.lora_rank", "update.lora_alpha", "train.seed", *REWARD_PARAMS],
    "credit": ["credit"],
    "update": ["model", "update", "train.seed"],
    "eval": ["model", "task", "sampling", "eval", "rollout.batch_size", "update.lora_rank",
             "update.lora_alpha", "train.seed", *REWARD_PARAMS],
    "baseline": ["model", "task", "sampling", "eval", "rollout.batch_size", "update.lora_rank",
                 "update.lora_alpha", *REWARD_PARAMS],
}
# Stages that run on launch.num_processes processes (`accelerate launch`); credit and summary stay single.
MULTI_PROCESS_STAGES = ("rollout", "probe", "update", "eval", "baseline")
HEADER = ("# Generated from params.yaml by `tpgrpo dvc-yaml` (`tpgrpo run` does it before `dvc repro`).\n"
          "# Edit params.yaml, not this file.\n")


def _iter_dir(i: int) -> str:
    return f"data/iters/{i:04d}"


def reward_deps(cfg: Config, *specs) -> list[str]:
    """The reward code and the configured local reward-model folders the given reward specs load."""
    from tpgrpo.tasks.rewards import reward_folders

    folders = [f for spec in specs for f in reward_folders(spec, cfg)]
    return [*REWARD_CODE, *dict.fromkeys(folders)]


def _metric(path: str) -> dict:
    return {path: {"cache": False}}


def stage_command(cfg: Config, name: str, iteration: int | None = None) -> str:
    """The shell command of one stage: ``tpgrpo stage NAME --iter I``, or for a model stage with
    ``launch.num_processes`` > 1 or ``launch.config_file`` set the same under ``accelerate launch``."""
    args = f"stage {name}" + ("" if iteration is None else f" --iter {iteration}")
    launch = cfg.launch
    if name not in MULTI_PROCESS_STAGES or (launch.num_processes == 1 and not launch.config_file):
        return f"tpgrpo {args}"
    if launch.config_file:
        how = f"--config_file {shlex.quote(launch.config_file)}"
    else:  # one machine: torchrun via --multi_gpu (gloo on the CPU), a free port so runs can share a machine
        how = (f"--multi_gpu --num_machines 1 --num_processes {launch.num_processes} --mixed_precision no "
               "--dynamo_backend no --main_process_port 0")
    return f"accelerate launch {how} -m tpgrpo {args}"


def iteration_stages(cfg: Config, i: int) -> dict[str, dict]:
    """The rollout, probe, credit, update and eval stages of iteration ``i``."""
    d, prev = _iter_dir(i), [f"{_iter_dir(i - 1)}/policy"] if i > 0 else []
    cmd = lambda name: stage_command(cfg, name, i)  # noqa: E731
    model = [cfg.model.path]
    return {
        f"rollout-{i:04d}": {
            "cmd": cmd("rollout"), "params": STAGE_PARAMS["rollout"],
            "deps": ["stages/rollout.py", *MODEL_CODE, *reward_deps(cfg, cfg.task.reward), *model,
                     cfg.task.train_prompts, *prev],
            "outs": [f"{d}/trajectories.zarr", f"{d}/prompt_embeds.safetensors"],
            "metrics": [_metric(f"{d}/rollout.json")]},
        f"probe-{i:04d}": {
            "cmd": cmd("probe"), "params": STAGE_PARAMS["probe"],
            "deps": ["stages/probe.py", *MODEL_CODE, *reward_deps(cfg, cfg.task.reward), *model,
                     f"{d}/trajectories.zarr", f"{d}/prompt_embeds.safetensors", *prev],
            "outs": [f"{d}/probe.parquet"], "metrics": [_metric(f"{d}/probe.json")]},
        f"credit-{i:04d}": {
            "cmd": cmd("credit"), "params": STAGE_PARAMS["credit"],
            "deps": ["stages/credit.py", "tpgrpo/credit.py", "tpgrpo/advantages.py", f"{d}/probe.parquet"],
            "outs": [f"{d}/credit.parquet"], "metrics": [_metric(f"{d}/credit.json")]},
        f"update-{i:04d}": {
            "cmd": cmd("update"), "params": STAGE_PARAMS["update"],
            "deps": ["stages/update.py", "tpgrpo/update.py", "tpgrpo/loss.py", *MODEL_CODE, *model,
                     f"{d}/trajectories.zarr", f"{d}/prompt_embeds.safetensors", f"{d}/credit.parquet", *prev],
            "outs": [f"{d}/policy"], "metrics": [_metric(f"{d}/update.json")]},
        f"eval-{i:04d}": {
            "cmd": cmd("eval"), "params": STAGE_PARAMS["eval"],
            "deps": ["stages/eval.py", *MODEL_CODE, *reward_deps(cfg, cfg.task.reward, cfg.task.eval_reward),
                     *model, cfg.task.eval_prompts, f"{d}/policy"],
            "metrics": [_metric(f"{d}/eval.json")]},
    }


def render(cfg: Config) -> dict:
    """The whole ``dvc.yaml`` as a mapping."""
    stages: dict[str, dict] = {
        "baseline": {
            "cmd": stage_command(cfg, "baseline"), "params": STAGE_PARAMS["baseline"],
            "deps": ["stages/eval.py", *MODEL_CODE, *reward_deps(cfg, cfg.task.reward, cfg.task.eval_reward),
                     cfg.model.path, cfg.task.eval_prompts],
            "metrics": [_metric("data/iters/baseline_eval.json")]},
    }
    for i in range(cfg.train.iterations):
        stages.update(iteration_stages(cfg, i))
    per_iter = [f"{_iter_dir(i)}/{name}.json" for i in range(cfg.train.iterations)
                for name in ("rollout", "probe", "credit", "update", "eval")]
    stages["summary"] = {
        "cmd": "tpgrpo stage summary", "deps": ["stages/summary.py", "data/iters/baseline_eval.json", *per_iter],
        "metrics": [_metric("data/metrics/summary.json")],
        "plots": [{"data/metrics/history.csv": {"x": "iteration", "cache": False}}]}
    return {"stages": stages}


class _NoAliasDumper(yaml.SafeDumper):
    """Write repeated lists out in full (no YAML anchors) so dvc.yaml reads plainly."""

    def ignore_aliases(self, data) -> bool:
        return True


def write_dvc_yaml(cfg: Config, root: Path) -> bool:
    """Write ``dvc.yaml`` if its content changed; returns whether it did."""
    config_file = cfg.launch.config_file
    if config_file and not (root / config_file).is_file():
        raise ConfigError(f"params: launch.config_file = {config_file!r}: file not found "
                          "(expected an accelerate config file, path relative to the project root)")
    text = HEADER + yaml.dump(render(cfg), Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False, width=120)
    path = root / "dvc.yaml"
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_name(".dvc.yaml.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True
