"""Pretraining on a TINY config: reproducible, saves a loadable model, lowers the loss."""

from __future__ import annotations

import csv
import json
import os

import numpy as np
import pytest
import torch

from tpgrpo.models.tiny import TinyConfig, build_tiny, load_tiny
from tpgrpo.models.pretrain import flow_loss, lr_at, pretrain

CONFIG = TinyConfig(image_size=16, patch_size=4, num_layers=1, num_heads=2, head_dim=8, text_layers=1,
                    text_hidden=16, text_heads=2, text_intermediate=32, max_length=16)
COLOURS = {"red": (220, 30, 30), "green": (30, 200, 30), "blue": (30, 30, 220)}


def _standin_data(rng: np.random.Generator, batch: int):
    """A stand-in renderer: one coloured square at a random place on black."""
    names = list(COLOURS)
    prompts, images = [], np.zeros((batch, 16, 16, 3), dtype=np.uint8)
    for i in range(batch):
        colour = names[int(rng.integers(len(names)))]
        y, x = rng.integers(0, 9, size=2)
        images[i, y:y + 7, x:x + 7] = COLOURS[colour]
        prompts.append(f"a {colour} square")
    return prompts, images


@pytest.fixture(autouse=True)
def _no_tasks_vocab(monkeypatch):
    """Build the tokenizer from a stand-in vocabulary (independent of tpgrpo.tasks)."""
    monkeypatch.setattr("tpgrpo.models.tiny._default_vocabulary", lambda: (["a", "square", *COLOURS], "0123"))


def _run(folder, steps=12, **kw):
    return pretrain(folder, seed=3, steps=steps, batch_size=8, lr=3e-3, config=CONFIG, data=_standin_data,
                    log_every=4, save_every_minutes=None, **kw)


def test_same_seed_gives_identical_weights(tmp_path, capsys):
    info = _run(tmp_path / "a")
    _run(tmp_path / "b")
    a, b = load_tiny(tmp_path / "a"), load_tiny(tmp_path / "b")
    for pa, pb in zip(a.transformer.state_dict().values(), b.transformer.state_dict().values()):
        assert torch.equal(pa, pb)
    for pa, pb in zip(a.text_encoder.state_dict().values(), b.text_encoder.state_dict().values()):
        assert torch.equal(pa, pb)
    saved = json.loads((tmp_path / "a" / "pretrain.json").read_text())
    assert saved["steps"] == info["steps"] == 12 and saved["complete"] and saved["seed"] == 3
    assert np.isfinite(saved["final_loss"]) and saved["config"]["num_layers"] == 1
    rows = list(csv.DictReader(open(tmp_path / "a" / "pretrain_log.csv")))
    assert [int(r["step"]) for r in rows] == [4, 8, 12]
    assert "pretrain step=4" in capsys.readouterr().out
    # the save is atomic: no temp or backup folders left behind
    assert sorted(os.listdir(tmp_path)) == ["a", "b"]


def test_training_lowers_the_loss_on_a_fixed_batch(tmp_path):
    prompts, images = _standin_data(np.random.default_rng(123), 32)

    def fixed_loss(backend):
        torch.manual_seed(0)
        with torch.no_grad():
            return float(flow_loss(backend, backend.encode_images(images), prompts,
                                   torch.Generator().manual_seed(7)))

    before = fixed_loss(build_tiny(CONFIG, seed=3))
    _run(tmp_path / "m", steps=40, ema_decay=0.0)
    after = fixed_loss(load_tiny(tmp_path / "m"))
    assert after < 0.8 * before


def test_rerun_replaces_the_folder(tmp_path):
    _run(tmp_path / "m", steps=4)
    (tmp_path / "m" / "stale.txt").write_text("old")
    _run(tmp_path / "m", steps=4)
    assert not (tmp_path / "m" / "stale.txt").exists()


