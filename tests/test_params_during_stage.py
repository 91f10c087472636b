"""A params edit while a stage runs (issue 25, item 6): the stage read params.yaml when it started, DVC
records params.yaml when the stage exits. A change to a value the stage depends on must fail the stage
(DVC then records nothing); a change elsewhere, or the same value written otherwise, must not."""

from __future__ import annotations

import json

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
