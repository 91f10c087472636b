"""The FLUX backend on a tiny random stock FluxPipeline: packing, guidance embedding (no CFG), agreement
with diffusers' own pipeline, LoRA targets, one RL iteration through the CLI, LoRA export, folder errors."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from tiny_pipelines import (RESOLUTION, check_bad_model_path_is_one_line, check_lora_loads_into_stock_pipeline, cli,
                            make_pipeline_project, run_stages, timesteps_seen)

from tpgrpo.errors import PipelineError
from tpgrpo.models import load_backend
from tpgrpo.models.flux import latent_image_ids, pack_latents, unpack_latents

PROMPTS = ["a red circle", "two blue squares"]


@pytest.fixture(scope="module")
def backend(flux_model_dir):
    return load_backend("flux", flux_model_dir, resolution=RESOLUTION)


@pytest.fixture(scope="module")
def trained(flux_model_dir, tmp_path_factory):
    """A project after one rollout -> probe -> credit -> update iteration through the CLI (guidance 3.5)."""
    root = make_pipeline_project(tmp_path_factory.mktemp("fluxproj") / "p", flux_model_dir, "flux",
                                 sampling={"guidance_scale": 3.5})
    run_stages(root, 1)
    return root


def test_pack_unpack_round_trip_matches_flux_pipeline():
    from diffusers import FluxPipeline

    x = torch.randn(3, 16, 8, 12)
    packed = pack_latents(x)
    assert packed.shape == (3, 4 * 6, 64)
    torch.testing.assert_close(packed, FluxPipeline._pack_latents(x, 3, 16, 8, 12), atol=0, rtol=0)
    torch.testing.assert_close(unpack_latents(packed, 8, 12), x, atol=0, rtol=0)
    torch.testing.assert_close(FluxPipeline._unpack_latents(packed, 64, 96, 8), x, atol=0, rtol=0)
    torch.testing.assert_close(latent_image_ids(8, 12, "cpu", torch.float32),
                               FluxPipeline._prepare_latent_image_ids(3, 4, 6, "cpu", torch.float32))


def test_shapes_and_the_guidance_embedding_instead_of_cfg(backend):
    assert backend.latent_shape == (16, RESOLUTION // 8, RESOLUTION // 8)  # public latents stay unpacked
    emb = backend.encode_prompts(PROMPTS)
    assert emb.embeds.shape == (2, 512, 32) and emb.pooled.shape == (2, 32)  # T5 512 tokens, CLIP pooled
    x, s = backend.initial_noise([1, 2]), torch.tensor([1.0, 0.4])
    batches = []
    hook = backend.transformer.register_forward_hook(
        lambda m, args, kw, out: batches.append((kw["hidden_states"].shape, kw["guidance"].tolist())),
        with_kwargs=True)
    try:
        with torch.no_grad():
            v35 = backend.velocity(x, s, emb, 3.5)
            v1 = backend.velocity(x, s, emb, 1.0)
    finally:
        hook.remove()
    assert batches == [((2, 16, 64), [3.5, 3.5]), ((2, 16, 64), [1.0, 1.0])]  # one pass, no doubled batch
    assert v35.shape == x.shape and v35.dtype == torch.float32 and not torch.allclose(v35, v1)
    assert backend.decode(x).shape == (2, RESOLUTION, RESOLUTION, 3)


def test_bf16_transformer_gets_fp32_sigmas_as_timesteps(flux_model_dir):
    """The timestep goes in as fp32 sigma (FLUX's transformer multiplies by 1000 itself), not rounded by us;
    FluxTransformer2DModel then casts it to its own dtype, exactly as it does under FluxPipeline."""
    half = load_backend("flux", flux_model_dir, dtype="bf16", resolution=RESOLUTION)
    sigma = torch.tensor([0.9231, 0.4567])
    seen, v = timesteps_seen(half, sigma, PROMPTS, 3.5)
    assert len(seen) == 1 and seen[0].dtype == torch.float32 and torch.equal(seen[0], sigma)


def test_ode_sampling_matches_the_stock_pipeline(backend, flux_model_dir):
    """Same packed noise, same sigmas, guidance 3.5: our sampler + decode == FluxPipeline."""
    from diffusers import FluxPipeline

    from tpgrpo.policy.generate import sample_ode
    from tpgrpo.algo.schedule import flow_sigmas

    ours = sample_ode(backend, PROMPTS[:1], [7], num_steps=2, guidance_scale=3.5, shift=3.0)
    pipe = FluxPipeline.from_pretrained(flux_model_dir, local_files_only=True)  # its scheduler: shift 1
    ref = pipe(PROMPTS[0], num_inference_steps=2, sigmas=flow_sigmas(2, 3.0)[:-1].tolist(), guidance_scale=3.5,
               height=RESOLUTION, width=RESOLUTION, latents=pack_latents(backend.initial_noise([7])),
               output_type="np").images
    assert np.abs(ours[0].astype(np.float64) / 255.0 - ref[0]).max() <= 1.0 / 255 + 1e-4


def test_lora_targets_attention_feed_forward_and_single_block_mlps(flux_model_dir):
    from peft.tuners.lora import LoraLayer

    from tpgrpo.policy.lora import attach_lora

    fresh = load_backend("flux", flux_model_dir, resolution=RESOLUTION)
    attach_lora(fresh, 4, 8)
    adapted = {n for n, m in fresh.transformer.named_modules() if isinstance(m, LoraLayer)}
    for name in ("transformer_blocks.0.attn.to_q", "transformer_blocks.0.attn.add_v_proj",
                 "transformer_blocks.0.ff.net.2", "transformer_blocks.0.ff_context.net.0.proj",
                 "single_transformer_blocks.1.attn.to_k", "single_transformer_blocks.1.proj_mlp",
                 "single_transformer_blocks.1.proj_out"):
        assert name in adapted, name
    assert "proj_out" not in adapted and "x_embedder" not in adapted  # the final projection stays frozen


def test_bad_model_folders_are_one_line_errors(sd3_model_dir, tmp_path):
    with pytest.raises(PipelineError) as info:
        load_backend("flux", sd3_model_dir)
    msg = str(info.value)
    assert "_class_name='StableDiffusion3Pipeline'" in msg and "FluxPipeline" in msg and "\n" not in msg
    with pytest.raises(PipelineError, match="does not exist"):
        load_backend("flux", tmp_path / "nope")


def test_one_iteration_through_the_cli_and_a_bad_path(trained, tmp_path):
    import zarr

    d = trained / "data" / "iters" / "0001"
    store = zarr.open_group(str(d / "trajectories.zarr"), mode="r")
    assert store["states"].shape == (4, 3, 16, RESOLUTION // 8, RESOLUTION // 8)
    assert store.attrs["guidance_scale"] == 3.5
    update = json.loads((d / "update.json").read_text())
    assert update["first_pass_ratio_max_dev"] < 1e-5 and update["approx_kl_after"] > 0
    assert json.loads((d / "rollout.json").read_text())["cfg_doubled"] is False

    check_bad_model_path_is_one_line(trained, tmp_path)


def test_export_loads_into_a_fresh_stock_pipeline(trained, flux_model_dir, tmp_path):
    from diffusers import FluxPipeline
    from safetensors.torch import load_file

    from tpgrpo.config import load_config
    from tpgrpo.policy.loading import load_policy

    out = tmp_path / "lora"
    result = cli("export", "--iter", "1", "--out", str(out), "--params", str(trained / "params.yaml"))
    assert result.exit_code == 0, result.output
    saved = load_file(out / "pytorch_lora_weights.safetensors")
    assert any(".ff.net.2.lora_B" in k for k in saved)
    assert any("single_transformer_blocks.0.proj_out" in k for k in saved)

    pipe = FluxPipeline.from_pretrained(flux_model_dir, local_files_only=True)
    check_lora_loads_into_stock_pipeline(pipe, out, saved, PROMPTS[0], num_inference_steps=2, height=RESOLUTION,
                                         width=RESOLUTION, guidance_scale=3.5)

    # The stock pipeline's adapted transformer gives policy 1 (iteration 1's update)'s velocity.
    policy = load_policy(load_config(trained / "params.yaml"), trained, 2)  # sampled by iteration 2: policy 1
    x, emb = policy.initial_noise([5]), policy.encode_prompts(PROMPTS[:1])
    with torch.no_grad():
        ours = policy.velocity(x, torch.tensor([0.6]), emb, 3.5)
        policy.transformer = pipe.transformer
        theirs = policy.velocity(x, torch.tensor([0.6]), emb, 3.5)
    torch.testing.assert_close(ours, theirs, atol=1e-5, rtol=1e-5)
