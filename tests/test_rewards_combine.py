"""Reward specs: a name or a weighted mapping, from params.yaml to the rollout stage."""

from __future__ import annotations

import copy
import shutil

import numpy as np
import pytest
import yaml
from typer.testing import CliRunner

from tpgrpo.cli import app
from tpgrpo.config import ConfigError, config_from_dict
from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.render import render_prompt, render_violation
from tpgrpo.tasks.rewards import REWARD_NAMES, WeightedSum, build_reward, get_reward

try:
    from tests.conftest import REPO
except ImportError:  # pytest's rootdir import mode
    from conftest import REPO

METAS = build_prompt_sets()["compositional_eval"][:24]


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return np.stack([render_prompt(m, rng) if i % 3 else render_violation(m, "wrong_color", rng)
                     for i, m in enumerate(METAS)])


def test_weighted_combination_is_the_weighted_sum(images):
    combined = build_reward({"jpeg_compressibility": 0.5, "geneval": 2.0, "geneval_soft": -1.0})
    assert isinstance(combined, WeightedSum)
    assert combined.name == "0.5*jpeg_compressibility + 2*geneval + -1*geneval_soft"
    result = combined(images, METAS)
    parts = {n: get_reward(n)(images, METAS) for n in ("jpeg_compressibility", "geneval", "geneval_soft")}
    expected = 0.5 * parts["jpeg_compressibility"].reward + 2.0 * parts["geneval"].reward - parts["geneval_soft"].reward
    np.testing.assert_allclose(result.reward, expected, rtol=0, atol=1e-12)
    # strict: the first component that defines one (jpeg has none, so geneval's)
    assert result.has_strict and 0 < parts["geneval"].strict.sum() < len(METAS)
    np.testing.assert_array_equal(result.strict, parts["geneval"].strict)
    only_jpeg = build_reward({"jpeg_compressibility": 1.0})(images, METAS)
    assert not only_jpeg.has_strict and not only_jpeg.strict.any()
    np.testing.assert_array_equal(only_jpeg.reward, parts["jpeg_compressibility"].reward)
    # a name alone is the reward itself
    np.testing.assert_array_equal(build_reward("geneval")(images, METAS).reward, parts["geneval"].reward)


def test_each_component_checks_its_own_task(images):
    text = build_prompt_sets()["text_eval"][:2]
    with pytest.raises(ValueError, match="reward 'geneval' scores 'compositional' prompts"):
        build_reward({"jpeg_compressibility": 1.0, "geneval": 1.0})(images[:2], text)


@pytest.fixture(scope="module")
def raw() -> dict:
    return yaml.safe_load((REPO / "params.yaml").read_text())


def test_params_accept_a_name_or_a_mapping(raw):
    assert config_from_dict(raw).task.reward == "geneval_soft"  # the shipped params, unchanged
    mixed = copy.deepcopy(raw)
    mixed["task"]["reward"] = {"geneval_soft": 1, "pickscore": "5e-1"}
    mixed["task"]["eval_reward"] = {"geneval": 1.0}
    cfg = config_from_dict(mixed)
    assert cfg.task.reward == {"geneval_soft": 1.0, "pickscore": 0.5} and cfg.task.eval_reward == {"geneval": 1.0}
    assert cfg.params_hash(["task.reward"]) != config_from_dict(raw).params_hash(["task.reward"])


@pytest.mark.parametrize("key, value, expected", [
    ("reward", "pickscor", "params: task.reward = 'pickscor': unknown reward (known rewards: geneval, geneval_soft"),
    ("eval_reward", {"geneval": 1.0, "clip": 1.0}, "params: task.eval_reward.clip: unknown reward (known rewards:"),
    ("reward", {"geneval": "heavy"}, "params: task.reward.geneval = 'heavy': expected float"),
    ("reward", {"geneval": float("inf")}, "params: task.reward.geneval = inf: expected float"),
    ("reward", {}, "params: task.reward = {}: expected a reward name or a mapping name -> weight"),
    ("reward", ["geneval"], "params: task.reward = ['geneval']: expected a reward name or a mapping"),
])
def test_bad_reward_specs_are_one_line_config_errors(raw, key, value, expected):
    bad = copy.deepcopy(raw)
    bad["task"][key] = value
    with pytest.raises(ConfigError) as info:
        config_from_dict(bad)
    assert str(info.value).startswith(expected) and "\n" not in str(info.value)
    assert all(name in str(info.value) for name in ("remote", "pickscore")) or "expected float" in expected


@pytest.mark.parametrize("section, key, value, expected", [
    ("remote_reward", "encoding", "jpeg", "remote_reward.encoding = 'jpeg': expected one of png, raw"),
    ("remote_reward", "timeout", 0, "remote_reward.timeout = 0.0: expected a value > 0"),
    ("remote_reward", "retries", -1, "remote_reward.retries = -1: expected a value >= 0"),
    ("reward_models", "geneval_detector_threshold", 1.5, "expected a value in [0, 1]"),
    ("reward_models", "pickscore_pth", "x", "unknown key reward_models.pickscore_pth"),
])
def test_reward_sections_are_validated(raw, section, key, value, expected):
    bad = copy.deepcopy(raw)
    bad[section][key] = value
    with pytest.raises(ConfigError, match=expected.replace("[", r"\[").replace("]", r"\]")):
        config_from_dict(bad)


