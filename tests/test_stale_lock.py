"""`tpgrpo run` clears DVC's rwlock only when every PID in it is gone or a zombie (never a live one)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import psutil
import pytest
from typer.testing import CliRunner

from tpgrpo.cli import app
from tpgrpo.pipeline.dvc_integration.dvclock import RWLOCK, clear_stale_lock, lock_pids, pid_state, stale_pids


def lock_of(*pids: int) -> dict:
    """A DVC rwlock naming ``pids``: the first as writer, all as readers."""
    cmd = "dvc repro"
    return {"write": {"/p/data/iters/0001/trajectories.zarr": {"pid": pids[0], "cmd": cmd}},
            "read": {"/p/params.yaml": [{"pid": p, "cmd": cmd} for p in pids]}}


@pytest.fixture
def dead_pid() -> int:
    """The PID of a process that ran, exited and was reaped (nothing by that PID exists)."""
    proc = subprocess.Popen([sys.executable, "-c", "pass"])
    proc.wait()
    assert pid_state(proc.pid) is None
    return proc.pid


@pytest.fixture
def zombie_pid():
    """A forked child that exited but is not waited for yet: a zombie, which psutil still reports as existing."""
    pid = os.fork()
    if pid == 0:  # the child: leave at once, no cleanup handlers
        os._exit(0)
    try:
        deadline = time.time() + 10
        while pid_state(pid) != "Z":
            assert time.time() < deadline, "the child never became a zombie"
            time.sleep(0.01)
        assert psutil.pid_exists(pid)  # why DVC itself keeps the entry
        yield pid
    finally:
        os.waitpid(pid, 0)


def test_pid_state_reads_proc():
    assert pid_state(os.getpid()) in ("R", "S")


def test_lock_pids_collects_writers_and_readers():
    assert lock_pids(lock_of(7, 5, 7)) == [5, 7]
    assert lock_pids({}) == []


def test_dead_and_zombie_pids_make_the_lock_stale(dead_pid, zombie_pid):
    assert stale_pids(lock_of(dead_pid)) == [dead_pid]
    assert stale_pids(lock_of(zombie_pid)) == [zombie_pid]
    assert stale_pids(lock_of(zombie_pid, dead_pid)) == sorted([zombie_pid, dead_pid])


def test_a_live_pid_keeps_the_lock(dead_pid, zombie_pid):
    assert stale_pids(lock_of(os.getpid())) is None
    assert stale_pids(lock_of(dead_pid, zombie_pid, os.getpid())) is None
    assert stale_pids({}) is None  # nothing to judge: leave it to DVC


def test_clear_stale_lock_removes_only_a_stale_file(tmp_path, zombie_pid):
    path = tmp_path / RWLOCK
    path.parent.mkdir(parents=True)
    path.write_text(json.dumps(lock_of(os.getpid(), zombie_pid)))
    assert clear_stale_lock(tmp_path) is None and path.is_file()
    path.write_text("{not json")
    assert clear_stale_lock(tmp_path) is None and path.is_file()  # DVC reports a corrupt lock itself
    path.write_text(json.dumps(lock_of(zombie_pid)))
    note = clear_stale_lock(tmp_path)
    assert not path.exists() and "\n" not in note and str(zombie_pid) in note and "stale" in note


@pytest.mark.parametrize("live", [False, True])
def test_tpgrpo_run_clears_a_stale_lock_before_dvc_repro(tiny_project, monkeypatch, zombie_pid, live):
    """Through the CLI: a zombie's lock is removed with one line before `dvc repro`; a live one's is kept, and
    the run refuses with one line before it renders anything (a DVC process runs a stage there)."""
    root = tiny_project
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=root, check=True)
    path = root / RWLOCK
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(lock_of(os.getpid() if live else zombie_pid)))
    seen = []

    def fake_run(cmd, **kwargs):  # dvc itself does not run: the test is about what happens before it
        seen.append((list(cmd), path.exists()))
        return subprocess.CompletedProcess(cmd, 0)

    monkeypatch.setattr(subprocess, "run", fake_run)
    result = CliRunner().invoke(app, ["run", "--params", str(root / "params.yaml")])
    notes = [line for line in result.output.splitlines() if "stale DVC lock" in line]
    if live:
        assert result.exit_code == 2 and result.output.strip().count("\n") == 0, result.output
        assert f"DVC process {os.getpid()} is running a stage" in result.output
        assert path.is_file() and not seen and not notes and not (root / "dvc.yaml").exists()
    else:
        assert result.exit_code == 0, result.output
        assert seen and seen[-1][0][-1] == "repro"
        assert not path.exists() and not seen[-1][1] and len(notes) == 1 and str(zombie_pid) in notes[0]
