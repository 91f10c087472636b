"""Each stage reads the rollout's shape once, from its own input, and never guesses; chains and trees implement
one interface, and the stages dispatch to it once with no shape names of their own (tpgrpo.rollout_shape)."""

from __future__ import annotations

import ast
import dataclasses
import inspect
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import zarr

from tpgrpo import rollout_shape
from tpgrpo.config import Config, TreeConfig
from tpgrpo.io.schemas import ArtifactError


def _store(path, **attrs):
    group = zarr.open_group(str(path), mode="w")
    group.attrs.update(attrs)
    return path


def test_the_shape_of_a_config_a_store_and_a_probe_table(tmp_path):
    assert rollout_shape.of_config(Config()) == "chain"
    assert rollout_shape.of_config(dataclasses.replace(Config(), tree=TreeConfig(enabled=True))) == "tree"
    assert rollout_shape.of_store(_store(tmp_path / "chain.zarr", iteration=1)) == "chain"  # chains predate the attr
    assert rollout_shape.of_store(_store(tmp_path / "tree.zarr", shape="tree")) == "tree"
    table = pa.table({"x": [1]})
    pq.write_table(table.replace_schema_metadata({b"tpgrpo.completion": b"tree"}), tmp_path / "tree.parquet")
    pq.write_table(table.replace_schema_metadata({b"tpgrpo.completion": b"exact"}), tmp_path / "exact.parquet")
    assert rollout_shape.of_probe_table(tmp_path / "tree.parquet") == "tree"
    assert rollout_shape.of_probe_table(tmp_path / "exact.parquet") == "chain"


def test_a_missing_damaged_or_unknown_store_is_one_line_not_a_chain(tmp_path):
    with pytest.raises(Exception, match=r"run the rollout stage first") as missing:
        rollout_shape.of_store(tmp_path / "none.zarr")
    (tmp_path / "bad.zarr").mkdir()
    (tmp_path / "bad.zarr" / "zarr.json").write_text("{not json")
    with pytest.raises(ArtifactError, match=r"bad.zarr: not a readable Zarr group") as damaged:
        rollout_shape.of_store(tmp_path / "bad.zarr")
    with pytest.raises(ArtifactError, match=r"attribute 'shape' = 'forest': expected one of chain, tree") as unknown:
        rollout_shape.of_store(_store(tmp_path / "forest.zarr", shape="forest"))
    assert all("\n" not in str(e.value) for e in (missing, damaged, unknown))


REPO = Path(__file__).resolve().parents[1]


def test_the_readers_by_stage_and_pick():
    """shape_for reads each stage's own record; pick refuses a shape or stage it does not know in one line."""
    from tpgrpo.io.artifacts import IterationPaths

    tree_cfg = dataclasses.replace(Config(), tree=TreeConfig(enabled=True))
    paths = IterationPaths(Path("/nonexistent"), 1)
    assert rollout_shape.shape_for("rollout", tree_cfg, paths) == "tree"
    assert rollout_shape.shape_for("update", Config(), paths, attrs={"shape": "tree"}) == "tree"
    assert rollout_shape.shape_for("update", Config(), paths, attrs={}) == "chain"
    assert rollout_shape.implementation("rollout", Config(), paths, chain="c", tree="t") == "c"
    assert rollout_shape.pick("tree", chain=1, tree=2) == 2
    with pytest.raises(ValueError, match=r"rollout shape 'forest': expected one of chain, tree"):
        rollout_shape.pick("forest", chain=1, tree=2)
    with pytest.raises(ValueError, match=r"stage 'eval' is not one of rollout, probe, credit, update"):
        rollout_shape.shape_for("eval", Config(), paths)
    with pytest.raises(ValueError, match=r"pass the store's attrs"):
        rollout_shape.shape_for("update", Config(), paths)


def _functions(obj) -> dict[str, inspect.Signature]:
    return {name: inspect.signature(getattr(obj, name)) for name in dir(obj)
            if not name.startswith("_") and inspect.isfunction(getattr(obj, name))}


