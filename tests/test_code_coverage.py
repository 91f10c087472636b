"""What a stage runs is what its code manifest covers, and DVC never records code or a dvc.yaml that did not run.

Attacks two past failures: a hand-kept list of each stage's code missed files the stages run, and
`dvc exp run -S` / `dvc repro` after a params edit ran another pipeline than `tpgrpo run` renders.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_project

from tpgrpo.pipeline.rendering.code_graph import is_orchestration
from tpgrpo.pipeline.rendering.code_manifest import STAGE_KIND, kind_code, write_manifests

# Runs one `tpgrpo stage ...` command in this process and, at exit, writes {project module: the file whose code
# imported it first} for every project module it imported. A finder at the front of sys.meta_path sees every
# import that loads a module, `importlib.import_module` included (the reward registry's and the model
# registry's imports by name), and names the first frame outside importlib.
_RECORD = ("import atexit, json, sys\n"
           "out = sys.argv.pop(1)\n"
           "first = {}\n"
           "class Recorder:\n"
           "    @staticmethod\n"
           "    def find_spec(name, path=None, target=None):\n"
           "        if name.split('.')[0] in ('tpgrpo', 'stages') and name not in first:\n"
           "            f = sys._getframe(1)\n"
           "            while f is not None and (f.f_code.co_filename.startswith('<frozen') or\n"
           "                                     '/importlib/' in f.f_code.co_filename):\n"
           "                f = f.f_back\n"
           "            first[name] = f.f_code.co_filename if f is not None else ''\n"
           "        return None\n"
           "sys.meta_path.insert(0, Recorder)\n"
           "atexit.register(lambda: json.dump(first, open(out, 'w')))\n"
           "from tpgrpo.__main__ import main\n"
           "sys.argv[0] = 'tpgrpo'\n"
           "main()\n")


def _by_importer(root: Path, first: dict[str, str]) -> tuple[set[str], set[str]]:
    """(files of the modules stage code imported, files of those orchestration or the harness imported): a
    module counts as the stage's when the file that imported it is project code outside orchestration."""
    from tpgrpo.pipeline.rendering.code_graph import module_file

    stage, other = set(), set()
    for module, importer in first.items():
        path = module_file(root, module)
        where = Path(importer).resolve()
        relative = where.relative_to(root).as_posix() if where.is_relative_to(root) else None
        if path:
            (stage if relative and not is_orchestration(relative) else other).add(path)
    return stage, other


@pytest.mark.slow
def test_every_project_module_a_stage_imports_is_in_its_kinds_manifest(tmp_path, tiny_model_dir):
    """Each stage of a 1-iteration tiny run, in a fresh process (no stage server): every project module the
    stage's code imported at run time (by name too) is a file of its kind's manifest. What the orchestration
    that ran it imported (the command line, tpgrpo/pipeline/, and what they import themselves, e.g. the
    process group for `tpgrpo status`'s note) decides how the stage runs, not what it computes: in no
    manifest."""
    root = make_tiny_project(tmp_path / "project", tiny_model_dir).resolve()
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
        stage, other = _by_importer(root, json.loads(out.read_text()))
        # what ran it
        assert "tpgrpo/pipeline/execution/stage_runner.py" in other and f"stages/{command[0]}.py" in other
        assert len(stage) >= 3, stage  # the stage module's own imports were seen
        missing = stage - set(kind_code(root, STAGE_KIND[command[0]]))
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
        f.write("EDITED = 1  # edited after the code stage ran (a comment alone changes no manifest)\n")
    result = CliRunner().invoke(app, ["stage", "credit", "--iter", "1", "--params", str(root / "params.yaml")])
    assert result.exit_code == 2
    message = result.output.strip()
    assert message.count("\n") == 0 and "data/code/credit.json does not match" in message, message
    assert "tpgrpo/algo/credit.py" in message
    assert not (root / "data" / "iters" / "0001" / "credit.parquet").exists()

    write_manifests(root)  # re-recorded: now a library upgrade is refused the same way
    import tpgrpo.pipeline.rendering.libraries as libs

    real = libs.installed_version
    monkeypatch.setattr(libs, "installed_version", lambda dist: "99.0" if dist == "torch" else real(dist))
    result = CliRunner().invoke(app, ["stage", "credit", "--iter", "1", "--params", str(root / "params.yaml")])
    assert result.exit_code == 2 and "torch" in result.output and "99.0" in result.output, result.output


def test_the_code_stage_refuses_a_dvc_yaml_other_params_render(tmp_path, tiny_model_dir, monkeypatch):
    from typer.testing import CliRunner

    from tpgrpo.cli import app
    from tpgrpo.config import load_config
    from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml

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


def _stage_as_dvc_runs_it(root: Path, pythonpath: Path | None) -> subprocess.CompletedProcess:
    """``tpgrpo stage credit --iter 1`` through the console script (what dvc.yaml's command finds on PATH: it
    imports the installed package, not the project's copy, unless PYTHONPATH puts that first)."""
    import os

    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(DVC_STAGE="credit-0001", OMP_NUM_THREADS="1", **({"PYTHONPATH": str(pythonpath)} if pythonpath else {}))
    script = Path(sys.executable).parent / "tpgrpo"
    return subprocess.run([str(script), "stage", "credit", "--iter", "1"], cwd=root, env=env, capture_output=True,
                          text=True, timeout=300)


def test_under_dvc_a_stage_refuses_modules_that_are_not_the_projects_code(tmp_path, tiny_model_dir):
    """The manifests hash the project's copy of the code; the modules that run may come from
    another checkout (an install pointing elsewhere, `dvc exp run --temp`). Identical bytes run; a different
    file is refused with one line, exit 2, before the stage writes anything; the project's code first on
    PYTHONPATH runs."""
    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    write_manifests(root)
    same = _stage_as_dvc_runs_it(root, None)  # the checkout's code, byte for byte the project's copy: runs
    assert same.returncode == 2 and "probe.parquet" in same.stderr and "records" not in same.stderr, same.stderr

    with open(root / "tpgrpo" / "algo" / "credit.py", "a") as f:
        f.write("OTHER = 1  # the project's credit, not the installed one\n")
    write_manifests(root)  # the manifest matches the project's files: only the running code differs
    other = _stage_as_dvc_runs_it(root, None)
    message = other.stderr.strip()
    assert other.returncode == 2 and message.count("\n") == 0, other.stderr
    assert message.startswith("error: the code that runs is not the code data/code/credit.json records"), message
    assert "tpgrpo/algo/credit.py differs" in message and f"PYTHONPATH={root}" in message
    assert "`PYTHONPATH=. dvc exp run --temp`" in message
    assert not (root / "data" / "iters" / "0001" / "credit.parquet").exists()

    own = _stage_as_dvc_runs_it(root, root)  # the project's code first: what the manifest records runs
    assert own.returncode == 2 and "probe.parquet" in own.stderr and "records" not in own.stderr, own.stderr


def test_a_project_without_its_own_code_is_refused_in_one_line(tmp_path, tiny_model_dir):
    """The manifests hash the project's copy of the code; a project folder without one (its manifests copied
    from elsewhere) has nothing they could match: one line naming the missing file, exit 2."""
    import shutil

    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    write_manifests(root)
    shutil.rmtree(root / "stages")
    done = _stage_as_dvc_runs_it(root, None)
    message = done.stderr.strip()
    assert done.returncode == 2 and message.count("\n") == 0, done.stderr
    assert message.startswith("error: code path stages/") and "not found under" in message, message
