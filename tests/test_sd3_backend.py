"""The SD3 backend on a tiny random stock StableDiffusion3Pipeline: shapes, agreement with diffusers'
own pipeline, one RL iteration through the CLI, prompt-embedding cache, LoRA export, folder errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pytest
import torch
from tiny_pipelines import (RESOLUTION, check_bad_model_path_is_one_line, check_lora_loads_into_stock_pipeline, cli,
                            make_pipeline_project, run_stages, timesteps_seen)

from tpgrpo.errors import PipelineError
from tpgrpo.models import load_backend

PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module")
def backend(sd3_model_dir):
    return load_backend("sd3", sd3_model_dir, resolution=RESOLUTION)


@pytest.fixture(scope="module")
def trained(sd3_model_dir, tmp_path_factory):
    """A project after one rollout -> probe -> credit -> update iteration through the CLI."""
    root = make_pipeline_project(tmp_path_factory.mktemp("sd3proj") / "p", sd3_model_dir, "sd3")
    run_stages(root, 1)
    return root


def test_shapes_dtypes_and_default_resolution(backend, sd3_model_dir):
    assert backend.latent_shape == (16, RESOLUTION // 8, RESOLUTION // 8)
    assert load_backend("sd3", sd3_model_dir).resolution == 512  # 0 / None -> the paper's 512
    emb = backend.encode_prompts(PROMPTS)
    assert emb.embeds.shape == (2, 32 + 256, 64) and emb.pooled.shape == (2, 64)  # CLIP 32 + T5 256 tokens
    assert emb.uncond_embeds.shape == (1, 288, 64) and not torch.equal(emb.uncond_embeds[0], emb.embeds[0])
    x = backend.initial_noise([1, 2])
    v = backend.velocity(x, torch.tensor([1.0, 0.4]), emb, 4.5)
    assert v.shape == x.shape and v.dtype == torch.float32 and torch.isfinite(v).all()
    images = backend.decode(x)
    assert images.shape == (2, RESOLUTION, RESOLUTION, 3) and images.dtype == np.uint8
    half = load_backend("sd3", sd3_model_dir, dtype="bf16", resolution=RESOLUTION)
    assert half.transformer.dtype == torch.bfloat16
    assert half.velocity(x, 0.5, half.encode_prompts(PROMPTS), 4.5).dtype == torch.float32


def test_cfg_runs_one_doubled_batch(backend):
    emb = backend.encode_prompts(PROMPTS)
    x, s = backend.initial_noise([3, 4]), torch.tensor([0.9, 0.3])
    batches = []
    hook = backend.transformer.register_forward_hook(
        lambda m, args, kw, out: batches.append(kw["hidden_states"].shape[0]), with_kwargs=True)
    try:
        with torch.no_grad():
            v = backend.velocity(x, s, emb, 4.5)
    finally:
        hook.remove()
    assert batches == [4]  # [uncond; cond] in one pass
    with torch.no_grad():
        v_cond = backend.predict(x, s * 1.0, emb.embeds, emb.pooled)
        u, up = emb.uncond(2)
        v_uncond = backend.predict(x, s * 1.0, u, up)
    torch.testing.assert_close(v, v_uncond + 4.5 * (v_cond - v_uncond), atol=1e-5, rtol=1e-5)


def test_ode_sampling_matches_the_stock_pipeline(backend, sd3_model_dir):
    """Same noise, same sigmas: our encode + CFG velocity + Euler + decode == StableDiffusion3Pipeline."""
    from diffusers import StableDiffusion3Pipeline

    from tpgrpo.policy.generate import sample_ode

    ours = sample_ode(backend, PROMPTS[:1], [7], num_steps=2, guidance_scale=4.5, shift=3.0)
    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_model_dir, local_files_only=True)
    ref = pipe(PROMPTS[0], num_inference_steps=2, guidance_scale=4.5, height=RESOLUTION, width=RESOLUTION,
               latents=backend.initial_noise([7]), output_type="np").images  # its scheduler: shift 3
    assert np.abs(ours[0].astype(np.float64) / 255.0 - ref[0]).max() <= 1.0 / 255 + 1e-4


def test_low_precision_weights_still_give_float32_velocities(sd3_model_dir):
    half = load_backend("sd3", sd3_model_dir, dtype="bf16", resolution=RESOLUTION)
    assert next(half.transformer.parameters()).dtype == torch.bfloat16
    assert next(half.vae.parameters()).dtype == torch.float32  # the VAE always decodes in fp32
    emb = half.encode_prompts(PROMPTS)
    with torch.no_grad():
        v = half.velocity(half.initial_noise([1, 2]), torch.tensor([1.0, 0.5]), emb, 4.5)
    assert v.dtype == torch.float32 and torch.isfinite(v).all()


def test_bf16_transformer_gets_fp32_timesteps_like_the_stock_pipeline(sd3_model_dir):
    """StableDiffusion3Pipeline passes ``t.expand(B)``, fp32 ``1000 sigma``; a bf16 cast would round 923.1 to 924."""
    half = load_backend("sd3", sd3_model_dir, dtype="bf16", resolution=RESOLUTION)
    sigma = torch.tensor([0.9231, 0.4567])
    seen, v = timesteps_seen(half, sigma, PROMPTS, 4.5)
    assert len(seen) == 1 and seen[0].dtype == torch.float32
    assert torch.equal(seen[0], torch.cat([sigma, sigma]) * 1000.0)


def test_lora_targets_the_attention_projections_of_both_streams(sd3_model_dir):
    from peft.tuners.lora import LoraLayer

    from tpgrpo.policy.lora import attach_lora

    fresh = load_backend("sd3", sd3_model_dir, resolution=RESOLUTION)
    attach_lora(fresh, 4, 8)
    adapted = {n for n, m in fresh.transformer.named_modules() if isinstance(m, LoraLayer)}
    for name in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.to_out.0",
                 "transformer_blocks.0.attn.add_k_proj", "transformer_blocks.0.attn.to_add_out"):
        assert name in adapted, name
    assert not any(".ff." in n or n.startswith("proj_out") for n in adapted)


def test_bad_model_folders_are_one_line_errors(sd3_model_dir, flux_model_dir, tmp_path):
    cases = {tmp_path / "nope": "does not exist", flux_model_dir: "FluxPipeline"}
    (tmp_path / "empty").mkdir()
    cases[tmp_path / "empty"] = "model_index.json"
    partial = shutil.copytree(sd3_model_dir, tmp_path / "partial")
    shutil.rmtree(partial / "vae")
    cases[partial] = "vae/"
    for folder, expected in cases.items():
        with pytest.raises(PipelineError) as info:
            load_backend("sd3", folder)
        msg = str(info.value)
        assert expected in msg and str(folder) in msg and "\n" not in msg, msg


def test_one_iteration_through_the_cli_and_a_bad_path(trained, tmp_path):
    import zarr

    d = trained / "data" / "iters" / "0001"
    store = zarr.open_group(str(d / "trajectories.zarr"), mode="r")
    assert store["states"].shape == (4, 3, 16, RESOLUTION // 8, RESOLUTION // 8)
    update = json.loads((d / "update.json").read_text())
    assert update["first_pass_ratio_max_dev"] < 1e-5 and update["approx_kl_after"] > 0
    assert json.loads((d / "rollout.json").read_text())["cfg_doubled"] is True

    check_bad_model_path_is_one_line(trained, tmp_path)


def test_cached_prompt_embeddings_never_load_the_text_encoders(trained):
    import zarr

    from tpgrpo.io.artifacts import IterationPaths
    from tpgrpo.config import load_config
    from tpgrpo.policy.loading import load_policy, prompt_embeddings
    from tpgrpo.tasks.prompts import load_prompts

    cfg = load_config(trained / "params.yaml")
    assert IterationPaths(trained, 1).prompt_embeds.is_file()  # the rollout wrote it
    store = zarr.open_group(str(trained / "data" / "iters" / "0001" / "trajectories.zarr"), mode="r")
    prompts = [m["prompt"] for m in store.attrs["prompts"]]
    backend = load_policy(cfg, trained, 1)
    cached = prompt_embeddings(cfg, trained, 1, backend, prompts)
    assert not backend.text_encoders_loaded  # read from the file
    fresh = backend.encode_prompts(prompts)
    assert backend.text_encoders_loaded
    torch.testing.assert_close(cached.embeds, fresh.embeds, atol=0, rtol=0)
    torch.testing.assert_close(cached.pooled, fresh.pooled, atol=0, rtol=0)
    other = load_prompts(trained / cfg.task.train_prompts)[-1]["prompt"]
    reencoded = prompt_embeddings(cfg, trained, 1, load_policy(cfg, trained, 1), [other])
    assert len(reencoded) == 1  # other prompts than the cache holds: encoded again, not a wrong cache hit
    backend.free_text_encoders()
    assert not backend.text_encoders_loaded


def test_export_loads_into_a_fresh_stock_pipeline(trained, sd3_model_dir, tmp_path):
    from diffusers import StableDiffusion3Pipeline
    from safetensors.torch import load_file

    from tpgrpo.config import load_config
    from tpgrpo.policy.loading import load_policy

    out = tmp_path / "lora"
    result = cli("export", "--iter", "1", "--out", str(out), "--params", str(trained / "params.yaml"))
    assert result.exit_code == 0, result.output
    saved = load_file(out / "pytorch_lora_weights.safetensors")
    assert any("lora_B" in k and v.abs().max() > 0 for k, v in saved.items())  # trained, not the zero init

    pipe = StableDiffusion3Pipeline.from_pretrained(sd3_model_dir, local_files_only=True)
    check_lora_loads_into_stock_pipeline(pipe, out, saved, PROMPTS[0], num_inference_steps=2,
                                         height=RESOLUTION, width=RESOLUTION)

    # The stock pipeline's adapted transformer is exactly policy 1 (iteration 1's update) (same alpha / rank scale).
    policy = load_policy(load_config(trained / "params.yaml"), trained, 2)  # sampled by iteration 2: policy 1
    x, emb = policy.initial_noise([5]), policy.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        ours = policy.predict(x, torch.tensor([0.6]), emb.embeds, emb.pooled)
        theirs = pipe.transformer(hidden_states=x, encoder_hidden_states=emb.embeds, pooled_projections=emb.pooled,
                                  timestep=torch.tensor([600.0]), return_dict=False)[0]
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)


def test_export_ema_and_errors(trained, tmp_path):
    params = str(trained / "params.yaml")
    policy = trained / "data" / "iters" / "0001" / "policy"
    ema = policy / "ema"  # what an update.ema run writes beside the adapter (here: a stand-in copy)
    ema.mkdir()
    shutil.copy(policy / "pytorch_lora_weights.safetensors", ema)
    shutil.copy(policy / "adapter_config.json", ema)
    try:
        result = cli("export", "--iter", "1", "--ema", "--out", str(tmp_path / "ema"), "--params", params)
        assert result.exit_code == 0, result.output
        assert (tmp_path / "ema" / "pytorch_lora_weights.safetensors").read_bytes() == \
            (ema / "pytorch_lora_weights.safetensors").read_bytes()
    finally:
        shutil.rmtree(ema)
    for args, what in ((["--iter", "5"], "iteration 5 has no policy"), (["--iter", "1", "--ema"], "no EMA adapter")):
        result = cli("export", *args, "--out", str(tmp_path / "x"), "--params", params)
        lines = [line for line in result.output.splitlines() if line.strip()]
        assert result.exit_code != 0 and len(lines) == 1 and what in lines[0], result.output
    assert not (tmp_path / "x").exists()


def test_loading_takes_the_stored_pos_embed_table_without_computing_it(sd3_model_dir, monkeypatch):
    """The 384 x 384 sin-cos table of SD3.5-M took 10 of 15 s to load here; the file holds it anyway."""
    import diffusers.models.embeddings as embeddings
    from diffusers import SD3Transformer2DModel

    from tpgrpo.models import sd3

    assert sd3._stores_pos_embed(sd3_model_dir / "transformer")
    computed, original = [], embeddings.get_2d_sincos_pos_embed
    monkeypatch.setattr(embeddings, "get_2d_sincos_pos_embed", lambda *a, **k: computed.append(1) or original(*a, **k))
    fast = sd3.load_sd3(sd3_model_dir).transformer.state_dict()
    assert not computed
    stock = SD3Transformer2DModel.from_pretrained(sd3_model_dir, subfolder="transformer").state_dict()
    assert computed and fast.keys() == stock.keys() and sd3.POS_EMBED_KEY in fast
    for key, value in stock.items():
        assert torch.equal(fast[key], value), key
