"""Each stage reads the rollout's shape once, from its own input, and never guesses (tpgrpo.rollout_shape)."""

from __future__ import annotations

import dataclasses

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
