"""The `tree` params section is an input only while tree sampling is on (tpgrpo.stage_params.stage_inputs).

Why: a key added to a section a stage lists changes that stage's recorded params (dvc.lock) and its artifacts'
config_hash, so DVC re-runs it in every iteration of an existing run folder (at 1,000 iterations, the whole
history) for an edit that cannot change a result. The tree keys live in their own section, which the rollout
lists only with ``tree.enabled``: a chain project renders and hashes exactly what it did before the tree
existed (11d501c), an edit of a tree key while it is off re-runs nothing, and turning it on re-runs the
rollout (and, through its outputs, what follows).
"""

from __future__ import annotations

import dataclasses
import json
import subprocess
import sys

import pytest
import yaml

from conftest import tiny_params
from tpgrpo.config import Config, config_from_dict
from tpgrpo.pipeline.rendering.dvcfile import dvc_yaml_text, render
from tpgrpo.pipeline.status import stage_params
from tpgrpo.stage_common import provenance
from tpgrpo.stage_params import CHAIN_ONLY, STAGE_PARAMS, TREE_SHAPE

STAGES = ("rollout", "probe", "credit", "update", "eval", "eval_prompts", "baseline", "summary")
# The rollout section as on main 11d501c, before the tree: its recorded params and hash must stay these keys'.
MAIN_ROLLOUT_KEYS = ["prompts_per_iter", "group_size", "batch_size"]
# What the tree rollout reads of the sampling, rollout and probe sections (no window, group size, completion).
TREE_SAMPLING_KEYS = ["sampling.num_steps", "sampling.shift", "sampling.guidance_scale", "sampling.step_kind",
                      "sampling.noise_level", "rollout.prompts_per_iter", "rollout.batch_size"]
# Edits of keys the tree ignores, valid on the tiny schedule (T = 4, window 0 + 3 steps, G = 4).
IGNORED_EDITS = [{"sampling": {"window_size": 2}}, {"sampling": {"window_start": 1, "window_size": 2}},
                 {"rollout": {"group_size": 6}}]


def _project(tmp_path, name: str, **tree) -> tuple[Config, object]:
    """The tiny params with ``tree`` overrides: (Config, the params.yaml written for it)."""
    raw = tiny_params(tree=tree)
    params = tmp_path / f"{name}.yaml"
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    return config_from_dict(raw), params


def _hashes(cfg: Config) -> dict[str, str]:
    """Every stage's artifact ``config_hash`` (what provenance writes) under ``cfg``."""
    return {stage: provenance(cfg, 1, stage)["config_hash"] for stage in STAGES}


def test_a_chain_project_records_and_hashes_what_it_did_before_the_tree(tmp_path):
    cfg, params = _project(tmp_path, "chain")
    assert [f.name for f in dataclasses.fields(cfg.rollout)] == MAIN_ROLLOUT_KEYS
    stages = render(cfg, tmp_path)["stages"]
    assert not any(p == "tree" or p.startswith("tree.") for name, s in stages.items() if name != "code"
                   for p in s.get("params", []))
    # the code stage lists the switch only (it checks dvc.yaml against params.yaml, which tree.enabled changes);
    # the code stage re-runs in a second and rewrites byte-identical manifests: no iteration stage re-runs
    assert [p for p in stages["code"]["params"] if p.startswith("tree")] == ["tree.enabled"]
    assert stages["rollout-0001"]["params"] == STAGE_PARAMS["rollout"]  # the list main renders
    # What DVC records for the rollout (the leaves of its listed params): main's rollout keys, no tree key.
    recorded = stage_params(params, "rollout")
    assert sorted(k for k in recorded if k.startswith(("rollout.", "tree"))) == sorted(
        f"rollout.{k}" for k in MAIN_ROLLOUT_KEYS)
    # Its config_hash is the hash of main's list, over a rollout section holding main's keys only.
    assert _hashes(cfg) == {s: cfg.params_hash(STAGE_PARAMS[s]) for s in STAGES}


def test_with_tree_off_a_tree_edit_re_runs_nothing(tmp_path):
    cfg, params = _project(tmp_path, "off")
    edited, edited_params = _project(tmp_path, "off_edited", children=3, roots=2, split_steps="0,1")
    assert dvc_yaml_text(cfg, tmp_path) == dvc_yaml_text(edited, tmp_path)
    assert _hashes(cfg) == _hashes(edited)
    assert all(stage_params(params, s) == stage_params(edited_params, s) for s in STAGES)


