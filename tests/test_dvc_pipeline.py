"""The whole pipeline through the real `dvc repro` on a tiny project (slow: minutes, CI runs it)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_project

pytestmark = pytest.mark.slow


def env() -> dict:
    e = dict(os.environ, DVC_NO_ANALYTICS="1")
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    return e


def tpgrpo_run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=root, env=env(),
                          capture_output=True, text=True)


def repro(root: Path) -> str:
    out = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    return out.stdout


def ran(output: str) -> set[str]:
    return {line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")}


def set_param(root: Path, section: str, key: str, value) -> None:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw[section][key] = value
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def artifacts(root: Path, iteration: int) -> dict[str, bytes]:
    d = root / "data" / "iters" / f"{iteration:04d}"
    return {name: (d / name).read_bytes() for name in ("probe.parquet", "credit.parquet")}


def adapter(root: Path, iteration: int) -> dict:
    from safetensors.torch import load_file

    return load_file(root / "data" / "iters" / f"{iteration:04d}" / "policy" / "pytorch_lora_weights.safetensors")


def test_repro_trains_then_reruns_only_what_changed(tiny_project):
    root = tiny_project
    first = tpgrpo_run(root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (root / "data" / "metrics" / "history.csv").is_file()
    assert ran(repro(root)) == set()  # nothing changed: nothing runs

    set_param(root, "credit", "mode", "flow_grpo")
    rerun = ran(repro(root))
    assert "credit-0000" in rerun and "update-0000" in rerun
    assert not any(name.startswith(("rollout-0000", "probe-0000", "baseline")) for name in rerun)

    set_param(root, "train", "iterations", 3)
    more = tpgrpo_run(root)
    assert more.returncode == 0, more.stderr[-3000:]
    assert ran(more.stdout) == {"rollout-0002", "probe-0002", "credit-0002", "update-0002", "eval-0002", "summary"}


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_model_dir) -> Path:
    """An uninterrupted run of the tiny project, to compare interrupted runs with."""
    root = make_tiny_project(tmp_path_factory.mktemp("clean") / "project", tiny_model_dir)
    assert tpgrpo_run(root).returncode == 0
    return root


@pytest.mark.parametrize("victim", ["rollout-0001", "update-0000"])
def test_sigkill_mid_stage_then_rerun_matches_uninterrupted(tiny_project, tmp_path, clean, victim):
    import torch

    root = tiny_project
    subprocess.run([sys.executable, "-m", "tpgrpo", "dvc-yaml"], cwd=root, env=env(), check=True)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=root, env=env(), check=True)
    log = open(tmp_path / "repro.log", "w")
    proc = subprocess.Popen([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env(), stdout=log,
                            stderr=subprocess.STDOUT, start_new_session=True)
    deadline = time.time() + 600
    while f"Running stage '{victim}'" not in (tmp_path / "repro.log").read_text():
        assert proc.poll() is None and time.time() < deadline, "stage never started"
        time.sleep(0.2)
    time.sleep(3.0)  # into the stage's work (model loaded, sampling or training)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    assert repro(root)  # the rerun finishes
    for i in (0, 1):
        assert artifacts(root, i) == artifacts(clean, i)
        a, b = adapter(root, i), adapter(clean, i)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)
