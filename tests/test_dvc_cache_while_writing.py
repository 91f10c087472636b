"""Caching while writing (``launch.cache_while_writing``, ``tpgrpo.io.dvc_prehash.CachePlacer``): every object the
rollout puts into DVC's cache is named by the md5 of its own bytes, protected as DVC's are, and never replaces an
object already there; a wrong object or a failed write leaves nothing wrong behind; and ``dvc repro`` then
keeps the placed objects instead of copying the store again, with ``dvc status`` clean and ``dvc checkout``
restoring the store from them."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import sys
from pathlib import Path

import numpy as np

from test_dvc_prehash import DVC_ENV, big_store_arrays, dvc_project, files_of, md5_of

REPO = Path(__file__).resolve().parents[1]
CACHE = Path(".dvc/cache/files/md5")


def cache_object(root: Path, md5: str) -> Path:
    return root / CACHE / md5[:2] / md5[2:]


def cache_files(root: Path) -> list[Path]:
    return files_of(root / CACHE) if (root / CACHE).is_dir() else []


def test_every_object_placed_is_named_by_the_md5_of_its_bytes_and_protected(tmp_path):
    from tpgrpo.io.trajectories import read_trajectories, write_zarr

    root = dvc_project(tmp_path / "project")
    arrays, attrs = big_store_arrays()
    store = root / "trajectories.zarr"
    write_zarr(store, arrays, attrs, hash_for_dvc=True, cache_for_dvc=True)
    chunk_files = [f for f in files_of(store) if f.name != "zarr.json"]
    assert len(chunk_files) >= 10
    for f in chunk_files:  # each chunk file has its object: the same bytes, another file (a copy, not a link)
        obj = cache_object(root, md5_of(f))
        assert obj.read_bytes() == f.read_bytes()
        assert stat.S_IMODE(obj.stat().st_mode) == 0o444 and obj.stat().st_ino != f.stat().st_ino
    placed = cache_files(root)
    assert all(md5_of(p) == p.parent.name + p.name for p in placed)  # nothing else, no temporary file
    np.testing.assert_array_equal(read_trajectories(store)[0]["states"], arrays["states"])

    # An object already there is left as it is: a second store of the same bytes places nothing new.
    inodes = {p: p.stat().st_ino for p in placed}
    write_zarr(root / "again.zarr", arrays, attrs, hash_for_dvc=True, cache_for_dvc=True)
    assert {p: p.stat().st_ino for p in placed} == inodes


def test_nothing_is_placed_without_either_knob_or_outside_a_dvc_project(tmp_path):
    from tpgrpo.io.trajectories import write_zarr

    root = dvc_project(tmp_path / "project")
    arrays, attrs = big_store_arrays()
    write_zarr(root / "a.zarr", arrays, attrs, hash_for_dvc=True, cache_for_dvc=False)
    write_zarr(root / "b.zarr", arrays, attrs, hash_for_dvc=False, cache_for_dvc=True)  # placing needs the md5s
    assert cache_files(root) == []
    write_zarr(tmp_path / "c.zarr", arrays, attrs, hash_for_dvc=True, cache_for_dvc=True)
    assert md5_of(tmp_path / "c.zarr" / "states" / "c.0.0.0.0.0") == md5_of(root / "a.zarr/states/c.0.0.0.0.0")


def test_objects_named_by_a_wrong_md5_are_caught_and_all_removed(tmp_path, monkeypatch, capsys):
    """What a writer that reused a buffer after handing it over would produce: objects whose names are not the
    md5s of their bytes. The read-back of the first catches it, and every object placed goes."""
    import hashlib

    from tpgrpo.io import dvc_prehash
    from tpgrpo.io.trajectories import write_zarr

    monkeypatch.setattr(dvc_prehash, "_md5", lambda view: hashlib.md5(bytes(view)[1:]).hexdigest())
    root = dvc_project(tmp_path / "project")
    assert write_zarr(root / "trajectories.zarr", *big_store_arrays(), hash_for_dvc=True, cache_for_dvc=True) == 0
    err = capsys.readouterr().err
    assert "does not match its md5); DVC copies the rest" in err and len(err.strip().splitlines()) == 2
    assert cache_files(root) == []


def test_a_failed_write_stops_placing_and_leaves_only_sound_objects(tmp_path, monkeypatch, capsys):
    from tpgrpo.io.trajectories import read_trajectories, write_zarr

    calls = []
    real_replace = os.replace

    def replace_then_fail(src, dst):  # os.replace is zarr's too: only the cache's third rename fails
        if ".dvc/cache" in str(dst):
            calls.append(dst)
            if len(calls) == 3:
                raise OSError(28, "No space left on device")
        real_replace(src, dst)

    monkeypatch.setattr(os, "replace", replace_then_fail)
    root = dvc_project(tmp_path / "project")
    arrays, attrs = big_store_arrays()
    write_zarr(root / "trajectories.zarr", arrays, attrs, hash_for_dvc=True, cache_for_dvc=True)
    assert "cache while writing stopped (OSError: [Errno 28] No space left on device)" in capsys.readouterr().err
    placed = cache_files(root)
    assert len(placed) == 2 and all(md5_of(p) == p.parent.name + p.name for p in placed)  # no temporary file left
    np.testing.assert_array_equal(read_trajectories(root / "trajectories.zarr")[0]["states"], arrays["states"])


WRITER = """
import json, os, sys
from pathlib import Path
sys.path[:0] = [{repo!r}, {tests!r}]
from test_dvc_prehash import big_store_arrays
from tpgrpo.io.trajectories import write_zarr
write_zarr(Path("store.zarr"), *big_store_arrays(), hash_for_dvc=True, cache_for_dvc=sys.argv[1] == "on")
objects = {{}}
for folder, _, names in os.walk(".dvc/cache/files/md5"):
    for name in names:
        objects[os.path.join(folder, name)] = os.stat(os.path.join(folder, name)).st_ino
