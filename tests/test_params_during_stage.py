"""A params edit while a stage runs: the stage read params.yaml when it started, DVC
records params.yaml when the stage exits. A change to a value the stage depends on must fail the stage
(DVC then records nothing); a change elsewhere, or the same value written otherwise, must not."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys

import pytest
import yaml
from conftest import tiny_params
from typer.testing import CliRunner

from tpgrpo.cli import app

LR = 1.0e-2  # tiny_params' update.lr


@pytest.fixture
def project(tmp_path):
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    return tmp_path


def run_stage_that_edits(project, monkeypatch, stage: str, edit) -> tuple[int, list[str], bool]:
    """Run `tpgrpo stage STAGE --iter 1` whose work is to apply ``edit`` to params.yaml's text; returns the exit
    code, the output's lines and whether the work ran."""
    import importlib

    module = importlib.import_module(f"stages.{stage}")
    ran = []

    def work(cfg, iteration, root):  # what a user's editor does while the stage computes
        path = root / "params.yaml"
        path.write_text(edit(path.read_text()))
        ran.append(True)

    monkeypatch.setattr(module, "run", work)
    result = CliRunner().invoke(app, ["stage", stage, "--iter", "1", "--params", str(project / "params.yaml")])
    return result.exit_code, [line for line in result.output.splitlines() if line.strip()], bool(ran)


def test_an_edit_of_a_param_the_stage_reads_fails_it(project, monkeypatch):
    code, lines, ran = run_stage_that_edits(project, monkeypatch, "update",
                                            lambda text: text.replace(f"lr: {LR}", "lr: 0.005"))
    assert ran and code == 2
    assert lines == ["error: params.yaml changed while stage update --iter 1 ran (update.lr): its outputs are not "
                     "recorded; run again"]
    last = json.loads((project / "data" / ".last_stage.json").read_text())
    assert last["state"] == "failed" and "update.lr" in last["error"]


def test_an_edit_of_another_stage_s_param_does_not(project, monkeypatch):
    code, lines, ran = run_stage_that_edits(project, monkeypatch, "credit",
                                            lambda text: text.replace(f"lr: {LR}", "lr: 0.005"))
    assert ran and code == 0, lines


@pytest.mark.parametrize("written", ["5.0e+00", "5.", "5"])
def test_the_same_value_written_otherwise_is_no_change_as_dvc_reads_yaml(project, monkeypatch, written):
    """``adv_clip: 5.0`` rewritten: equal for DVC (YAML 1.2), so DVC's record is right and the stage passes.
    (PyYAML, YAML 1.1, reads ``5.0e+00`` as a float but ``1e-05``-style values as strings.)"""
    assert "adv_clip: 5.0\n" in (project / "params.yaml").read_text()
    code, lines, ran = run_stage_that_edits(project, monkeypatch, "credit",
                                            lambda text: text.replace("adv_clip: 5.0\n", f"adv_clip: {written}\n"))
    assert ran and code == 0, lines


def test_a_float_in_yaml_1_2_notation_compares_as_a_number(project, monkeypatch):
    """``1e-2`` is a string for PyYAML and 0.01 for DVC: rewriting 0.01 as 1e-2 changes nothing DVC records."""
    code, lines, ran = run_stage_that_edits(project, monkeypatch, "update",
                                            lambda text: text.replace(f"lr: {LR}", "lr: 1e-2"))
    assert ran and code == 0, lines
    code, lines, ran = run_stage_that_edits(project, monkeypatch, "update",
                                            lambda text: text.replace("lr: 1e-2", "lr: 2e-2"))
    assert ran and code == 2 and "(update.lr)" in lines[0]


# --- after the stage's own check: DVC reads params.yaml only once the stage has exited (tpgrpo run checks) ---

def _lock_with(stages: dict) -> dict:
    return {"schema": "2.0", "stages": stages}


