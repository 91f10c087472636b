"""tree.enabled: the tree rollout through the real CLI stages on the tiny project: rollout -> probe -> credit ->
update, every credit mode, and the config's one-line errors."""

from __future__ import annotations

import json
import shutil

import numpy as np
import pandas as pd
import pytest
import torch
import yaml

from conftest import make_tiny_project
from test_integrity import flip_bytes
from test_pipeline_stages import iteration_dir, run_iteration, run_ok, stage
from tpgrpo.config import ConfigError, config_from_dict
from tpgrpo.io.stage_logs import read_log

TREE = {"enabled": True, "split_steps": "0,1", "children": 1, "roots": 2}  # the params' tree section
# per root: edges 2 + 4 = 6 (3 SDE), leaves 4, nodes 1 + 2 + 4 = 7 (split 1 follows split 0: the depth-0
# children are the depth-1 parents); 3 prompts x 2 roots
EDGES, SDE_EDGES, LEAVES, NODES = 3 * 2 * 6, 3 * 2 * 3, 3 * 2 * 4, 3 * 2 * 7


def _tree_project(tmp_path, model_dir, mode="tp"):
    root = make_tiny_project(tmp_path / "project", model_dir)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["tree"].update(TREE)
    raw["credit"]["mode"] = mode
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return root


@pytest.fixture(scope="module")
def tree_run(tmp_path_factory, tiny_model_dir):
    root = _tree_project(tmp_path_factory.mktemp("tree"), tiny_model_dir)
    run_iteration(root, 1, ("rollout", "probe", "credit", "update"))
    return root


def test_rollout_writes_one_row_per_edge_and_counts_its_passes(tree_run):
    import zarr

    d = iteration_dir(tree_run, 1)
    store = zarr.open_group(str(d / "trajectories.zarr"), mode="r")
    assert "states" not in store and store["log_probs"].shape == (EDGES, 1)
    assert store["node_states"].shape == (NODES, 3, 32, 32)  # each state once: 42 where per edge were 72
    parent, child = store["tree_parent_node"][:], store["tree_child_node"][:]
    assert parent.max() < 14 and child.max() < 14 and len(set(child[:12])) == 12  # prompt-local, a child each
    assert store.attrs["shape"] == "tree" and store.attrs["group_size"] == 12
    sde = store["tree_sde"][:]
    assert int(sde.sum()) == SDE_EDGES and (store["log_probs"][:][~sde] == 0).all()
    rollout = json.loads((d / "rollout.json").read_text())
    # T = 4, splits at 0 and 1: rows 1 + 2 + 4 + 4 = 11 per root; 6 roots; one call per step per chunk
    assert rollout["forward_passes"] == 6 * 11 and rollout["decodes"] == LEAVES and rollout["sde_edges"] == SDE_EDGES


def test_probe_assembles_q_from_the_leaves_and_q_is_the_ode_completion(tree_run):
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import ode_complete
    from tpgrpo.config import load_config
    from tpgrpo.models import load_backend
    from tpgrpo.tasks.rewards import get_reward

    d = iteration_dir(tree_run, 1)
    probe = pd.read_parquet(d / "probe.parquet").sort_values(["trajectory", "step"])
    q = probe["reward"].to_numpy().reshape(EDGES, 2)
    heads = probe[probe.step == 0].reset_index(drop=True)
    assert json.loads((d / "probe.json").read_text())["forward_passes"] == 0
    np.testing.assert_array_equal(q[~heads["sde"].to_numpy(), 0], q[~heads["sde"].to_numpy(), 1])  # ODE: d = 0
    linked = heads["parent_trajectory"].to_numpy() >= 0
    np.testing.assert_array_equal(q[linked, 0], q[heads["parent_trajectory"].to_numpy()[linked], 1])
    # exactness through the stages: complete the stored states of the first prompt's edges with the probe's code
    import zarr

    store = zarr.open_group(str(d / "trajectories.zarr"), mode="r")
    cfg = load_config(tree_run / "params.yaml")
    backend = load_backend("tiny", tree_run / "data" / "base")
    rows = np.arange(12)
    embeds = backend.encode_prompts([heads["prompt"][0]]).select(torch.zeros(24, dtype=torch.long))
    nodes = np.stack([store["tree_parent_node"][:12], store["tree_child_node"][:12]], 1).reshape(-1)
    states = torch.from_numpy(store["node_states"][:14][nodes])  # (edge, parent/child) pairs, prompt 0's nodes
    k = _split_step(store, rows)
    steps = torch.from_numpy(np.stack([k, k + 1], 1).reshape(-1)).long()  # parent at step k, child at k + 1
    final, _ = ode_complete(backend, states, steps, flow_sigmas(4, cfg.sampling.shift), embeds,
                            cfg.sampling.guidance_scale, batch_size=64)
    expected = get_reward(cfg.task.reward)(backend.decode(final), [{"task": "compositional"}] * 24).reward
    np.testing.assert_allclose(q[:12].reshape(-1), expected, atol=1e-6)


