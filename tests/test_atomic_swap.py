"""An artifact written through ``atomic_path`` over an older one, SIGKILLed at every point of the swap: the name
holds the old artifact or the new one, whole (never nothing, never half a folder), and the next writer of that
name leaves no leftover. Both ways of swapping: the one-step exchange (Linux) and the two renames elsewhere."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from tpgrpo.io import atomic
from tpgrpo.io.atomic import atomic_path, recover, swap_in

KILLER = Path(__file__).resolve().parent / "kill_points.py"
REPO = Path(__file__).resolve().parents[1]
OLD = {"a.bin": b"old a" * 100, "b.bin": b"old b", "sub/c.bin": b"old c"}
NEW = {"a.bin": b"new a", "d.bin": b"new d" * 50, "sub/c.bin": b"new c", "sub/e.bin": b"new e"}

# Writes NEW as the folder artifact `art` (or a file, argv[2] == "file"); argv[1] == "two-step": no exchange.
PROGRAM = textwrap.dedent("""
    import sys
    from pathlib import Path
    from tpgrpo.io import atomic
    NEW = %r
    if sys.argv[1] == "two-step":
        atomic._exchange = lambda a, b: False
    with atomic.atomic_path(Path("art")) as tmp:
        if sys.argv[2] == "file":
            tmp.write_bytes(NEW["a.bin"])
        else:
            for name, data in NEW.items():
                (tmp / name).parent.mkdir(parents=True, exist_ok=True)
                (tmp / name).write_bytes(data)
""") % (NEW,)


def _write(folder: Path, files: dict) -> None:
    for name, data in files.items():
        (folder / name).parent.mkdir(parents=True, exist_ok=True)
        (folder / name).write_bytes(data)


def _content(path: Path):
    if path.is_file():
        return path.read_bytes()
    if not path.is_dir():
        return None
    return {p.relative_to(path).as_posix(): p.read_bytes() for p in path.rglob("*") if p.is_file()}


def _run(root: Path, at: int, how: str, kind: str, count: Path | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, str(KILLER), "--at", str(at), "--within", "tpgrpo.io.atomic:swap_in",
            "--point", "tpgrpo.io.atomic:_exchange", *(["--count", str(count)] if count else []),
            "-m", "program", how, kind]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))
    return subprocess.run(args, cwd=root, env=env, capture_output=True, text=True, start_new_session=True)


@pytest.mark.parametrize("how", ["exchange", "two-step"])
@pytest.mark.parametrize("kind", ["folder", "file"])
def test_a_swap_killed_at_every_point_leaves_the_old_or_the_new_artifact_whole(tmp_path, how, kind):
    if how == "exchange" and not atomic._libc():
        pytest.skip("no renameat2 here")
    old = OLD if kind == "folder" else OLD["a.bin"]
    new = NEW if kind == "folder" else NEW["a.bin"]

    def project(name: str) -> Path:
        root = tmp_path / name
        root.mkdir()
        (root / "program.py").write_text(PROGRAM)
        if kind == "folder":
            _write(root / "art", OLD)
        else:
            (root / "art").write_bytes(OLD["a.bin"])
        return root

    control = project("control")
    done = _run(control, 0, how, kind, count=tmp_path / "count")
    assert done.returncode == 0, done.stderr
    assert _content(control / "art") == new
    points = int((tmp_path / "count").read_text())
    assert points >= (1 if kind == "file" else 4), points
    seen = set()
    for at in range(1, points + 1):
        root = project(f"at{at}")
        killed = _run(root, at, how, kind)
        assert killed.returncode == -9, (at, killed.stderr[-600:])
        now = _content(root / "art")
        if how == "two-step" and now is None:  # between its two renames: the old one lies aside, whole
            (aside,) = root.glob(".art.old-*")
            assert _content(aside) == old, at
            seen.add("aside")
        else:
            assert now in (old, new), at
            seen.add("old" if now == old else "new")
        recover(root / "art")  # what the next writer of the name does first
        assert _content(root / "art") in (old, new), at
        assert sorted(p.name for p in root.iterdir()) == ["art", "program.py"], at  # no leftover
    assert "old" in seen and "new" in seen or kind == "file"  # the kills landed both before and after the swap
    if how == "two-step" and kind == "folder":
        assert "aside" in seen


def test_a_file_and_a_folder_swap_either_way(tmp_path):
    for old_is_dir in (True, False):
        path = tmp_path / f"art{old_is_dir}"
        _write(path, OLD) if old_is_dir else path.write_bytes(b"old")
        with atomic_path(path) as tmp:
            if old_is_dir:
                tmp.write_bytes(b"new")
            else:
                _write(tmp, NEW)
        assert _content(path) == (b"new" if old_is_dir else NEW)
        assert [p.name for p in tmp_path.iterdir() if p.name.startswith(".")] == []


def test_recover_puts_back_only_a_dead_writers_copy_and_only_where_nothing_replaced_it(tmp_path):
    path = tmp_path / "art"
    dead = 2 ** 22 + 12345  # above the default pid_max: no such process
    _write(tmp_path / f".art.old-{dead}-aaaaaaaa", OLD)
    (tmp_path / f".art.tmp-{dead}-bbbbbbbb").mkdir()
    live = tmp_path / f".art.old-{os.getpid()}-cccccccc"
    live.mkdir()
    assert len(recover(path)) == 2
    assert _content(path) == OLD and live.is_dir()  # a running writer's copy is its own business
    live.rmdir()
    _write(tmp_path / f".art.old-{dead}-dddddddd", {"x": b"older"})
    recover(path)
    assert _content(path) == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def test_a_failed_write_leaves_the_old_artifact_and_no_temporary(tmp_path):
    path = tmp_path / "art"
    _write(path, OLD)
    with pytest.raises(RuntimeError):
        with atomic_path(path) as tmp:
            _write(tmp, NEW)
            raise RuntimeError("the stage failed")
    assert _content(path) == OLD and sorted(p.name for p in tmp_path.iterdir()) == ["art"]
    swap_in(_mk(tmp_path / "new", NEW), path)
    assert _content(path) == NEW and sorted(p.name for p in tmp_path.iterdir()) == ["art"]


def _mk(folder: Path, files: dict) -> Path:
    _write(folder, files)
    return folder
