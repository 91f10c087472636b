"""With ``update.ema`` the EMA of the LoRA weights is what eval scores, and so what export hands out and what
the summary's figures show (spec section 7)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
import yaml
from typer.testing import CliRunner

from tpgrpo.cli import app
from tpgrpo.config import load_config
from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.policy import lora


@pytest.fixture
def ema_project(tiny_project):
    """The tiny project with ``update.ema: true`` and a hand-made iteration 1 policy whose EMA adapter
    (``policy/ema``) differs from its raw adapter (both random, nonzero)."""
    root = tiny_project
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["update"]["ema"] = True
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    from tpgrpo.policy.loading import load_policy

    cfg = load_config(root / "params.yaml")
    backend = load_policy(cfg, root, 1, trainable=True)
    gen = torch.Generator().manual_seed(3)
    weights = [{k: torch.randn(v.shape, generator=gen) * 0.3 for k, v in lora.lora_state_dict(backend).items()}
               for _ in range(2)]
    policy = IterationPaths(root, 1).policy
    lora.save_adapter(backend, policy, state_dict=weights[0])
    lora.save_adapter(backend, policy / "ema", state_dict=weights[1])
    return root


@pytest.mark.parametrize("flag,folder", [([], "ema"), (["--ema"], "ema"), (["--no-ema"], "")])
def test_export_hands_out_the_ema_by_default_with_update_ema(ema_project, tmp_path, flag, folder):
    root = ema_project
    out = tmp_path / "out"
    result = CliRunner().invoke(app, ["export", "--iter", "1", "--out", str(out),
                                      "--params", str(root / "params.yaml"), *flag])
    assert result.exit_code == 0, result.output
    source = IterationPaths(root, 1).policy / folder / lora.WEIGHTS_FILE
    assert (out / lora.WEIGHTS_FILE).read_bytes() == source.read_bytes()


def test_summary_grid_shows_the_ema_policy(ema_project):
    from tpgrpo.policy.generate import sample_ode
    from tpgrpo.reports.figures import grid_images
    from tpgrpo.policy.loading import load_policy

    root = ema_project
    cfg = load_config(root / "params.yaml")
    images, prompts = grid_images(cfg, root, 1)
    backend = load_policy(cfg, root, 2)  # the raw adapter of policy 1
    lora.load_lora_weights(backend, lora.read_adapter_weights(IterationPaths(root, 1).policy / "ema"))
    seeds = [int(s) for s in _grid_seeds(cfg, root)]
    ema_images = sample_ode(backend, prompts, seeds, num_steps=cfg.eval.num_steps,
                            guidance_scale=cfg.eval.guidance_scale, shift=cfg.sampling.shift,
                            batch_size=cfg.rollout.batch_size)
    raw_images = sample_ode(load_policy(cfg, root, 2), prompts, seeds, num_steps=cfg.eval.num_steps,
                            guidance_scale=cfg.eval.guidance_scale, shift=cfg.sampling.shift,
                            batch_size=cfg.rollout.batch_size)
    assert not np.array_equal(ema_images, raw_images)  # the two adapters really differ
    np.testing.assert_array_equal(images, ema_images)


def _grid_seeds(cfg, root):
    """The grid's seeds, as ``grid_images`` draws them (the eval's first seed of each grid prompt)."""
    from tpgrpo.policy.generate import evaluation_seeds
    from tpgrpo.reports.figures import grid_prompts

    metas = grid_prompts(cfg, root)
    return evaluation_seeds(cfg.eval.seed, metas, cfg.eval.samples_per_prompt)[::cfg.eval.samples_per_prompt]
