"""Each iteration stage is declared once (tpgrpo.stage_params.ITERATION_STAGES): the declaration is consistent,
and what dvc.yaml, IterationPaths, retention, the block digest, tpgrpo status and tpgrpo compare use is read
from it. (The files a real run writes are checked against it in tests/test_dvc_pipeline.py.)"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest

from conftest import tiny_params
from tpgrpo import stage_params
from tpgrpo.config import config_from_dict
from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.pipeline.rendering import dvcfile
from tpgrpo.stage_params import ITERATION_OUTPUTS, ITERATION_STAGES, Output

REPO = Path(__file__).resolve().parents[1]


def test_each_stage_reads_only_what_an_earlier_stage_of_its_iteration_wrote():
    written: set[str] = set()
    for stage in ITERATION_STAGES:
        assert set(stage.inputs) <= written, stage.name
        written |= {out.name for out in stage.outputs}


def test_names_attributes_and_references_are_unique_and_resolve():
    outputs = [out for stage in ITERATION_STAGES for out in stage.outputs]
    assert len({o.name for o in outputs}) == len({o.attr for o in outputs}) == len(outputs) == len(ITERATION_OUTPUTS)
    assert all(name in dvcfile.EXTERNAL for stage in ITERATION_STAGES for name in stage.external)
    assert all((REPO / path).is_file() for stage in ITERATION_STAGES for path in stage.code)
    assert all(f"{stage.name}.json" in {o.name for o in stage.outputs} for stage in ITERATION_STAGES)  # its log
    assert all(set(o.read_by) <= {stage_params.SUMMARY, stage_params.DONE, stage_params.COMPARE} for o in outputs)


def test_the_schemas_name_the_declared_files():
    from tpgrpo.io import schemas

    assert schemas.PROBE.file == schemas.PROBE_TREE.file == ITERATION_OUTPUTS["probe"].name
    assert schemas.CREDIT.file == ITERATION_OUTPUTS["credit"].name
    assert schemas.TRAJECTORIES_FILE == ITERATION_OUTPUTS["trajectories"].name
    assert schemas.EMBEDDINGS_FILE == ITERATION_OUTPUTS["prompt_embeds"].name


def test_iteration_paths_come_from_the_declaration():
    paths = IterationPaths(Path("/r"), 7)
    for attr, out in ITERATION_OUTPUTS.items():
        assert getattr(paths, attr) == Path("/r/data/iters/0007") / out.name
    with pytest.raises(AttributeError, match="no 'trajectory'.*outputs: trajectories, prompt_embeds"):
        paths.trajectory  # noqa: B018 - a misspelt name is an error that lists the right ones


def test_a_new_output_is_one_line(monkeypatch):
    """Declaring one more output of the credit stage puts it in dvc.yaml and in IterationPaths."""
    stages = list(ITERATION_STAGES)
    credit = next(i for i, s in enumerate(stages) if s.name == "credit")
    extra = Output("credit_by_step.parquet", "credit_by_step", read_by=(stage_params.SUMMARY,))
    stages[credit] = dataclasses.replace(stages[credit], outputs=(*stages[credit].outputs, extra))
    monkeypatch.setattr(stage_params, "ITERATION_STAGES", tuple(stages))
    monkeypatch.setattr(dvcfile, "ITERATION_STAGES", tuple(stages))
    monkeypatch.setitem(ITERATION_OUTPUTS, extra.attr, extra)
    rendered = dvcfile.iteration_stages(config_from_dict(tiny_params()), 3)
    assert rendered["credit-0003"]["outs"][-1] == "data/iters/0003/credit_by_step.parquet"
    assert IterationPaths(Path("/r"), 3).credit_by_step == Path("/r/data/iters/0003/credit_by_step.parquet")


def test_what_the_orchestration_reads_is_derived():
    from tpgrpo.comparison.runs import ITER_FILES
    from tpgrpo.pipeline.long_runs.block_logs import READ_BY_SUMMARY
    from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES
    from tpgrpo.pipeline.long_runs.retention import DROPPABLE
    from tpgrpo.pipeline.execution.stage_runner import STAGES
    from tpgrpo.pipeline.status import ITERATION_FILES

    by_reader = lambda *r: {o.name for o in ITERATION_OUTPUTS.values() if set(o.read_by) & set(r)}  # noqa: E731
    assert set(READ_BY_SUMMARY) == by_reader(stage_params.SUMMARY)
    assert set(ITERATION_FILES) == by_reader(stage_params.DONE)
    assert set(ITER_FILES) == by_reader(stage_params.DONE, stage_params.COMPARE)
    assert DROPPABLE == {o.name: o.droppable for o in ITERATION_OUTPUTS.values() if o.droppable}
    assert STAGES == tuple(s.name for s in ITERATION_STAGES)
    assert all(KIND_STAGES[s.name][:len(s.code)] == list(s.code) for s in ITERATION_STAGES)  # + the baseline's (eval)
    uncached = {next(iter(o)) for s in dvcfile.iteration_stages(config_from_dict(tiny_params()), 2).values()
                for o in s["outs"] if isinstance(o, dict)}
    assert uncached == {f"data/iters/0002/{o.name}" for o in ITERATION_OUTPUTS.values() if not o.cached}


def test_an_edit_to_one_stages_declaration_changes_that_stages_manifest_only(tmp_path):
    """Every stage's code holds stage_params.py, but each manifest records only its own stage's declaration
    of it (with the shared tables and functions): a new field in eval's declaration re-runs the evals (and the
    baseline, which eval's manifest covers), no rollout; a comment in it re-runs nothing; an edit of a shared
    table still re-runs every stage."""
    import json
    import shutil

    from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES, manifest_path, write_manifests

    for folder in ("stages", "tpgrpo"):
        shutil.copytree(REPO / folder, tmp_path / folder, ignore=shutil.ignore_patterns("__pycache__"))
    declarations = tmp_path / "tpgrpo" / "stage_params.py"
    original = declarations.read_text()

    def changed_by(old: str, new: str) -> set[str]:
        assert original.count(old) == 1, old
        write_manifests(tmp_path)
        before = {kind: (tmp_path / manifest_path(kind)).read_bytes() for kind in KIND_STAGES}
        declarations.write_text(original.replace(old, new))
        write_manifests(tmp_path)
        declarations.write_text(original)
        return {kind for kind in KIND_STAGES if (tmp_path / manifest_path(kind)).read_bytes() != before[kind]}

    write_manifests(tmp_path)
    assert all("tpgrpo/stage_params.py" in json.loads((tmp_path / manifest_path(k)).read_text())["files"]
               for k in KIND_STAGES)
    eval_out = 'Output("eval.json", "eval_metrics", cached=False, read_by=(SUMMARY, DONE))'
    assert changed_by(eval_out, eval_out.replace("cached=False", 'cached=False, droppable=""')) == {"eval"}
    assert changed_by('"update.ema", "train.seed",', '"update.ema", "train.seed", "train.iterations",') == {"eval"}
    assert changed_by('"update.ema", "train.seed",', '"update.ema",  # a comment\n         "train.seed",') == set()
    assert changed_by('"stages/credit.py",), ("credit",)', '"stages/credit.py",), ("credit", "train.seed")') == {
        "credit"}
    assert changed_by('PATH_SWITCHES = {"probe"', 'UNUSED = 1\nPATH_SWITCHES = {"probe"') == set(KIND_STAGES)
