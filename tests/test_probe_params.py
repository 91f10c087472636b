"""The probe records whether credit.mode is flow_grpo, not the mode (tpgrpo.stage_params.PATH_SWITCHES).

Why: the probe read credit.mode only to know whether to load a model (flow_grpo's probe writes Q_k = R_fin from
the rollout), yet listed it among its params, so switching tp -> incremental re-ran every probe of the run's
history for tables that come out identical (found by `bench/up_to_date.py --sequences 4 --seed 70 --length 4`).
dvc.yaml is the same for every mode (`dvc exp run -S credit.mode=...` runs it), so the choice is recorded in the
probe's code manifest (``"path": "final_reward"`` under flow_grpo, nothing otherwise: a tp run's manifest is
what it was) and its config_hash hashes credit.mode under flow_grpo only.
"""

from __future__ import annotations

import json
import re
import shutil

import pytest
import yaml
from conftest import REPO, tiny_params

from tpgrpo.config import config_from_dict
from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES, manifest_path, write_manifests
from tpgrpo.pipeline.rendering.dvcfile import dvc_yaml_text
from tpgrpo.pipeline.status import stage_params
from tpgrpo.stage_common import provenance

SCORED = ("tp", "incremental", "tp_unconstrained")  # the modes whose probe scores every state with the model
STAGES = ("rollout", "probe", "credit", "update", "eval", "eval_prompts", "baseline", "summary")


def _project(tmp_path, mode: str) -> dict:
    """A copy of the code and a params.yaml with ``credit.mode: mode``: what each stage records under it."""
    root = tmp_path / mode
    for folder in ("stages", "tpgrpo"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    raw = tiny_params(credit={"mode": mode})
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    cfg = config_from_dict(raw)
    write_manifests(root)
    return {"dvc_yaml": dvc_yaml_text(cfg, root),
            "params": {s: stage_params(root / "params.yaml", s) for s in STAGES},
            "hash": {s: provenance(cfg, 1, s)["config_hash"] for s in STAGES},
            "manifest": {k: (root / manifest_path(k)).read_text() for k in KIND_STAGES}}


@pytest.fixture(scope="module")
def records(tmp_path_factory) -> dict[str, dict]:
    tmp = tmp_path_factory.mktemp("modes")
    return {mode: _project(tmp, mode) for mode in (*SCORED, "flow_grpo")}


def test_the_scored_modes_record_the_same_probe(records):
    tp = records["tp"]
    for mode in SCORED[1:]:
        other = records[mode]
        assert other["dvc_yaml"] == tp["dvc_yaml"]
        assert other["params"]["probe"] == tp["params"]["probe"], mode
        assert other["hash"]["probe"] == tp["hash"]["probe"], mode
        assert other["manifest"] == tp["manifest"], mode  # the probe's (and every kind's) manifest
        # what does read the mode still records it: the credit (and what follows it through its table)
        assert other["params"]["credit"] != tp["params"]["credit"] and other["hash"]["credit"] != tp["hash"]["credit"]


def test_flow_grpo_records_another_probe(records):
    """To or from flow_grpo the probe re-runs: its manifest (a dependency DVC hashes) and config_hash differ; the
    rendered stages do not (so `dvc exp run -S credit.mode=flow_grpo` runs the dvc.yaml it has)."""
    tp, flow = records["tp"], records["flow_grpo"]
    assert flow["dvc_yaml"] == tp["dvc_yaml"]
    assert json.loads(flow["manifest"]["probe"]).get("path") == "final_reward"
    assert "path" not in json.loads(tp["manifest"]["probe"])  # a tp run's manifest, as before paths existed
    assert flow["hash"]["probe"] != tp["hash"]["probe"]
    assert {k: v for k, v in flow["manifest"].items() if k != "probe"} == {
        k: v for k, v in tp["manifest"].items() if k != "probe"}


def test_a_tp_probe_records_the_keys_it_recorded_before_but_the_mode(records):
    """An existing run folder's probe entries (made when the probe listed credit.mode) stay valid for DVC, which
    compares only the keys dvc.yaml lists: the probe lists the same keys as before, less credit.mode."""
    recorded = records["tp"]["params"]["probe"]
    assert "credit.mode" not in recorded
    assert {"probe.completion", "probe.batch_size", "model.path", "train.seed", "update.lora_rank"} <= set(recorded)


def test_a_manifest_whose_path_is_not_the_params_is_refused(tmp_path):
    """A credit.mode edited after the code stage wrote the manifests: the probe refuses to run (DVC would record
    a final-reward table under a scored manifest, or the reverse), with one line."""
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.rendering.code_manifest import check_code

    root = tmp_path
    for folder in ("stages", "tpgrpo"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))
    scored = config_from_dict(tiny_params(credit={"mode": "tp"}))
    flow = config_from_dict(tiny_params(credit={"mode": "flow_grpo"}))
    write_manifests(root, scored)
    check_code(root, "probe", scored)
    check_code(root, "credit", flow)  # only the probe's manifest records the path
    with pytest.raises(PipelineError, match="code path default -> final_reward"):
        check_code(root, "probe", flow)


@pytest.mark.slow
def test_a_trained_project_re_runs_the_probe_only_to_or_from_flow_grpo(tmp_path, tiny_model_dir):
    """One iteration through `tpgrpo run`, then credit.mode tp -> incremental -> tp_unconstrained (no probe
    runs, the credit does), -> flow_grpo (the probe runs, loading no model) -> tp (the probe runs again)."""
    from conftest import make_tiny_project
    from test_dvc_pipeline import ran, set_param, tpgrpo_run

    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    set_param(root, "train", "iterations", 1)
    first = tpgrpo_run(root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    for mode, probes in (("incremental", False), ("tp_unconstrained", False), ("flow_grpo", True), ("tp", True)):
        set_param(root, "credit", "mode", mode)
        done = tpgrpo_run(root)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        # run, or restored from DVC's run cache (back to tp: the tp run's probe, credit and update)
        redone = ran(done.stdout) | set(re.findall(r"Stage '([\w-]+)' is cached", done.stdout))
        assert ("probe-0001" in redone) == probes and "credit-0001" in redone, (mode, done.stdout[-3000:])
        assert "rollout-0001" not in redone
        passes = json.loads((root / "data" / "iters" / "0001" / "probe.json").read_text())["forward_passes"]
        assert (passes == 0) == (mode == "flow_grpo"), (mode, passes)
