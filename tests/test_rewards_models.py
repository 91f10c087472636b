"""Model rewards from local folders: PickScore and the aesthetic head on tiny models built from configs."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from tpgrpo.config import Config, ConfigError
from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.render import render_prompt
from tpgrpo.tasks.rewards import build_reward

try:
    from tests.tiny_reward_models import save_tiny_aesthetic_head, save_tiny_clip
except ImportError:  # pytest's rootdir import mode
    from tiny_reward_models import save_tiny_aesthetic_head, save_tiny_clip

METAS = build_prompt_sets()["compositional_eval"][:6]


def config(**reward_models) -> Config:
    cfg = Config()
    return dataclasses.replace(cfg, reward_models=dataclasses.replace(cfg.reward_models, **reward_models))


@pytest.fixture(scope="module")
def clip_dir(tmp_path_factory):
    return save_tiny_clip(tmp_path_factory.mktemp("pickscore") / "PickScore_v1")


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return np.stack([render_prompt(m, rng) for m in METAS])


def hand_pickscore(folder, images, prompts) -> np.ndarray:
    """logit_scale.exp() * cos(text, image) computed from the model's own towers and projections."""
    from transformers import AutoProcessor, CLIPModel

    model = CLIPModel.from_pretrained(folder).eval()
    processor = AutoProcessor.from_pretrained(folder)
    inputs = processor(text=prompts, images=list(images), return_tensors="pt", padding=True)
    with torch.no_grad():
        text = model.text_projection(model.text_model(input_ids=inputs["input_ids"],
                                                      attention_mask=inputs["attention_mask"]).pooler_output)
        image = model.visual_projection(model.vision_model(pixel_values=inputs["pixel_values"]).pooler_output)
        cos = torch.nn.functional.cosine_similarity(text, image, dim=-1)
        return (model.logit_scale.exp() * cos).double().numpy()


def test_pickscore_is_logit_scale_times_cosine_divided(clip_dir, images):
    reward = build_reward("pickscore", config(pickscore_path=str(clip_dir), pickscore_divisor=26.0, batch_size=4))
    result = reward(images, METAS)
    expected = hand_pickscore(clip_dir, images, [m["prompt"] for m in METAS])
    np.testing.assert_allclose(result.reward * 26.0, expected, rtol=1e-4, atol=1e-4)
    assert np.all(np.abs(expected) <= 100.0 + 1e-4) and expected.std() > 0  # 100 * cos, not constant
    assert not result.has_strict and not result.strict.any()
    # batching (4 then 2) changes nothing: pointwise, and in order
    one_by_one = np.concatenate([reward(images[i:i + 1], METAS[i:i + 1]).reward for i in range(len(METAS))])
    np.testing.assert_allclose(one_by_one, result.reward, rtol=1e-5, atol=1e-6)


def test_pickscore_depends_on_the_prompt(clip_dir, images):
    reward = build_reward("pickscore", config(pickscore_path=str(clip_dir)))
    a = reward(images, METAS).reward
    other = [dict(m, prompt="a sign that says \"42\"") for m in METAS]
    b = reward(images, other).reward
    assert np.all(np.isfinite(a)) and np.abs(a - b).max() > 1e-3
    with pytest.raises(ValueError, match="prompt 0 has no 'prompt' text"):
        reward(images[:1], [{"task": "compositional"}])


def test_pickscore_processor_from_its_own_folder(clip_dir, tmp_path, images):
    import shutil

    model_only = tmp_path / "model"
    model_only.mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(clip_dir / name, model_only / name)
    with pytest.raises(ConfigError, match="pickscore_processor_path"):  # no processor files beside it
        build_reward("pickscore", config(pickscore_path=str(model_only)))
    reward = build_reward("pickscore", config(pickscore_path=str(model_only), pickscore_processor_path=str(clip_dir)))
    same = build_reward("pickscore", config(pickscore_path=str(clip_dir)))
    np.testing.assert_allclose(reward(images, METAS).reward, same(images, METAS).reward, rtol=1e-6)


@pytest.mark.parametrize("setting, message", [
    ({}, "params: reward_models.pickscore_path is not set: expected a CLIP save_pretrained folder"),
    ({"pickscore_path": "no/such/folder"}, "folder no/such/folder not found (expected a CLIP"),
    ({"pickscore_path": "{empty}"}, "has no config.json (expected a CLIP save_pretrained folder"),
    ({"pickscore_path": "{weightless}"}, "has no model.safetensors or pytorch_model.bin"),
])
def test_missing_or_wrong_pickscore_folder_is_one_line_naming_path_and_files(tmp_path, setting, message):
    (tmp_path / "empty").mkdir()
    (tmp_path / "weightless").mkdir()
    (tmp_path / "weightless" / "config.json").write_text("{}")
    setting = {k: v.format(empty=tmp_path / "empty", weightless=tmp_path / "weightless")
               for k, v in setting.items()}
    with pytest.raises(ConfigError) as info:
        build_reward({"geneval": 1.0, "pickscore": 0.5}, config(**setting), root=tmp_path)
    assert message.replace("no/such/folder", str(tmp_path / "no/such/folder")) in str(info.value) \
        or message in str(info.value)
    assert "\n" not in str(info.value)


def test_corrupt_weights_fail_with_one_line(clip_dir, tmp_path, images):
    import shutil

    from tpgrpo.errors import RewardError

    broken = tmp_path / "broken"
    shutil.copytree(clip_dir, broken)
    (broken / "model.safetensors").write_bytes(b"not a safetensors file")
    reward = build_reward("pickscore", config(pickscore_path=str(broken)))  # files are there: builds
    with pytest.raises(RewardError, match=f"reward pickscore: cannot load {broken}") as info:
        reward(images[:1], METAS[:1])
    assert "\n" not in str(info.value)


def test_aesthetic_head_over_clip_image_embeddings(clip_dir, tmp_path, images):
    from transformers import AutoProcessor, CLIPModel

    head_path = save_tiny_aesthetic_head(tmp_path / "sac+logos+ava1-l14-linearMSE.pth", dim=16)
    reward = build_reward("aesthetic", config(aesthetic_clip_path=str(clip_dir), aesthetic_head_path=str(head_path)))
    result = reward(images, METAS)
    # by hand: normalised projected image embedding through the five linear layers (dropout off)
    model, processor = CLIPModel.from_pretrained(clip_dir).eval(), AutoProcessor.from_pretrained(clip_dir)
    state = torch.load(head_path)
    with torch.no_grad():
        pooled = model.vision_model(pixel_values=processor(images=list(images), return_tensors="pt")["pixel_values"])
        x = torch.nn.functional.normalize(model.visual_projection(pooled.pooler_output), dim=-1)
        for i in (0, 2, 4, 6, 7):
            x = x @ state[f"layers.{i}.weight"].T + state[f"layers.{i}.bias"]
    np.testing.assert_allclose(result.reward, x.squeeze(-1).double().numpy(), rtol=1e-4, atol=1e-5)
    assert not result.has_strict and result.reward.std() > 0
    # the prompt is ignored
    np.testing.assert_allclose(reward(images, [dict(m, prompt="x") for m in METAS]).reward, result.reward)
    with pytest.raises(ConfigError, match="aesthetic_head_path = 'nope.pth': file .*nope.pth not found"):
        build_reward("aesthetic", config(aesthetic_clip_path=str(clip_dir), aesthetic_head_path="nope.pth"),
                     root=tmp_path)
