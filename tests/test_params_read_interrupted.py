"""What a stage read from params.yaml is checked against what DVC recorded for it even when the repro does not
end well: a later stage failing, a Ctrl-C, or the run killed outright (then by the next run, before its
repro). Fast: DVC replaced by a stand-in that does what a repro with an edit in the window does (a stage notes
what it read, params.yaml changes, DVC records the new value); slow, at the end: a real run interrupted."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

import tpgrpo.pipeline.repro as repro
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.long_runs.blocks import read_lock, write_lock
from tpgrpo.pipeline.dvc_integration.params_read import NOTES

READ, RECORDED = 0.01, 0.005  # update.lr as the stage read it, and as DVC recorded it (edited in the window)


@pytest.fixture
def project(tmp_path, monkeypatch) -> Path:
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=tmp_path, check=True)
    write_lock(tmp_path, {"schema": "2.0", "stages": {
        "credit-0001": {"cmd": "c", "params": {"params.yaml": {"credit.mode": "tp"}}}}})
    monkeypatch.setattr("tpgrpo.pipeline.rendering.dvcfile.write_dvc_yaml", lambda *a, **k: False)
    monkeypatch.setattr("tpgrpo.pipeline.rendering.code_manifest.refresh_manifests", lambda *a, **k: None)
    return tmp_path


def _window(root: Path) -> None:
    """update-0001 ran having read lr 0.01; params.yaml was edited before DVC recorded it: 0.005 recorded."""
    folder = root / NOTES
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "update-0001.json").write_text(json.dumps({"update.lr": READ}))
    lock = read_lock(root)
    lock["stages"]["update-0001"] = {"cmd": "u", "params": {"params.yaml": {"update.lr": RECORDED}}}
    write_lock(root, lock)


def _fake_dvc(root: Path, then):
    """A stand-in for `dvc repro`: the window, then ``then`` (an exit code, or an exception to raise)."""
    def run(args, *a, **k):
        _window(root)
        if isinstance(then, BaseException):
            raise then
        return subprocess.CompletedProcess(args, then)
    return run


@pytest.mark.parametrize("then", [1, KeyboardInterrupt()], ids=["a-later-stage-fails", "ctrl-c"])
def test_after_a_failed_or_interrupted_repro_the_disagreeing_entry_is_dropped_at_once(project, monkeypatch, then):
    monkeypatch.setattr(repro.subprocess, "run", _fake_dvc(project, then))
    lines = []
    with pytest.raises(PipelineError if then == 1 else KeyboardInterrupt):
        repro._repro(project, None, 1, {}, lines.append)
    assert "update-0001" not in read_lock(project)["stages"]  # `dvc status` lists it; the next repro re-runs it
    assert "credit-0001" in read_lock(project)["stages"]
    assert len(lines) == 1 and lines[0].startswith("dropped the dvc.lock entry of update-0001 (update-0001: update.lr)")


def test_the_notes_a_killed_run_left_are_checked_before_the_next_repro(project, monkeypatch):
    _window(project)  # the run was SIGKILLed right after DVC recorded update-0001: nothing checked it
    seen = {}

    def dvc(args, *a, **k):
        seen["stages"] = set(read_lock(project)["stages"])
        return subprocess.CompletedProcess(args, 0)

    monkeypatch.setattr(repro.subprocess, "run", dvc)
    lines = []
    assert repro._repro(project, None, 1, {}, lines.append) == []
    assert seen["stages"] == {"credit-0001"}  # dropped before DVC ran: DVC re-runs update-0001
    assert len(lines) == 1 and "an earlier run, killed," in lines[0]
    assert not (project / NOTES).exists()  # checked, then cleared


def test_a_repro_that_ends_well_still_returns_what_it_dropped(project, monkeypatch):
    monkeypatch.setattr(repro.subprocess, "run", _fake_dvc(project, 0))
    lines = []
    assert repro._repro(project, None, 1, {}, lines.append) == ["update-0001 (update-0001: update.lr)"]
    assert lines == []  # repro_checked says it (re-running ...)


@pytest.mark.slow
@pytest.mark.parametrize("how", ["ctrl-c", "killed"])
def test_a_params_edit_recorded_in_the_window_then_an_interruption_re_runs_the_stage(tiny_project, monkeypatch,
                                                                                      how):
    """A real run of one iteration: right after its repro, params.yaml holds another update.lr and dvc.lock
    records it for update-0001 (what DVC writes when the edit lands after the stage's own check), then the run
    is interrupted before tpgrpo checks (Ctrl-C: `dvc status` lists update-0001 at once; killed: the next
    `tpgrpo run` drops it first). The next run re-runs update-0001, and `dvc status` is clean after it."""
    from typer.testing import CliRunner

    from tpgrpo.cli import app

    root = tiny_project
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"].update(iterations=1, block_size=0)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    lr = raw["update"]["lr"]
    real_run, real_check = subprocess.run, repro._check_notes

    def run_then_edit_then_stop(args, *a, **k):
        done = real_run(args, *a, **k)
        if args[1:4] == ["-m", "tpgrpo.pipeline.dvc_integration.dvc_atomic", "repro"]:
            (root / "params.yaml").write_text((root / "params.yaml").read_text().replace(f"lr: {lr}", "lr: 0.005"))
            lock = read_lock(root)
            lock["stages"]["update-0001"]["params"]["params.yaml"]["update.lr"] = 0.005
            write_lock(root, lock)
            if how == "killed":  # the process is gone before any check: nothing of tpgrpo runs after this
                monkeypatch.setattr(repro, "_check_notes", lambda *a, **k: None)
            raise KeyboardInterrupt
        return done

    def dvc_status() -> dict:
        done = real_run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True, text=True)
        assert done.returncode == 0, done.stderr
        return json.loads(done.stdout or "{}")

    monkeypatch.setattr(repro.subprocess, "run", run_then_edit_then_stop)
    assert CliRunner().invoke(app, ["run", "--params", str(root / "params.yaml")]).exit_code != 0
    monkeypatch.setattr(repro.subprocess, "run", real_run)
    monkeypatch.setattr(repro, "_check_notes", real_check)
    trained_with_the_old_lr = (root / "data/iters/0001/update.json").read_bytes()
    assert ("update-0001" in dvc_status()) == (how == "ctrl-c")  # killed: only the notes know, until the next run
    again = CliRunner().invoke(app, ["run", "--params", str(root / "params.yaml")])
    assert again.exit_code == 0, again.output
    assert (how == "killed") == ("dropped the dvc.lock entry of update-0001" in again.output), again.output
    assert (root / "data/iters/0001/update.json").read_bytes() != trained_with_the_old_lr  # it ran again
    assert dvc_status() == {}
