"""Shared fixtures: a tiny saved model and a tiny project folder (params, prompts, model, code)."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest
import yaml

REPO = Path(__file__).resolve().parents[1]
os.environ.setdefault("DVC_NO_ANALYTICS", "1")
os.environ.setdefault("DVC_STUDIO_OFFLINE", "true")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs two workers on two cores: one torch thread each, as the processes they start
    # (a worker with torch's default of one thread per core would oversubscribe the machine 2x).
    if not os.environ.get("OMP_NUM_THREADS"):  # unset or empty (libgomp rejects an empty value)
        os.environ["OMP_NUM_THREADS"] = "1"

# A small but real configuration: 32x32 images (the detector's scale), 1 transformer block.
TINY_PARAMS_OVERRIDES = {
    "model": {"path": "data/base"},
    "task": {"reward": "jpeg_compressibility", "eval_reward": "geneval"},
    # the sampler, credit and objective the tests were written for (TP-GRPO: guided SDE chains, tp credit, the
    # grpo update), whatever params.yaml's default run uses: a test that wants another says so
    "sampling": {"num_steps": 4, "window_size": 3, "guidance_scale": 4.5},
    "rollout": {"prompts_per_iter": 3, "group_size": 4, "batch_size": 8},
    "probe": {"batch_size": 8},
    "credit": {"mode": "tp"},
    # pinned to the chain and the tree shape the tests were written for: a test that wants a tree says so
    "tree": {"enabled": False, "split_steps": "0,3,6", "children": 1},
    "update": {"lora_rank": 4, "lora_alpha": 8, "micro_batch": 8, "optimizer_steps_per_iter": 2, "epochs": 1,
               "lr": 1.0e-2, "clip_range": 0.2, "min_transitions_per_step": 1, "objective": "grpo"},
    "eval": {"every": 1, "num_steps": 4, "num_prompts": 2, "samples_per_prompt": 2, "seed": 0, "guidance_scale": 4.5},
    "train": {"iterations": 2},
}


@pytest.fixture(autouse=True)
def no_process_group_left_behind():
    """After each test, forget the process-global ``Dist`` (tpgrpo.distributed): a stage's ``run`` called
    directly sets it (``current()`` -> ``init()``) and only the stage runner tears it down, so a later test in
    the same worker process saw it instead of ``RANK``; which tests share a worker depends on timing (xdist,
    loadfile), so such a test failed at random under load."""
    import sys

    yield
    distributed = sys.modules.get("tpgrpo.distributed")
    if distributed is not None and distributed._CURRENT is not None and distributed._CURRENT.world == 1:
        distributed._CURRENT = None  # a world-1 Dist holds no process group: nothing to tear down


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory) -> Path:
    """A freshly initialised tiny model saved in the diffusers layout (built once per session)."""
    from tpgrpo.models.tiny import TinyConfig, build_tiny

    config = TinyConfig(image_size=32, patch_size=8, num_layers=1, num_heads=2, head_dim=16, text_layers=1,
                        text_hidden=32, text_heads=2, text_intermediate=64)
    folder = tmp_path_factory.mktemp("model") / "base"
    build_tiny(config, seed=0).save_pretrained(folder)
    return folder


@pytest.fixture(scope="session")
def sd3_model_dir(tmp_path_factory) -> Path:
    """A tiny random stock StableDiffusion3Pipeline saved with save_pretrained (tests/tiny_pipelines.py)."""
    from tiny_pipelines import build_sd3_pipeline, save_pipeline

    return save_pipeline(build_sd3_pipeline(seed=0), tmp_path_factory.mktemp("sd3") / "base")


@pytest.fixture(scope="session")
def flux_model_dir(tmp_path_factory) -> Path:
    """A tiny random stock FluxPipeline saved with save_pretrained (tests/tiny_pipelines.py)."""
    from tiny_pipelines import build_flux_pipeline, save_pipeline

    return save_pipeline(build_flux_pipeline(seed=0), tmp_path_factory.mktemp("flux") / "base")


def tiny_params(**sections) -> dict:
    """The repo's params.yaml with the tiny overrides (and any given sections merged in)."""
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for overrides in (TINY_PARAMS_OVERRIDES, sections):
        for section, values in overrides.items():
            raw[section].update(values)
    return raw


def make_tiny_project(root: Path, model_dir: Path) -> Path:
    """A project root: params.yaml, data/prompts, data/base, and the code dvc.yaml lists as deps."""
    (root / "data").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "prompts", root / "data" / "prompts")
    shutil.copytree(model_dir, root / "data" / "base")
    for code in ("stages", "tpgrpo"):
        shutil.copytree(REPO / code, root / code, ignore=shutil.ignore_patterns("__pycache__"))
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    return root


@pytest.fixture
def tiny_project(tmp_path, tiny_model_dir) -> Path:
    return make_tiny_project(tmp_path / "project", tiny_model_dir)