def _split_step(store, rows):
    """Schedule step of each edge: its split index into the tree's split steps."""
    split = store.attrs["tree_split_steps"]
    return np.asarray(split)[store["tree_depth"][:][rows]]


def test_the_update_reads_each_edge_pair_from_the_node_store(tree_run):
    """NodeStates: edge e's (parent, child) states are its two node_states rows, each node read once."""
    from tpgrpo.io.trajectories import read_trajectories
    from tpgrpo.policy.states import NodeStates
    from tpgrpo.rollout_shape.stored_states import store_states

    arrays, attrs = read_trajectories(iteration_dir(tree_run, 1) / "trajectories.zarr", lazy=("node_states",))
    states = store_states(arrays, len(attrs["prompts"]), "tree").verify()
    assert isinstance(states, NodeStates) and states.shape == (EDGES, 2, 3, 32, 32)
    nodes, base = arrays["node_states"][:], arrays["prompt_index"].astype(np.int64) * (NODES // 3)
    x, x_next = states.pairs(torch.arange(EDGES), torch.zeros(EDGES, dtype=torch.long))
    np.testing.assert_array_equal(x.numpy(), nodes[arrays["tree_parent_node"] + base])
    np.testing.assert_array_equal(x_next.numpy(), nodes[arrays["tree_child_node"] + base])
    assert states.peak_read_bytes == NODES * 3 * 32 * 32 * 4  # all 42 nodes, once each (72 edge states)


def test_credit_is_the_tree_credit_of_the_probe_table_and_update_trains_sde_edges(tree_run):
    from tpgrpo.algo.tree_credit import tree_credit_table

    d = iteration_dir(tree_run, 1)
    credit = pd.read_parquet(d / "credit.parquet").sort_values("trajectory")
    probe = pd.read_parquet(d / "probe.parquet")
    expected = tree_credit_table(probe, "tp", "group", False, 5.0)
    np.testing.assert_allclose(credit["advantage"].to_numpy(), expected["advantage"].to_numpy())
    sde = probe[probe.step == 0].sort_values("trajectory")["sde"].to_numpy()
    assert (credit["advantage"].to_numpy()[~sde] == 0).all() and (credit["advantage"].to_numpy()[sde] != 0).any()
    update = json.loads((d / "update.json").read_text())
    assert update["first_pass_ratio_max_dev"] < 1e-5  # the stored SDE log-probs are the sampling policy's
    assert 0 < update["num_transitions"] <= SDE_EDGES and update["approx_kl_after"] > 0


def test_credit_json_counts_only_the_sde_edges(tree_run):
    """credit.json's rates (and the summary's tp_rate from them) are over the trained SDE edges: an ODE edge's
    increment is 0 by construction and it has no policy, so counting it would dilute every rate."""
    d = iteration_dir(tree_run, 1)
    credit, log = pd.read_parquet(d / "credit.parquet"), json.loads((d / "credit.json").read_text())
    heads = pd.read_parquet(d / "probe.parquet").query("step == 0").set_index("trajectory")
    sde = credit[heads.loc[credit["trajectory"], "sde"].to_numpy()]
    assert len(sde) == SDE_EDGES < len(credit) == EDGES
    assert log["turning_point_rate"] == float(sde["turning_point"].mean())
    assert log["zero_increment_fraction"] == float((sde["incremental"] == 0).mean()) < 0.5  # ODE zeros left out
    assert log["incremental_abs_mean"] == float(sde["incremental"].abs().mean())
    assert log["tp_positive_trend"] + log["tp_negative_trend"] <= int(sde["turning_point"].sum())


@pytest.mark.parametrize("mode", ["flow_grpo", "incremental", "tp_unconstrained"])
def test_every_credit_mode_runs_on_a_tree(tree_run, mode):
    from tpgrpo.algo.tree_credit import tree_credit_table

    probe = pd.read_parquet(iteration_dir(tree_run, 1) / "probe.parquet")
    table = tree_credit_table(probe, mode, "group", False, 5.0)
    assert len(table) == EDGES and np.isfinite(table["advantage"]).all()
    assert (table["advantage"] != 0).any()


def _set(store, name, index, value):
    import zarr

    zarr.open_array(str(store / name), mode="r+")[index] = value  # checksums recomputed: decodes fine


def _old_layout(store):
    """The layout before the node store: each edge's (parent, child) states in 'states', no node arrays."""
    import zarr

    for name in ("node_states", "tree_parent_node", "tree_child_node"):
        shutil.rmtree(store / name)
    zarr.open_group(str(store), mode="r+").create_array("states", data=np.zeros((EDGES, 2, 3, 32, 32), np.float32))


NODE = "node_states/c.0.0.0.0"  # the one file of the 42 nodes (64 per file)
TREE_DAMAGE = {  # damage to the node store -> (stage that reads it, words of its one-line error)
    "flipped bytes in the node_states file": (lambda s: flip_bytes(s / NODE), "update",
                                              ["array 'node_states' is damaged", "fails its checksum"]),
    "the node_states file deleted": (lambda s: (s / NODE).unlink(), "probe",
                                     ["array 'node_states' has 0 of its 1 chunk files"]),
    "node_states deleted": (lambda s: shutil.rmtree(s / "node_states"), "update", ["missing array 'node_states'"]),
    "a child node out of range": (lambda s: _set(s, "tree_child_node", 5, 14), "update",
                                  ["array 'tree_child_node' has values", "..14; expected 0..13"]),
    "a parent node below 0": (lambda s: _set(s, "tree_parent_node", 7, -1), "probe",
                              ["array 'tree_parent_node' has values -1..", "expected 0..13"]),
    "a store of the old layout": (_old_layout, "probe", ["tree store of the old layout", "re-run the rollout"]),
    # each tree_* array was optional in the schema, so a store without one ended in a KeyError
    **{f"{name} deleted, then {stage}": (lambda s, name=name: shutil.rmtree(s / name), stage,
                                         [f"missing array '{name}'"])
       for name, stage in (("tree_leaf", "probe"), ("tree_sde", "probe"), ("tree_parent", "probe"),
                           ("tree_depth", "probe"), ("tree_sde", "update"), ("tree_depth", "update"))},
    "NaN in node_states": (lambda s: _set(s, "node_states", (5, 0, 3, 3), np.nan), "update",
                           ["array 'node_states' has 1 non-finite values (first at [5, 0, 3, 3]"]),
}


@pytest.mark.parametrize("case", list(TREE_DAMAGE))
def test_a_damaged_node_store_is_one_line_naming_the_store_and_array(tree_run, tmp_path, case):
    damage, name, words = TREE_DAMAGE[case]
    root = shutil.copytree(tree_run, tmp_path / "project")
    damage(iteration_dir(root, 1) / "trajectories.zarr")
    result = stage(root, name, 1)
    lines = [line for line in result.output.splitlines() if line.strip() and "it/s]" not in line]
    assert result.exit_code == 2 and lines[-1].startswith("error: "), result.output
    assert "Traceback" not in result.output and "trajectories.zarr (iteration 1)" in lines[-1], lines[-1]
    for word in words:
        assert word in lines[-1], lines[-1]


@pytest.mark.parametrize("written", [[0, 3, 6], "0,3,6", 3, [3]])
def test_split_steps_may_be_a_yaml_list_or_int_and_hash_as_the_text(written):
    """``tree.split_steps: [0, 3, 6]`` and ``3`` are what YAML makes of natural spellings: accepted,
    held as the text ``"0,3,6"`` / ``"3"``, so the config hash of a run that wrote the text is unchanged."""
    from conftest import tiny_params

    from tpgrpo.stage_common import provenance

    cfg = config_from_dict(tiny_params(tree={**TREE, "split_steps": written}, sampling={"num_steps": 10}))
    text = "0,3,6" if isinstance(written, (list, str)) and written != [3] else "3"
    same = config_from_dict(tiny_params(tree={**TREE, "split_steps": text}, sampling={"num_steps": 10}))
    assert cfg.tree.split_steps == text
    assert provenance(cfg, 1, "rollout")["config_hash"] == provenance(same, 1, "rollout")["config_hash"]


@pytest.mark.parametrize("written, held", [(3, 3), ("3", 3), ([3], 3), ("3,1", "3,1"), ([3, 1], "3,1")])
def test_children_one_count_or_one_per_split_hash_as_one_spelling(written, held):
    """``tree.children``: an int, kept an int (the hash of a run that wrote one is unchanged), or one count per
    split as text or a list, held as the text ``"3,1"``; each spelling hashes as the held value."""
    from conftest import tiny_params

    from tpgrpo.stage_common import provenance

    cfg = config_from_dict(tiny_params(tree={**TREE, "children": written}))
    same = config_from_dict(tiny_params(tree={**TREE, "children": held}))
    assert cfg.tree.children == held and type(cfg.tree.children) is type(held)
    assert provenance(cfg, 1, "rollout")["config_hash"] == provenance(same, 1, "rollout")["config_hash"]


def test_tree_params_errors_are_one_line():
    from conftest import tiny_params

    for tree, probe, match in (({**TREE, "split_steps": "0,3"}, "exact", r"tree.split_steps = '0,3'.*\[0, 2\]"),
                               ({**TREE, "split_steps": "a"}, "exact", "comma-separated"),
                               ({**TREE, "split_steps": [0, "a"]}, "exact", r"a list of ints \(\[0, 3, 6\]\)"),
                               ({**TREE, "split_steps": True}, "exact", "comma-separated text"),
                               ({**TREE, "children": "3,x"}, "exact", r"tree.children = '3,x'.*one per split"),
                               ({**TREE, "children": [3, 0]}, "exact", r"tree.children = \[3, 0\].*> 0"),
                               ({**TREE, "children": True}, "exact", "tree.children = True"),
                               ({**TREE, "children": "3,1,1,1"}, "exact",
                                r"tree.children = '3,1,1,1'.*one count per split step"),
                               (TREE, "x0", "probe.completion = 'x0' with tree.enabled")):
        raw = tiny_params(tree=tree, probe={"completion": probe})
        with pytest.raises(ConfigError, match=match) as info:
            config_from_dict(raw)
        assert "\n" not in str(info.value)


def test_the_tree_stages_read_only_the_params_they_declare(tmp_path, tiny_model_dir):
    """As tests/test_stage_params.py for the chain: the tree's branches read no undeclared param."""
    import importlib

    from test_stage_params import Recorder, covered, declared
    from tpgrpo.config import load_config

    root = _tree_project(tmp_path, tiny_model_dir)
    cfg = load_config(root / "params.yaml")
    for name in ("rollout", "probe", "credit", "update"):
        reads: set[str] = set()
        importlib.import_module(f"stages.{name}").run(Recorder(cfg, reads), 1, root)
        undeclared = sorted(r for r in reads if not covered(r, declared(name, cfg)))
        assert not undeclared and reads, (name, undeclared)
        # the rollout reads the shape, credit the baseline, probe and update no tree key
        assert any(r.startswith("tree.") and r != "tree.enabled" for r in reads) == (name in ("rollout", "credit")), name
    assert json.loads((iteration_dir(root, 1) / "probe.json").read_text())["completion"] == "tree"


@pytest.mark.slow
def test_two_processes_write_the_same_tree_as_one(tmp_path, tiny_model_dir):
    """The tree rollout's chunks (one prompt group each here) over 2 processes (accelerate, gloo): the same
    trajectories.zarr bytes, probe and credit tables as on 1 process."""
    from test_distributed_stages import run_stage, tree_bytes

    roots = []
    for processes in (1, 2):
        root = _tree_project(tmp_path / str(processes), tiny_model_dir)
        raw = yaml.safe_load((root / "params.yaml").read_text())
        raw["rollout"]["batch_size"] = 4
        raw["launch"]["num_processes"] = processes
        (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        for name in ("rollout", "probe", "credit"):
            out = run_stage(root, name)
            assert out.returncode == 0, f"{processes} {name}:\n{out.stderr[-3000:]}"
        roots.append(iteration_dir(root, 1))
    one, two = roots
    assert tree_bytes(one / "trajectories.zarr") == tree_bytes(two / "trajectories.zarr")
    for name in ("probe.parquet", "credit.parquet"):
        assert (one / name).read_bytes() == (two / name).read_bytes(), name
    rollout = read_log(two / "rollout.json", "rollout")  # with its timing sidecar
    assert rollout["processes"] == 2 and rollout["chunks"] == 3


@pytest.mark.slow
def test_tpgrpo_run_trains_a_tree_and_a_second_run_does_nothing(tmp_path, tiny_model_dir):
    """The tree through the real `tpgrpo run` (dvc.yaml rendered, DVC runs the stages): both iterations,
    then nothing left to run."""
    from test_dvc_pipeline import tpgrpo_run

    root = _tree_project(tmp_path, tiny_model_dir)
    first = tpgrpo_run(root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for i in (1, 2):
        assert json.loads((iteration_dir(root, i) / "probe.json").read_text())["completion"] == "tree"
        assert (iteration_dir(root, i) / "policy" / "pytorch_lora_weights.safetensors").is_file()
    second = tpgrpo_run(root)
    assert second.returncode == 0 and "Running stage" not in second.stdout, second.stdout[-3000:]