def test_chains_and_trees_implement_one_interface_with_the_same_signatures():
    """Each stage's two implementations provide what its Protocol names, with equal signatures."""
    from tpgrpo.policy import probe_scoring
    from tpgrpo.rollout_shape import chain_rollout, chain_update, chains, tree_probe, tree_rollout, tree_update, trees

    for protocol, chain, tree in ((rollout_shape.ShapeTables, chains, trees),
                                  (rollout_shape.ShapeStates, chain_update, tree_update)):
        wanted = _functions(protocol)
        assert wanted and wanted.keys() <= _functions(chain).keys() & _functions(tree).keys()
        for name, signature in wanted.items():
            params = list(signature.parameters)[1:]  # without self
            assert list(inspect.signature(getattr(chain, name)).parameters) == params, (chain.__name__, name)
            assert list(inspect.signature(getattr(tree, name)).parameters) == params, (tree.__name__, name)
    for chain_run, tree_run in ((chain_rollout.run, tree_rollout.run), (probe_scoring.run_chain_probe, tree_probe.run)):
        assert list(inspect.signature(chain_run).parameters) == list(inspect.signature(tree_run).parameters) == [
            "cfg", "iteration", "root"]


def _dispatch_sites(path: Path) -> tuple[int, list[str]]:
    """How many times ``path`` calls ``rollout_shape.implementation``, and what in it names a shape itself: a
    string constant "tree" / "chain", or the names CHAIN / TREE / of_config / of_store / of_store_attrs /
    checked_probe_table / of_probe_table (a stage asking for the shape and branching on it)."""
    tree = ast.parse(path.read_text())
    calls, found = 0, []
    banned = {"CHAIN", "TREE", "of_config", "of_store", "of_store_attrs", "checked_probe_table", "of_probe_table"}
    for node in ast.walk(tree):
        if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "implementation":
            calls += 1
        if isinstance(node, ast.Constant) and node.value in ("tree", "chain"):
            found.append(f"line {node.lineno}: {node.value!r}")
        if isinstance(node, ast.Attribute) and node.attr in banned:
            found.append(f"line {node.lineno}: .{node.attr}")
        if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("tpgrpo.rollout_shape"):
            found += [f"line {node.lineno}: imports {a.name}" for a in node.names if a.name in banned]
    return calls, found


def test_each_stage_dispatches_once_and_names_no_shape_itself():
    """rollout, probe, credit and update each make one call to rollout_shape.implementation (the update one
    per path, in read_store) and compare no shape of their own; the chain's probe code makes none."""
    expected = {"stages/rollout.py": 1, "stages/probe.py": 1, "stages/credit.py": 1,
                "stages/update.py": 1, "tpgrpo/policy/probe_scoring.py": 0}
    for name, calls in expected.items():
        assert _dispatch_sites(REPO / name) == (calls, []), name
    for path in sorted((REPO / "stages").glob("*.py")):
        assert not _dispatch_sites(path)[1], path.name


def test_the_checker_finds_a_stage_that_branches_on_a_shape_name(tmp_path):
    """The checker itself: a stage comparing the shape by hand is caught."""
    path = tmp_path / "stage.py"
    path.write_text("from tpgrpo import rollout_shape\nfrom tpgrpo.rollout_shape import TREE\n"
                    "def run(cfg, i, root):\n    if rollout_shape.of_config(cfg) == 'tree':\n        return 1\n")
    assert _dispatch_sites(path) == (0, ["line 2: imports TREE", "line 4: 'tree'", "line 4: .of_config"])


def test_store_states_by_name_is_each_shapes_states_reader():
    from tpgrpo.policy.states import LazyStates, NodeStates
    from tpgrpo.rollout_shape.stored_states import store_states

    class _Array:  # the parts of a CheckedArray the constructors read
        shape, chunk_rows = (6, 3, 4, 4), 2

    chain = store_states({"states": _Array()}, 2)
    assert type(chain) is LazyStates and chain.shape == (6, 3, 4, 4)
    import numpy as np

    arrays = {"node_states": _Array(), "prompt_index": np.array([0, 1]), "tree_parent_node": np.array([0, 0]),
              "tree_child_node": np.array([1, 2])}
    tree = store_states(arrays, 2, "tree")
    assert type(tree) is NodeStates and tree.nodes.tolist() == [[0, 1], [3, 5]]  # prompt 1's nodes start at 3
    with pytest.raises(ValueError, match="forest"):
        store_states(arrays, 2, "forest")
