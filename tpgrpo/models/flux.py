"""FLUX.1 (e.g. FLUX.1-dev) from a local diffusers ``FluxPipeline`` folder.

Folder layout (what ``FluxPipeline.save_pretrained`` writes): ``model_index.json``, ``transformer/``
(``FluxTransformer2DModel``), ``vae/`` (``AutoencoderKL``), ``text_encoder/`` (CLIP ``CLIPTextModel``),
``text_encoder_2/`` (T5 ``T5EncoderModel``), ``tokenizer/``, ``tokenizer_2/``, ``scheduler/``.
Nothing is downloaded (``local_files_only=True``).

Latents: public latents stay UNPACKED, ``(B, 16, R/8, R/8)`` for R x R images, like SD3's, so samplers
and trajectory stores are the same for every backend. ``velocity`` packs them into FLUX's 2x2-patch
token sequence ``(B, (h/2)(w/2), 64)`` (``FluxPipeline._pack_latents``), builds the latent image ids and
text ids, runs the transformer and unpacks the result.

Guidance: FLUX.1-dev is guidance-distilled. There is NO classifier-free guidance (no doubled batch, the
empty-prompt embeddings are unused); the ``guidance_scale`` given to ``velocity`` -- the pipeline's
``sampling.guidance_scale`` -- is the value of FLUX's guidance embedding (FluxPipeline's default 3.5;
the paper's CFG 4.5 is an SD3 value). Models without a guidance embedding (FLUX.1-schnell) ignore it.

Conditioning (``FluxPipeline.encode_prompt``): ``embeds (N, max_sequence_length, 4096)`` T5 hidden
states, ``pooled (N, 768)`` CLIP pooled output.
"""

from __future__ import annotations

import torch

from tpgrpo.errors import PipelineError
from tpgrpo.models.base import PromptEmbeddings, as_sigma_batch
from tpgrpo.models.latent import (LatentBackend, check_pipeline_folder, load_component, resolve_resolution,
                                  vae_scale_factor)

CLASS_NAME = "FluxPipeline"
REQUIRED = ("transformer", "vae", "scheduler", "text_encoder", "text_encoder_2", "tokenizer", "tokenizer_2")
ATTENTION = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
             "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]
FEED_FORWARD = ["ff.net.0.proj", "ff.net.2", "ff_context.net.0.proj", "ff_context.net.2"]
DEFAULT_RESOLUTION = 512  # pixels


def lora_targets(num_single_layers: int) -> list[str]:
    """LoRA target modules: attention projections of every block, the feed-forwards of the double blocks,
    and the MLP in/out of every single block. The single blocks' ``proj_out`` is named per block
    (``single_transformer_blocks.<i>.proj_out``) so the transformer's final ``proj_out`` is NOT adapted."""
    single = [f"single_transformer_blocks.{i}.proj_out" for i in range(num_single_layers)]
    return ATTENTION + FEED_FORWARD + ["proj_mlp"] + single


