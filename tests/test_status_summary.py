"""`tpgrpo status`, the summary's headline numbers and curves, and what dvc.yaml gives `dvc metrics/plots`."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pandas as pd
import pytest
import yaml

from conftest import tiny_params
from tpgrpo.reports.history import at_a_glance, eval_curve, headline, train_curve
from tpgrpo.stage_params import GLANCE
from tpgrpo.config import config_from_dict
from tpgrpo.pipeline.rendering.dvcfile import PLOTS, render
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.status import check_iteration, record_stage, status_text


def fake_iteration(root, i, evaluated=False, reward=0.5, stages=("rollout", "probe", "credit", "update", "eval")):
    folder = root / "data" / "iters" / f"{i:04d}"
    folder.mkdir(parents=True, exist_ok=True)
    for stage in stages:
        payload = {"iteration": i}
        if stage == "eval":
            payload.update(evaluated=evaluated, eval_reward=reward, eval_strict_accuracy=reward / 10)
        (folder / f"{stage}.json").write_text(json.dumps(payload))
    (folder / "blob.bin").write_bytes(b"x" * 1024 * 1024)


def test_status_names_done_iterations_the_last_stage_reward_and_disk(tmp_path):
    root = tmp_path
    (root / "data" / "iters").mkdir(parents=True)
    (root / "data" / "iters" / "baseline_eval.json").write_text(
        json.dumps({"eval_reward": 0.4, "eval_strict_accuracy": 0.05}))
    for i in (1, 2, 3):
        fake_iteration(root, i, evaluated=(i == 2), reward=0.45)
    fake_iteration(root, 4, stages=("rollout", "probe"))
    fake_iteration(root, 6)
    record_stage(root, "probe", 7, "failed", "missing input data/iters/0007/trajectories.zarr")
    text = status_text(root, planned=12)
    lines = text.splitlines()
    assert lines[0] == "iterations: 4 of 12 done (1-3, 6)"
    assert "iteration 4: partly done (rollout)" in lines[1]
    assert "probe --iter 7: failed" in text and "error: missing input" in text
    assert "base 0.400 (strict 0.050) -> iteration 2: 0.450 (strict 0.045), +0.050" in text
    assert "disk: 5.0 MB in 5 iteration folders" in text
    assert len(lines) <= 12  # one screen
    assert "sealed" not in text
    for name in ("0001-0002.yaml", "0003-0004.yaml"):  # two sealed blocks
        (root / "data" / "seals").mkdir(exist_ok=True)
        (root / "data" / "seals" / name).write_text("outs: []\n")
    assert "dvc: iterations 1-4 sealed in 2 block stages" in status_text(root, planned=12)


def test_status_says_a_running_stage_whose_process_is_gone_was_killed(tmp_path):
    record_stage(tmp_path, "update", 3, "running")
    path = tmp_path / "data" / ".last_stage.json"
    payload = json.loads(path.read_text())
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    payload["pid"] = dead.pid
    path.write_text(json.dumps(payload))
    assert "update --iter 3: killed (its process is gone)" in status_text(tmp_path, planned=3)
    payload["pid"] = os.getpid()  # alive
    path.write_text(json.dumps(payload))
    assert "update --iter 3: running" in status_text(tmp_path, planned=3)


@pytest.mark.parametrize("iteration", [0, 13, -2])
def test_an_iteration_outside_the_run_is_refused_naming_the_run(tmp_path, iteration):
    fake_iteration(tmp_path, 1)
    fake_iteration(tmp_path, 2)
    cfg = config_from_dict(tiny_params(train={"iterations": 12}))
    with pytest.raises(PipelineError, match=rf"--iter {iteration}: this run has iterations 1\.\.12 .*finished: 1-2\)$"):
        check_iteration(cfg, tmp_path, iteration)
    check_iteration(cfg, tmp_path, 12)  # in range: no error (the stage itself says what is missing)


def history_frame() -> pd.DataFrame:
    nan = float("nan")
    return pd.DataFrame({
        "iteration": [0, 1, 2, 3, 4],
        "eval_eval_reward": [0.40, nan, 0.47, nan, 0.45], "eval_eval_strict_accuracy": [0.05, nan, 0.09, nan, 0.1],
        "eval_train_reward": [0.30, nan, 0.35, nan, 0.36],
        "rollout_mean_reward": [nan, 0.31, 0.33, 0.34, 0.36], "credit_turning_point_rate": [nan, 0.1, 0.2, 0.1, 0.05],
        "update_approx_kl_after": [nan, 1e-5, 2e-5, 3e-5, 4.123456e-5],
        **{f"{s}_wall_seconds": [nan, 10.0, 12.0, 10.0, 12.0] for s in ("rollout", "probe", "credit", "update")},
        "eval_wall_seconds": [5.0, nan, 6.0, nan, 6.0],
    })


def test_headline_numbers_are_base_latest_best_and_the_latest_training_figures():
    frame = history_frame()
    evals, train = eval_curve(frame), train_curve(frame)
    assert evals["iteration"].tolist() == [0, 2, 4]  # base + evaluated iterations only
    assert train["iteration"].tolist() == [1, 2, 3, 4]
    assert train["wall_seconds"].tolist() == [40.0, 54.0, 40.0, 54.0]  # every stage's wall, eval when it ran
    head = headline(evals, train)
    assert head["held_out"] == {"base": 0.4, "latest": 0.45, "best": 0.47, "best_iter": 2}
    assert head["strict"] == {"base": 0.05, "latest": 0.1, "best": 0.1, "best_iter": 4}
    assert head["train_reward"] == 0.36 and head["tp_rate"] == 0.05 and head["approx_kl"] == 4.12e-5
    assert head["iterations"] == 4 and head["s_per_iter"] == 47.0
    glance = at_a_glance(evals, train)
    assert list(glance) == list(GLANCE)
    assert glance["held_out"] == {"base": 0.4, "latest": 0.45, "best": 0.47, "best_at": 2}
    assert glance["train_reward"] == {"base": 0.31, "latest": 0.36, "best": 0.36, "best_at": 4}
    assert glance["strict"] == {"base": 0.05, "latest": 0.1, "best": 0.1, "best_at": 4}
    assert glance["approx_kl_x1e6"] == {"base": 10.0, "latest": 41.2346, "mean": 25.3086}
    assert glance["seconds_per_iter"] == {"latest": 54.0, "mean": 47.0}


def test_best_strict_accuracy_is_a_policys_when_the_base_beats_every_policy():
    """The best row is the best policy's, and best_at its iteration, even when the base model scores higher."""
    frame = history_frame()
    frame.loc[0, "eval_eval_strict_accuracy"] = 0.3
    glance = at_a_glance(eval_curve(frame), train_curve(frame))
    assert glance["strict"] == {"base": 0.3, "latest": 0.1, "best": 0.1, "best_at": 4}


