"""The embedded tiny text-to-image model: pixel-space 32x32 RGB, no VAE, runs on a laptop CPU.

A diffusers ``SD3Transformer2DModel`` (patch 4 -> 8x8 = 64 image tokens) conditioned on a small
transformers ``CLIPTextModel`` (its per-token hidden states -> ``encoder_hidden_states``, its pooled
end-token state -> ``pooled_projections``), both trained jointly by ``tpgrpo.models.pretrain``. It is saved
in the diffusers pipeline folder layout and loaded with each class's ``from_pretrained``, the same
path the SD3.5 backend uses for a user's folder.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path

import numpy as np
import torch

from tpgrpo.models.base import FlowBackend, PromptEmbeddings, guided_velocity, move_module
from tpgrpo.models.tokenizer import EOS, build_tokenizer, tokenize

MODEL_JSON = "tpgrpo_model.json"
SUBFOLDERS = ("transformer", "text_encoder", "tokenizer", "scheduler")
# Attention projections of both streams of every joint block (Flow-GRPO's SD3 choice). The last
# block has no ``to_add_out`` (context_pre_only); peft only needs each name to match somewhere.
LORA_TARGETS = ["attn.to_q", "attn.to_k", "attn.to_v", "attn.to_out.0",
                "attn.add_q_proj", "attn.add_k_proj", "attn.add_v_proj", "attn.to_add_out"]


@dataclass(frozen=True)
class TinyConfig:
    """Architecture of the tiny model (defaults: the measured ~3.5M-parameter transformer).

    Fields:
        image_size: image side in pixels (the latent is the RGB image itself, ``(3, S, S)``).
        patch_size: transformer patch side in pixels (4 -> 64 tokens at 32x32; 2 is ~4x slower).
        num_layers: joint transformer blocks.
        num_heads, head_dim: attention heads and their width (model width = product).
        text_layers, text_hidden, text_heads, text_intermediate: the CLIP text encoder's size;
            ``text_hidden`` is both ``joint_attention_dim`` and ``pooled_projection_dim``.
        max_length: tokens per prompt including ``<bos>``/``<eos>`` (longer prompts are truncated).
    """

    image_size: int = 32
    patch_size: int = 4
    num_layers: int = 6
    num_heads: int = 4
    head_dim: int = 32
    text_layers: int = 2
    text_hidden: int = 128
    text_heads: int = 4
    text_intermediate: int = 512
    max_length: int = 20

    @classmethod
    def from_dict(cls, d: dict) -> "TinyConfig":
        """Build from a dict, rejecting unknown keys (names them)."""
        known = {f.name for f in fields(cls)}
        unknown = sorted(set(d) - known)
        if unknown:
            raise ValueError(f"unknown TinyConfig keys: {unknown}")
        return cls(**d)


def _default_vocabulary() -> tuple[list[str], str]:
    """Prompt words and quoted-text characters of the task package (imported lazily)."""
    from tpgrpo.tasks.prompts import TEXT_CHARSET, VOCABULARY
    return list(VOCABULARY), str(TEXT_CHARSET)


class TinyBackend(FlowBackend):
    """``FlowBackend`` over the tiny pixel-space model. Latents are RGB in [-1, 1], ``(3, S, S)``."""

    kind = "tiny"

    def __init__(self, transformer, text_encoder, tokenizer, config: TinyConfig,
                 device="cpu", dtype: torch.dtype = torch.float32):
        self.config = config
        self.device = torch.device(device)
        self.dtype = dtype
        self.transformer = move_module(transformer, self.device, dtype).eval()
        self.text_encoder = move_module(text_encoder, self.device, dtype).eval()
        self.tokenizer = tokenizer
        self.latent_shape = (3, config.image_size, config.image_size)
        self.lora_target_modules = list(LORA_TARGETS)

    def to_device(self, device) -> "TinyBackend":
        self.device = torch.device(device)
        self.transformer = move_module(self.transformer, self.device, self.dtype)
        self.text_encoder = move_module(self.text_encoder, self.device, self.dtype)
        return self

    # -- text ---------------------------------------------------------------------------------
    def encode_text(self, prompts: list[str]) -> tuple[torch.Tensor, torch.Tensor]:
        """``(hidden (N, L, D), pooled (N, D))`` of ``prompts``, WITH gradient (pretraining)."""
        ids = tokenize(self.tokenizer, prompts, self.config.max_length).to(self.device)
        out = self.text_encoder(input_ids=ids)
        return out.last_hidden_state, out.pooler_output

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        """Encode ``prompts`` and "" once, without gradient; see ``PromptEmbeddings``."""
        with torch.no_grad():
            hidden, pooled = self.encode_text(list(prompts) + [""])
        return PromptEmbeddings(embeds=hidden[:-1], pooled=pooled[:-1],
                                uncond_embeds=hidden[-1:], uncond_pooled=pooled[-1:])

    # -- denoiser -----------------------------------------------------------------------------
    def predict(self, x: torch.Tensor, sigma: torch.Tensor, hidden: torch.Tensor,
                pooled: torch.Tensor) -> torch.Tensor:
        """Raw transformer velocity ``(B, 3, S, S)`` float32; ``sigma (B,)`` in [0, 1]."""
        out = self.transformer(
            hidden_states=x.to(self.dtype),
            encoder_hidden_states=hidden.to(self.dtype),
            pooled_projections=pooled.to(self.dtype),
            # SD3's time embedding expects 1000 * sigma, in fp32 as StableDiffusion3Pipeline passes it (its
            # sinusoidal projection runs in fp32; a bf16 cast would round 923.1 to 924).
            timestep=sigma.float() * 1000.0,
            return_dict=False,
        )[0]
        return out.float()

    def velocity(self, x, sigma, embeds: PromptEmbeddings, guidance_scale: float) -> torch.Tensor:
        """Guided velocity ``(B, 3, S, S)`` float32 (see ``FlowBackend.velocity``).

        With guidance the unconditional and conditional branches run as ONE doubled batch
        ``[uncond; cond]``; ``guidance_scale == 1`` runs the conditional branch alone.
        """
        return guided_velocity(self.predict, self.device, x, sigma, embeds, guidance_scale)

    def decode(self, x: torch.Tensor) -> np.ndarray:
        """RGB latents in [-1, 1] ``(B, 3, S, S)`` -> ``uint8 (B, S, S, 3)`` (values clamped)."""
        img = ((x.detach().float().clamp(-1.0, 1.0) + 1.0) * 127.5).round().to(torch.uint8)
        return img.permute(0, 2, 3, 1).cpu().numpy()

    def encode_images(self, images: np.ndarray) -> torch.Tensor:
        """``uint8 (B, S, S, 3)`` -> latents ``(B, 3, S, S)`` float32 in [-1, 1] (decode's inverse)."""
        t = torch.from_numpy(np.ascontiguousarray(images)).to(self.device)
        return t.permute(0, 3, 1, 2).float() / 127.5 - 1.0

    def modules(self) -> list[torch.nn.Module]:
        """The trainable modules: ``[transformer, text_encoder]``."""
        return [self.transformer, self.text_encoder]

    def num_parameters(self) -> int:
        return sum(p.numel() for m in self.modules() for p in m.parameters())

    # -- persistence --------------------------------------------------------------------------
    def save_pretrained(self, folder) -> None:
        """Write the diffusers layout: ``transformer/ text_encoder/ tokenizer/ scheduler/`` +
        ``tpgrpo_model.json`` (kind, image size, architecture)."""
        from diffusers import FlowMatchEulerDiscreteScheduler

        folder = Path(folder)
        folder.mkdir(parents=True, exist_ok=True)
        self.transformer.save_pretrained(folder / "transformer")
        self.text_encoder.save_pretrained(folder / "text_encoder")
        self.tokenizer.save_pretrained(folder / "tokenizer")
        # The scheduler is for stock-pipeline compatibility; tpgrpo samples with flow_sigmas.
        FlowMatchEulerDiscreteScheduler(num_train_timesteps=1000, shift=1.0).save_pretrained(
            folder / "scheduler")
        meta = {"kind": self.kind, "image_size": self.config.image_size,
                "latent_shape": list(self.latent_shape), "config": asdict(self.config)}
        (folder / MODEL_JSON).write_text(json.dumps(meta, indent=2) + "\n")


def build_tiny(config: TinyConfig | None = None, seed: int = 0, words: list[str] | None = None,
               charset: str | None = None) -> TinyBackend:
    """A freshly initialised tiny model (weights depend only on ``config`` and ``seed``).

    ``words``/``charset`` default to ``tpgrpo.tasks.prompts.VOCABULARY``/``TEXT_CHARSET``.
    """
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextConfig, CLIPTextModel

    config = config or TinyConfig()
    if words is None or charset is None:
        default_words, default_charset = _default_vocabulary()
        words = default_words if words is None else words
        charset = default_charset if charset is None else charset
    if config.image_size % config.patch_size:
        raise ValueError(f"image_size {config.image_size} not divisible by patch {config.patch_size}")
    tokenizer = build_tokenizer(words, charset, config.max_length)
    vocab = tokenizer.get_vocab()
    text_config = CLIPTextConfig(
        vocab_size=len(vocab), hidden_size=config.text_hidden, intermediate_size=config.text_intermediate,
        num_hidden_layers=config.text_layers, num_attention_heads=config.text_heads,
        max_position_embeddings=config.max_length, projection_dim=config.text_hidden,
        pad_token_id=vocab["[PAD]"], bos_token_id=vocab["<bos>"], eos_token_id=vocab[EOS])
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoder = CLIPTextModel(text_config)
        transformer = SD3Transformer2DModel(
            sample_size=config.image_size, patch_size=config.patch_size, in_channels=3, out_channels=3,
            num_layers=config.num_layers, attention_head_dim=config.head_dim,
            num_attention_heads=config.num_heads, joint_attention_dim=config.text_hidden,
            caption_projection_dim=config.num_heads * config.head_dim,  # must equal the model width
            pooled_projection_dim=config.text_hidden,
            pos_embed_max_size=config.image_size // config.patch_size)
    return TinyBackend(transformer, text_encoder, tokenizer, config)


def _check_folder(folder: Path) -> None:
    """Raise a one-line FileNotFoundError naming what is missing from a model folder."""
    expected = f"{', '.join(s + '/' for s in SUBFOLDERS)} and {MODEL_JSON}"
    if not folder.is_dir():
        raise FileNotFoundError(
            f"model folder {folder} does not exist (expected a folder with {expected}; "
            "create one with `tpgrpo pretrain`)")
    for name in SUBFOLDERS:
        if not (folder / name).is_dir():
            raise FileNotFoundError(f"model folder {folder} has no {name}/ sub-folder (expected {expected})")
    if not (folder / MODEL_JSON).is_file():
        raise FileNotFoundError(f"model folder {folder} has no {MODEL_JSON} (expected {expected})")


def load_tiny(folder, device="cpu", dtype: torch.dtype = torch.float32) -> TinyBackend:
    """Load a folder written by ``TinyBackend.save_pretrained`` (local files only, no hub)."""
    from diffusers import SD3Transformer2DModel
    from transformers import CLIPTextModel, PreTrainedTokenizerFast

    folder = Path(os.fspath(folder))
    _check_folder(folder)
    meta = json.loads((folder / MODEL_JSON).read_text())
    if meta.get("kind") != "tiny":
        raise ValueError(f"{folder / MODEL_JSON} says kind={meta.get('kind')!r}, expected 'tiny'")
    config = TinyConfig.from_dict(meta["config"])
    transformer = SD3Transformer2DModel.from_pretrained(folder / "transformer", torch_dtype=dtype,
                                                        local_files_only=True)
    text_encoder = CLIPTextModel.from_pretrained(folder / "text_encoder", dtype=dtype, local_files_only=True)
    tokenizer = PreTrainedTokenizerFast.from_pretrained(folder / "tokenizer", local_files_only=True)
    return TinyBackend(transformer, text_encoder, tokenizer, config, device=device, dtype=dtype)
