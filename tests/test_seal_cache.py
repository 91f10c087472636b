"""The sealed blocks' stat cache (tpgrpo.pipeline.long_runs.seal_cache): any change to a block's files or lock is
seen."""

from __future__ import annotations

import os
import time

from test_sealing import _four_iterations_sealed

from tpgrpo.pipeline.long_runs import seal_cache
from tpgrpo.pipeline.long_runs.blocks import Block, block_entry, write_block_entry, write_lock

BLOCK = Block(1, 2)


def _sealed_with_files(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    write_lock(root, lock)
    (root / ".dvc").mkdir()
    for path in seal_cache.summary(root, BLOCK)["paths"]:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        if path.endswith((".zarr", "policy")):
            (root / path).mkdir(exist_ok=True)
            (root / path / "part").write_text("x")
        else:
            (root / path).write_text("x")
    return root


def test_a_block_is_trusted_only_after_dvc_vouched_and_until_any_file_of_it_changes(tmp_path):
    root = _sealed_with_files(tmp_path)
    assert not seal_cache.unchanged(root, [BLOCK])  # never vouched for (a fresh clone): DVC checks it
    seal_cache.vouch(root, [BLOCK])
    assert seal_cache.unchanged(root, [BLOCK])
    inner = root / "data/iters/0001/trajectories.zarr/part"
    changes = [
        lambda: os.utime(inner, (time.time() + 60, time.time() + 60)),  # a touch
        lambda: inner.write_text("y"),  # an in-place write, same size
        lambda: (inner.unlink(), inner.write_text("x")),  # a new file of the same content (new inode)
        lambda: inner.unlink(),  # a delete inside a folder output
        lambda: (root / "data/iters/0002/credit.parquet").unlink(),  # a delete of a file output
    ]
    for change in changes:
        seal_cache.vouch(root, [BLOCK])
        assert seal_cache.unchanged(root, [BLOCK])
        change()
        assert not seal_cache.unchanged(root, [BLOCK])


def test_a_rewritten_lock_invalidates_what_was_cached_of_it(tmp_path):
    root = _sealed_with_files(tmp_path)
    seal_cache.vouch(root, [BLOCK])
    entry = block_entry(root, BLOCK)
    entry["params"]["params.yaml"]["credit"]["mode"] = "incremental"
    write_block_entry(root, BLOCK, entry)  # e.g. DVC re-ran the block, or retention thinned it
    assert not seal_cache.unchanged(root, [BLOCK])
    assert seal_cache.summary(root, BLOCK)["params"]["credit"]["mode"] == "incremental"
    (root / seal_cache.CACHE / "0001-0002.json").write_text("{not json")  # a damaged cache is no cache
    assert not seal_cache.unchanged(root, [BLOCK])
    assert seal_cache.summary(root, BLOCK)["params"]["credit"]["mode"] == "incremental"


def test_no_cache_is_written_outside_a_dvc_project(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    assert seal_cache.summary(root, BLOCK) is not None and not (root / ".dvc").exists()


def test_a_sealed_file_rewritten_during_the_repro_is_not_vouched_for(tmp_path, monkeypatch):
    """``tpgrpo run`` takes the blocks' stamps before the full ``dvc repro``: a file written again
    while DVC ran (a stage re-run by hand) is not taken as what DVC checked; one that did not move is."""
    import subprocess

    from tpgrpo.config import config_from_dict
    from conftest import tiny_params
    from tpgrpo.pipeline import repro

    root = _sealed_with_files(tmp_path)
    cfg = config_from_dict(tiny_params(train={"iterations": 4, "block_size": 2}))
    inner = root / "data/iters/0001/credit.json"
    checked = []  # dvc status after a repro: only when it wrote dvc.lock (this fake DVC never does)

    def fake_dvc(args, **kwargs):  # DVC's full check, during which a hand-run rewrites a sealed log
        if "repro" in args:
            inner.unlink()
            inner.write_text("x")  # the same bytes, a new inode: DVC hashed the old file
        return subprocess.CompletedProcess(args, 0)

    for name, value in [("write_dvc_yaml", lambda *a, **k: False), ("refresh_manifests", lambda *a, **k: None),
                        ("clear_notes", lambda *a: None), ("drop_disagreeing", lambda *a: []),
                        ("check_outputs_cached", lambda *a, **k: checked.append(a))]:
        module = {"write_dvc_yaml": "tpgrpo.pipeline.rendering.dvcfile",
                  "refresh_manifests": "tpgrpo.pipeline.rendering.code_manifest",
                  "check_outputs_cached": "tpgrpo.pipeline.status"}.get(name,
                                                                         "tpgrpo.pipeline.dvc_integration.params_read")
        monkeypatch.setattr(f"{module}.{name}", value)
    monkeypatch.setattr(repro.subprocess, "run", fake_dvc)
    assert repro.repro_args(root, 4) == ["repro"]  # never vouched for: the full check
    repro._repro(root, cfg, 4, {}, lambda line: None)
    assert not seal_cache.unchanged(root, [BLOCK])  # before: vouched for with the rewritten file's stamp
    monkeypatch.setattr(repro.subprocess, "run", lambda args, **kwargs: subprocess.CompletedProcess(args, 0))
    repro._repro(root, cfg, 4, {}, lambda line: None)
    assert seal_cache.unchanged(root, [BLOCK]) and repro.repro_args(root, 4)[-1] == "dvc.yaml"
    assert checked == []