def test_curves_of_a_flow_grpo_run_which_has_no_probe_columns():
    frame = history_frame().drop(columns=["probe_wall_seconds"])
    assert train_curve(frame)["wall_seconds"].tolist() == [30.0, 42.0, 30.0, 42.0]


def test_dvc_yaml_declares_only_the_summary_as_a_metric_and_named_plots():
    cfg = config_from_dict(tiny_params(train={"iterations": 3}))
    stages = render(cfg)["stages"]
    metrics = [m for stage in stages.values() for m in stage.get("metrics", [])]
    assert metrics == [{f"data/metrics/{name}.json": {"cache": False}} for name in GLANCE]
    assert list(stages) == ["code", "eval_prompts", "baseline", *[f"{n}-{i:04d}" for i in (1, 2, 3)
                                          for n in ("rollout", "probe", "credit", "update", "eval")], "summary"]
    assert "data/iters/0001/policy" in stages["rollout-0002"]["deps"]
    for name in ("baseline", "eval-0001", "eval-0003"):  # the held-out prompts' embeddings, encoded once
        assert "data/iters/eval_prompt_embeds" in stages[name]["deps"], name
    assert stages["eval_prompts"]["outs"][0] == "data/iters/eval_prompt_embeds"  # DVC-cached
    assert not any(d.endswith("/policy") for d in stages["rollout-0001"]["deps"])  # iteration 1 samples the base
    names = [next(iter(p)) for p in render(cfg)["plots"]]
    assert names == [next(iter(p)) for p in PLOTS] and "held_out_reward" in names and "turning_point_rate" in names
    assert yaml.safe_load(yaml.safe_dump(render(cfg)))["plots"] == PLOTS


def _full_disk(monkeypatch):
    """Creating and writing new files fails with ENOSPC as on a full disk (the error names no file, as a
    failed write does); rewriting a file that exists, in place, still works (its blocks are freed first)."""
    import errno
    import pathlib

    def write_text(self, *args, **kwargs):
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(pathlib.Path, "write_text", write_text)


