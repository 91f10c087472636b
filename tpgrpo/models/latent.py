"""What the SD3.5 and FLUX backends share: a VAE latent space, text encoders that load lazily and can
be freed, and the checks of a local diffusers pipeline folder.

Latents are the VAE's latents ``(B, C, H/f, W/f)`` float32 (SD3.5 / FLUX.1: C = 16, f = 8), in the
*scaled* space the transformer sees: ``z = (vae_latent - shift_factor) * scaling_factor``; ``decode``
undoes that before the VAE decoder. The VAE always runs in float32 (it is small; fp16 VAEs overflow).

Text encoders are the expensive, frozen part (SD3.5: two CLIPs + T5-XXL; FLUX: CLIP + T5-XXL). They
are given to a backend as ``prompt_encoder``: a diffusers pipeline of the model's class that holds the
text encoders and tokenizers (its ``encode_prompt`` is the encoding logic), or a zero-argument callable
returning one (loaded on the first ``encode_prompts``, so a stage that reads cached embeddings never
loads them), or None (no text encoders: build ``PromptEmbeddings`` yourself, e.g. ``blank_embeddings``).
"""

from __future__ import annotations

import gc
import json
import os
from pathlib import Path
from typing import Callable

import numpy as np
import torch

from tpgrpo.errors import PipelineError
from tpgrpo.models.base import FlowBackend, PromptEmbeddings, move_module

TEXT_MODULES = ("text_encoder", "text_encoder_2", "text_encoder_3")


def check_pipeline_folder(folder, class_name: str, required: tuple[str, ...],
                          optional: tuple[str, ...] = ()) -> Path:
    """Raise a one-line ``PipelineError`` unless ``folder`` is a diffusers ``class_name`` folder.

    Checks that the folder exists, has ``model_index.json`` whose ``_class_name`` is ``class_name``,
    and has every ``required`` sub-folder. Returns the folder as a ``Path``.
    """
    folder = Path(os.fspath(folder))
    listed = ", ".join(f"{s}/" for s in required)
    extra = f" ({', '.join(s + '/' for s in optional)} optional)" if optional else ""
    expected = f"expected a diffusers {class_name} folder with model_index.json, {listed}{extra}"
    if not folder.is_dir():
        raise PipelineError(f"model.path {folder} does not exist ({expected})")
    index = folder / "model_index.json"
    if not index.is_file():
        raise PipelineError(f"model.path {folder} has no model_index.json ({expected})")
    try:
        found = json.loads(index.read_text()).get("_class_name")
    except (json.JSONDecodeError, AttributeError):
        raise PipelineError(f"model.path {folder}: model_index.json is not a JSON object ({expected})") from None
    if found != class_name:
        raise PipelineError(f"model.path {folder}: model_index.json says _class_name={found!r} ({expected})")
    for name in required:
        if not (folder / name).is_dir():
            raise PipelineError(f"model.path {folder} has no {name}/ sub-folder ({expected})")
    return folder


def load_component(cls, folder: Path, subfolder: str, device, dtype: torch.dtype):
    """``cls.from_pretrained(folder, subfolder=...)`` with every tensor read from the safetensors file straight
    onto ``device`` in ``dtype`` (diffusers' single-device ``device_map``), not staged in host memory first.

    On a GPU node each process would otherwise hold the whole transformer (SD3.5-M: 5 GiB in bf16) in host
    memory before moving it, times the processes per node. On the CPU the tensors and their values are the
    same as a plain load (tests/test_sd3_backend.py). Nothing is downloaded.
    """
    return cls.from_pretrained(folder, subfolder=subfolder, dtype=dtype, local_files_only=True,
                               device_map={"": torch.device(device)})


def vae_scale_factor(vae) -> int:
    """Pixels per latent cell along a side: ``2 ** (len(block_out_channels) - 1)`` (8 for SD3/FLUX)."""
    return 2 ** (len(vae.config.block_out_channels) - 1)


