"""A stand-in for SD3.5-M with the real tensor shapes and none of its arithmetic (``bench/paper_bytes.py``).

What is real: every tensor a stage stores or reads has SD3.5-M's shape at 512 px. Latents are
``(16, 64, 64)`` float32; prompt embeddings ``(N, 333, 4096)`` and pooled ``(N, 2048)`` in the model dtype
(77 CLIP + 256 T5 tokens, as ``StableDiffusion3Pipeline.encode_prompt`` returns them); the LoRA targets are
SD3's (``tpgrpo.models.sd3.LORA_TARGETS``) on 24 joint blocks of width 1,536, the last one context-pre-only
(no ``to_add_out``): 191 linears of 1,536 x 1,536, so a rank-32 adapter has 18,776,064 float32 weights
(71.6 MiB) and AdamW keeps two more of each.

What is NOT: the velocity is ``-0.1 x`` plus a term from the pooled text embedding and one from the LoRA
weights (so the adapter trains and AdamW keeps state for every weight); the base linears are never run
(their weights are uninitialised memory, never read); "decoding" maps the first 3 latent channels to a
64 x 64 RGB image (the rewards score that). The model's compute and its load from disk are therefore not
measured here: ``bench/paper_bytes.py`` measures loads from the real-size folder separately.
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np
import torch
from diffusers import ConfigMixin, ModelMixin
from diffusers.configuration_utils import register_to_config
from diffusers.loaders.peft import PeftAdapterMixin

from tpgrpo.models.base import FlowBackend, PromptEmbeddings, as_sigma_batch
from tpgrpo.models.sd3 import LORA_TARGETS

MARKER = "standin.json"  # a model folder holding this file loads as the stand-in (bench/paper_standin/sitecustomize.py)
LATENT = (16, 64, 64)  # SD3.5-M's VAE latent at 512 px
TEXT_TOKENS, TEXT_DIM, POOLED_DIM = 333, 4096, 2048


def _linear(dim: int, dtype: torch.dtype) -> torch.nn.Linear:
    # uninitialised: the base weights are never read, and 191 x 4.5 MiB untouched pages cost no memory
    return torch.nn.utils.skip_init(torch.nn.Linear, dim, dim, dtype=dtype)


class _Attention(torch.nn.Module):
    """The eight projections of one SD3 joint block's ``attn`` (seven in the context-pre-only last block)."""

    def __init__(self, dim: int, dtype: torch.dtype, pre_only: bool):
        super().__init__()
        for name in ("to_q", "to_k", "to_v", "add_q_proj", "add_k_proj", "add_v_proj"):
            setattr(self, name, _linear(dim, dtype))
        self.to_out = torch.nn.ModuleList([_linear(dim, dtype)])
        self.to_add_out = None if pre_only else _linear(dim, dtype)


class _Block(torch.nn.Module):
    def __init__(self, dim: int, dtype: torch.dtype, pre_only: bool):
        super().__init__()
        self.attn = _Attention(dim, dtype, pre_only)


class StandinTransformer(ModelMixin, ConfigMixin, PeftAdapterMixin):
    """SD3.5-M's LoRA-target module tree (``transformer_blocks.{i}.attn.*``) and nothing else."""

    @register_to_config
    def __init__(self, num_layers: int = 24, dim: int = 1536, dtype: str = "bf16"):
        super().__init__()
        torch_dtype = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[dtype]
        self.transformer_blocks = torch.nn.ModuleList(
            _Block(dim, torch_dtype, pre_only=(i == num_layers - 1)) for i in range(num_layers))

    def lora_term(self) -> torch.Tensor:
        """A scalar through every LoRA weight (0 without an adapter): the adapter's only effect on velocities."""
        layers = [m for m in self.modules() if hasattr(m, "lora_A") and "default" in getattr(m, "lora_A", {})]
        if not layers:
            return torch.zeros(())
        ones = torch.ones(1, self.config.dim)
        return sum(m.lora_B["default"](m.lora_A["default"](ones)).mean() for m in layers)


class StandinBackend(FlowBackend):
    """``FlowBackend`` with SD3.5-M's shapes at 512 px and stand-in arithmetic (module docstring)."""

    kind = "sd3"
    cfg_doubles_batch = True

    def __init__(self, device="cpu", dtype: torch.dtype = torch.bfloat16):
        self.device = torch.device(device)
        self.dtype = dtype
        self.latent_shape = LATENT
        name = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
        self.transformer = StandinTransformer(dtype=name)
        self.lora_target_modules = list(LORA_TARGETS)

    def _text(self, prompt: str) -> tuple[torch.Tensor, torch.Tensor]:
        g = torch.Generator().manual_seed(zlib.crc32(prompt.encode()))
        return (torch.randn(TEXT_TOKENS, TEXT_DIM, generator=g).to(self.dtype),
                torch.randn(POOLED_DIM, generator=g).to(self.dtype))

    def encode_prompts(self, prompts: list[str]) -> PromptEmbeddings:
        rows = [self._text(p) for p in prompts]
        empty = self._text("")
        return PromptEmbeddings(torch.stack([r[0] for r in rows]), torch.stack([r[1] for r in rows]),
                                empty[0][None], empty[1][None])

    def predict(self, x: torch.Tensor, sigma: torch.Tensor, embeds: torch.Tensor, pooled: torch.Tensor) -> torch.Tensor:
        """Stand-in velocity ``(B, 16, 64, 64)`` float32."""
        text = pooled.float().mean(dim=1)[:, None, None, None]
        return -0.1 * x + 0.01 * text * sigma[:, None, None, None] + 1e-3 * torch.tanh(self.transformer.lora_term())

    def velocity(self, x, sigma, embeds: PromptEmbeddings, guidance_scale: float) -> torch.Tensor:
        """Guided as SD3 guides (``v_u + g (v_c - v_u)``), the two branches apart: the stand-in reads only the
        pooled embeddings, and a doubled batch of 333 x 4,096 token embeddings is seconds of copying here."""
        from tpgrpo.algo.sampling import cfg

        s = as_sigma_batch(sigma, x.shape[0], self.device)
        v_cond = self.predict(x, s, embeds.embeds, embeds.pooled)
        if guidance_scale == 1.0:
            return v_cond
        u_pooled = embeds.uncond_pooled.expand(x.shape[0], -1)
        return cfg(self.predict(x, s, None, u_pooled), v_cond, guidance_scale)

    def decode(self, x: torch.Tensor) -> np.ndarray:
        """The first 3 latent channels as a 64 x 64 uint8 RGB image (not a VAE decode)."""
        rgb = torch.tanh(x[:, :3].detach().float()).permute(0, 2, 3, 1)
        return ((rgb + 1.0) * 127.5).round().clamp(0, 255).to(torch.uint8).cpu().numpy()

    def modules(self) -> list[torch.nn.Module]:
        return [self.transformer]

    def num_parameters(self) -> int:
        return sum(p.numel() for p in self.transformer.parameters())


def is_standin(path) -> bool:
    return (Path(path) / MARKER).is_file()
