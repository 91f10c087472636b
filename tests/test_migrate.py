"""`tpgrpo migrate`: a project an older version made is refused in one line until migrated, once; migrating keeps
the record of every stage whose code is unchanged (today's dependencies, today's md5s) and drops the record of a
stage whose code changed since it ran. Sealed blocks recorded in the root lock: tests/test_sealing.py; the
real-DVC pass (nothing re-runs after migrating): tests/test_code_manifest.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import pytest
import yaml
from conftest import tiny_params
from test_code_manifest import _copy_code

from tpgrpo.config import config_from_dict
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.long_runs.blocks import read_lock, write_lock
from tpgrpo.pipeline.migrate import migrate, older_layouts, refuse_older_layout
from tpgrpo.pipeline.rendering.code_hash import BYTES
from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES, kind_code, manifest_path, manifest_text
from tpgrpo.pipeline.rendering.dvcfile import render


def _md5(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def _project(root: Path, mode: str = "tp"):
    raw = tiny_params(train={"iterations": 1}, credit={"mode": mode})
    _copy_code(root)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return config_from_dict(raw)


def _item(path: str, md5: str) -> dict:
    return {"path": path, "hash": "md5", "md5": md5, "size": 1}


def _old_entry(root: Path, kind: str, params: dict) -> dict:
    """A stage's record as the layout before the manifests wrote it: its code files with their byte md5s."""
    deps = [_item(f, _md5(root / f)) for f in kind_code(root, kind)] + [_item("data/iters/0001/in.bin", "d" * 32)]
    return {"cmd": f"tpgrpo stage {kind} --iter 1", "deps": sorted(deps, key=lambda d: d["path"]),
            "params": {"params.yaml": params}, "outs": [_item(f"data/iters/0001/{kind}.out", "e" * 32)]}


def test_a_project_with_code_files_as_dependencies_is_refused_then_migrated(tmp_path):
    cfg = _project(tmp_path)
    probe_params = {"credit.mode": "tp", "probe": {"completion": "exact"}}  # credit.mode: the probe's code path
    lock = {"schema": "2.0", "stages": {"rollout-0001": _old_entry(tmp_path, "rollout", {"train.seed": 0}),
                                        "probe-0001": _old_entry(tmp_path, "probe", probe_params),
                                        "credit-0001": _old_entry(tmp_path, "credit", {"credit": {"mode": "tp"}})}}
    lock["stages"]["credit-0001"]["deps"][-1]["md5"] = "0" * 32  # a code file of it changed since it ran
    write_lock(tmp_path, lock)
    assert older_layouts(tmp_path) == ["code files as stage dependencies"]
    with pytest.raises(PipelineError, match=r"dvc.lock: made by an older version of tpgrpo \(code files as stage "
                                            r"dependencies\): run `tpgrpo migrate` once"):
        refuse_older_layout(tmp_path)

    notes = migrate(tmp_path, cfg)
    assert notes == ["the stages now depend on code manifests (data/code/) instead of their code files",
                     "code changed since credit-0001 ran: they re-run"]
    assert older_layouts(tmp_path) == [] and migrate(tmp_path, cfg) == []
    stages, rendered = read_lock(tmp_path)["stages"], render(cfg, tmp_path)["stages"]
    assert set(stages) == {"rollout-0001", "probe-0001"}  # credit's record went: DVC re-runs it
    for name, kind in (("rollout-0001", "rollout"), ("probe-0001", "probe")):
        deps = {d["path"]: d["md5"] for d in stages[name]["deps"]}
        manifest = tmp_path / manifest_path(kind)
        assert deps == {"data/iters/0001/in.bin": "d" * 32, manifest_path(kind): _md5(manifest)}
        assert manifest_path(kind) in rendered[name]["deps"] and json.loads(manifest.read_text())["hashes"] == "code"
        assert stages[name]["outs"] == lock["stages"][name]["outs"]  # no artifact's record changes
    assert stages["probe-0001"]["params"] == {"params.yaml": {"probe": {"completion": "exact"}}}
    assert "credit.mode" not in rendered["probe-0001"]["params"]
    assert "rollout-0001" in (tmp_path / "dvc.yaml").read_text()  # rendered again, code stage first
    assert next(iter(yaml.safe_load((tmp_path / "dvc.yaml").read_text())["stages"])) == "code"


def test_manifests_of_byte_md5s_are_refused_then_rewritten_with_code_md5s(tmp_path):
    """Manifests written before code md5s: the records naming an unchanged manifest get the new one's md5
    (nothing re-runs); a kind whose code changed since keeps the old md5 in its records (its stages re-run)."""
    cfg = _project(tmp_path, "flow_grpo")
    (tmp_path / "data" / "code").mkdir(parents=True)
    for kind in KIND_STAGES:
        (tmp_path / manifest_path(kind)).write_text(manifest_text(tmp_path, kind, cfg, BYTES))
    old = {kind: _md5(tmp_path / manifest_path(kind)) for kind in KIND_STAGES}
    lock = {"schema": "2.0", "stages": {
        "code": {"cmd": "tpgrpo stage code", "deps": [_item("tpgrpo", "f" * 32 + ".dir")],
                 "outs": [_item(manifest_path(k), old[k]) for k in KIND_STAGES]},
        **{f"{k}-0001": {"cmd": f"tpgrpo stage {k} --iter 1", "deps": [_item(manifest_path(k), old[k])]}
           for k in ("rollout", "update")}}}
    write_lock(tmp_path, lock)
    with open(tmp_path / "tpgrpo" / "algo" / "loss.py", "a") as f:  # update's code, after its manifest
        f.write("# a comment: a change in the byte md5s' format\n")
    assert older_layouts(tmp_path) == [f"{manifest_path(next(iter(KIND_STAGES)))} and others with byte md5s"]
    with pytest.raises(PipelineError, match="byte md5s.*tpgrpo migrate"):
        refuse_older_layout(tmp_path)

    notes = migrate(tmp_path, cfg)
    assert notes == [f"rewrote {len(KIND_STAGES)} code manifests with code md5s",
                     "the code of update changed since its manifest was written: those stages re-run"]
    now = {kind: _md5(tmp_path / manifest_path(kind)) for kind in KIND_STAGES}
    assert all(json.loads((tmp_path / manifest_path(k)).read_text())["hashes"] == "code" for k in KIND_STAGES)
    stages = read_lock(tmp_path)["stages"]
    assert stages["rollout-0001"]["deps"][0]["md5"] == now["rollout"] != old["rollout"]
    assert stages["update-0001"]["deps"][0]["md5"] == old["update"]  # DVC sees it changed: update re-runs
    outs = {o["path"]: o["md5"] for o in stages["code"]["outs"]}
    assert outs == {manifest_path(k): (old[k] if k == "update" else now[k]) for k in KIND_STAGES}
    assert older_layouts(tmp_path) == []


def test_a_project_of_todays_layout_has_nothing_to_migrate(tmp_path):
    cfg = _project(tmp_path)
    assert older_layouts(tmp_path) == [] and migrate(tmp_path, cfg) == []
    assert not (tmp_path / "dvc.yaml").exists()  # nothing written