def test_budget_is_required_and_lr_schedule_shape():
    with pytest.raises(ValueError, match="budget"):
        pretrain("unused", config=CONFIG, data=_standin_data)
    assert lr_at(0.0, 1.0, 0.1) == 0.0
    assert lr_at(0.1, 1.0, 0.1) == pytest.approx(1.0)
    assert lr_at(1.0, 1.0, 0.1) == pytest.approx(0.1)
    assert lr_at(0.5, 1.0, 0.1) > lr_at(0.9, 1.0, 0.1)


def test_pretrain_command_is_typer_compatible():
    import inspect
    import typing

    from tpgrpo.models.pretrain import pretrain_command

    hints = typing.get_type_hints(pretrain_command, include_extras=True)
    assert {"out_dir", "seed", "minutes", "steps", "batch_size"} <= set(hints)
    assert str(inspect.signature(pretrain_command).parameters["out_dir"].default) == "data/base"


def test_task_data_is_reproducible_and_mixes_tasks():
    pytest.importorskip("tpgrpo.tasks.render")
    from tpgrpo.models.pretrain import task_data

    draw = task_data(("compositional", "text"))
    p1, im1 = draw(np.random.default_rng(5), 16)
    p2, im2 = draw(np.random.default_rng(5), 16)
    assert p1 == p2 and np.array_equal(im1, im2)
    assert im1.shape == (16, 32, 32, 3) and im1.dtype == np.uint8
    assert any('"' in p for p in p1) and any('"' not in p for p in p1)
    with pytest.raises(ValueError, match="nope"):
        task_data(("nope",))


def test_resumed_pieces_give_the_weights_of_an_uninterrupted_run(tmp_path):
    """Stop after every single step (a piece of ~0 minutes), resume each time: the same weights and log."""
    from tpgrpo.models.pretrain_checkpoint import default_checkpoint_path

    whole = _run(tmp_path / "whole", steps=10)
    pieces, info = 0, {"complete": False}
    while not info["complete"]:
        info = _run(tmp_path / "pieces", steps=10, piece_minutes=1e-9)
        pieces += 1
        assert pieces <= 11
    assert pieces >= 9  # it really stopped and resumed between steps
    assert not default_checkpoint_path(tmp_path / "pieces").exists()  # deleted at the end
    a, b = load_tiny(tmp_path / "whole"), load_tiny(tmp_path / "pieces")
    for module_a, module_b in ((a.transformer, b.transformer), (a.text_encoder, b.text_encoder)):
        for (name, pa), pb in zip(module_a.state_dict().items(), module_b.state_dict().values()):
            assert torch.equal(pa, pb), name
    assert (tmp_path / "whole" / "pretrain_log.csv").read_text() \
        .split("\n")[1].split(",")[:2] == (tmp_path / "pieces" / "pretrain_log.csv").read_text() \
        .split("\n")[1].split(",")[:2]
    saved = json.loads((tmp_path / "pieces" / "pretrain.json").read_text())
    assert saved["steps"] == whole["steps"] == 10 and saved["final_loss"] == whole["final_loss"]
    assert saved["cpu"] and saved["threads"] >= 1


def test_a_piece_writes_no_model_and_a_checkpoint_of_another_run_is_refused(tmp_path):
    from tpgrpo.models.pretrain_checkpoint import default_checkpoint_path

    info = _run(tmp_path / "m", steps=10, piece_minutes=1e-9)
    assert not info["complete"] and not (tmp_path / "m").exists()
    assert default_checkpoint_path(tmp_path / "m").exists()
    with pytest.raises(ValueError, match=r"checkpoint of another run \(max_steps = 10"):
        _run(tmp_path / "m", steps=20)


def test_a_budget_change_on_resume_is_recorded_and_reproducible(tmp_path):
    """Stop a 10-step run at step 4, resume it as a 6-step run: recorded, and the same weights twice."""
    for name in ("a", "b"):
        first = _run(tmp_path / name, steps=10, stop_at_step=4)
        assert not first["complete"] and first["steps"] == 4
        info = _run(tmp_path / name, steps=6, change_budget=True)
        assert info["complete"] and info["steps"] == 6
        assert info["budget_changes"] == [{"at_step": 4, "from_steps": 10, "to_steps": 6}]
    a, b = load_tiny(tmp_path / "a"), load_tiny(tmp_path / "b")
    for pa, pb in zip(a.transformer.state_dict().values(), b.transformer.state_dict().values()):
        assert torch.equal(pa, pb)
    straight = _run(tmp_path / "straight", steps=6)  # the lr schedule differs from step 4 on: other weights
    assert straight["budget_changes"] == [] and straight["final_loss"] != info["final_loss"]


