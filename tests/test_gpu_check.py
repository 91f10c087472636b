"""bench/gpu_check.py's pieces that run without a GPU: the project it makes, the timed stage commands it runs
(1 and 2 processes), and the kill of a running stage."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import yaml

from bench import gpu_check

REPO = Path(__file__).resolve().parents[1]


def _project(tmp_path, processes: int) -> Path:
    return gpu_check.make_project(tmp_path / "project", "cuda", smoke=True, processes=processes)


def test_the_project_runs_two_ema_iterations(tmp_path):
    params = yaml.safe_load(_project(tmp_path, 2).read_text())
    assert params["update"]["ema"] is True and params["train"]["iterations"] == 2
    assert params["launch"]["num_processes"] == 2 and params["model"]["device"] == "cuda"


def test_timed_commands_are_the_stage_commands_through_the_timer(tmp_path):
    timer = [str(REPO / "bench" / "stage_timer.py"), "--timings", "t.json"]
    one = _project(tmp_path / "a", 1)
    assert gpu_check.timed_command(one, "update", 2, Path("t.json")) == [
        sys.executable, *timer, "stage", "update", "--iter", "2", "--params", str(one)]
    two = _project(tmp_path / "b", 2)
    command = gpu_check.timed_command(two, "update", 2, Path("t.json"))
    assert command[:3] == [sys.executable, "-m", "accelerate.commands.launch"]
    assert command[command.index("--num_processes") + 1] == "2"
    assert command[-9:] == [*timer, "stage", "update", "--iter", "2", "--params", str(two)]
    credit = gpu_check.timed_command(two, "credit", 2, Path("t.json"))  # a single-process stage
    assert credit[:2] == [sys.executable, timer[0]]


def test_kill_step_kills_at_the_marker_and_refuses_a_command_that_ended(tmp_path):
    marker = tmp_path / "loaded"
    sleeper = f"import pathlib, time; time.sleep(1); pathlib.Path({str(marker)!r}).touch(); time.sleep(60)"
    row = gpu_check.kill_step("sleeper", [sys.executable, "-c", sleeper], marker, 50.0)
    assert row["ok"] and row["note"] == "killed after its model load" and 1 <= row["seconds"] < 30
    row = gpu_check.kill_step("quick", [sys.executable, "-c", "pass"], tmp_path / "never", 30.0)
    assert not row["ok"] and "before the kill" in row["error"]


@pytest.mark.slow
def test_the_held_weights_step_passes_on_the_cpu_and_reads_the_servers_log(tmp_path):
    """Step 2 on the CPU (what the GPU check runs on cuda): the forked load gets the weights a load from disk
    gets, and the smoke `tpgrpo run` forks its rollout and update from the server that held the model."""
    gpu_check._DEADLINE[0] = float("inf")
    forked, run = gpu_check.resident_check("cpu", tmp_path)
    assert forked["ok"] and forked["note"].startswith("per stage, median of 3"), forked
    assert run["ok"] and run["note"] == "forked from the holder: rollout, update", run
    log = (tmp_path / "resident" / ".dvc" / "tmp" / "stage_server.log").read_text()
    assert "model held: tiny " in log
