"""The shipped base model in data/base: loads through from_pretrained, and a fixed prompt and seed give
a fixed reward (a drift check: a change in the model code, the sampler or a dependency shows up here)."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest

REPO = Path(__file__).resolve().parents[1]
BASE = REPO / "data" / "base"



def test_shipped_model_is_complete_and_small():
    info = json.loads((BASE / "pretrain.json").read_text())
    assert info["complete"] is True and info["kind"] == "tiny"
    size = sum(p.stat().st_size for p in BASE.rglob("*") if p.is_file())
    assert size < 60 * 2**20  # the folder ships in every clone


def test_shipped_model_is_the_documented_one():
    """The architecture, budget and data docs/tiny-model.md describe, and the machine it was trained on."""
    from tpgrpo.models.tiny import TinyConfig

    info = json.loads((BASE / "pretrain.json").read_text())
    config = TinyConfig.from_dict(info["config"])
    assert (config.image_size, config.patch_size, config.num_layers, config.num_heads, config.head_dim) == \
        (32, 4, 6, 4, 32)
    assert info["hparams"]["tasks"] == ["compositional"] and not info["hparams"]["custom_data"]
    assert info["minutes"] > 0 and info["cpu"] and info["threads"] >= 1
    doc = (REPO / "docs" / "tiny-model.md").read_text()
    assert f"--steps {info['steps']}" in doc and f"{info['minutes']:.0f} minutes" in doc
    phases = [info]  # a second phase records the model it started from (pretrain --init-from)
    while phases[-1]["hparams"].get("init_from"):
        phases.append(phases[-1]["hparams"]["init_from"])
        assert "--init-from" in doc and f"--steps {phases[-1]['steps']}" in doc
        assert f"{phases[-1]['minutes']:.0f} minutes" in doc
    assert sum(phase["steps"] for phase in phases) >= 5000
    assert json.loads((BASE / "tpgrpo_model.json").read_text())["config"] == info["config"]


def test_fixed_prompt_and_seed_give_the_recorded_reward():
    from tpgrpo.models import load_backend
    from tpgrpo.policy.generate import sample_ode
    from tpgrpo.tasks.prompts import build_prompt_sets
    from tpgrpo.tasks.rewards import get_reward

    expected = json.loads((REPO / "tests" / "data" / "shipped_model_rewards.json").read_text())
    backend = load_backend("tiny", BASE)
    images = sample_ode(backend, expected["prompts"], expected["seeds"], num_steps=10, guidance_scale=4.5)
    metas = {m["prompt"]: m for key, ms in build_prompt_sets().items() for m in ms}
    scored = get_reward("geneval_soft")(images, [metas[p] for p in expected["prompts"]])
    np.testing.assert_allclose(scored.reward, expected["geneval_soft"], atol=1e-3)
    assert int(images.astype(np.int64).sum()) == pytest.approx(expected["pixel_sum"], rel=1e-4)
