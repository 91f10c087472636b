"""What the stages share: prompts of an iteration, the policy of an iteration, provenance of artifacts.

Stages (``stages/*.py``) stay thin: they read inputs, call these helpers and the maths, and read and write
artifacts with :mod:`tpgrpo.io.artifacts` (checked against :mod:`tpgrpo.io.schemas`).
"""

from __future__ import annotations

import json
import platform
import time
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

import numpy as np

from tpgrpo import __version__
from tpgrpo.io.artifacts import IterationPaths, read_embeddings, require, write_embeddings
from tpgrpo.config import Config
from tpgrpo.errors import PipelineError
from tpgrpo.io.schemas import EMBEDDING_FIELDS
from tpgrpo.algo.seeds import sample_seed


def resolve(root: Path, path: str) -> Path:
    """A params path relative to the project root (absolute paths pass through)."""
    p = Path(path)
    return p if p.is_absolute() else root / p


def select_prompts(cfg: Config, root: Path, iteration: int) -> list[dict]:
    """The ``rollout.prompts_per_iter`` training prompts of an iteration, drawn by a stable seed."""
    from tpgrpo.tasks.prompts import load_prompts

    metas = load_prompts(require(resolve(root, cfg.task.train_prompts), "task.train_prompts"))
    n = cfg.rollout.prompts_per_iter
    if n > len(metas):
        raise PipelineError(f"rollout.prompts_per_iter = {n} but {cfg.task.train_prompts} has {len(metas)}")
    rng = np.random.default_rng(sample_seed(cfg.train.seed, iteration, "prompt-choice", 0))
    return [metas[i] for i in sorted(rng.choice(len(metas), size=n, replace=False))]


def sampler_spec(cfg: Config):
    """The rollout's :class:`SamplerSpec` from the ``sampling`` params."""
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import SamplerSpec

    s = cfg.sampling
    return SamplerSpec(
        sigmas=flow_sigmas(s.num_steps, s.shift), window_start=s.window_start, window_size=s.window_size,
        step_kind=s.step_kind, noise_level=s.noise_level, guidance_scale=s.guidance_scale)


def sampling_from_attrs(attrs: dict):
    """The :class:`SamplingConfig` a trajectory store was sampled with (from its attributes).

    The update must recompute log-probs with exactly the rollout's sampler, whatever params.yaml says now.
    """
    from tpgrpo.config import SamplingConfig

    return SamplingConfig(**{key: attrs[key] for key in (
        "num_steps", "shift", "guidance_scale", "step_kind", "noise_level", "window_start", "window_size")})


def load_policy(cfg: Config, root: Path, iteration: int, trainable: bool = False):
    """The backend with the LoRA policy that iteration ``iteration`` samples from: policy ``iteration - 1``.

    Iterations are numbered 1..N. Iteration 1 samples from policy 0, the base model (a fresh LoRA is zero
    at init, so attaching it changes nothing); iteration i > 1 loads policy i - 1, the adapter that
    iteration i - 1's update wrote. (The eval of iteration i scores policy i: ``iteration = i + 1``.)
    """
    import torch

    from tpgrpo.pipeline.distributed import current, local_device
    from tpgrpo.models import load_backend
    from tpgrpo.policy.lora import attach_lora

    device = local_device(cfg.model.device, current())  # one GPU per process when launched
    backend = load_backend(cfg.model.kind, resolve(root, cfg.model.path), device, cfg.model.dtype,
                           resolution=cfg.model.resolution)
    previous = IterationPaths(root, iteration).previous()
    adapter = None
    if previous is not None:
        adapter = require(previous.policy, f"policy of iteration {iteration - 1}: run its update first")
    if adapter is not None or trainable:
        # LoRA A is drawn at random: seed it so an interrupted run re-creates the same start.
        torch.manual_seed(sample_seed(cfg.train.seed, 0, "lora-init", 0))
        attach_lora(backend, cfg.update.lora_rank, cfg.update.lora_alpha, adapter_dir=adapter)
    if trainable and cfg.update.gradient_checkpointing:
        # The same gradients, less activation memory: diffusers re-runs each block in the backward pass.
        backend.transformer.enable_gradient_checkpointing()
    return backend


