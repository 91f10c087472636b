"""Tiny, randomly initialised SD3 and FLUX pipelines built offline from configs (no hub), saved with the
stock ``save_pretrained`` so the backends load them exactly as they would load SD3.5-M or FLUX.1-dev.

Sizes: 64 x 64 images, a 4-level VAE (factor 8) with 16 latent channels -> latents (16, 8, 8); CLIP
tokenizers are byte-level BPE with no merges (one token per character) over a 32-token window.
"""

from __future__ import annotations

from pathlib import Path

import torch

RESOLUTION = 64
CLIP_LENGTH = 32  # tokens per prompt of the CLIP tokenizers (model_max_length)
T5_LENGTH = 64  # model_max_length of the T5 tokenizer (the backends pad to their max_sequence_length)


def clip_tokenizer():
    """A real ``CLIPTokenizer`` over the 256 byte-level characters (+ end-of-word forms), no merges."""
    from tokenizers import pre_tokenizers
    from transformers import CLIPTokenizer

    chars = sorted(pre_tokenizers.ByteLevel.alphabet())
    vocab = {"<|startoftext|>": 0}
    for c in chars + [c + "</w>" for c in chars]:
        vocab.setdefault(c, len(vocab))
    vocab["<|endoftext|>"] = len(vocab)  # the highest id: CLIP pools at the end token either way
    return CLIPTokenizer(vocab=vocab, merges=[], model_max_length=CLIP_LENGTH)


def t5_tokenizer():
    """A real ``T5Tokenizer`` (Unigram) over lower-case letters, digits and a few marks."""
    from transformers import T5Tokenizer

    pieces = [("<pad>", 0.0), ("</s>", 0.0), ("<unk>", 0.0), ("\u2581", -2.0)]
    pieces += [(c, -1.0) for c in "abcdefghijklmnopqrstuvwxyz0123456789\"'"]
    return T5Tokenizer(vocab=pieces, extra_ids=0, model_max_length=T5_LENGTH)


def _clip_config(vocab_size: int, projection: bool):
    from transformers import CLIPTextConfig

    return CLIPTextConfig(vocab_size=vocab_size, hidden_size=32, intermediate_size=37, num_hidden_layers=2,
                          num_attention_heads=4, max_position_embeddings=CLIP_LENGTH,
                          projection_dim=32 if projection else 512, bos_token_id=0,
                          eos_token_id=vocab_size - 1, pad_token_id=vocab_size - 1)


def _t5(vocab_size: int, d_model: int):
    from transformers import T5Config, T5EncoderModel

    return T5EncoderModel(T5Config(vocab_size=vocab_size, d_model=d_model, d_kv=8, d_ff=64, num_layers=1,
                                   num_heads=2, relative_attention_num_buckets=8)).eval()


def _vae(shift: float, scale: float):
    from diffusers import AutoencoderKL

    return AutoencoderKL(sample_size=RESOLUTION, in_channels=3, out_channels=3, block_out_channels=(8, 8, 8, 8),
                         down_block_types=("DownEncoderBlock2D",) * 4, up_block_types=("UpDecoderBlock2D",) * 4,
                         layers_per_block=1, latent_channels=16, norm_num_groups=4, use_quant_conv=False,
                         use_post_quant_conv=False, shift_factor=shift, scaling_factor=scale).eval()


def build_sd3_pipeline(seed: int = 0):
    """A tiny stock ``StableDiffusion3Pipeline`` (2 joint blocks, 2 heads of 8, T5 width 64)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, SD3Transformer2DModel, StableDiffusion3Pipeline
    from transformers import CLIPTextModelWithProjection

    tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        text_encoders = [CLIPTextModelWithProjection(_clip_config(len(tok), True)).eval() for _ in range(2)]
        transformer = SD3Transformer2DModel(
            sample_size=RESOLUTION // 8, patch_size=2, in_channels=16, out_channels=16, num_layers=2,
            attention_head_dim=8, num_attention_heads=2, joint_attention_dim=64, caption_projection_dim=16,
            pooled_projection_dim=64, pos_embed_max_size=32).eval()
        pipe = StableDiffusion3Pipeline(
            transformer=transformer, scheduler=FlowMatchEulerDiscreteScheduler(shift=3.0), vae=_vae(0.0609, 1.5035),
            text_encoder=text_encoders[0], tokenizer=tok, text_encoder_2=text_encoders[1], tokenizer_2=tok,
            text_encoder_3=_t5(len(t5_tok), 64), tokenizer_3=t5_tok)
    return pipe


def build_flux_pipeline(seed: int = 0):
    """A tiny stock ``FluxPipeline`` (1 double + 2 single blocks, 2 heads of 16, guidance embedding)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, FluxPipeline, FluxTransformer2DModel
    from transformers import CLIPTextModel

    tok, t5_tok = clip_tokenizer(), t5_tokenizer()
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        transformer = FluxTransformer2DModel(
            patch_size=1, in_channels=64, num_layers=1, num_single_layers=2, attention_head_dim=16,
            num_attention_heads=2, joint_attention_dim=32, pooled_projection_dim=32, guidance_embeds=True,
            axes_dims_rope=(4, 4, 8)).eval()
        pipe = FluxPipeline(
            scheduler=FlowMatchEulerDiscreteScheduler(shift=1.0), vae=_vae(0.1159, 0.3611),
            text_encoder=CLIPTextModel(_clip_config(len(tok), False)).eval(), tokenizer=tok,
            text_encoder_2=_t5(len(t5_tok), 32), tokenizer_2=t5_tok, transformer=transformer)
    return pipe