def test_dvc_yaml_lists_configured_reward_folders(raw):
    from conftest import REPO

    from tpgrpo.pipeline.rendering.code_manifest import kind_code
    from tpgrpo.pipeline.rendering.dvcfile import render

    mixed = copy.deepcopy(raw)
    mixed["task"]["reward"] = {"geneval_soft": 1.0, "pickscore": 0.1}
    mixed["reward_models"]["pickscore_path"] = "models/PickScore_v1"
    mixed["reward_models"]["geneval_detector_path"] = "models/owlv2"  # not used by any spec: not a dep
    mixed["tree"]["enabled"] = False  # a chain's probe scores completions (a tree's reads its store only)
    stages = render(config_from_dict(mixed))["stages"]
    for name, kind in (("rollout-0001", "rollout"), ("probe-0001", "probe"), ("eval-0001", "eval"),
                       ("baseline", "eval")):
        assert "models/PickScore_v1" in stages[name]["deps"]
        assert f"data/code/{kind}.json" in stages[name]["deps"] and "tpgrpo/rewards/pickscore.py" in kind_code(REPO, kind)
        assert "models/owlv2" not in stages[name]["deps"]
        # every reward_models key but its device (an execution knob), and remote_reward
        listed = set(stages[name]["params"])
        assert {"reward_models.pickscore_path", "reward_models.batch_size", "remote_reward"} <= listed
        assert "reward_models" not in listed and "reward_models.device" not in listed
    assert "models/PickScore_v1" not in stages["update-0001"]["deps"]


def test_rollout_and_probe_stages_with_a_weighted_reward(tiny_project, tmp_path):
    """Three copies of a project differ only in task.reward; same seeds, same images: the combined
    rollout's final rewards are the weighted sum of the single ones, and the probe uses the same spec."""
    import zarr

    runner = CliRunner()
    specs = {"mix": {"jpeg_compressibility": 1.0, "geneval_soft": 0.5}, "jpeg": "jpeg_compressibility",
             "soft": "geneval_soft"}
    stores = {}
    for label, spec in specs.items():
        root = tmp_path / label
        shutil.copytree(tiny_project, root)
        params = yaml.safe_load((root / "params.yaml").read_text())
        params["task"]["reward"] = spec
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        for stage in ("rollout", "probe") if label == "mix" else ("rollout",):
            result = runner.invoke(app, ["stage", stage, "--iter", "1", "--params", str(root / "params.yaml")])
            assert result.exit_code == 0, result.output
        stores[label] = zarr.open_group(str(root / "data/iters/0001/trajectories.zarr"), mode="r")
    mix, jpeg, soft = (stores[k]["final_reward"][:] for k in ("mix", "jpeg", "soft"))
    np.testing.assert_array_equal(stores["mix"]["states"][:], stores["jpeg"]["states"][:])
    np.testing.assert_allclose(mix, jpeg + 0.5 * soft, rtol=0, atol=1e-12)
    np.testing.assert_array_equal(stores["mix"]["final_strict"][:], stores["soft"]["final_strict"][:])
    assert dict(stores["mix"].attrs["reward"]) == specs["mix"]
    import pandas as pd

    probe = pd.read_parquet(tmp_path / "mix/data/iters/0001/probe.parquet")
    last = probe[probe.step == probe.step.max()].sort_values("trajectory")["reward"].to_numpy()
    np.testing.assert_array_equal(last, mix)
    assert np.isfinite(probe["reward"]).all() and probe.loc[probe.step == 0, "reward"].nunique() > 1


def test_stages_declare_the_reward_params_they_read(tiny_project):
    """The recording-config check of test_stage_params, with model rewards that read reward_models."""
    import importlib

    from tpgrpo.config import load_config

    try:
        from tests.test_stage_params import Recorder, covered, declared
        from tests.tiny_reward_models import save_tiny_clip, save_tiny_owlvit
    except ImportError:  # pytest's rootdir import mode
        from test_stage_params import Recorder, covered, declared
        from tiny_reward_models import save_tiny_clip, save_tiny_owlvit

    root = tiny_project
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["task"]["reward"] = {"jpeg_compressibility": 1.0, "pickscore": 0.1}
    params["task"]["eval_reward"] = "geneval_detector"
    params["reward_models"].update(pickscore_path=str(save_tiny_clip(root / "models" / "clip")),
                                   geneval_detector_path=str(save_tiny_owlvit(root / "models" / "owl")))
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    cfg = load_config(root / "params.yaml")
    for name, iteration in [("rollout", 0), ("probe", 0), ("baseline", None)]:
        reads: set[str] = set()
        importlib.import_module(f"stages.{name}").run(Recorder(cfg, reads), iteration, root)
        assert {"reward_models.pickscore_path", "reward_models.device"} <= reads, name
        undeclared = sorted(r for r in reads if not covered(r, declared(name, cfg)))
        assert not undeclared, f"stage {name} reads {undeclared} but dvc.yaml does not list them"


def test_a_configured_but_missing_reward_folder_stops_the_stage_before_sampling(tiny_project):
    params = yaml.safe_load((tiny_project / "params.yaml").read_text())
    params["task"]["reward"] = {"geneval_soft": 1.0, "pickscore": 0.5}
    params["reward_models"]["pickscore_path"] = "models/PickScore_v1"
    (tiny_project / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    result = CliRunner().invoke(app, ["stage", "rollout", "--iter", "1", "--params", str(tiny_project / "params.yaml")])
    assert result.exit_code == 2
    line = result.output.strip()
    assert line.startswith("error: params: reward_models.pickscore_path = 'models/PickScore_v1': folder ")
    assert "not found (expected a CLIP save_pretrained folder with config.json" in line and "\n" not in line
    assert not (tiny_project / "data/iters/0001/trajectories.zarr").exists()


def test_every_registered_name_is_documented_in_params_yaml():
    text = (REPO / "params.yaml").read_text()
    assert all(name in text for name in REWARD_NAMES)