def pack_latents(x: torch.Tensor) -> torch.Tensor:
    """``(B, C, h, w)`` -> ``(B, (h/2)(w/2), 4C)``: 2x2 patches as tokens (``FluxPipeline._pack_latents``)."""
    b, c, h, w = x.shape
    x = x.view(b, c, h // 2, 2, w // 2, 2).permute(0, 2, 4, 1, 3, 5)
    return x.reshape(b, (h // 2) * (w // 2), c * 4)


def unpack_latents(tokens: torch.Tensor, h: int, w: int) -> torch.Tensor:
    """``(B, (h/2)(w/2), 4C)`` -> ``(B, C, h, w)``, the inverse of ``pack_latents`` (latent sizes h, w)."""
    b, _, d = tokens.shape
    x = tokens.view(b, h // 2, w // 2, d // 4, 2, 2).permute(0, 3, 1, 4, 2, 5)
    return x.reshape(b, d // 4, h, w)


def latent_image_ids(h: int, w: int, device, dtype) -> torch.Tensor:
    """``((h/2)(w/2), 3)`` position ids of the packed tokens: (0, row, column), as FluxPipeline builds them."""
    ids = torch.zeros(h // 2, w // 2, 3)
    ids[..., 1] += torch.arange(h // 2)[:, None]
    ids[..., 2] += torch.arange(w // 2)[None, :]
    return ids.reshape(-1, 3).to(device=device, dtype=dtype)


class FluxBackend(LatentBackend):
    """``FlowBackend`` over a FLUX transformer + VAE (+ CLIP and T5 text encoders); see the module doc.

    Args:
        transformer: ``FluxTransformer2DModel``; ``vae``: ``AutoencoderKL`` (16 latent channels).
        prompt_encoder: a ``FluxPipeline`` holding the text encoders and tokenizers (transformer/vae may be
            None), a zero-argument callable returning one (lazy), or None.
        resolution: image side in pixels (default 512); a multiple of 2 x VAE factor (16).
        device, dtype: of the transformer and text encoders; ``velocity`` returns float32 regardless.
        max_sequence_length: T5 tokens per prompt (FLUX.1-dev: 512).
        decode_batch_size: images per VAE decode call.
    """

    kind = "flux"
    cfg_doubles_batch = False  # guidance is an embedding input: one forward pass per step

    def __init__(self, transformer, vae, prompt_encoder=None, *, resolution: int = DEFAULT_RESOLUTION,
                 device="cpu", dtype: torch.dtype = torch.float32, max_sequence_length: int = 512,
                 decode_batch_size: int = 4):
        super().__init__(transformer, vae, prompt_encoder, resolution=resolution, device=device, dtype=dtype,
                         multiple=vae_scale_factor(vae) * 2, decode_batch_size=decode_batch_size)
        cfg = transformer.config
        if cfg.in_channels != 4 * self.latent_shape[0]:
            raise PipelineError(f"FLUX transformer in_channels {cfg.in_channels} != 4 x VAE latent_channels "
                                f"{self.latent_shape[0]} (expected matching transformer/ and vae/)")
        self.guidance_embeds = bool(cfg.guidance_embeds)
        self.max_sequence_length = int(max_sequence_length)
        self.lora_target_modules = lora_targets(int(cfg.num_single_layers))
        _, h, w = self.latent_shape
        self._img_ids = latent_image_ids(h, w, self.device, self.dtype)

    def to_device(self, device) -> "FluxBackend":
        super().to_device(device)
        self._img_ids = self._img_ids.to(self.device)
        return self

    def _encode(self, pipe, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        embeds, pooled, _ = pipe.encode_prompt(prompt=prompts, prompt_2=None, device=self.device,
                                               num_images_per_prompt=1,
                                               max_sequence_length=self.max_sequence_length)
        return embeds, pooled

    def velocity(self, x, sigma, embeds: PromptEmbeddings, guidance_scale: float) -> torch.Tensor:
        """Velocity ``(B, C, h, w)`` float32 at unpacked latents ``x (B, C, h, w)`` and ``sigma`` in [0, 1].

        ``guidance_scale`` is the distilled guidance value fed to the guidance embedding (no CFG, one
        transformer pass per sample; ignored when the model has no guidance embedding). Gradients flow.
        """
        batch, _, h, w = x.shape
        if len(embeds) != batch:
            raise ValueError(f"embeds has {len(embeds)} rows but x has batch {batch}")
        s = as_sigma_batch(sigma, batch, self.device)
        img_ids = self._img_ids if (h, w) == self.latent_shape[1:] else latent_image_ids(h, w, self.device, self.dtype)
        guidance = torch.full((batch,), float(guidance_scale), device=self.device, dtype=torch.float32) \
            if self.guidance_embeds else None
        out = self.transformer(
            hidden_states=pack_latents(x.to(self.device, self.dtype)),
            encoder_hidden_states=embeds.embeds.to(self.dtype), pooled_projections=embeds.pooled.to(self.dtype),
            # sigma in fp32, not rounded here; FLUX's transformer casts it to its own dtype and multiplies by
            # 1000 itself, which is what it gets under FluxPipeline (t / 1000) too.
            timestep=s,
            guidance=guidance,
            txt_ids=torch.zeros(embeds.embeds.shape[1], 3, device=self.device, dtype=self.dtype),
            img_ids=img_ids, return_dict=False)[0]
        return unpack_latents(out, h, w).float()


def load_flux(folder, device="cpu", dtype: torch.dtype = torch.float32, resolution: int | None = None,
              max_sequence_length: int = 512) -> FluxBackend:
    """Load a ``FluxBackend`` from a local ``FluxPipeline`` folder (no download).

    The transformer and VAE load now, straight onto ``device`` (``load_component``); the text encoders load
    on the first ``encode_prompts``.
    ``resolution`` None/0 means 512 pixels. A bad folder is a one-line ``PipelineError`` naming the path.
    """
    from diffusers import AutoencoderKL, FluxTransformer2DModel

    folder = check_pipeline_folder(folder, CLASS_NAME, REQUIRED)
    transformer = load_component(FluxTransformer2DModel, folder, "transformer", device, dtype)
    vae = load_component(AutoencoderKL, folder, "vae", device, torch.float32)

    def load_text_encoders():
        from diffusers import FluxPipeline

        return FluxPipeline.from_pretrained(folder, transformer=None, vae=None, dtype=dtype,
                                            local_files_only=True)

    return FluxBackend(transformer, vae, load_text_encoders,
                       resolution=resolve_resolution(resolution, DEFAULT_RESOLUTION), device=device, dtype=dtype,
                       max_sequence_length=max_sequence_length)