def test_a_stage_failing_on_a_full_disk_is_one_line_naming_the_file_and_status_says_so(tmp_path, monkeypatch,
                                                                                        capsys):
    import stages.credit
    from tpgrpo.cli import run_app
    from tpgrpo.io.artifacts import IterationPaths, write_json

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    record_stage(tmp_path, "update", 1, "done")  # the note of the stage before
    target = IterationPaths(tmp_path, 1).credit_metrics
    monkeypatch.setattr(stages.credit, "run", lambda cfg, iteration, root: write_json(target, {"x": 1}))
    _full_disk(monkeypatch)
    with pytest.raises(SystemExit) as info:
        run_app(["stage", "credit", "--iter", "1", "--params", str(tmp_path / "params.yaml")], "tpgrpo")
    err = capsys.readouterr().err
    assert info.value.code == 2 and err.count("\n") == 1 and "Traceback" not in err, err
    assert err.startswith(f"error: {target}: No space left on device (ENOSPC)"), err
    assert not target.exists() and not [p for p in target.parent.iterdir() if ".tmp-" in p.name]
    text = status_text(tmp_path, planned=2)
    assert "last stage: credit --iter 1: failed" in text and "No space left on device" in text, text


def test_status_never_names_an_older_stage_when_the_last_could_not_record(tmp_path, monkeypatch):
    """A disk so full that even the in-place rewrite of the note fails: the note is left empty and status
    says the last stage is unknown, not that the stage before it was done."""
    import builtins
    import errno

    from tpgrpo.pipeline import status

    record_stage(tmp_path, "update", 1, "done")
    _full_disk(monkeypatch)

    class Full:
        def __init__(self, f):
            self.f = f

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def write(self, text):
            raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(status, "open", lambda path, mode="r": Full(builtins.open(path, mode)), raising=False)
    record_stage(tmp_path, "eval", 1, "failed", "OSError: [Errno 28] No space left on device")
    text = status_text(tmp_path, planned=2)
    assert "update --iter 1: done" not in text
    assert "last stage: unknown (data/.last_stage.json is empty or unreadable" in text, text


def test_a_stage_run_called_directly_sets_the_process_global_dist():
    from tpgrpo import distributed

    assert distributed.current().is_main and distributed._CURRENT is not None  # left for conftest to clear


def test_no_test_starts_with_a_dist_an_earlier_one_left(monkeypatch):
    """The test above left a world-1 ``Dist``: with it, ``is_main_process`` ignored ``RANK`` and the next test
    saw rank 1 note its failure, whenever an earlier test in the same worker had called a stage's ``run``."""
    from tpgrpo import distributed

    assert distributed._CURRENT is None
    monkeypatch.setenv("RANK", "1")
    assert not distributed.is_main_process()


def test_only_the_main_process_notes_a_failed_stage(tmp_path, monkeypatch):
    from typer.testing import CliRunner

    from tpgrpo.cli import app

    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    for rank, noted in (("1", False), ("0", True)):
        monkeypatch.setenv("RANK", rank)
        result = CliRunner().invoke(app, ["stage", "credit", "--iter", "99", "--params", str(tmp_path / "params.yaml")])
        assert result.exit_code == 2 and "--iter 99" in result.output
        assert (tmp_path / "data" / ".last_stage.json").exists() == noted, rank


def test_an_output_dvc_recorded_but_could_not_store_fails_the_run_with_one_line(tmp_path):
    """What DVC leaves when it logs "failed to transfer" (a full disk): the stage recorded in dvc.lock, its
    output's object missing from the cache. Made here by deleting the object after a real `dvc repro`."""
    from tpgrpo.pipeline.status import check_outputs_cached

    env = dict(os.environ, DVC_NO_ANALYTICS="1")
    dvc = [sys.executable, "-m", "dvc"]
    subprocess.run([*dvc, "init", "-q", "--no-scm"], cwd=tmp_path, env=env, check=True)
    (tmp_path / "dvc.yaml").write_text(yaml.safe_dump({"stages": {"make": {
        "cmd": f"{sys.executable} -c \"open('out.txt', 'w').write('hello')\"", "outs": ["out.txt"]}}}))
    subprocess.run([*dvc, "repro", "-q"], cwd=tmp_path, env=env, check=True)
    check_outputs_cached(tmp_path, env)  # all stored: nothing to say
    for obj in (tmp_path / ".dvc" / "cache").rglob("*"):
        if obj.is_file():
            obj.unlink()
    with pytest.raises(PipelineError) as info:
        check_outputs_cached(tmp_path, env)
    message = str(info.value)
    assert message.startswith("dvc repro recorded stages it could not store: make's output out.txt is not in cache")
    assert "\n" not in message
