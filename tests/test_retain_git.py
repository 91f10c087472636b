"""`tpgrpo retain` frees cache objects only when git can list what other commits record: a git that fails
("dubious ownership" of a shared folder) or is missing stops it with one line, before it deletes anything;
a project in no git repository has no other commits to keep."""

from __future__ import annotations

import os
import stat
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import tiny_params

from tpgrpo.config import config_from_dict
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.long_runs.blocks import (Block, committed_oids, in_git, object_path, read_lock, write_lock,
                                              write_yaml)
from tpgrpo.pipeline.rendering.dvcfile import block_out_paths
from tpgrpo.pipeline.long_runs.retention import retain

DUBIOUS = """#!/bin/sh
echo "fatal: detected dubious ownership in repository at '$PWD'" >&2
echo "To add an exception for this directory, call:" >&2
echo "" >&2
echo "	git config --global --add safe.directory $PWD" >&2
exit 128
"""


def _env() -> dict[str, str]:
    return dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")


def _project(root: Path) -> tuple[Path, object, list[Path]]:
    """A git + DVC project of 4 iterations, block 1-2 sealed with its outputs on disk and in the cache, a
    retention policy that drops some of them; returns (root, config, the block's cache objects)."""
    raw = tiny_params(train={"iterations": 4, "block_size": 2},
                      retention={"keep_trajectories": 1, "keep_adapter_every": 2})
    root.mkdir(parents=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q"], cwd=root, env=_env(), check=True)
    cfg = config_from_dict(raw)
    block = Block(1, 2)
    cache = root / ".dvc" / "cache"
    outs, objects = [], []
    for k, path in enumerate(block_out_paths(cfg, block)):
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text(path)
        md5 = f"{k + 1:032x}"
        objects.append(object_path(cache, md5, legacy=False))
        objects[-1].parent.mkdir(parents=True, exist_ok=True)
        objects[-1].write_text(path)
        outs.append({"path": path, "hash": "md5", "md5": md5})
    write_yaml(block.entries_path(root), {"rollout-0001": {"cmd": "x", "outs": outs}})
    write_yaml(block.seal_path(root), {"first": 1, "last": 2, "outs": block_out_paths(cfg, block)})
    write_yaml(block.lockfile(root), {"schema": "2.0", "stages": {block.name: {"cmd": "x", "outs": outs}}})
    write_lock(root, {"schema": "2.0", "stages": {"update-0003": {"cmd": "x"}}})
    return root, cfg, objects


def _snapshot(root: Path) -> dict[str, bytes]:
    return {p.relative_to(root).as_posix(): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and ".git/" not in p.as_posix() and "/tmp/" not in p.as_posix()}


def _fake_git(folder: Path, script: str | None) -> str:
    """A PATH whose `git` is ``script`` (None: no git at all), with this interpreter's folder after it."""
    folder.mkdir()
    if script is not None:
        (folder / "git").write_text(script)
        (folder / "git").chmod(stat.S_IRWXU)
    return os.pathsep.join([str(folder), str(Path(sys.executable).parent)])


@pytest.mark.parametrize("git", ["dubious", "missing"])
def test_a_failing_or_missing_git_stops_retain_in_one_line_before_it_deletes_anything(tmp_path, monkeypatch, git):
    root, cfg, objects = _project(tmp_path / "project")
    before = _snapshot(root)
    monkeypatch.setenv("PATH", _fake_git(tmp_path / "bin", DUBIOUS if git == "dubious" else None))
    with pytest.raises(PipelineError) as caught:
        retain(root, cfg)
    message = str(caught.value)
    assert "\n" not in message and "nothing was deleted" in message
    assert ("dubious ownership" in message) if git == "dubious" else ("git: cannot run it" in message)
    assert _snapshot(root) == before  # workspace, records and cache objects all as they were
    assert all(p.is_file() for p in objects)
    # without the cache clean-up git is not needed: the outputs go, their objects stay
    dropped = retain(root, cfg, gc=False)
    assert dropped and not any((root / p).exists() for p in dropped) and all(p.is_file() for p in objects)


def test_the_cli_says_it_in_one_line_and_exits_non_zero(tmp_path):
    root, _, _ = _project(tmp_path / "project")
    env = dict(_env(), PATH=_fake_git(tmp_path / "bin", DUBIOUS))
    done = subprocess.run([sys.executable, "-m", "tpgrpo", "retain"], cwd=root, env=env, capture_output=True,
                          text=True)
    lines = done.stderr.strip().splitlines()
    assert done.returncode != 0 and len(lines) == 1 and "dubious ownership" in lines[0], done.stderr


def test_with_a_working_git_retain_frees_what_no_commit_records(tmp_path):
    root, cfg, objects = _project(tmp_path / "project")
    assert committed_oids(root) == set()  # a repository without commits
    dropped = retain(root, cfg)
    freed = [p for p in objects if not p.exists()]
    assert dropped and len(freed) == len(dropped)  # each dropped output's object, nothing else
    assert "update-0003" in read_lock(root)["stages"]


def test_a_project_in_no_git_repository_needs_no_git(tmp_path, monkeypatch):
    plain = tmp_path / "plain"
    plain.mkdir()
    monkeypatch.delenv("GIT_DIR", raising=False)
    monkeypatch.setenv("PATH", _fake_git(tmp_path / "bin", None))
    assert not in_git(plain) and committed_oids(plain) == set()
    (plain / ".git").mkdir()
    (plain / "sub").mkdir()
    assert in_git(plain / "sub")  # git looks in the folders above too