def policy_to_score(cfg: Config, root: Path, iteration: int) -> tuple[object, str]:
    """The backend with the weights policy ``iteration`` is scored with, and their name (eval, figures).

    With ``update.ema`` the EMA of the LoRA weights (``policy/ema``, spec section 7) replaces the raw
    adapter, as ``tpgrpo export`` hands out; a policy without it is a one-line error. Policy 0 is the base
    model (``"base"``).
    """
    from tpgrpo.policy.export import EMA_FOLDER
    from tpgrpo.policy.lora import WEIGHTS_FILE, load_lora_weights, read_adapter_weights

    if iteration == 0:
        return load_policy(cfg, root, 1), "base"
    if not cfg.update.ema:
        return load_policy(cfg, root, iteration + 1), "adapter"
    folder = IterationPaths(root, iteration).policy / EMA_FOLDER
    if not (folder / WEIGHTS_FILE).is_file():  # checked before the model loads: fail fast
        raise PipelineError(f"update.ema is true but {folder / WEIGHTS_FILE} is missing (the policy was "
                            f"trained with update.ema false: re-run `tpgrpo stage update --iter {iteration}`)")
    backend = load_policy(cfg, root, iteration + 1)
    load_lora_weights(backend, read_adapter_weights(folder))
    return backend, "ema"


def prompt_embeddings(cfg: Config, root: Path, iteration: int, backend, prompts: list[str], write: bool = False):
    """The ``PromptEmbeddings`` of an iteration's ``prompts``: the text encoders run once per iteration.

    The rollout (``write=True``) encodes them and, on the main process, writes
    ``data/iters/NNNN/prompt_embeds.safetensors`` atomically (a DVC output of the rollout: the tensors in
    the encoders' dtype, with the prompts and a hash of the ``model`` params as metadata). Probe and update
    read that file when it holds exactly these prompts for the same ``model`` params, so a big model's
    text encoders never load there; otherwise they encode again (the same numbers: encoding is
    deterministic). After encoding, a backend that can free its text encoders does.
    """
    from tpgrpo.pipeline.distributed import current
    from tpgrpo.stage_params import MODEL_PARAMS

    path = IterationPaths(root, iteration).prompt_embeds
    key = {"prompts": json.dumps(list(prompts)), "model": cfg.params_hash(MODEL_PARAMS)}  # not model.device
    if not write and path.is_file():
        cached = read_embeddings(path, key)
        if cached is not None:
            from tpgrpo.models.base import PromptEmbeddings

            return PromptEmbeddings(**{name: cached[name].to(backend.device) if name in cached else None
                                       for name in EMBEDDING_FIELDS})
    embeds = backend.encode_prompts(list(prompts))
    if hasattr(backend, "free_text_encoders"):
        backend.free_text_encoders()
    if write and current().is_main:
        write_embeddings(path, {name: getattr(embeds, name) for name in EMBEDDING_FIELDS
                                if getattr(embeds, name) is not None}, key)
    return embeds


def provenance(cfg: Config, iteration: int, stage: str) -> dict[str, str]:
    """Metadata every artifact carries: what made it, from which params (a hash of the params the stage
    declares in dvc.yaml), with which versions."""
    from importlib.metadata import version

    from tpgrpo.stage_params import STAGE_PARAMS

    return {
        "tpgrpo_version": __version__, "stage": stage, "iteration": str(iteration),
        "config_hash": cfg.params_hash(STAGE_PARAMS[stage]), "torch_version": version("torch"),  # not torch.__version__: no import
        "python_version": platform.python_version(),
    }


def check_finite(name: str, values: Any, where: str) -> None:
    """Refuse NaN or infinite values with one line naming the quantity and where it came from."""
    arr = np.asarray(values, dtype=np.float64)
    bad = ~np.isfinite(arr)
    if bad.any():
        first = np.argwhere(bad)[0].tolist()
        raise PipelineError(f"{name} has {int(bad.sum())} non-finite values in {where} (first at {first})")


@contextmanager
def stopwatch(metrics: dict[str, Any], key: str = "wall_seconds") -> Iterator[None]:
    """Record the wall time of the block into ``metrics[key]`` (seconds)."""
    start = time.perf_counter()
    yield
    metrics[key] = round(time.perf_counter() - start, 3)
