"""A stage re-run by hand writes the same tracked bytes, and seconds are still read.

What differs between two runs of a stage on the same inputs (its wall seconds, the process count, the Python
and torch versions) lives in an untracked sidecar beside its log (:mod:`tpgrpo.io.stage_logs`): the logs and
tables DVC hashes are the same bytes, so `dvc status` stays clean. Every reader of seconds (the summary,
``tpgrpo compare``, the archive) reads the sidecar, and the log's own ``wall_seconds`` in older runs.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_project
from typer.testing import CliRunner

from tpgrpo.cli import app
from tpgrpo.comparison.runs import stage_seconds, train_seconds
from tpgrpo.io.stage_logs import log_seconds, read_log, timing_path, write_log

STAGES = ("rollout", "probe", "credit", "update", "eval")


def run_stage(root: Path, name: str, iteration: int | None) -> None:
    args = ["stage", name, "--params", str(root / "params.yaml")] + (["--iter", str(iteration)] if iteration else [])
    result = CliRunner().invoke(app, args)
    assert result.exit_code == 0, f"{name}: {result.output}"


def tracked(root: Path) -> dict[str, bytes]:
    """Every file the stages wrote under data/iters but the timing sidecars and the summary's own log."""
    iters = root / "data" / "iters"
    return {p.relative_to(iters).as_posix(): p.read_bytes() for p in sorted(iters.rglob("*"))
            if p.is_file() and not p.name.endswith(".timing.json") and p.name != "summary_log.json"}


@pytest.fixture(scope="module")
def ran(tmp_path_factory, tiny_model_dir) -> Path:
    """A tiny project after one evaluated iteration and the baseline (train.iterations = 1)."""
    root = make_tiny_project(tmp_path_factory.mktemp("rerun") / "project", tiny_model_dir)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"]["iterations"], params["eval"]["every"] = 1, 1
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    for name, iteration in [("eval_prompts", None), *((s, 1) for s in STAGES), ("baseline", None)]:
        run_stage(root, name, iteration)
    return root


def test_every_stage_rerun_by_hand_rewrites_its_tracked_outputs_byte_for_byte(ran):
    before = tracked(ran)
    assert {"0001/credit.json", "0001/eval.json", "0001/eval.parquet", "baseline_eval.json",
            "eval_prompts.json", "0001/probe.parquet", "0001/update.json"} <= set(before)
    for name, iteration in [("eval_prompts", None), *((s, 1) for s in STAGES), ("baseline", None)]:
        run_stage(ran, name, iteration)
        changed = sorted(k for k, v in tracked(ran).items() if before.get(k) != v)
        assert not changed, f"a re-run of {name} changed tracked outputs {changed}"


def test_the_seconds_and_process_counts_are_in_the_sidecars_only(ran):
    iters = ran / "data" / "iters"
    for log in [*(iters / "0001" / f"{s}.json" for s in STAGES), iters / "baseline_eval.json",
                iters / "eval_prompts.json"]:
        assert "wall_seconds" not in json.loads(log.read_text()) and "processes" not in json.loads(log.read_text())
        side = json.loads(timing_path(log).read_text())
        assert side["wall_seconds"] >= 0 and {"python_version", "torch_version"} <= set(side), log.name
    assert json.loads(timing_path(iters / "0001" / "rollout.json").read_text())["processes"] == 1
    assert read_log(iters / "0001" / "update.json", "update")["processes"] == 1


def test_no_table_records_a_version_of_python_or_torch(ran):
    import pyarrow.parquet as pq

    for name in ("0001/probe.parquet", "0001/credit.parquet", "0001/eval.parquet", "baseline_eval.parquet"):
        meta = {k.decode(): v.decode() for k, v in pq.read_schema(ran / "data" / "iters" / name).metadata.items()}
        assert meta["tpgrpo.stage"] and not {"tpgrpo.python_version", "tpgrpo.torch_version"} & set(meta), name


def test_the_summary_reads_each_stages_seconds_from_its_sidecar(ran):
    from tpgrpo.reports.history import history
    from tpgrpo.config import load_config

    frame = history(load_config(ran / "params.yaml"), ran).set_index("iteration")
    for stage in STAGES:
        want = json.loads(timing_path(ran / "data" / "iters" / "0001" / f"{stage}.json").read_text())["wall_seconds"]
        assert frame.loc[1, f"{stage}_wall_seconds"] == pytest.approx(want)


def test_seconds_come_from_the_sidecar_else_from_an_older_log(tmp_path):
    d = tmp_path / "data" / "iters" / "0001"
    write_log(d / "rollout.json", {"iteration": 1, "wall_seconds": 3.5, "processes": 2})
    write_log(d / "credit.json", {"iteration": 1, "wall_seconds": 0.5})
    write_log(d / "update.json", {"iteration": 1, "wall_seconds": 6.0})
    (d / "probe.json").write_text(json.dumps({"iteration": 1, "wall_seconds": 2.0}))  # written before the sidecar
    assert json.loads((d / "rollout.json").read_text()) == {"iteration": 1}
    assert stage_seconds(d, "rollout") == 3.5 and stage_seconds(d, "probe") == 2.0
    assert train_seconds(tmp_path, 1) == [12.0]
    (d / "credit.json").write_text(json.dumps({"iteration": 1}))
    timing_path(d / "credit.json").unlink()
    with pytest.raises(Exception, match="credit.json: no wall_seconds in it or in credit.timing.json"):
        log_seconds(d / "credit.json")


@pytest.mark.slow
def test_a_stage_rerun_by_hand_in_a_finished_run_leaves_dvc_nothing_to_do(tmp_path, tiny_model_dir):
    """The issue's headline end to end: a finished run (iterations 1-4 a sealed block, 5 open); each stage
    re-run by hand, the eval of the sealed block's iteration 4 among them, leaves `dvc status` clean, `dvc repro
    --dry` with nothing to run and `tpgrpo run` with nothing to do. Before: every hand run changed its log
    (wall_seconds), and the uncached eval logs made DVC re-run the whole `tpgrpo block`."""
    import subprocess
    import sys

    from test_dvc_pipeline import env, ran, sealed_run, tpgrpo_run

    root = sealed_run(make_tiny_project(tmp_path / "project", tiny_model_dir), iterations=5, block_size=4)
    dvc = lambda *args: subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=env(),  # noqa: E731
                                       capture_output=True, text=True)
    for name, iteration in [("eval", 4), ("credit", 2), *((s, 5) for s in STAGES)]:
        hand = subprocess.run([sys.executable, "-m", "tpgrpo", "stage", name, "--iter", str(iteration)], cwd=root,
                              env=env(), capture_output=True, text=True)
        assert hand.returncode == 0, hand.stdout[-2000:] + hand.stderr[-2000:]
        status = dvc("status")
        assert status.returncode == 0 and "up to date" in status.stdout, f"{name} {iteration}: {status.stdout}"
    dry = dvc("repro", "--dry")
    assert dry.returncode == 0 and ran(dry.stdout) == set(), dry.stdout
    again = tpgrpo_run(root)
    assert again.returncode == 0 and ran(again.stdout) == set(), again.stdout[-3000:]
