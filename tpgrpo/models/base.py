"""The interface every flow-matching backend implements (the embedded tiny model, SD3.5, FLUX).

Conventions shared by all backends (rectified flow, spec section 1):
    ``x_s = (1 - s) * x0 + s * noise`` with ``s`` (sigma) in [0, 1]; the model predicts the velocity
    ``v ~ noise - x0``. Latents are ``(B, C, H, W)`` float32 in the backend's latent space (for a
    pixel-space model, RGB in [-1, 1]).

A sampler only needs ``encode_prompts``, ``initial_noise``, ``velocity`` and ``decode``; the RL
update puts LoRA adapters on ``transformer`` (``lora_target_modules``) and calls ``velocity`` with
gradients enabled.
"""

from __future__ import annotations

import abc
from dataclasses import dataclass
from typing import Sequence

import numpy as np
import torch


@dataclass(frozen=True)
class PromptEmbeddings:
    """Text conditioning for N prompts plus the unconditional (empty prompt) conditioning.

    Fields:
        embeds: ``(N, L, D)`` per-token hidden states of each prompt (the transformer's
            ``encoder_hidden_states``; D = ``joint_attention_dim``).
        pooled: ``(N, P)`` pooled prompt embedding (``pooled_projections``), or None for backends
            without one.
        uncond_embeds: ``(1, L, D)`` hidden states of the empty prompt "".
        uncond_pooled: ``(1, P)`` pooled embedding of "", or None.
    Encoded once and without gradient (the text encoder is frozen during RL).
    """

    embeds: torch.Tensor
    pooled: torch.Tensor | None
    uncond_embeds: torch.Tensor
    uncond_pooled: torch.Tensor | None

    def __len__(self) -> int:
        return int(self.embeds.shape[0])

    def index(self, idx: Sequence[int] | torch.Tensor | int) -> "PromptEmbeddings":
        """The embeddings of prompts ``idx`` (repeats allowed, e.g. a group of G samples per prompt)."""
        if isinstance(idx, int):
            idx = [idx]
        idx_t = torch.as_tensor(idx, dtype=torch.long, device=self.embeds.device).reshape(-1)
        return PromptEmbeddings(
            embeds=self.embeds.index_select(0, idx_t),
            pooled=None if self.pooled is None else self.pooled.index_select(0, idx_t.to(self.pooled.device)),
            uncond_embeds=self.uncond_embeds,
            uncond_pooled=self.uncond_pooled,
        )

    # Alias: ``embeds.select(idx)`` reads naturally at call sites that pick a sub-batch.
    select = index

    def repeat_interleave(self, repeats: int) -> "PromptEmbeddings":
        """Each prompt ``repeats`` times in a row: ``(N, ...) -> (N * repeats, ...)``."""
        return self.index(torch.arange(len(self)).repeat_interleave(repeats))

    def uncond(self, batch: int) -> tuple[torch.Tensor, torch.Tensor | None]:
        """The unconditional ``(embeds (batch, L, D), pooled (batch, P) or None)`` for a batch."""
        emb = self.uncond_embeds.expand(batch, *self.uncond_embeds.shape[1:])
        pooled = None if self.uncond_pooled is None else self.uncond_pooled.expand(batch, -1)
        return emb, pooled

    def to(self, device=None, dtype=None) -> "PromptEmbeddings":
        """A copy on ``device`` / in ``dtype``."""
        def move(t):
            return None if t is None else t.to(device=device, dtype=dtype)
        return PromptEmbeddings(move(self.embeds), move(self.pooled), move(self.uncond_embeds),
                                move(self.uncond_pooled))