def test_a_second_phase_starts_from_a_saved_model_and_records_it(tmp_path):
    """``init_from``: the second phase's step 0 is the first phase's saved (EMA) weights, its own schedule runs
    from there, and ``pretrain.json`` says what it started from; the same two phases give the same weights."""
    _run(tmp_path / "first", steps=8)
    info = _run(tmp_path / "second", steps=4, init_from=tmp_path / "first")
    again = _run(tmp_path / "again", steps=4, init_from=tmp_path / "first")
    start = info["hparams"]["init_from"]
    assert start["path"] == str(tmp_path / "first") and start["steps"] == 8 and len(start["weights_md5"]) == 32
    assert again["hparams"]["init_from"] == start and info["steps"] == 4
    second, first = load_tiny(tmp_path / "second"), load_tiny(tmp_path / "first")
    assert all(torch.equal(a, b) for a, b in zip(second.transformer.state_dict().values(),
                                                 load_tiny(tmp_path / "again").transformer.state_dict().values()))
    moved = [float((a - b).abs().max()) for a, b in zip(second.transformer.state_dict().values(),
                                                        first.transformer.state_dict().values())]
    assert 0 < max(moved) < 0.5  # trained on from the parent, not from fresh weights
    fresh = build_tiny(CONFIG, seed=3).transformer.state_dict()
    assert max(float((a - b).abs().max()) for a, b in zip(second.transformer.state_dict().values(),
                                                          fresh.values())) > max(moved)


def test_a_second_phase_refuses_another_configuration(tmp_path):
    _run(tmp_path / "first", steps=4)
    other = TinyConfig(**{**CONFIG.__dict__, "num_layers": 2})
    with pytest.raises(ValueError, match="--init-from .*first: its configuration differs"):
        pretrain(tmp_path / "second", seed=3, steps=2, batch_size=8, config=other, data=_standin_data,
                 save_every_minutes=None, init_from=tmp_path / "first")


def test_noise_mean_weights_the_high_noise_levels_and_is_recorded(tmp_path, monkeypatch):
    import tpgrpo.models.pretrain as pretrain_module

    seen = []
    real = pretrain_module.flow_loss

    def spy(backend, x0, prompts, generator, dropout=0.0, noise_mean=0.0):
        state = generator.get_state()  # replay the draws flow_loss makes: dropout, noise, then the levels
        torch.rand(x0.shape[0], generator=generator)
        torch.randn(x0.shape, generator=generator)
        seen.append(torch.sigmoid(torch.randn(x0.shape[0], generator=generator) + noise_mean))
        generator.set_state(state)
        return real(backend, x0, prompts, generator, dropout, noise_mean)

    monkeypatch.setattr(pretrain_module, "flow_loss", spy)
    plain = _run(tmp_path / "plain", steps=8)
    levels_plain = torch.cat(seen)
    seen.clear()
    high = _run(tmp_path / "high", steps=8, noise_mean=1.5)
    levels_high = torch.cat(seen)
    assert plain["hparams"]["t_sampling"] == "logit_normal(0,1)" and plain["hparams"]["noise_mean"] == 0.0
    assert high["hparams"]["t_sampling"] == "logit_normal(1.5,1)" and high["hparams"]["noise_mean"] == 1.5
    assert levels_plain.median() < 0.6 < 0.7 < levels_high.median()  # sigmoid(0) = 0.5, sigmoid(1.5) = 0.82
    _run(tmp_path / "piece", steps=8, piece_minutes=1e-9)  # a checkpoint at mean 0 does not resume at 1.5
    with pytest.raises(ValueError, match=r"checkpoint of another run \(hparams"):
        _run(tmp_path / "piece", steps=8, noise_mean=1.5)