def save_pipeline(pipe, folder: Path) -> Path:
    """``save_pretrained`` into ``folder`` (safetensors) and return it."""
    pipe.save_pretrained(folder, safe_serialization=True)
    return folder


# -- a project on a tiny pipeline, driven through the real CLI ---------------------------------------

PROJECT_PARAMS = {  # one short iteration: 2 prompts x 2 samples, T = 3 (window 2), 64 x 64 images
    "task": {"reward": "jpeg_compressibility", "eval_reward": "jpeg_compressibility"},
    "sampling": {"num_steps": 3, "window_size": 2, "shift": 3.0},
    "rollout": {"prompts_per_iter": 2, "group_size": 2, "batch_size": 4},
    "probe": {"batch_size": 8},
    "update": {"lora_rank": 4, "lora_alpha": 8, "micro_batch": 8, "optimizer_steps_per_iter": 2,
               "lr": 2.0e-2, "clip_range": 0.2, "min_transitions_per_step": 1},
    "train": {"iterations": 1},
}


def make_pipeline_project(root: Path, model_dir: Path, kind: str, **sections) -> Path:
    """A tiny project (conftest.make_tiny_project) whose model is the saved ``kind`` pipeline."""
    import yaml
    from conftest import make_tiny_project, tiny_params

    make_tiny_project(root, model_dir)  # copies model_dir to data/base
    overrides = {**PROJECT_PARAMS, "model": {"kind": kind, "path": "data/base", "resolution": RESOLUTION}}
    for section, values in sections.items():
        overrides[section] = {**overrides.get(section, {}), **values}
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(**overrides), sort_keys=False))
    return root


def cli(*args: str):
    """Invoke the tpgrpo CLI in-process (typer CliRunner); returns the result."""
    from typer.testing import CliRunner

    from tpgrpo.cli import app

    return CliRunner().invoke(app, [str(a) for a in args])


def run_stages(root: Path, iteration: int = 1, names=("rollout", "probe", "credit", "update")) -> None:
    for name in names:
        result = cli("stage", name, "--iter", str(iteration), "--params", str(root / "params.yaml"))
        assert result.exit_code == 0, f"{name}: {result.output}"


def check_lora_loads_into_stock_pipeline(pipe, lora_dir: Path, saved: dict, prompt: str, **call) -> None:
    """``pipe.load_lora_weights(lora_dir)`` loads every exported key with its value (none silently dropped)
    and changes the pipeline's image (same seed, ``call`` = extra pipeline arguments)."""
    import numpy as np
    from peft.utils import get_peft_model_state_dict

    before = pipe(prompt, generator=torch.Generator().manual_seed(0), output_type="np", **call).images
    pipe.load_lora_weights(lora_dir)
    after = pipe(prompt, generator=torch.Generator().manual_seed(0), output_type="np", **call).images
    assert np.abs(after - before).max() > 1e-3
    (name,) = pipe.get_list_adapters()["transformer"]
    loaded = get_peft_model_state_dict(pipe.transformer, adapter_name=name)
    assert set(loaded) == {k.removeprefix("transformer.") for k in saved}
    for key, value in saved.items():
        torch.testing.assert_close(loaded[key.removeprefix("transformer.")], value)


def check_bad_model_path_is_one_line(project: Path, scratch: Path) -> None:
    """A copy of ``project`` whose ``model.path`` does not exist: the rollout fails with one line naming it."""
    import shutil

    import yaml

    bad = shutil.copytree(project, scratch / "bad", ignore=shutil.ignore_patterns("iters"))
    raw = yaml.safe_load((bad / "params.yaml").read_text())
    raw["model"]["path"] = "data/no-such-model"
    (bad / "params.yaml").write_text(yaml.safe_dump(raw))
    result = cli("stage", "rollout", "--iter", "1", "--params", str(bad / "params.yaml"))
    lines = [line for line in result.output.splitlines() if line.strip()]
    assert result.exit_code != 0 and len(lines) == 1 and "data/no-such-model" in lines[0], result.output


def timesteps_seen(backend, sigma, prompts, guidance_scale: float):
    """``(timestep arguments the transformer received, velocity)`` for one ``backend.velocity`` call on
    ``len(sigma)`` fresh noises (a forward pre-hook records the keyword)."""
    seen = []
    hook = backend.transformer.register_forward_pre_hook(lambda m, args, kw: seen.append(kw["timestep"]),
                                                         with_kwargs=True)
    try:
        with torch.no_grad():
            v = backend.velocity(backend.initial_noise(list(range(1, len(sigma) + 1))), sigma,
                                 backend.encode_prompts(prompts), guidance_scale)
    finally:
        hook.remove()
    return seen, v
