"""A tree's probe table that disagrees with itself or with params.yaml is refused in one line by the credit
stage (tpgrpo.rollout_shape.checked_probe_table), instead of being credited as one-step chains.

The case seen: ``pd.read_parquet(p).to_parquet(p)`` keeps the tree's columns but drops tpgrpo's metadata
(``tpgrpo.completion = tree``); the credit stage then read the table as a chain of one step per edge, exit 0.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import numpy as np
import pandas as pd
import pytest
import yaml

from conftest import tiny_params
from tpgrpo import rollout_shape
from tpgrpo.io.artifacts import write_table
from tpgrpo.io.schemas import PROBE_COMPLETION_KEY, PROBE_TREE, ArtifactError
from tpgrpo.rollout_shape.tree_probe import tree_probe_table

TREE = {"enabled": True, "split_steps": "0,1", "children": 1, "roots": 2}  # as tests/test_tree_pipeline.py


def tiny_tree_arrays(prompts: int = 2) -> dict:
    """A store's tree arrays for ``prompts`` prompts of 3 edges each: a depth-0 ODE edge (its leaf is the root's),
    a depth-0 SDE edge, and a depth-1 SDE edge below it."""
    per_prompt = {"tree_parent": [-1, -1, 1], "tree_leaf": [0, 1, 2], "tree_parent_leaf": [0, 0, 1],
                  "tree_depth": [0, 0, 1], "tree_sde": [False, True, True], "sample": [0, 1, 2]}
    arrays = {k: np.tile(np.asarray(v), prompts) for k, v in per_prompt.items()}
    edges = 3 * prompts
    arrays.update(prompt_index=np.repeat(np.arange(prompts), 3), seeds=np.arange(edges),
                  final_reward=np.linspace(0.1, 0.9, edges), final_strict=np.arange(edges) % 2 == 0,
                  sigmas=np.tile([[1.0, 0.5]], (edges, 1)))
    return arrays


def write_tree_probe(path: Path) -> pd.DataFrame:
    metas = [{"id": f"p{i}", "prompt": f"prompt {i}"} for i in range(2)]
    frame = tree_probe_table(tiny_tree_arrays(), metas, "tiny store")
    write_table(path, frame, PROBE_TREE, {PROBE_COMPLETION_KEY: "tree"}, trajectories=6, steps=2)
    return frame


def project(root: Path, tree_enabled: bool) -> Path:
    """params.yaml (tiny, tree on or off) and iteration 1's probe.parquet of a tree."""
    raw = tiny_params(tree={**TREE, "enabled": tree_enabled})
    root.mkdir(parents=True, exist_ok=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    write_tree_probe(root / "data" / "iters" / "0001" / "probe.parquet")
    return root


def config(root: Path):
    from tpgrpo.config import load_config

    return load_config(root / "params.yaml")


def test_an_intact_tree_table_reads_as_a_tree(tmp_path):
    from tpgrpo.io.artifacts import IterationPaths
    from tpgrpo.rollout_shape import chains, trees

    root = project(tmp_path, tree_enabled=True)
    paths = IterationPaths(root, 1)
    assert rollout_shape.shape_for("credit", config(root), paths) == rollout_shape.TREE
    tables = rollout_shape.implementation("credit", config(root), paths, chain=chains, tree=trees)
    table = tables.read_probe(paths.probe)
    assert tables is trees and len(table) == 12 and table["sde"].sum() == 8


def test_a_tree_table_without_its_metadata_is_refused_in_one_line(tmp_path):
    root = project(tmp_path, tree_enabled=True)
    probe = root / "data" / "iters" / "0001" / "probe.parquet"
    pd.read_parquet(probe).to_parquet(probe)  # keeps the columns, drops tpgrpo.* metadata
    with pytest.raises(ArtifactError) as refused:
        rollout_shape.checked_probe_table(probe, config(root))
    assert str(refused.value) == (
        f"{probe}: has a tree's columns (parent_trajectory, depth, sde) but its metadata records "
        "tpgrpo.completion = None (a table rewritten without tpgrpo's metadata?): run the probe stage again")


def test_a_tree_table_under_chain_params_is_refused(tmp_path):
    root = project(tmp_path, tree_enabled=False)
    probe = root / "data" / "iters" / "0001" / "probe.parquet"
    with pytest.raises(ArtifactError, match=r"probe.parquet: a tree probe table \(tpgrpo.completion = 'tree'\), "
                                            r"but params has tree.enabled: false"):
        rollout_shape.checked_probe_table(probe, config(root))


def test_tree_metadata_without_the_tree_columns_is_refused(tmp_path):
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = project(tmp_path, tree_enabled=True)
    probe = root / "data" / "iters" / "0001" / "probe.parquet"
    table = pq.read_table(probe)
    pq.write_table(table.drop_columns(["depth", "sde", "parent_trajectory"]).replace_schema_metadata(
        table.schema.metadata), probe)
    assert isinstance(table, pa.Table)
    with pytest.raises(ArtifactError, match=r"lacks a tree's columns .* records tpgrpo.completion = 'tree'"):
        rollout_shape.checked_probe_table(probe, config(root))


def test_credit_stage_refuses_a_rewritten_tree_table_through_the_cli(tmp_path):
    root = project(tmp_path, tree_enabled=True)
    probe = root / "data" / "iters" / "0001" / "probe.parquet"
    pd.read_parquet(probe).to_parquet(probe)
    done = subprocess.run([sys.executable, "-m", "tpgrpo", "stage", "credit", "--iter", "1", "--params",
                           str(root / "params.yaml")], cwd=root, capture_output=True, text=True)
    assert done.returncode == 2, done.stderr[-2000:]
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "has a tree's columns" in lines[0] and str(probe) in lines[0], lines
    assert not (probe.parent / "credit.parquet").exists()
