"""Every stage dvc.yaml runs has one record (tpgrpo.stage_params: ITERATION_STAGES once per iteration, RUN_STAGES
once per run; the code stage, which writes the manifests, is the one stage without); the command line, the
tables keyed by stage name and dvc.yaml derive from the records, and the run-level files are spelt in one place."""

from __future__ import annotations

import ast
import shutil
from pathlib import Path

from typer.testing import CliRunner

from conftest import tiny_params
from tpgrpo import stage_params
from tpgrpo.config import config_from_dict
from tpgrpo.pipeline.rendering import dvcfile
from tpgrpo.pipeline.long_runs.blocks import Block
from tpgrpo.stage_params import ITERATION_STAGES, RUN_STAGES

REPO = Path(__file__).resolve().parents[1]
RECORDS = (*ITERATION_STAGES, *RUN_STAGES)
# The code that still spells the baseline's files itself: the comparison reads other runs' folders (its own
# module, kept out of this change). Only shrinks: a new spelling elsewhere fails.
SPELT_ELSEWHERE = {"tpgrpo/comparison/results.py", "tpgrpo/comparison/runs.py", "tpgrpo/comparison/store.py"}


def _rendered_names(cfg) -> list[str]:
    """The stage names dvc.yaml renders under ``cfg``, ``-NNNN`` cut off (``rollout-0001`` -> ``rollout``)."""
    return [name.split("-")[0] for name in dvcfile.render(cfg)["stages"]]


def test_every_stage_dvc_yaml_renders_has_exactly_one_record():
    names = [stage.name for stage in RECORDS]
    assert len(names) == len(set(names)), names
    for sections in ({}, {"tree": {"enabled": True, "split_steps": "0,1"}}, {"update": {"objective": "nft"}}):
        rendered = _rendered_names(config_from_dict(tiny_params(**sections)))
        assert set(rendered) - {"code"} == set(names), rendered
        assert rendered.count("code") == 1  # written by code_manifest.code_stage: it runs no stage module
    # the block a sealed block's pipeline file holds runs iteration stages only
    block = dvcfile.block_stage(config_from_dict(tiny_params()), Block(1, 2))
    assert block["cmd"].startswith("tpgrpo block ")


def test_every_record_is_a_stage_command_with_its_help():
    from tpgrpo.pipeline.execution.stage_runner import stage_app

    registered = {c.name: c for c in stage_app.registered_commands}
    assert set(registered) == {s.name for s in RECORDS} | {"code"}, sorted(registered)
    runner = CliRunner()
    for stage in RUN_STAGES:
        shown = runner.invoke(stage_app, [stage.name, "--help"], env={"COLUMNS": "200"})
        assert shown.exit_code == 0 and stage.help in shown.output, (stage.name, shown.output)
        assert "--iter" not in shown.output, stage.name  # once per run


def test_the_tables_keyed_by_stage_derive_from_the_records():
    from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES, STAGE_KIND

    assert stage_params.STAGE_PARAMS == {s.name: list(s.params) for s in RECORDS}
    assert stage_params.MULTI_PROCESS_STAGES == ("rollout", "probe", "update", "eval", "baseline")
    assert STAGE_KIND == {**{s.name: s.name for s in RECORDS}, "baseline": "eval"}
    assert KIND_STAGES["eval"] == ["stages/eval.py", "stages/baseline.py"]  # the baseline's manifest is eval's
    assert set(KIND_STAGES) == set(STAGE_KIND.values())
    assert all((REPO / path).is_file() for stage in RECORDS for path in stage.code)
    assert all(name in dvcfile.EXTERNAL for stage in RUN_STAGES for name in stage.external)
    produced = {out.path for stage in RUN_STAGES for out in stage.outputs}
    assert all(path in produced for stage in RUN_STAGES for path in stage.inputs)


def test_a_run_stage_entry_comes_from_its_record():
    cfg = config_from_dict(tiny_params())
    stages = dvcfile.render(cfg)["stages"]
    baseline = next(s for s in RUN_STAGES if s.name == "baseline")
    assert stages["baseline"]["deps"][0] == "data/code/eval.json"
    assert stages["baseline"]["outs"] == [{out.path: {"cache": False}} for out in baseline.outputs]
    assert stages["eval_prompts"]["outs"][0] == stage_params.EVAL_EMBEDS  # DVC-cached: no "cache: false"
    summary = stages["summary"]
    assert summary["deps"][1:3] == [stage_params.BASELINE_LOG, stage_params.BASELINE_TABLE]
    assert summary["outs"][:4] == [{p: {"cache": False}} for p in (
        "data/metrics/summary.json", "data/metrics/history.csv", stage_params.EVAL_CURVE, stage_params.TRAIN_CURVE)]
    assert "data/iters/0002/eval.json" in summary["deps"]  # its deps on the iterations: added by the renderer


def _spelt(path: Path, text: str) -> bool:
    """Whether a string literal of ``path``'s code (not a docstring nor a comment) holds ``text``."""
    tree = ast.parse(path.read_text(), filename=str(path))
    docstrings = {id(node.value) for node in ast.walk(tree) if isinstance(node, ast.Expr)}
    return any(isinstance(node, ast.Constant) and isinstance(node.value, str) and text in node.value
               and id(node) not in docstrings for node in ast.walk(tree))


def test_the_baseline_files_are_spelt_in_one_place():
    spelt = {path.relative_to(REPO).as_posix() for folder in ("tpgrpo", "stages")
             for path in (REPO / folder).rglob("*.py") if _spelt(path, "baseline_eval.")}
    assert "tpgrpo/stage_params.py" in spelt  # the declaration (the check finds what it looks for)
    assert spelt - {"tpgrpo/stage_params.py"} <= SPELT_ELSEWHERE, sorted(spelt)


def test_an_edit_of_a_run_stages_record_changes_its_kinds_manifest_only(tmp_path):
    """As an iteration stage's declaration: the baseline's record counts for the eval's manifest (which covers
    it), the summary's for the summary's; the help line of `tpgrpo stage NAME` for none."""
    from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES, manifest_path, write_manifests

    for folder in ("stages", "tpgrpo"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    declarations = tmp_path / "tpgrpo" / "stage_params.py"
    original = declarations.read_text()
    write_manifests(tmp_path)
    before = {kind: (tmp_path / manifest_path(kind)).read_bytes() for kind in KIND_STAGES}

    def changed_by(old: str, new: str) -> set[str]:
        assert original.count(old) == 1, old
        declarations.write_text(original.replace(old, new))
        write_manifests(tmp_path)
        declarations.write_text(original)
        return {kind for kind in KIND_STAGES if (tmp_path / manifest_path(kind)).read_bytes() != before[kind]}

    assert changed_by('"update.lora_alpha",\n         *REWARD_PARAMS),',
                      '"update.lora_alpha",\n         *REWARD_PARAMS, "train.seed"),') == {"eval"}
    assert changed_by('"credit.mode", "train.iterations")', '"credit.mode")') == {"summary"}
    assert changed_by("Evaluate the base model (the curves' starting point).",
                      "Evaluate the base model once (the curves' starting point).") == set()
    assert changed_by('multi_process=True, manifest="eval"', 'multi_process=True, manifest="eval_prompts"') == {
        "eval", "eval_prompts"}
