"""Rendering beside a running repro: `tpgrpo run` and `tpgrpo dvc-yaml` rewrite dvc.yaml, the block
files and the manifests, so while a DVC command runs in the project, or another `tpgrpo run` holds the
project's run lock, they stop with one line and write nothing."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml
from conftest import make_tiny_project
from test_dvc_pipeline import env

# A stage with an output, as every pipeline stage has: DVC's rwlock names the repro's PID for it while it runs.
SLEEPER = {"stages": {"sleep": {"cmd": f"{sys.executable} -c \"import pathlib, time; pathlib.Path('started').touch(); "
                                       "time.sleep(120); pathlib.Path('slept').touch()\"", "outs": ["slept"]}}}


def _tpgrpo(root: Path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpgrpo", *args], cwd=root, env=env(), capture_output=True,
                          text=True, timeout=300)


def _wait_for(path: Path, proc: subprocess.Popen, what: str) -> None:
    """Until ``path`` exists (an event, not a fixed delay); fails if ``proc`` ended first."""
    while not path.exists():
        assert proc.poll() is None, f"{what} ended before {path.name} appeared: {proc.stdout.read()[-2000:]}"
        time.sleep(0.05)


def _project(tmp_path: Path, model_dir: Path) -> Path:
    root = make_tiny_project(tmp_path / "project", model_dir)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=root, env=env(), check=True)
    return root


def _refused(done: subprocess.CompletedProcess, *expected: str) -> None:
    lines = done.stderr.strip().splitlines()
    assert done.returncode == 2 and len(lines) == 1 and all(e in lines[0] for e in expected), (
        done.returncode, done.stdout[-2000:], done.stderr[-2000:])


def test_run_and_dvc_yaml_refuse_while_dvc_repro_runs_a_stage(tmp_path, tiny_model_dir):
    """A real `dvc repro` whose stage sleeps: DVC has released its repository lock while the stage runs and
    names itself in .dvc/tmp/rwlock. Before, both commands rewrote dvc.yaml under it (and `tpgrpo run` the
    manifests)."""
    root = _project(tmp_path, tiny_model_dir)
    (root / "dvc.yaml").write_text(yaml.safe_dump(SLEEPER))
    before = (root / "dvc.yaml").read_bytes()
    repro = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env(), stdout=subprocess.PIPE,
                             stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        _wait_for(root / "started", repro, "dvc repro")
        for command in ("dvc-yaml", "run"):
            _refused(_tpgrpo(root, command), "is running a stage in this project", str(repro.pid))
            assert (root / "dvc.yaml").read_bytes() == before, command
            assert not (root / "data" / "code").exists(), command  # no manifest written either
    finally:
        os.killpg(repro.pid, signal.SIGTERM)
        repro.wait(timeout=60)
    done = _tpgrpo(root, "dvc-yaml")  # DVC is gone: the same command goes ahead
    assert done.returncode == 0 and "dvc.yaml updated" in done.stdout, done.stderr
    assert "rollout-0001" in yaml.safe_load((root / "dvc.yaml").read_text())["stages"]


def test_dvc_yaml_refuses_while_a_tpgrpo_run_holds_the_run_lock(tmp_path, tiny_model_dir):
    """Between its repros `tpgrpo run` holds no DVC lock but renders the next block: it holds the project's
    run lock for the whole run, and a second `tpgrpo run` or `tpgrpo dvc-yaml` is refused meanwhile."""
    root = _project(tmp_path, tiny_model_dir)
    before = (root / "dvc.yaml").read_bytes() if (root / "dvc.yaml").exists() else None
    holder = subprocess.Popen(
        [sys.executable, "-c", "import pathlib, time\nfrom tpgrpo.pipeline.dvc_integration.dvclock import rendering\n"
         "with rendering(pathlib.Path('.').resolve()):\n    pathlib.Path('held').touch()\n    time.sleep(120)\n"],
        cwd=root, env=env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for(root / "held", holder, "the run lock's holder")
        for command in ("dvc-yaml", "run"):
            _refused(_tpgrpo(root, command), ".dvc/tmp/tpgrpo_run.lock", f"PID {holder.pid}")
            assert ((root / "dvc.yaml").read_bytes() if (root / "dvc.yaml").exists() else None) == before, command
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait(timeout=60)
    assert _tpgrpo(root, "dvc-yaml").returncode == 0  # released with its holder
