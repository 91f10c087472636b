"""Hashing while writing (``launch.hash_while_writing``, ``tpgrpo.io.dvc_prehash``): every md5 the rollout hands
to DVC's state database is the md5 of the file's bytes on disk, a file changed afterwards is hashed by DVC
again, and what ``dvc repro`` records for the trajectory store is its files' true md5s."""

from __future__ import annotations

import asyncio
import hashlib
import json
import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import yaml

from test_artifacts import trajectory_arrays
from test_dvc_pipeline import tpgrpo_run

DVC_ENV = {**os.environ, "DVC_NO_ANALYTICS": "1", "DVC_STUDIO_OFFLINE": "true"}


def md5_of(path: Path) -> str:
    return hashlib.md5(path.read_bytes()).hexdigest()


def files_of(folder: Path) -> list[Path]:
    return sorted(p for p in folder.rglob("*") if p.is_file())


def dvc_project(root: Path) -> Path:
    root.mkdir(parents=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=root, env=DVC_ENV, check=True)
    return root


def state_md5s(root: Path, files: list[Path]) -> dict[Path, str | None]:
    """What DVC's state database holds for each file now (None: no entry, or one whose stat no longer matches)."""
    from dvc.repo import Repo

    repo = Repo(str(root))
    try:
        return {f: (info.value if info else None) for f in files
                for _, info in [repo.state.get(os.path.abspath(f), repo.fs)]}
    finally:
        repo.close()


def big_store_arrays() -> tuple[dict, dict]:
    """A store with several chunk files per array and random (not constant) states."""
    arrays, attrs = trajectory_arrays(n=130)
    arrays["states"] = np.random.default_rng(0).normal(size=arrays["states"].shape).astype(np.float32)
    attrs["prompts"] = [{"id": str(i)} for i in range(65)]
    return arrays, attrs


def test_every_md5_handed_to_dvc_is_the_md5_of_the_file_on_disk(tmp_path):
    from tpgrpo.io.trajectories import write_zarr

    root = dvc_project(tmp_path / "project")
    arrays, attrs = big_store_arrays()
    store = root / "data" / "trajectories.zarr"
    handed = write_zarr(store, arrays, attrs, hash_for_dvc=True)
    files = files_of(store)
    held = state_md5s(root, files)
    chunk_files = [f for f in files if f.name != "zarr.json"]
    assert handed == len([m for m in held.values() if m]) and len(chunk_files) >= 10
    assert all(held[f] for f in chunk_files)  # every chunk file vouched for; zarr.json files may be written twice
    assert {f: m for f, m in held.items() if m} == {f: md5_of(f) for f, m in held.items() if m}

    # The knob changes who hashes, never a byte: the same store written without it is identical.
    plain = tmp_path / "plain.zarr"
    assert write_zarr(plain, arrays, attrs) == 0
    assert {f.relative_to(plain): md5_of(f) for f in files_of(plain)} == \
        {f.relative_to(store): md5_of(f) for f in files}


def test_a_file_changed_after_its_md5_was_handed_is_hashed_again(tmp_path):
    """Flipped bytes, a truncation and a same-size rewrite all move the stat DVC keys its entry on."""
    from tpgrpo.io.trajectories import write_zarr

    root = dvc_project(tmp_path / "project")
    store = root / "trajectories.zarr"
    write_zarr(store, *big_store_arrays(), hash_for_dvc=True)
    flipped, truncated, rewritten = [f for f in files_of(store) if f.name != "zarr.json"][:3]
    with open(flipped, "r+b") as f:  # in place: same inode, same size
        f.seek(5)
        byte = f.read(1)
        f.seek(5)
        f.write(bytes([byte[0] ^ 0xFF]))
    truncated.write_bytes(truncated.read_bytes()[:-1])
    rewritten.write_bytes(bytes(reversed(rewritten.read_bytes())))
    held = state_md5s(root, [flipped, truncated, rewritten])
    assert held == {flipped: None, truncated: None, rewritten: None}


def test_keys_written_twice_or_deleted_get_no_md5(tmp_path):
    from zarr.core.buffer import default_buffer_prototype

    from tpgrpo.io.dvc_prehash import HashingStore, entries_for

    store = HashingStore(tmp_path / "s")
    buf = default_buffer_prototype().buffer.from_bytes

    async def writes():
        await store.set("a/once", buf(b"1" * 100))
        await store.set("a/twice", buf(b"2" * 100))
        await store.set("a/twice", buf(b"3" * 100))
        await store.set("b/gone", buf(b"4" * 100))
        await store.delete("b/gone")
        await store.set("c/x", buf(b"5" * 100))
        await store.delete_dir("c")

    asyncio.run(writes())
    cleared = HashingStore(tmp_path / "t")
    asyncio.run(cleared.set("k", buf(b"6" * 10)))
    asyncio.run(cleared.clear())
    assert cleared.md5s() == {}
    written = store.md5s()
    assert written == {"a/once": (hashlib.md5(b"1" * 100).hexdigest(), 100)}
    (tmp_path / "s" / "a" / "once").write_bytes(b"1" * 99)  # a size that is not what was hashed: no entry
    assert entries_for(tmp_path / "s", written) == []


