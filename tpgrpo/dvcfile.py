"""Render ``dvc.yaml`` from ``params.yaml``: the four stages (plus eval) once per iteration.

DVC's ``foreach`` cannot do arithmetic (iteration i needs iteration i - 1's policy), so the iteration
list is written out here; ``tpgrpo run`` re-renders it before ``dvc repro``, so raising
``train.iterations`` adds stages and DVC runs only the new ones. Each stage lists exactly the params it
reads (a test checks this against the code) and its own code as dependencies.
"""

from __future__ import annotations

from pathlib import Path

import yaml

from tpgrpo.config import Config

MODEL_CODE = ["tpgrpo/models", "tpgrpo/trajectory.py", "tpgrpo/sampling.py", "tpgrpo/schedule.py",
              "tpgrpo/pipeline.py", "tpgrpo/policy.py"]
REWARD_CODE = ["tpgrpo/tasks"]

# The params each stage reads (DVC re-runs a stage when one of these changes).
STAGE_PARAMS = {
    "rollout": ["model", "task.train_prompts", "task.reward", "sampling", "rollout",
                "update.lora_rank", "update.lora_alpha", "train.seed"],
    "probe": ["model", "probe", "update.lora_rank", "update.lora_alpha", "train.seed"],
    "credit": ["credit"],
    "update": ["model", "update", "train.seed"],
    "eval": ["model", "task", "sampling", "eval", "rollout.batch_size", "update.lora_rank",
             "update.lora_alpha", "train.seed"],
    "baseline": ["model", "task", "sampling", "eval", "rollout.batch_size", "update.lora_rank",
                 "update.lora_alpha"],
}
HEADER = ("# Generated from params.yaml by `tpgrpo dvc-yaml` (`tpgrpo run` does it before `dvc repro`).\n"
          "# Edit params.yaml, not this file.\n")


def _iter_dir(i: int) -> str:
    return f"data/iters/{i:04d}"


def _metric(path: str) -> dict:
    return {path: {"cache": False}}


def iteration_stages(cfg: Config, i: int) -> dict[str, dict]:
    """The rollout, probe, credit, update and eval stages of iteration ``i``."""
    d, prev = _iter_dir(i), [f"{_iter_dir(i - 1)}/policy"] if i > 0 else []
    cmd = lambda name: f"tpgrpo stage {name} --iter {i}"  # noqa: E731
    model = [cfg.model.path]
    return {
        f"rollout-{i:04d}": {
            "cmd": cmd("rollout"), "params": STAGE_PARAMS["rollout"],
            "deps": ["stages/rollout.py", *MODEL_CODE, *REWARD_CODE, *model, cfg.task.train_prompts, *prev],
            "outs": [f"{d}/trajectories.zarr"], "metrics": [_metric(f"{d}/rollout.json")]},
        f"probe-{i:04d}": {
            "cmd": cmd("probe"), "params": STAGE_PARAMS["probe"],
            "deps": ["stages/probe.py", *MODEL_CODE, *REWARD_CODE, *model, f"{d}/trajectories.zarr", *prev],
            "outs": [f"{d}/probe.parquet"], "metrics": [_metric(f"{d}/probe.json")]},
        f"credit-{i:04d}": {
            "cmd": cmd("credit"), "params": STAGE_PARAMS["credit"],
            "deps": ["stages/credit.py", "tpgrpo/credit.py", "tpgrpo/advantages.py", f"{d}/probe.parquet"],
            "outs": [f"{d}/credit.parquet"], "metrics": [_metric(f"{d}/credit.json")]},
        f"update-{i:04d}": {
            "cmd": cmd("update"), "params": STAGE_PARAMS["update"],
            "deps": ["stages/update.py", "tpgrpo/update.py", "tpgrpo/loss.py", *MODEL_CODE, *model,
                     f"{d}/trajectories.zarr", f"{d}/credit.parquet", *prev],
            "outs": [f"{d}/policy"], "metrics": [_metric(f"{d}/update.json")]},
        f"eval-{i:04d}": {
            "cmd": cmd("eval"), "params": STAGE_PARAMS["eval"],
            "deps": ["stages/eval.py", *MODEL_CODE, *REWARD_CODE, *model, cfg.task.eval_prompts, f"{d}/policy"],
            "metrics": [_metric(f"{d}/eval.json")]},
    }


def render(cfg: Config) -> dict:
    """The whole ``dvc.yaml`` as a mapping."""
    stages: dict[str, dict] = {
        "baseline": {
            "cmd": "tpgrpo stage baseline", "params": STAGE_PARAMS["baseline"],
            "deps": ["stages/eval.py", *MODEL_CODE, *REWARD_CODE, cfg.model.path, cfg.task.eval_prompts],
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
    text = HEADER + yaml.dump(render(cfg), Dumper=_NoAliasDumper, sort_keys=False, default_flow_style=False, width=120)
    path = root / "dvc.yaml"
    if path.exists() and path.read_text() == text:
        return False
    tmp = path.with_name(".dvc.yaml.tmp")
    tmp.write_text(text)
    tmp.replace(path)
    return True
