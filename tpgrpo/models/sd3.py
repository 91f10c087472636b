"""Stable Diffusion 3 / 3.5 (e.g. SD3.5-Medium) from a local diffusers ``StableDiffusion3Pipeline`` folder.

Folder layout (what ``StableDiffusion3Pipeline.save_pretrained`` writes): ``model_index.json``,
``transformer/`` (``SD3Transformer2DModel``), ``vae/`` (``AutoencoderKL``), ``text_encoder/`` and
``text_encoder_2/`` (``CLIPTextModelWithProjection``), ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``,
and optionally ``text_encoder_3/`` + ``tokenizer_3/`` (T5; without them the T5 part of the conditioning is
zeros, as in diffusers). Nothing is downloaded (``local_files_only=True``).

Conditioning (``StableDiffusion3Pipeline.encode_prompt``): ``embeds (N, 77 + max_sequence_length, 4096)``
= [CLIP-L | CLIP-G hidden states padded to 4096 ; T5 hidden states], ``pooled (N, 2048)``; the
unconditional branch is the empty prompt "". Latents ``(16, R/8, R/8)`` for R x R images (SD3.5).
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from pathlib import Path
from typing import Iterator

import torch

from tpgrpo.errors import PipelineError
from tpgrpo.models.base import PromptEmbeddings, guided_velocity
from tpgrpo.models.latent import (LatentBackend, check_pipeline_folder, load_component, resolve_resolution,
                                  vae_scale_factor)

CLASS_NAME = "StableDiffusion3Pipeline"
REQUIRED = ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
OPTIONAL = ("text_encoder_3", "tokenizer_3")
# Attention projections of both streams (Flow-GRPO's SD3 choice). Names match by suffix; the last
# block has no to_add_out (context_pre_only) and SD3.5-M's second attention (attn2) is not targeted.
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
DEFAULT_RESOLUTION = 512  # pixels: the paper trains SD3.5-M at 512 x 512


class SD3Backend(LatentBackend):
    """``FlowBackend`` over an SD3 transformer + VAE (+ text encoders), with classifier-free guidance.

    Args:
        transformer: ``SD3Transformer2DModel``; ``vae``: ``AutoencoderKL`` (16 latent channels for SD3.5).
        prompt_encoder: a ``StableDiffusion3Pipeline`` holding the text encoders and tokenizers (its
            transformer/vae may be None), a zero-argument callable returning one (lazy), or None.
        resolution: image side in pixels (default 512); a multiple of VAE factor x patch size (16).
        device, dtype: of the transformer and text encoders; ``velocity`` returns float32 regardless.
        max_sequence_length: T5 tokens per prompt (diffusers' default 256).
        decode_batch_size: images per VAE decode call.
    """

    kind = "sd3"

    def __init__(self, transformer, vae, prompt_encoder=None, *, resolution: int = DEFAULT_RESOLUTION,
                 device="cpu", dtype: torch.dtype = torch.float32, max_sequence_length: int = 256,
                 decode_batch_size: int = 4):
        patch = int(transformer.config.patch_size)
        super().__init__(transformer, vae, prompt_encoder, resolution=resolution, device=device, dtype=dtype,
                         multiple=vae_scale_factor(vae) * patch, decode_batch_size=decode_batch_size)
        cfg = transformer.config
        if cfg.in_channels != self.latent_shape[0]:
            raise PipelineError(f"SD3 transformer in_channels {cfg.in_channels} != VAE latent_channels "
                                f"{self.latent_shape[0]} (expected matching transformer/ and vae/)")
        tokens_side = self.latent_shape[1] // patch
        if cfg.pos_embed_max_size is not None and tokens_side > cfg.pos_embed_max_size:
            limit = cfg.pos_embed_max_size * patch * self.vae_scale_factor
            raise PipelineError(f"model.resolution = {resolution}: expected at most {limit} pixels for this "
                                "transformer (pos_embed_max_size)")
        self.max_sequence_length = int(max_sequence_length)
        self.lora_target_modules = list(LORA_TARGETS)

    def _encode(self, pipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, _, pooled, _ = pipe.encode_prompt(
            prompt=prompts, prompt_2=None, prompt_3=None, device=self.device, num_images_per_prompt=1,
            do_classifier_free_guidance=False, max_sequence_length=self.max_sequence_length)
        return embeds, pooled

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor,
                pooled: torch.Tensor) -> torch.Tensor:
        """Raw transformer velocity ``(B, C, h, w)`` float32; ``sigma (B,)`` in [0, 1]."""
        out = self.transformer(
            hidden_states=x.to(self.dtype), encoder_hidden_states=embeds.to(self.dtype),
            pooled_projections=pooled.to(self.dtype),
            # SD3's time embedding expects 1000 * sigma, in fp32 as StableDiffusion3Pipeline passes it (its
            # sinusoidal projection runs in fp32; a bf16 cast would round 923.1 to 924).
            timestep=sigma.float() * 1000.0,
            return_dict=False)[0]
        return out.float()

    def velocity(self, x, sigma, embeds: PromptEmbeddings, guidance_scale: float) -> torch.Tensor:
        """Guided velocity ``(B, C, h, w)`` float32 at latents ``x (B, C, h, w)`` and ``sigma`` in [0, 1].

        With ``guidance_scale != 1`` the unconditional ("" prompt) and conditional branches run as ONE
        doubled batch ``[uncond; cond]`` and combine as ``v_u + g (v_c - v_u)``; 1 runs the conditional
        branch alone. Gradients flow (the RL update calls this).
        """
        return guided_velocity(self.predict, self.device, x, sigma, embeds, guidance_scale)


def load_sd3(folder, device="cpu", dtype: torch.dtype = torch.float32, resolution: int | None = None,
             max_sequence_length: int = 256) -> SD3Backend:
    """Load an ``SD3Backend`` from a local ``StableDiffusion3Pipeline`` folder (no download).

    The transformer and VAE load now, straight onto ``device`` (``load_component``); the text encoders load
    on the first ``encode_prompts`` (a stage that reads cached prompt embeddings never loads them). ``resolution`` None/0 means 512 pixels.
    A folder that is missing, has no/wrong ``model_index.json`` or lacks a sub-folder is a one-line
    ``PipelineError`` naming the path and the expected layout.
    """
    from diffusers import AutoencoderKL, SD3Transformer2DModel

    folder = check_pipeline_folder(folder, CLASS_NAME, REQUIRED, OPTIONAL)
    with _no_pos_embed_table() if _stores_pos_embed(folder / "transformer") else nullcontext():
        transformer = load_component(SD3Transformer2DModel, folder, "transformer", device, dtype)
    vae = load_component(AutoencoderKL, folder, "vae", device, torch.float32)

    def load_text_encoders():
        from diffusers import StableDiffusion3Pipeline

        no_t5 = {} if (folder / "text_encoder_3").is_dir() else {"text_encoder_3": None, "tokenizer_3": None}
        # The transformer is passed (not loaded again): without T5 the pipeline reads its joint_attention_dim.
        return StableDiffusion3Pipeline.from_pretrained(folder, transformer=transformer, vae=None, dtype=dtype,
                                                        local_files_only=True, **no_t5)

    return SD3Backend(transformer, vae, load_text_encoders,
                      resolution=resolve_resolution(resolution, DEFAULT_RESOLUTION), device=device, dtype=dtype,
                      max_sequence_length=max_sequence_length)


POS_EMBED_KEY = "pos_embed.pos_embed"  # SD3's persistent sin-cos table, (1, 384^2, 1536) for SD3.5-M


def _stores_pos_embed(folder: Path) -> bool:
    """Whether the transformer's safetensors files hold ``POS_EMBED_KEY`` (stock SD3 / SD3.5 folders do)."""
    from safetensors import safe_open

    for path in sorted(Path(folder).glob("*.safetensors")):
        with safe_open(str(path), framework="pt") as f:
            if POS_EMBED_KEY in f.keys():
                return True
    return False


@contextmanager
def _no_pos_embed_table() -> Iterator[None]:
    """Construct the transformer without computing its sin-cos table, which ``from_pretrained`` then
    overwrites with the file's copy (use only when ``_stores_pos_embed``).

    diffusers' ``PatchEmbed`` computes the 384 x 384 x 1536 table (226M floats) at construction: 10 of the
    15 s of loading SD3.5-M here (bench/real_size.py), paid again by every model stage in every process. An
    uninitialised table of the same shape stands in for it.
    """
    import diffusers.models.embeddings as embeddings

    original = embeddings.get_2d_sincos_pos_embed

    def uninitialised(embed_dim, grid_size, *args, output_type="np", **kwargs):
        if output_type != "pt":
            return original(embed_dim, grid_size, *args, output_type=output_type, **kwargs)
        side = (grid_size, grid_size) if isinstance(grid_size, int) else tuple(grid_size)
        return torch.empty(side[0] * side[1], embed_dim)

    embeddings.get_2d_sincos_pos_embed = uninitialised
    try:
        yield
    finally:
        embeddings.get_2d_sincos_pos_embed = original