json.dump(objects, open("../placed.json", "w"))
"""


def repro_with_writer(tmp_path: Path, knob: str) -> tuple[Path, dict]:
    """A DVC project whose one stage writes a store with the knob at ``knob``; `dvc repro` it. Returns the
    project and the cache objects (path -> inode) that were there when the stage's command ended."""
    root = dvc_project(tmp_path / knob / "project")
    (root / "write.py").write_text(WRITER.format(repo=str(REPO), tests=str(REPO / "tests")))
    (root / "dvc.yaml").write_text(f"stages:\n  write:\n    cmd: {sys.executable} write.py {knob}\n"
                                   "    deps: [write.py]\n    outs: [store.zarr]\n")
    done = subprocess.run([sys.executable, "-m", "dvc", "repro", "-q"], cwd=root, env=DVC_ENV, capture_output=True,
                          text=True)
    assert done.returncode == 0, done.stderr[-2000:]
    return root, json.loads((tmp_path / knob / "placed.json").read_text())


def test_dvc_repro_keeps_the_placed_objects_instead_of_copying_the_store(tmp_path):
    root, placed = repro_with_writer(tmp_path, "on")
    store = root / "store.zarr"
    chunk_objects = {str(cache_object(root, md5_of(f)).relative_to(root)) for f in files_of(store)
                     if f.name != "zarr.json"}
    assert chunk_objects <= set(placed)
    for rel in chunk_objects:  # the very files the stage placed: DVC found them and copied nothing over them
        assert (root / rel).stat().st_ino == placed[rel]
    status = subprocess.run([sys.executable, "-m", "dvc", "status", "-q"], cwd=root, env=DVC_ENV)
    assert status.returncode == 0
    before = {f.relative_to(store): md5_of(f) for f in files_of(store)}
    subprocess.run(["rm", "-rf", str(store)], check=True)
    subprocess.run([sys.executable, "-m", "dvc", "checkout", "-q"], cwd=root, env=DVC_ENV, check=True)
    assert {f.relative_to(store): md5_of(f) for f in files_of(store)} == before

    # The control: with the knob off the stage leaves the cache empty and DVC copies the store there itself.
    root_off, placed_off = repro_with_writer(tmp_path, "off")
    assert placed_off == {}
    assert {p.relative_to(root_off) for p in cache_files(root_off)} >= {Path(rel) for rel in chunk_objects}