def test_with_tree_on_the_rollout_lists_the_shape_and_credit_the_baseline(tmp_path):
    chain, _ = _project(tmp_path, "chain")
    tree, params = _project(tmp_path, "on", enabled=True, split_steps="0,1")
    wider, _ = _project(tmp_path, "on_wider", enabled=True, split_steps="0,1", children=2)
    grouped, _ = _project(tmp_path, "on_grouped", enabled=True, split_steps="0,1", baseline="depth_group")
    stages = render(tree, tmp_path)["stages"]
    listed = stages["rollout-0001"]["params"]
    assert listed[-4:] == ["tree.enabled", *TREE_SHAPE]
    # the chain's keys but those the tree does not read (sampling and rollout then listed key by key)
    assert [k for k in listed if k.startswith(("sampling", "rollout", "probe"))] == TREE_SAMPLING_KEYS
    assert [k for k in listed if not k.startswith(("sampling", "rollout", "probe", "tree"))] == [
        k for k in STAGE_PARAMS["rollout"] if k not in ("sampling", "rollout", "probe.completion")]
    assert stages["credit-0001"]["params"] == [*STAGE_PARAMS["credit"], "tree.baseline"]
    # (the code stage lists the switch: it decides what dvc.yaml lists)
    assert all(not any(p.startswith("tree") and p != "tree.enabled" for p in s.get("params", []))
               for n, s in stages.items() if not n.startswith(("rollout-", "credit-")))
    assert {"tree.enabled", "tree.children"} <= set(stage_params(params, "rollout"))
    on, more, off, regrouped = _hashes(tree), _hashes(wider), _hashes(chain), _hashes(grouped)
    assert on["rollout"] != more["rollout"] and on["rollout"] != off["rollout"]
    # Only the rollout reads the shape; what follows re-runs through the rollout's outputs.
    assert {s: h for s, h in on.items() if s != "rollout"} == {s: h for s, h in more.items() if s != "rollout"}
    # The baseline is the credit stage's alone: the rollout's hash (so its store) stays.
    assert {s: h for s, h in on.items() if s != "credit"} == {s: h for s, h in regrouped.items() if s != "credit"}
    assert on["credit"] != regrouped["credit"]


@pytest.mark.parametrize("edit", IGNORED_EDITS, ids=lambda e: ",".join(f"{s}.{k}" for s in e for k in e[s]))
def test_with_tree_on_an_edit_of_a_key_the_tree_does_not_read_re_runs_nothing(tmp_path, edit):
    """The tree rollout reads no window, group size or probe completion, and eval, baseline and summary never
    read the window: with the tree on, an edit of one changes no stage's list or recorded params and
    no config_hash. With the tree off the same edit re-runs the rollout (and the chain lists what it did)."""
    tree = {"enabled": True, "split_steps": "0,1"}
    on, edited = (tmp_path / "on.yaml", tmp_path / "edited.yaml")
    for path, raw in ((on, tiny_params(tree=tree)), (edited, tiny_params(tree=tree, **edit))):
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg, cfg_edited = (config_from_dict(yaml.safe_load(p.read_text())) for p in (on, edited))
    assert dvc_yaml_text(cfg, tmp_path) == dvc_yaml_text(cfg_edited, tmp_path)
    assert _hashes(cfg) == _hashes(cfg_edited)
    assert all(stage_params(on, s) == stage_params(edited, s) for s in STAGES)
    assert not set(CHAIN_ONLY) & set(stage_params(on, "rollout"))
    chain, chain_edited = config_from_dict(tiny_params()), config_from_dict(tiny_params(**edit))
    assert _hashes(chain)["rollout"] != _hashes(chain_edited)["rollout"]


@pytest.mark.parametrize("edit", [{"probe": {"batch_size": 7}}, {"probe": {"completion": "ode:1"}},
                                  {"model": {"resolution": 16}}, {"update": {"lora_rank": 2}}],
                         ids=lambda e: ",".join(f"{s}.{k}" for s in e for k in e[s]))
