"""The tiny backend, its tokenizer and ODE sampling, on a TINY config (never the shipped weights)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from tpgrpo.models import load_backend
from tpgrpo.models.tiny import TinyConfig, build_tiny, load_tiny
from tpgrpo.models.tokenizer import EOS, PAD, tokenize
from tiny_pipelines import timesteps_seen
from tpgrpo.policy.generate import sample_ode, save_grid

WORDS = "a an the one two three red green blue circle circles square squares left right of and sign that says".split()
CHARSET = "0123456789AB"
CONFIG = TinyConfig(image_size=16, patch_size=4, num_layers=1, num_heads=2, head_dim=8, text_layers=1,
                    text_hidden=16, text_heads=2, text_intermediate=32, max_length=16)
PROMPTS = ["a red circle", 'a sign that says "42"', "two blue squares", ""]


@pytest.fixture(scope="module")
def backend():
    return build_tiny(CONFIG, seed=0, words=WORDS, charset=CHARSET)


def _tokens(backend, prompt):
    ids = tokenize(backend.tokenizer, [prompt], CONFIG.max_length)[0]
    return backend.tokenizer.convert_ids_to_tokens(ids.tolist())


def test_quoted_text_is_tokenized_per_character(backend):
    toks = _tokens(backend, 'a sign that says "42AB"')
    assert toks[:11] == ["<bos>", "a", "sign", "that", "says", '"', "4", "2", "A", "B", '"']
    assert toks[11] == EOS and set(toks[12:]) == {PAD}
    assert "[UNK]" not in toks


def test_eos_has_the_highest_id_and_empty_prompt_works(backend):
    vocab = backend.tokenizer.get_vocab()
    assert vocab[EOS] == max(vocab.values())
    assert backend.text_encoder.config.eos_token_id == vocab[EOS]
    assert _tokens(backend, "")[:3] == ["<bos>", EOS, PAD]
    emb = backend.encode_prompts([""])
    assert torch.allclose(emb.embeds, emb.uncond_embeds)


def test_long_prompt_is_truncated_keeping_eos(backend):
    toks = _tokens(backend, " ".join(["red"] * 40))
    assert len(toks) == CONFIG.max_length and toks[-1] == EOS


def test_tokenizer_round_trip(backend, tmp_path):
    from transformers import PreTrainedTokenizerFast

    backend.tokenizer.save_pretrained(tmp_path)
    reloaded = PreTrainedTokenizerFast.from_pretrained(tmp_path)
    a = tokenize(backend.tokenizer, PROMPTS, CONFIG.max_length)
    b = tokenize(reloaded, PROMPTS, CONFIG.max_length)
    assert torch.equal(a, b)


def test_embeddings_shapes_and_prompts_differ(backend):
    emb = backend.encode_prompts(PROMPTS[:3])
    assert emb.embeds.shape == (3, CONFIG.max_length, CONFIG.text_hidden)
    assert emb.pooled.shape == (3, CONFIG.text_hidden)
    assert emb.uncond_embeds.shape == (1, CONFIG.max_length, CONFIG.text_hidden)
    assert not emb.embeds.requires_grad
    for i in range(3):
        for j in range(i + 1, 3):
            assert not torch.allclose(emb.pooled[i], emb.pooled[j])
    sub = emb.index([2, 0, 0])
    assert torch.equal(sub.embeds[0], emb.embeds[2]) and torch.equal(sub.pooled[2], emb.pooled[0])


def test_guidance_one_is_the_conditional_branch(backend):
    emb = backend.encode_prompts(PROMPTS[:2])
    x, s = backend.initial_noise([1, 2]), torch.tensor([0.3, 0.9])
    v = backend.velocity(x, s, emb, 1.0)
    v_cond = backend.predict(x, s, emb.embeds, emb.pooled)
    assert v.dtype == torch.float32 and v.shape == (2, 3, 16, 16)
    assert torch.equal(v, v_cond)


def test_cfg_doubled_batch_equals_two_calls(backend):
    from tpgrpo.algo.sampling import cfg

    emb = backend.encode_prompts(PROMPTS[:3])
    x, s = backend.initial_noise([1, 2, 3]), torch.tensor([0.2, 0.5, 1.0])
    with torch.no_grad():
        v = backend.velocity(x, s, emb, 4.5)
        u_h, u_p = emb.uncond(3)
        expected = cfg(backend.predict(x, s, u_h, u_p), backend.predict(x, s, emb.embeds, emb.pooled), 4.5)
    torch.testing.assert_close(v, expected, atol=1e-5, rtol=1e-5)


def test_velocity_carries_gradient(backend):
    emb = backend.encode_prompts(PROMPTS[:2])
    v = backend.velocity(backend.initial_noise([0, 1]), 0.5, emb, 4.5)
    v.square().mean().backward()
    grads = [p.grad for p in backend.transformer.parameters() if p.grad is not None]
    assert grads and any(g.abs().sum() > 0 for g in grads)
    backend.transformer.zero_grad(set_to_none=True)


def test_initial_noise_depends_only_on_the_seed(backend):
    a = backend.initial_noise([5, 6, 7])
    b = backend.initial_noise([7])
    assert a.shape == (3, 3, 16, 16) and a.dtype == torch.float32
    assert torch.equal(a[2], b[0])
    assert not torch.equal(a[0], a[1])


def test_decode_maps_and_clamps(backend):
    x = torch.full((1, 3, 16, 16), -1.0)
    x[0, 0] = 1.0
    x[0, 1] = 5.0  # out of range is clamped
    img = backend.decode(x)
    assert img.dtype == np.uint8 and img.shape == (1, 16, 16, 3)
    assert (img[0, :, :, 0] == 255).all() and (img[0, :, :, 1] == 255).all() and (img[0, :, :, 2] == 0).all()
    torch.testing.assert_close(backend.encode_images(img), x.clamp(-1, 1))


def test_save_load_round_trip_gives_identical_velocities(backend, tmp_path):
    backend.save_pretrained(tmp_path / "m")
    for name in ("transformer", "text_encoder", "tokenizer", "scheduler", "tpgrpo_model.json"):
        assert (tmp_path / "m" / name).exists()
    loaded = load_backend("tiny", tmp_path / "m")
    assert loaded.config == CONFIG and loaded.latent_shape == (3, 16, 16)
    x, s = backend.initial_noise([3, 4]), torch.tensor([0.4, 0.8])
    with torch.no_grad():
        v1 = backend.velocity(x, s, backend.encode_prompts(PROMPTS[:2]), 4.5)
        v2 = loaded.velocity(x, s, loaded.encode_prompts(PROMPTS[:2]), 4.5)
    assert torch.equal(v1, v2)
    assert not loaded.transformer.training and not loaded.text_encoder.training


def test_missing_folder_gives_one_line_error_naming_the_path(tmp_path):
    missing = tmp_path / "nope"
    with pytest.raises(FileNotFoundError) as info:
        load_tiny(missing)
    msg = str(info.value)
    assert str(missing) in msg and "\n" not in msg and "transformer/" in msg
    (tmp_path / "half" / "transformer").mkdir(parents=True)
    with pytest.raises(FileNotFoundError) as info:
        load_backend("tiny", tmp_path / "half")
    assert "text_encoder/" in str(info.value) and "\n" not in str(info.value)


def test_unknown_backend_kinds():
    from tpgrpo.errors import PipelineError

    with pytest.raises(PipelineError, match="model.path x does not exist"):  # sd3/flux: tests/test_sd3_backend.py
        load_backend("sd3", "x")
    with pytest.raises(ValueError, match="unknown backend kind"):
        load_backend("dalle", "x")


def test_build_is_seeded():
    a = build_tiny(CONFIG, seed=1, words=WORDS, charset=CHARSET)
    b = build_tiny(CONFIG, seed=1, words=WORDS, charset=CHARSET)
    c = build_tiny(CONFIG, seed=2, words=WORDS, charset=CHARSET)
    pa, pb, pc = (torch.cat([p.flatten() for m in k.modules() for p in m.parameters()]) for k in (a, b, c))
    assert torch.equal(pa, pb) and not torch.equal(pa, pc)


def test_sample_ode_is_deterministic_per_seed(backend, tmp_path):
    prompts, seeds = PROMPTS[:3], [10, 11, 12]
    a = sample_ode(backend, prompts, seeds, num_steps=3, guidance_scale=4.5, batch_size=2)
    b = sample_ode(backend, prompts, seeds, num_steps=3, guidance_scale=4.5, batch_size=3)
    c = sample_ode(backend, prompts[1:2], seeds[1:2], num_steps=3, guidance_scale=4.5)
    assert a.shape == (3, 16, 16, 3) and a.dtype == np.uint8
    # Batched matmuls may round differently; uint8 images agree up to one level.
    assert np.abs(a.astype(int) - b.astype(int)).max() <= 1
    assert np.abs(a[1:2].astype(int) - c.astype(int)).max() <= 1
    assert np.array_equal(a, sample_ode(backend, prompts, seeds, num_steps=3, batch_size=2))
    path = save_grid(a, tmp_path / "grid.png", ncol=2, upscale=2)
    from PIL import Image

    assert Image.open(path).size == (2 * 32 + 3, 2 * 32 + 3)


def test_real_task_prompts_tokenize_without_unknowns_or_truncation():
    prompts_mod = pytest.importorskip("tpgrpo.tasks.prompts")
    from tpgrpo.models.tokenizer import UNK, build_tokenizer

    max_length = TinyConfig().max_length
    tok = build_tokenizer(prompts_mod.VOCABULARY, prompts_mod.TEXT_CHARSET, max_length)
    sets = prompts_mod.build_prompt_sets(seed=0)
    prompts = [m["prompt"] for metas in sets.values() for m in metas]
    ids = tokenize(tok, prompts, max_length)
    assert not (ids == tok.convert_tokens_to_ids(UNK)).any()
    # every prompt ends with <eos> before the padding, i.e. nothing was truncated
    eos = tok.convert_tokens_to_ids(EOS)
    assert ((ids == eos).sum(1) == 1).all() and (ids[:, -1] != eos).all()


def test_evaluate_prompts_breaks_down_per_kind(backend, monkeypatch):
    import sys
    import types

    from tpgrpo.policy.generate import evaluate_prompts, evaluation_seeds

    class Result:
        def __init__(self, reward, strict):
            self.reward, self.strict = reward, strict

    def brightness(images, metas):  # stand-in reward: mean brightness; strict if kind == "a"
        assert len(images) == len(metas)
        return Result(images.mean(axis=(1, 2, 3)) / 255.0, np.array([m["kind"] == "a" for m in metas]))

    fake = types.ModuleType("tpgrpo.tasks.rewards")
    fake.get_reward = lambda name: brightness
    monkeypatch.setitem(sys.modules, "tpgrpo.tasks.rewards", fake)
    metas = [{"id": f"p{i}", "kind": "ab"[i % 2], "prompt": PROMPTS[i % 3]} for i in range(3)]
    out = evaluate_prompts(backend, metas, "brightness", num_steps=2, seed=1, samples_per_prompt=2,
                           return_images=True)
    assert out["n"] == 6 and out["images"].shape == (6, 16, 16, 3)
    assert out["per_kind"]["a"]["n"] == 4 and out["per_kind"]["a"]["strict_accuracy"] == 1.0
    assert out["per_kind"]["b"]["strict_accuracy"] == 0.0 and out["strict_accuracy"] == pytest.approx(4 / 6)
    assert out["reward_mean"] == pytest.approx(out["images"].mean() / 255.0)
    # an image's seed depends on its prompt id and sample index only
    assert evaluation_seeds(1, metas[1:2], 2) == evaluation_seeds(1, metas, 2)[2:4]


def test_bf16_model_gets_fp32_timesteps_equal_to_1000_sigma():
    """As diffusers' StableDiffusion3Pipeline does: the timestep is not rounded to the weights' dtype
    (bf16 would turn 923.1 into 924); the transformer's sinusoidal embedding takes it in fp32."""
    from tpgrpo.models.tiny import TinyBackend

    built = build_tiny(CONFIG, seed=0, words=WORDS, charset=CHARSET)
    half = TinyBackend(built.transformer, built.text_encoder, built.tokenizer, CONFIG, dtype=torch.bfloat16)
    sigma = torch.tensor([0.9231, 0.4567])
    seen, v = timesteps_seen(half, sigma, PROMPTS[:2], 4.5)
    assert v.dtype == torch.float32
    assert len(seen) == 1 and seen[0].dtype == torch.float32
    assert torch.equal(seen[0], torch.cat([sigma, sigma]) * 1000.0)  # [uncond; cond], exactly 1000 sigma
    assert float(seen[0][0]) != float((sigma[0] * 1000.0).to(torch.bfloat16))  # what the old cast gave
