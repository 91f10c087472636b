"""params.yaml loading: strict, typed, one-line errors naming the key."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from tpgrpo.config import Config, ConfigError, config_from_dict, load_config

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load((ROOT / "params.yaml").read_text())


def test_shipped_params_load_and_match_documented_defaults(raw):
    cfg = config_from_dict(raw)
    assert isinstance(cfg, Config)
    # The spec's CPU-scaled sampler: T = 10, window 9 from step 0, noise 0.7; the default run samples its rollouts
    # without guidance (DiffusionNFT's setting, docs/default-run.md) and evaluates at the paper's 4.5.
    assert (cfg.sampling.num_steps, cfg.sampling.window_size, cfg.sampling.window_start) == (10, 9, 0)
    assert cfg.sampling.noise_level == 0.7 and cfg.sampling.guidance_scale == 1.0 and cfg.eval.guidance_scale == 4.5
    assert (cfg.update.objective, cfg.credit.mode, cfg.tree.enabled) == ("nft", "flow_grpo", False)
    assert cfg.probe.completion == "exact"  # the spec's completion until a cheap mode is shown to keep the reward


@pytest.mark.parametrize("mutate, expected", [
    (lambda r: r["credit"].update(modee="tp"), "unknown key credit.modee"),
    (lambda r: r["update"].pop("lr"), "missing key update.lr"),
    (lambda r: r.pop("probe"), "missing section probe (its keys and defaults: docs/parameters.md)"),
    (lambda r: r.update(extra={}), "unknown section 'extra'"),
    (lambda r: r["credit"].update(mode="tpp"), "credit.mode = 'tpp': expected one of"),
    (lambda r: r["probe"].update(completion="ode:0"),
     "probe.completion = 'ode:0': expected exact, x0, ode:M, grid:M, heun:M or heun-grid:M"),
    (lambda r: r["rollout"].update(group_size="8"), "rollout.group_size = '8': expected int"),
    (lambda r: r["rollout"].update(group_size=1), "rollout.group_size = 1: expected >= 2"),
    (lambda r: r["update"].update(lr=-1.0), "update.lr = -1.0: expected a value > 0"),
    (lambda r: r["update"].update(lr=float("nan")), "update.lr = nan: expected float"),
    (lambda r: r["credit"].update(global_std=1), "credit.global_std = 1: expected bool"),
    (lambda r: r["sampling"].update(window_size=11), "expected <= sampling.num_steps (10)"),
    (lambda r: r["sampling"].update(window_size=0), "sampling.window_size = 0"),
    # An sde step at the last step (s -> 0) would leave noise in the final latent.
    (lambda r: r["sampling"].update(step_kind="sde", window_size=10),
     "sampling.window_start + sampling.window_size = 10 with sampling.step_kind = sde: expected <= 9"),
    (lambda r: r["sampling"].update(step_kind="sde", window_start=3, window_size=7),
     "sampling.window_start + sampling.window_size = 10 with sampling.step_kind = sde: expected <= 9"),
])
def test_bad_params_give_one_line_error_naming_the_key(raw, mutate, expected):
    bad = copy.deepcopy(raw)
    mutate(bad)
    with pytest.raises(ConfigError) as info:
        config_from_dict(bad)
    message = str(info.value)
    assert expected in message
    assert "\n" not in message


@pytest.mark.parametrize("kind, start, size, ok", [
    ("sde", 0, 9, True),    # the shipped default: steps 0..8 SDE, step 9 ODE
    ("sde", 1, 8, True),
    ("sde", 0, 10, False),  # sde noise in the final latent
    ("cps", 0, 10, True),   # cps is deterministic at the last step (s_{k+1} = 0)
    ("cps", 2, 8, True),
])
def test_a_window_reaching_the_last_step_is_allowed_for_cps_only(raw, kind, start, size, ok):
    changed = copy.deepcopy(raw)
    changed["sampling"].update(step_kind=kind, window_start=start, window_size=size)
    if ok:
        assert config_from_dict(changed).sampling.window_size == size
    else:
        with pytest.raises(ConfigError, match=r"sampling.window_size .*step_kind = sde: expected <= 9"):
            config_from_dict(changed)


def test_int_accepted_for_float_and_overrides(tmp_path, raw):
    path = tmp_path / "params.yaml"
    path.write_text(yaml.safe_dump(raw))
    cfg = load_config(path, overrides={"update.lr": 1, "credit.mode": "flow_grpo"})
    assert cfg.update.lr == 1.0 and isinstance(cfg.update.lr, float)
    assert cfg.credit.mode == "flow_grpo"
    # PyYAML parses `3e-4` (no dot) as a string; a float field accepts it, a word is still an error.
    assert load_config(path, overrides={"update.lr": "3e-4"}).update.lr == 3e-4
    with pytest.raises(ConfigError, match="update.lr = 'fast': expected float"):
        load_config(path, overrides={"update.lr": "fast"})
    with pytest.raises(ConfigError, match="override 'nosuch.key'"):
        load_config(path, overrides={"nosuch.key": 1})


def test_missing_or_invalid_file(tmp_path):
    with pytest.raises(ConfigError, match="not found"):
        load_config(tmp_path / "nope.yaml")
    bad = tmp_path / "params.yaml"
    bad.write_text("model: [unclosed\n")
    with pytest.raises(ConfigError, match="not valid YAML"):
        load_config(bad)


def test_params_hash_tracks_only_named_params(raw):
    a = config_from_dict(raw)
    changed = copy.deepcopy(raw)
    changed["credit"]["mode"] = "incremental"
    b = config_from_dict(changed)
    assert a.params_hash(["credit"]) != b.params_hash(["credit"])
    assert a.params_hash(["credit.mode"]) != b.params_hash(["credit.mode"])
    assert a.params_hash(["model", "credit.balance"]) == b.params_hash(["model", "credit.balance"])