def test_a_tree_probe_lists_only_the_switch(tmp_path, edit):
    """A tree's probe reads its store only (no model, pass or reward): it lists tree.enabled, so an edit of a
    probe key changes no record of it; one the rollout reads too re-runs it through the store, not its list.
    With the tree off the chain probe lists what it did."""
    tree = {"enabled": True, "split_steps": "0,1"}
    on, edited = (tmp_path / "on.yaml", tmp_path / "edited.yaml")
    for path, raw in ((on, tiny_params(tree=tree)), (edited, tiny_params(tree=tree, **edit))):
        path.write_text(yaml.safe_dump(raw, sort_keys=False))
    assert stage_params(on, "probe") == stage_params(edited, "probe") == {"tree.enabled": True}
    if "completion" not in edit.get("probe", {}):  # a tree takes the exact completion only: ode:1 is refused
        cfg, cfg_edited = (config_from_dict(yaml.safe_load(p.read_text())) for p in (on, edited))
        assert _hashes(cfg)["probe"] == _hashes(cfg_edited)["probe"]
    chain = tmp_path / "chain.yaml"
    chain.write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    assert {"probe.batch_size", "probe.completion", "model.resolution"} <= set(stage_params(chain, "probe"))


@pytest.mark.parametrize("spelling", ["yes", "on", "True"])
def test_a_yaml_1_1_true_switches_the_section_on_for_the_checks_as_for_the_stage(tmp_path, spelling):
    """DVC (and the params-read checks) parse YAML 1.2, where `yes` is a string; the config loader reads it
    as true and samples trees: the checks must then count the tree keys as read, as the stage does."""
    from tpgrpo.config import load_config

    _, params = _project(tmp_path, "spelt", enabled=True, split_steps="0,1")
    params.write_text(params.read_text().replace("enabled: true", f"enabled: {spelling}"))
    assert load_config(params).tree.enabled
    assert {"tree.enabled", "tree.children"} <= set(stage_params(params, "rollout"))


@pytest.mark.slow
def test_a_trained_chain_project_runs_nothing_for_the_tree_section(tmp_path, tiny_model_dir):
    """A chain project trained for one iteration through `tpgrpo run`: DVC recorded no tree key but the code
    stage's switch (tree.enabled, which decides what dvc.yaml lists), so for a params file without the tree
    section (an older project's) `dvc status` names the code stage only (a second's work, no iteration stage),
    and after the section comes back with other values (tree off) `tpgrpo run` runs no stage."""
    from conftest import make_tiny_project
    from test_dvc_pipeline import env, tpgrpo_run

    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"]["iterations"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    first = tpgrpo_run(root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    lock = yaml.safe_load((root / "dvc.lock").read_text())["stages"]
    assert lock["code"]["params"]["params.yaml"]["tree.enabled"] is False
    assert all("tree" not in json.dumps(entry) for name, entry in lock.items() if name != "code")
    lacking = {k: v for k, v in raw.items() if k != "tree"}  # the params as before the tree section existed
    (root / "params.yaml").write_text(yaml.safe_dump(lacking, sort_keys=False))
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, env=env(), capture_output=True,
                            text=True)
    assert status.returncode == 0 and "code:" in status.stdout, status.stdout + status.stderr
    assert not any(f"{s}-0001" in status.stdout for s in ("rollout", "probe", "credit", "update", "eval")), status.stdout
    raw["tree"].update({"children": 3, "roots": 2, "split_steps": "0,1"})  # edited while off: inert
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    second = tpgrpo_run(root)
    assert second.returncode == 0 and "Running stage" not in second.stdout, second.stdout[-3000:]


@pytest.mark.slow
def test_a_trained_tree_project_runs_nothing_for_a_key_the_tree_does_not_read(tmp_path, tiny_model_dir):
    """A tree project trained for one iteration through `tpgrpo run`; the window and the group size edited
    (keys only a chain reads): `dvc status` stays clean, the recorded rollout's config_hash is the edited
    params' hash, and `tpgrpo run` runs no stage (before the fix: the rollout and all after it)."""
    import zarr

    from test_dvc_pipeline import env, tpgrpo_run
    from test_tree_pipeline import _tree_project
    from tpgrpo.config import load_config

    root = _tree_project(tmp_path, tiny_model_dir)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"]["iterations"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    first = tpgrpo_run(root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for section, values in ({"sampling": {"window_start": 1, "window_size": 2}, "rollout": {"group_size": 6}}).items():
        raw[section].update(values)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, env=env(), capture_output=True,
                            text=True)
    assert status.returncode == 0 and "up to date" in status.stdout, status.stdout + status.stderr
    store = zarr.open_group(str(root / "data" / "iters" / "0001" / "trajectories.zarr"), mode="r")
    assert store.attrs["config_hash"] == provenance(load_config(root / "params.yaml"), 1, "rollout")["config_hash"]
    second = tpgrpo_run(root)
    assert second.returncode == 0 and "Running stage" not in second.stdout, second.stdout[-3000:]