def test_a_wrong_md5_is_caught_by_the_read_back_and_nothing_is_handed(tmp_path, monkeypatch, capsys):
    """What a writer that reused a buffer after handing it over would produce: md5s of other bytes."""
    from tpgrpo.io import dvc_prehash
    from tpgrpo.io.trajectories import write_zarr

    monkeypatch.setattr(dvc_prehash, "_md5", lambda view: hashlib.md5(bytes(view)[1:]).hexdigest())
    root = dvc_project(tmp_path / "project")
    assert write_zarr(root / "trajectories.zarr", *big_store_arrays(), hash_for_dvc=True) == 0
    assert "is not that of the file on disk; no md5 handed to DVC" in capsys.readouterr().err
    assert not any(state_md5s(root, files_of(root / "trajectories.zarr")).values())


def test_outside_a_dvc_project_nothing_is_handed(tmp_path):
    from tpgrpo.io.trajectories import read_trajectories, write_zarr

    assert write_zarr(tmp_path / "trajectories.zarr", *big_store_arrays(), hash_for_dvc=True) == 0
    # a `.dvc/` DVC cannot open (made for a git repository that is not there): nothing handed, the store written
    (tmp_path / "git" / ".dvc").mkdir(parents=True)
    (tmp_path / "git" / ".dvc" / "config").write_text("")
    arrays, attrs = big_store_arrays()
    assert write_zarr(tmp_path / "git" / "trajectories.zarr", arrays, attrs, hash_for_dvc=True) == 0
    np.testing.assert_array_equal(read_trajectories(tmp_path / "git" / "trajectories.zarr")[0]["states"],
                                  arrays["states"])


def test_a_locked_state_database_costs_the_shortcut_not_the_store(tmp_path, monkeypatch, capsys):
    import sqlite3

    from dvc_data.hashfile.state import State

    from tpgrpo.io.trajectories import read_trajectories, write_zarr

    def locked(*args, **kwargs):
        raise sqlite3.OperationalError("database is locked")

    monkeypatch.setattr(State, "save_many", locked)
    root = dvc_project(tmp_path / "project")
    arrays, attrs = big_store_arrays()
    assert write_zarr(root / "trajectories.zarr", arrays, attrs, hash_for_dvc=True) == 0
    assert "md5s not handed to DVC (OperationalError: database is locked)" in capsys.readouterr().err
    np.testing.assert_array_equal(read_trajectories(root / "trajectories.zarr")[0]["states"], arrays["states"])


def test_dvc_repro_records_the_true_md5s_of_a_store_it_did_not_hash(tiny_project):
    """End to end: `tpgrpo run` with the knob on (the default). Each file of iteration 1's store in the
    `.dir` object DVC recorded has the md5 of its bytes, and DVC's state holds the rollout's entries."""
    raw = yaml.safe_load((tiny_project / "params.yaml").read_text())
    assert raw["launch"]["hash_while_writing"] is True
    raw["train"]["iterations"] = 1
    (tiny_project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    done = tpgrpo_run(tiny_project)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    lock = yaml.safe_load((tiny_project / "dvc.lock").read_text())["stages"]
    outs = {o["path"]: o for o in lock["rollout-0001"]["outs"]}
    store_rel = next(p for p in outs if p.endswith("trajectories.zarr"))
    dir_md5 = outs[store_rel]["md5"].removesuffix(".dir")
    listing = json.loads((tiny_project / ".dvc/cache/files/md5" / dir_md5[:2] / (dir_md5[2:] + ".dir")).read_text())
    store = tiny_project / store_rel
    recorded = {entry["relpath"]: entry["md5"] for entry in listing}
    assert recorded == {str(f.relative_to(store)): md5_of(f) for f in files_of(store)}
    held = state_md5s(tiny_project, files_of(store))
    assert all(held[f] == md5_of(f) for f in files_of(store) if f.name != "zarr.json")
    # launch.cache_while_writing (on by default): the rollout put each chunk file's object into the cache
    # itself, before it wrote its timing log; DVC's commit, after the stage, found them and copied none (a copy
    # would be a newer file).
    assert raw["launch"]["cache_while_writing"] is True
    metrics_written = (tiny_project / "data/iters/0001/rollout.timing.json").stat().st_mtime_ns  # untracked
    objects = [tiny_project / ".dvc/cache/files/md5" / m[:2] / m[2:] for m in
               (md5_of(f) for f in files_of(store) if f.name != "zarr.json")]
    assert objects and all(o.stat().st_mtime_ns <= metrics_written for o in objects)


@pytest.mark.parametrize("value", ["yes", 1])
def test_the_knob_must_be_a_boolean(tmp_path, value):
    from tpgrpo.config import ConfigError, load_config

    raw = yaml.safe_load((Path(__file__).resolve().parents[1] / "params.yaml").read_text())
    raw["launch"]["hash_while_writing"] = value
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(raw))
    with pytest.raises(ConfigError, match="launch.hash_while_writing"):
        load_config(tmp_path / "params.yaml")