def test_a_lock_entry_that_disagrees_with_what_its_stage_read_is_dropped(tmp_path, monkeypatch):
    from tpgrpo.pipeline.long_runs.blocks import read_lock, write_lock
    from tpgrpo.pipeline.dvc_integration.params_read import NOTES, drop_disagreeing, note_params_read

    # a DVC project: the entries are dropped under DVC's lock
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=tmp_path, check=True)
    monkeypatch.setenv("DVC_STAGE", "update-0001")
    write_lock(tmp_path, _lock_with({
        "update-0001": {"cmd": "u", "params": {"params.yaml": {"update": {"lr": 0.005, "ema": False}}}},
        "credit-0001": {"cmd": "c", "params": {"params.yaml": {"credit.mode": "tp"}}},
        "iters-0003-0004": {"cmd": "b", "params": {"params.yaml": {"update": {"lr": 0.005}}}}}))
    note_params_read(tmp_path, "update-0001", {"update.lr": 0.01, "update.ema": False})  # read before an edit
    note_params_read(tmp_path, "credit-0001", {"credit.mode": "tp", "absent.key": "<absent>"})
    note_params_read(tmp_path, "update-0004", {"update.lr": 0.01})  # a stage of a sealed block's re-run
    assert sorted(drop_disagreeing(tmp_path)) == ["iters-0003-0004 (update-0004: update.lr)",
                                                  "update-0001 (update-0001: update.lr)"]
    assert list(read_lock(tmp_path)["stages"]) == ["credit-0001"] and not (tmp_path / NOTES).exists()
    assert drop_disagreeing(tmp_path) == []  # notes are cleared: nothing is checked twice
    monkeypatch.delenv("DVC_STAGE")
    note_params_read(tmp_path, "credit-0001", {"credit.mode": "incremental"})  # a hand run: DVC records nothing
    assert not (tmp_path / NOTES).exists()


@pytest.mark.slow
def test_an_edit_dvc_records_after_the_stage_checked_is_re_run(tiny_project, monkeypatch):
    """Inject the window: right after the first ``dvc repro``, params.yaml holds another update.lr and
    dvc.lock records it for update-0001 (what DVC writes when the edit lands after the stage's own check).
    ``tpgrpo run`` must drop that entry and train update-0001 again with the recorded value."""
    import subprocess

    import tpgrpo.pipeline.repro as repro
    from tpgrpo.pipeline.long_runs.blocks import read_lock, write_lock

    root = tiny_project
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"].update(iterations=1, block_size=0)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    real_run, repros = subprocess.run, []

    def run_then_edit(args, *a, **k):
        done = real_run(args, *a, **k)
        # tpgrpo run calls DVC through tpgrpo.pipeline.dvc_integration.dvc_atomic (DVC's CLI with atomic lock writes)
        if args[1] == "-m" and args[2] in ("dvc", "tpgrpo.pipeline.dvc_integration.dvc_atomic") and args[3] == "repro" \
                and not repros:
            repros.append(True)
            (root / "params.yaml").write_text((root / "params.yaml").read_text().replace(f"lr: {LR}", "lr: 0.005"))
            lock = read_lock(root)
            lock["stages"]["update-0001"]["params"]["params.yaml"]["update.lr"] = 0.005  # a key: update has knobs
            write_lock(root, lock)
        return done

    monkeypatch.setattr(repro.subprocess, "run", run_then_edit)
    policy = root / "data/iters/0001/policy"
    result = CliRunner().invoke(app, ["run", "--params", str(root / "params.yaml")])
    assert result.exit_code == 0, result.output
    assert "re-running update-0001 (update-0001: update.lr): params.yaml changed as DVC recorded it" in result.output
    first = json.loads((root / "data/iters/0001/update.json").read_text())
    monkeypatch.setattr(repro.subprocess, "run", real_run)
    status = real_run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, capture_output=True, text=True)
    assert json.loads(status.stdout or "{}") == {}
    # what is recorded is what ran: a fresh run with lr 0.005 from scratch trains the same adapter
    fresh = root.parent / "fresh"
    shutil.copytree(root, fresh, ignore=shutil.ignore_patterns(".dvc", "dvc.lock"))  # code whole: tpgrpo/reports too
    for made in ("data/iters", "data/metrics", "data/reports"):
        shutil.rmtree(fresh / made, ignore_errors=True)
    assert CliRunner().invoke(app, ["run", "--params", str(fresh / "params.yaml")]).exit_code == 0
    again = json.loads((fresh / "data/iters/0001/update.json").read_text())
    assert {k: v for k, v in first.items() if "seconds" not in k} == {k: v for k, v in again.items()
                                                                      if "seconds" not in k}
    assert policy.is_dir()