class LatentBackend(FlowBackend):
    """Base of ``SD3Backend`` and ``FluxBackend``: VAE decoding and the text-encoder life cycle.

    Args:
        transformer: the diffusers transformer (velocity model; LoRA goes here).
        vae: the diffusers ``AutoencoderKL`` (kept in float32).
        prompt_encoder: pipeline with the text encoders, a callable returning one, or None (see module doc).
        resolution: image side in pixels (square images); must be a multiple of ``multiple``.
        device, dtype: where the transformer and text encoders live and their weights' dtype.
        multiple: the resolution must be a multiple of this (VAE factor x transformer patch).
        decode_batch_size: images per VAE decoder call (a memory knob).
    """

    def __init__(self, transformer, vae, prompt_encoder=None, *, resolution: int, device="cpu",
                 dtype: torch.dtype = torch.float32, multiple: int, decode_batch_size: int = 4):
        self.device, self.dtype = torch.device(device), dtype
        if resolution < 1 or resolution % multiple:
            raise PipelineError(f"model.resolution = {resolution}: expected a positive multiple of {multiple} "
                                f"pixels for this {self.kind} model")
        self.resolution = int(resolution)
        self.transformer = move_module(transformer, self.device, dtype).eval().requires_grad_(False)
        self.vae = move_module(vae, self.device, torch.float32).eval().requires_grad_(False)
        self.vae_scale_factor = vae_scale_factor(vae)
        side = self.resolution // self.vae_scale_factor
        self.latent_shape = (int(vae.config.latent_channels), side, side)
        self.decode_batch_size = max(1, int(decode_batch_size))
        is_pipeline = hasattr(prompt_encoder, "encode_prompt")  # a pipeline is callable too: test this first
        self._encoder = prompt_encoder if is_pipeline else None
        self._encoder_loader: Callable | None = None if is_pipeline else prompt_encoder
        self._freed = False
        if self._encoder is not None:
            self._prepare_encoder(self._encoder)

    def to_device(self, device) -> "LatentBackend":
        self.device = torch.device(device)
        self.transformer = move_module(self.transformer, self.device, self.dtype)
        self.vae = move_module(self.vae, self.device, torch.float32)
        if self._encoder is not None:  # a lazy loader puts them on self.device when it runs
            self._prepare_encoder(self._encoder)
        return self

    # -- text encoders ------------------------------------------------------------------------
    def _prepare_encoder(self, pipe) -> None:
        for name in TEXT_MODULES:
            module = getattr(pipe, name, None)
            if module is not None:
                move_module(module, self.device, self.dtype).eval().requires_grad_(False)

    def _text_pipeline(self):
        if self._freed:
            raise PipelineError(f"{type(self).__name__}: the text encoders were freed (free_text_encoders); "
                                "encode prompts before freeing them or use cached prompt embeddings")
        if self._encoder is None:
            if self._encoder_loader is None:
                raise PipelineError(f"{type(self).__name__} was built without text encoders "
                                    "(prompt_encoder=None): pass PromptEmbeddings instead of prompts")
            self._encoder = self._encoder_loader()
            self._prepare_encoder(self._encoder)
        return self._encoder

    @property
    def has_text_encoders(self) -> bool:
        """Whether ``encode_prompts`` can run (loaded now or loadable on first use)."""
        return not self._freed and (self._encoder is not None or self._encoder_loader is not None)

    @property
    def text_encoders_loaded(self) -> bool:
        """Whether the text encoders are in memory now (a lazy backend loads them on first use)."""
        return self._encoder is not None

    def free_text_encoders(self) -> None:
        """Drop the text encoders (and their memory); ``encode_prompts`` fails clearly afterwards."""
        self._encoder, self._encoder_loader, self._freed = None, None, True
        gc.collect()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()

    def _encode(self, pipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(embeds (N, L, D), pooled (N, P))`` of ``prompts`` through ``pipe.encode_prompt``."""
        raise NotImplementedError

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        """Encode ``prompts`` and "" once, without gradient, in ``self.dtype`` on ``self.device``.

        Returns ``PromptEmbeddings`` with ``embeds (N, L, D)``, ``pooled (N, P)`` and the empty prompt's
        ``(1, L, D)`` / ``(1, P)`` (the unconditional branch; L, D, P depend on the model).
        """
        pipe = self._text_pipeline()
        with torch.no_grad():
            embeds, pooled = self._encode(pipe, list(prompts) + [""])
        embeds, pooled = embeds.to(self.device, self.dtype), pooled.to(self.device, self.dtype)
        return PromptEmbeddings(embeds=embeds[:-1], pooled=pooled[:-1], uncond_embeds=embeds[-1:],
                                uncond_pooled=pooled[-1:])

    def blank_embeddings(self, n: int, seq_len: int) -> PromptEmbeddings:
        """Zero conditioning of the right widths for ``n`` prompts and ``seq_len`` tokens (benchmarks and
        tests that run without text encoders): ``embeds (n, seq_len, joint_attention_dim)``,
        ``pooled (n, pooled_projection_dim)``."""
        cfg = self.transformer.config
        emb = torch.zeros(n + 1, seq_len, cfg.joint_attention_dim, device=self.device, dtype=self.dtype)
        pooled = torch.zeros(n + 1, cfg.pooled_projection_dim, device=self.device, dtype=self.dtype)
        return PromptEmbeddings(emb[:n], pooled[:n], emb[n:], pooled[n:])

    # -- images ---------------------------------------------------------------------------------
    def _unscale(self, x: torch.Tensor) -> torch.Tensor:
        shift = self.vae.config.shift_factor or 0.0
        return x / self.vae.config.scaling_factor + shift

    @torch.no_grad()
    def decode(self, x: torch.Tensor) -> np.ndarray:
        """Latents ``(B, C, H/f, W/f)`` -> images ``uint8 (B, H, W, 3)``, decoded in chunks, no gradient.

        Applies the VAE's ``scaling_factor`` and ``shift_factor`` (``z / scaling + shift``), decodes in
        float32 and maps [-1, 1] to [0, 255] as diffusers' image processor does (clamp, round).
        """
        out = []
        for chunk in x.detach().split(self.decode_batch_size):
            z = self._unscale(chunk.to(self.device, torch.float32))
            img = self.vae.decode(z, return_dict=False)[0]
            img = ((img / 2 + 0.5).clamp(0, 1) * 255).round().to(torch.uint8)
            out.append(img.permute(0, 2, 3, 1).cpu().numpy())
        if not out:
            return np.zeros((0, self.resolution, self.resolution, 3), dtype=np.uint8)
        return np.concatenate(out)


def resolve_resolution(resolution: int | None, default: int) -> int:
    """``model.resolution``: 0 or None means the model's default (pixels)."""
    return int(default) if not resolution else int(resolution)