class FlowBackend(abc.ABC):
    """A text-to-image flow-matching model behind the small interface the samplers and the RL use.

    Attributes every implementation sets:
        latent_shape: ``(C, H, W)`` of one latent (tiny model: ``(3, 32, 32)`` pixels).
        transformer: the ``torch.nn.Module`` that predicts velocities (where LoRA goes).
        lora_target_modules: module names (peft ``target_modules``) for LoRA on ``transformer``.
        device: the ``torch.device`` the modules live on.
        dtype: the modules' ``torch.dtype``; inputs and outputs of ``velocity`` stay float32, and so does
            the timestep handed to the transformer (as diffusers' SD3 pipeline passes it: never rounded
            to a bf16 ``dtype``, which would turn 923.1 into 924).
        kind: short name of the backend (``"tiny"``, ``"sd3"``, ...).
        cfg_doubles_batch: whether guidance runs the transformer on a doubled ``[uncond; cond]`` batch
            (classifier-free guidance); False for FLUX's distilled guidance embedding.
    """

    latent_shape: tuple[int, int, int]
    transformer: torch.nn.Module
    lora_target_modules: list[str]
    device: torch.device
    dtype: torch.dtype
    kind: str
    cfg_doubles_batch: bool = True

    @abc.abstractmethod
    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        """Encode ``prompts`` (N strings) and the empty prompt once, without gradient."""

    def to_device(self, device) -> "FlowBackend":
        """Move this backend's modules (and any tensor it keeps) to ``device``, in place; returns it. Why: the
        stage server holds the base weights on the CPU, and a GPU stage forked from it moves its own copy
        (:func:`tpgrpo.models.resident.take`) instead of reading the folder again."""
        raise NotImplementedError(f"{type(self).__name__} cannot move to another device")

    @abc.abstractmethod
    def velocity(self, x: torch.Tensor, sigma: torch.Tensor, embeds: PromptEmbeddings,
                 guidance_scale: float) -> torch.Tensor:
        """Guided velocity ``v (B, C, H, W)`` float32 at latents ``x (B, C, H, W)``.

        Args:
            x: latents at noise level ``sigma``.
            sigma: ``(B,)`` (or scalar) noise levels in [0, 1].
            embeds: conditioning with ``len(embeds) == B`` (one row per sample).
            guidance_scale: classifier-free guidance scale; 1 means the conditional branch only.
        Gradients flow through this call (no ``torch.no_grad`` inside): the RL update uses it.
        """

    @abc.abstractmethod
    def decode(self, x: torch.Tensor) -> np.ndarray:
        """Latents ``(B, C, H, W)`` -> images ``uint8 (B, H', W', 3)``."""

    def initial_noise(self, seeds: Sequence[int]) -> torch.Tensor:
        """Standard-normal starting latents ``(B, C, H, W)`` float32 on ``self.device``.

        Each sample is drawn from its own CPU ``torch.Generator().manual_seed(seed)``, so a sample
        depends only on its seed, not on the batch it is drawn in nor on the device.
        """
        out = [torch.randn(self.latent_shape, generator=torch.Generator().manual_seed(int(s)),
                           dtype=torch.float32) for s in seeds]
        if not out:
            return torch.empty((0, *self.latent_shape), dtype=torch.float32, device=self.device)
        return torch.stack(out).to(self.device)


def as_sigma_batch(sigma, batch: int, device) -> torch.Tensor:
    """A scalar / 0-d / ``(B,)`` sigma as a ``(batch,)`` float32 tensor on ``device``."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=device)
    if s.ndim == 0:
        s = s.expand(batch)
    if s.shape != (batch,):
        raise ValueError(f"sigma must be a scalar or a ({batch},) tensor, got shape {tuple(s.shape)}")
    return s


def move_module(module: torch.nn.Module, device: torch.device, dtype: torch.dtype) -> torch.nn.Module:
    """Move/cast only when needed (diffusers warns on every ``.to(dtype)`` call); returns the module."""
    p = next(module.parameters())
    if p.dtype != dtype:
        module = module.to(dtype=dtype)
    if p.device != device:
        module = module.to(device=device)
    return module


def guided_velocity(predict, device, x: torch.Tensor, sigma, embeds: PromptEmbeddings,
                    guidance_scale: float) -> torch.Tensor:
    """Classifier-free guided velocity ``(B, C, H, W)`` float32 from a raw ``predict(x, sigma, hidden, pooled)``.

    The unconditional ("" prompt) and conditional branches run as ONE doubled batch ``[uncond; cond]`` and
    combine as ``v_u + g (v_c - v_u)``; ``guidance_scale == 1`` runs the conditional branch alone.
    ``sigma``: scalar or ``(B,)`` in [0, 1]; ``embeds``: one row per sample. Gradients flow.
    """
    from tpgrpo.algo.sampling import cfg

    batch = x.shape[0]
    if len(embeds) != batch:
        raise ValueError(f"embeds has {len(embeds)} rows but x has batch {batch}")
    x = x.to(device)
    s = as_sigma_batch(sigma, batch, device)
    if guidance_scale == 1.0:
        return predict(x, s, embeds.embeds, embeds.pooled)
    u_hidden, u_pooled = embeds.uncond(batch)
    v = predict(torch.cat([x, x]), torch.cat([s, s]), torch.cat([u_hidden.to(embeds.embeds.dtype), embeds.embeds]),
                torch.cat([u_pooled.to(embeds.pooled.dtype), embeds.pooled]))
    v_uncond, v_cond = v.chunk(2)
    return cfg(v_uncond, v_cond, guidance_scale)
