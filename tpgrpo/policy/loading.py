"""What the model stages load before they sample: an iteration's prompts, the sampler from params, the
policy of an iteration and its prompt embeddings.

Why a module of its own: a stage's code manifest is the import closure of its module, file by file, so these
helpers (which import the model backends, LoRA and the process group) sat in the manifest of every stage that
imported anything from :mod:`tpgrpo.stage_common` (credit, summary), and a model edit re-ran them. Only the
stages that load a model import this module.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from tpgrpo.algo.seeds import sample_seed
from tpgrpo.config import Config
from tpgrpo.errors import PipelineError
from tpgrpo.io.artifacts import IterationPaths, read_embeddings, require, write_embeddings
from tpgrpo.io.schemas import EMBEDDING_FIELDS
from tpgrpo.stage_common import provenance, resolve


def select_prompts(cfg: Config, root: Path, iteration: int) -> list[dict]:
    """The ``rollout.prompts_per_iter`` training prompts of an iteration, drawn by a stable seed."""
    from tpgrpo.tasks.prompts import load_prompts

    metas = load_prompts(require(resolve(root, cfg.task.train_prompts), "task.train_prompts"))
    n = cfg.rollout.prompts_per_iter
    if n > len(metas):
        raise PipelineError(f"rollout.prompts_per_iter = {n} but {cfg.task.train_prompts} has {len(metas)}")
    rng = np.random.default_rng(sample_seed(cfg.train.seed, iteration, "prompt-choice", 0))
    return [metas[i] for i in sorted(rng.choice(len(metas), size=n, replace=False))]


def sampler_spec(cfg: Config, window: tuple[int, int] | None = None):
    """The rollout's :class:`SamplerSpec` from the ``sampling`` params; ``window`` (start, size in steps)
    instead of ``sampling.window_*`` for a tree, which does not read them (its window is its split steps)."""
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import SamplerSpec

    s = cfg.sampling
    start, size = (s.window_start, s.window_size) if window is None else window
    return SamplerSpec(sigmas=flow_sigmas(s.num_steps, s.shift), window_start=start, window_size=size,
                       step_kind=s.step_kind, noise_level=s.noise_level, guidance_scale=s.guidance_scale)


def store_attrs(cfg: Config, iteration: int, spec, metas: list[dict], group_size: int, **fields) -> dict:
    """A trajectory store's attributes: the prompts, the samples per prompt (``group_size``: the chain's
    ``rollout.group_size``, a tree's edges), the sampler that made the states (``spec``, a
    :class:`SamplerSpec`, its window included), the reward, then ``fields`` (a key given there replaces the
    chain's value in place; a new one comes after ``reward``), then provenance. The chain and the tree rollout
    share it."""
    attrs = {"prompts": metas, "schedule_sigmas": spec.sigmas.tolist(), "group_size": group_size,
             "num_steps": spec.num_steps, "shift": cfg.sampling.shift,
             "window_start": spec.window_start, "window_size": spec.window_size,
             "step_kind": spec.step_kind, "noise_level": spec.noise_level,
             "guidance_scale": spec.guidance_scale, "reward": cfg.task.reward}
    return {**attrs, **fields, **provenance(cfg, iteration, "rollout")}


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

    from tpgrpo.distributed import current, local_device
    from tpgrpo.models import load_backend
    from tpgrpo.policy.lora import attach_lora

    # The adapter first: a missing one (retention dropped it) is one line, before the model loads and its
    # progress bars print.
    previous = IterationPaths(root, iteration).previous()
    adapter = None
    if previous is not None:
        adapter = require(previous.policy, f"policy of iteration {iteration - 1}: run its update first")
    device = local_device(cfg.model.device, current())  # one GPU per process when launched
    backend = load_backend(cfg.model.kind, resolve(root, cfg.model.path), device, cfg.model.dtype,
                           resolution=cfg.model.resolution)
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
    from tpgrpo.distributed import current

    path = IterationPaths(root, iteration).prompt_embeds
    from tpgrpo.stage_params import MODEL_PARAMS

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
