"""What a stage runs is what its code manifest covers, and DVC never records code or a dvc.yaml that did not run.

Attacks issue 25's items 3 and 17: a hand-kept list of each stage's code missed files the stages run, and
`dvc exp run -S` / `dvc repro` after a params edit ran another pipeline than `tpgrpo run` renders.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, make_tiny_project

from tpgrpo.pipeline.code_manifest import STAGE_KIND, kind_code, write_manifests

# Runs one `tpgrpo stage ...` command in this process and, at exit, writes the project modules it imported.
_RECORD = ("import atexit, json, sys\n"
           "out = sys.argv.pop(1)\n"
           "atexit.register(lambda: json.dump(sorted(m for m in sys.modules if m.split('.')[0] in "
           "('tpgrpo', 'stages')), open(out, 'w')))\n"
           "from tpgrpo.__main__ import main\n"
           "sys.argv[0] = 'tpgrpo'\n"
           "main()\n")


def _module_files(root: Path, modules: list[str]) -> set[str]:
    from tpgrpo.pipeline.code_graph import module_file

    return {f for m in modules if (f := module_file(root, m))}


@pytest.mark.slow
def test_every_project_module_a_stage_imports_is_in_its_kinds_manifest(tmp_path, tiny_model_dir):
    """Each stage of a 1-iteration tiny run, in a fresh process (no stage server): the project modules in
    sys.modules at its exit are all files of its kind's manifest."""
    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"]["iterations"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    commands = [["eval_prompts"], ["rollout", "--iter", "1"], ["probe", "--iter", "1"], ["credit", "--iter", "1"],
                ["update", "--iter", "1"], ["eval", "--iter", "1"], ["baseline"], ["summary"]]
    for command in commands:
        out = tmp_path / f"{command[0]}.json"
        done = subprocess.run([sys.executable, "-c", _RECORD, str(out), "stage", *command], cwd=root,
                              capture_output=True, text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        imported = _module_files(REPO, json.loads(out.read_text()))
        missing = imported - set(kind_code(root, STAGE_KIND[command[0]]))
        assert not missing, f"stage {command[0]} imported modules its manifest does not cover: {sorted(missing)}"


def test_under_dvc_a_stage_refuses_code_its_manifest_does_not_record(tmp_path, tiny_model_dir, monkeypatch):
    """DVC records the manifest as the stage's input: an edit after the code stage wrote it (or a library
    upgrade) stops the stage with one line naming the file, before it writes anything."""
    from typer.testing import CliRunner

    from tpgrpo.cli import app

    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    write_manifests(root)
    monkeypatch.setenv("DVC_STAGE", "credit-0001")
    with open(root / "tpgrpo" / "algo" / "credit.py", "a") as f:
        f.write("# edited after the code stage ran\n")
    result = CliRunner().invoke(app, ["stage", "credit", "--iter", "1", "--params", str(root / "params.yaml")])
    assert result.exit_code == 2
    message = result.output.strip()
    assert message.count("\n") == 0 and "data/code/credit.json does not match" in message, message
    assert "tpgrpo/algo/credit.py" in message
    assert not (root / "data" / "iters" / "0001" / "credit.parquet").exists()

    write_manifests(root)  # re-recorded: now a library upgrade is refused the same way
    import tpgrpo.pipeline.code_manifest as cm

    real = cm.library_versions
    monkeypatch.setattr(cm, "library_versions", lambda: {**real(), "torch": "99.0"})
    result = CliRunner().invoke(app, ["stage", "credit", "--iter", "1", "--params", str(root / "params.yaml")])
    assert result.exit_code == 2 and "torch" in result.output and "99.0" in result.output, result.output


def test_the_code_stage_refuses_a_dvc_yaml_other_params_render(tmp_path, tiny_model_dir, monkeypatch):
    from typer.testing import CliRunner

    from tpgrpo.cli import app
    from tpgrpo.config import load_config
    from tpgrpo.pipeline.dvcfile import write_dvc_yaml

    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    write_dvc_yaml(load_config(root / "params.yaml"), root)
    args = ["stage", "code", "--params", str(root / "params.yaml")]
    assert CliRunner().invoke(app, args).exit_code == 0
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["credit"]["mode"] = "flow_grpo"  # every mode renders the same stages: nothing to refuse
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    assert CliRunner().invoke(app, args).exit_code == 0
    raw["train"]["iterations"] += 1  # what `dvc exp run -S train.iterations=3` does
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 2 and "dvc.yaml was rendered from other params" in result.output
    assert "`tpgrpo dvc-yaml`" in result.output and result.output.strip().count("\n") == 0
