"""LoRA policy: attach, reference mode, save/load (peft and diffusers), EMA."""

from __future__ import annotations

import json

import pytest
import torch

from tpgrpo.policy import lora as policy
from tpgrpo.models.tiny import TinyConfig, build_tiny

TINY = TinyConfig(image_size=16, patch_size=4, num_layers=2, num_heads=2, head_dim=8, text_layers=1,
                  text_hidden=16, text_heads=2, text_intermediate=32, max_length=8)
WORDS, CHARSET = ["red", "blue", "circle", "square", "a"], "ab"
PROMPTS = ["red circle", "blue square"]


def make_backend(seed: int = 0):
    return build_tiny(TINY, seed=seed, words=WORDS, charset=CHARSET)


def randomize_lora(backend, seed: int = 1, scale: float = 0.3) -> None:
    """Give the adapter nonzero weights (at init lora_B = 0 and the adapter is a no-op)."""
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for _, p in policy.lora_parameters(backend):
            p.copy_(torch.randn(p.shape, generator=gen) * scale)


def probe_inputs(backend):
    gen = torch.Generator().manual_seed(5)
    x = torch.randn(2, *backend.latent_shape, generator=gen)
    return x, torch.tensor([1.0, 0.4]), backend.encode_prompts(PROMPTS)


def velocity(backend, inputs):
    x, s, emb = inputs
    with torch.no_grad():
        return backend.velocity(x, s, emb, 4.5)


def test_attach_is_identity_at_init_and_only_lora_trains():
    backend = make_backend()
    inputs = probe_inputs(backend)
    before = velocity(backend, inputs)
    policy.attach_lora(backend, rank=4, alpha=8)
    assert torch.equal(velocity(backend, inputs), before)
    lora = policy.lora_parameters(backend)
    assert lora and all(p.requires_grad and p.dtype == torch.float32 for _, p in lora)
    trainable = [n for n, p in backend.transformer.named_parameters() if p.requires_grad]
    assert len(trainable) == len(lora)
    assert not any(p.requires_grad for p in backend.text_encoder.parameters())
    with pytest.raises(ValueError, match="already has a LoRA"):
        policy.attach_lora(backend, rank=4, alpha=8)


def test_reference_mode_is_the_base_model_and_restores_flags():
    backend = make_backend()
    inputs = probe_inputs(backend)
    base = velocity(backend, inputs)
    policy.attach_lora(backend, rank=4, alpha=8)
    randomize_lora(backend)
    adapted = velocity(backend, inputs)
    assert not torch.allclose(adapted, base)
    with policy.reference_mode(backend):
        assert torch.equal(velocity(backend, inputs), base)
    assert torch.equal(velocity(backend, inputs), adapted)
    assert all(p.requires_grad for _, p in policy.lora_parameters(backend))


def test_save_then_attach_in_fresh_backend_gives_identical_velocities(tmp_path):
    backend = make_backend()
    inputs = probe_inputs(backend)
    policy.attach_lora(backend, rank=4, alpha=8)
    randomize_lora(backend)
    expected = velocity(backend, inputs)
    folder = policy.save_adapter(backend, tmp_path / "policy")
    assert sorted(p.name for p in folder.iterdir()) == [policy.CONFIG_FILE, policy.WEIGHTS_FILE, "sha256.json"]
    assert json.loads((folder / policy.CONFIG_FILE).read_text())["r"] == 4
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no temp left behind
    fresh = make_backend()
    policy.attach_lora(fresh, rank=4, alpha=8, adapter_dir=folder)
    assert torch.equal(velocity(fresh, inputs), expected)
    with pytest.raises(ValueError, match="rank 4, alpha 8"):
        policy.attach_lora(make_backend(), rank=8, alpha=8, adapter_dir=folder)
    with pytest.raises(FileNotFoundError, match="adapter folder"):
        policy.attach_lora(make_backend(), rank=4, alpha=8, adapter_dir=tmp_path / "nothing")


def test_diffusers_pipeline_loads_the_saved_adapter(tmp_path):
    """A stock StableDiffusion3Pipeline (tiny transformer; no text encoders or VAE are needed to load
    a transformer LoRA) reads the folder with ``load_lora_weights`` and gets the same model, alpha
    included (the adapter metadata carries it)."""
    from diffusers import FlowMatchEulerDiscreteScheduler, StableDiffusion3Pipeline

    backend = make_backend()
    inputs = probe_inputs(backend)
    policy.attach_lora(backend, rank=4, alpha=8)
    randomize_lora(backend)
    expected = velocity(backend, inputs)
    policy.save_adapter(backend, tmp_path / "policy")
    fresh = make_backend()
    pipe = StableDiffusion3Pipeline(
        transformer=fresh.transformer, scheduler=FlowMatchEulerDiscreteScheduler(), vae=None,
        text_encoder=None, tokenizer=None, text_encoder_2=None, tokenizer_2=None,
        text_encoder_3=None, tokenizer_3=None)
    pipe.load_lora_weights(tmp_path / "policy")
    assert torch.equal(velocity(fresh, inputs), expected)


def test_ema_schedule_state_and_export(tmp_path):
    backend = make_backend()
    policy.attach_lora(backend, rank=2, alpha=2)
    ema = policy.LoraEMA(backend)
    assert ema.decay(8) == pytest.approx(9 / 18) and ema.decay(1000) == 0.9
    start = {k: v.clone() for k, v in ema.shadow.items()}
    randomize_lora(backend)
    weights = policy.lora_state_dict(backend)
    assert [ema.step(backend) for _ in range(8)] == [False] * 7 + [True]
    for key, avg in ema.shadow.items():  # one update at n = 8: decay 0.5
        torch.testing.assert_close(avg, 0.5 * start[key] + 0.5 * weights[key])
    clone = policy.LoraEMA(backend)
    clone.load_state_dict(ema.state_dict())
    assert clone.num_steps == 8 and all(torch.equal(clone.shadow[k], v) for k, v in ema.shadow.items())
    ema.save_adapter(backend, tmp_path / "ema")
    exported = policy.read_adapter_weights(tmp_path / "ema")
    assert all(torch.equal(exported[k], v) for k, v in ema.shadow.items())
    with ema.applied(backend):
        assert all(torch.equal(policy.lora_state_dict(backend)[k], v) for k, v in ema.shadow.items())
    assert all(torch.equal(policy.lora_state_dict(backend)[k], v) for k, v in weights.items())
