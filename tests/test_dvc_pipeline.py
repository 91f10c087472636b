"""The whole pipeline through the real `dvc repro` on a tiny project (slow: minutes, CI runs it)."""

from __future__ import annotations

import json

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest
import yaml
from conftest import make_tiny_project

pytestmark = pytest.mark.slow


def env() -> dict:
    e = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    return e


def tpgrpo_run(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=root, env=env(),
                          capture_output=True, text=True)


def sealed_run(root: Path, iterations: int, block_size: int) -> Path:
    """``root``'s tiny project trained by ``tpgrpo run`` to ``iterations`` in blocks of ``block_size`` (its
    first block sealed)."""
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"].update({"iterations": iterations, "block_size": block_size})
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    first = tpgrpo_run(root)
    assert first.returncode == 0 and f"sealed iters-0001-{block_size:04d}" in first.stdout, first.stdout[-3000:]
    return root


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


def check_user_views(root: Path) -> None:
    """After a run: the figures exist, `dvc metrics show` is one short row, `dvc plots show` draws the named
    charts, `tpgrpo status` and re-running the last iteration's credit work as documented."""
    from PIL import Image

    from tpgrpo.pipeline.rendering.dvcfile import PLOTS
    from tpgrpo.reports.figures import FIGURES

    for name in FIGURES:
        with Image.open(root / "data" / "reports" / name) as image:
            assert image.format == "PNG" and min(image.size) > 100
    shown = subprocess.run([sys.executable, "-m", "dvc", "metrics", "show"], cwd=root, env=env(),
                           capture_output=True, text=True)
    lines = [line for line in shown.stdout.splitlines() if line.strip()]
    assert shown.returncode == 0 and len(lines) == 7 and max(map(len, lines)) <= 90, shown.stdout  # a small table
    assert lines[0].split() == ["Path", "base", "best", "best_at", "latest", "mean"], shown.stdout
    plots = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "-o", str(root / "plots_page")],
                           cwd=root, env=env(), capture_output=True, text=True)
    page = (root / "plots_page" / "index.html").read_text()
    assert plots.returncode == 0 and all(next(iter(p)) in page for p in PLOTS), plots.stdout + plots.stderr
    status = subprocess.run([sys.executable, "-m", "tpgrpo", "status"], cwd=root, env=env(), capture_output=True,
                            text=True)
    assert status.returncode == 0 and status.stdout.startswith("iterations: 2 of 2 done (1-2)"), status.stdout
    check_declared_outputs(root, (1, 2))
    before = (root / "data" / "iters" / "0002" / "credit.parquet").read_bytes()
    again = subprocess.run([sys.executable, "-m", "tpgrpo", "stage", "credit", "--iter", "2"], cwd=root, env=env(),
                           capture_output=True, text=True)
    assert again.returncode == 0 and (root / "data" / "iters" / "0002" / "credit.parquet").read_bytes() == before
    beyond = subprocess.run([sys.executable, "-m", "tpgrpo", "stage", "credit", "--iter", "3"], cwd=root, env=env(),
                            capture_output=True, text=True)
    assert beyond.returncode == 2 and "this run has iterations 1..2" in beyond.stderr


def check_declared_outputs(root: Path, iterations) -> None:
    """Each iteration folder holds exactly what tpgrpo.stage_params.ITERATION_STAGES declares, and the logs'
    timing sidecars: a stage that wrote an undeclared file, or a declared file no stage writes, fails here."""
    from tpgrpo.io.stage_logs import timing_path
    from tpgrpo.stage_params import ITERATION_OUTPUTS

    declared = {out.name for out in ITERATION_OUTPUTS.values()}
    sidecars = {timing_path(Path(name)).name for name in declared if name.endswith(".json")}
    for i in iterations:
        assert {p.name for p in (root / "data" / "iters" / f"{i:04d}").iterdir()} == declared | sidecars


def test_repro_trains_then_reruns_only_what_changed(tiny_project):
    root = tiny_project
    first = tpgrpo_run(root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    assert (root / "data" / "metrics" / "history.csv").is_file()
    # the held-out prompts were encoded once (eval_prompts) and every eval and the baseline read them
    assert (root / "data" / "iters" / "eval_prompt_embeds" / "chunk_0000.safetensors").is_file()
    assert {"eval_prompts", "baseline", "eval-0001"} <= ran(first.stdout)  # (the stages' output is captured)
    assert "encoding chunk" not in first.stdout + first.stderr
    assert ran(repro(root)) == set()  # nothing changed: nothing runs
    check_user_views(root)
    # The by-hand credit re-run rewrote credit.parquet byte for byte and its log (an output) with a new wall
    # time: DVC redoes (or restores from its run cache) that credit stage and the summary, nothing after it.
    assert ran(repro(root)) <= {"credit-0001", "summary"}

    set_param(root, "credit", "mode", "tp_unconstrained")
    rerun = ran(repro(root))
    assert "credit-0001" in rerun and "update-0001" in rerun  # not the probe: scored either way
    assert "probe-0001" not in rerun
    assert not any(name.startswith(("rollout-0001", "baseline")) for name in rerun)

    set_param(root, "credit", "mode", "flow_grpo")  # the same stages: the probe loads no model, Q_k = R_fin
    switched = tpgrpo_run(root)
    assert switched.returncode == 0, switched.stderr[-3000:]
    rerun = ran(switched.stdout)
    assert {"probe-0001", "credit-0001", "update-0001"} <= rerun
    assert not any(name.startswith(("rollout-0001", "baseline")) for name in rerun)
    assert json.loads((root / "data" / "iters" / "0001" / "probe.json").read_text())["forward_passes"] == 0

    set_param(root, "train", "iterations", 3)
    more = tpgrpo_run(root)
    assert more.returncode == 0, more.stderr[-3000:]
    assert ran(more.stdout) == {"code", "rollout-0003", "probe-0003", "credit-0003", "update-0003", "eval-0003",
                                "summary"}  # code: it checks dvc.yaml against train.iterations


@pytest.fixture(scope="module")
def clean(tmp_path_factory, tiny_model_dir) -> Path:
    """An uninterrupted run of the tiny project, to compare interrupted runs with."""
    root = make_tiny_project(tmp_path_factory.mktemp("clean") / "project", tiny_model_dir)
    assert tpgrpo_run(root).returncode == 0
    return root


@pytest.mark.parametrize("victim", ["rollout-0002", "update-0001"])
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
    for i in (1, 2):
        assert artifacts(root, i) == artifacts(clean, i)
        a, b = adapter(root, i), adapter(clean, i)
        assert a.keys() == b.keys() and all(torch.allclose(a[k], b[k], atol=1e-6) for k in a)


VEGA_PACKAGES = ("vega@5.20.2", "vega-lite@5.2.0", "vega-embed@6.18.2")  # what dvc_render's page loads from a CDN


def local_vega(folder: Path) -> dict[str, Path]:
    """The page's three scripts as local files (``npm pack`` from the npm registry; the CDN is unreachable)."""
    folder.mkdir(parents=True, exist_ok=True)
    scripts = {}
    for spec in VEGA_PACKAGES:
        name = spec.split("@")[0]
        subprocess.run(["npm", "pack", spec, "--silent"], cwd=folder, check=True, capture_output=True, timeout=300)
        tgz = next(folder.glob(f"{name}-[0-9]*.tgz"))
        subprocess.run(["tar", "xzf", str(tgz), "-C", str(folder), "--one-top-level=" + name], check=True)
        scripts[spec] = folder / name / "package" / "build" / f"{name}.min.js"
    return scripts


def test_dvc_plots_page_renders_its_named_charts_in_headless_chromium(clean, tmp_path):
    import re
    import shutil

    from PIL import Image

    from tpgrpo.pipeline.rendering.dvcfile import PLOTS

    chromium = shutil.which("chromium") or shutil.which("chromium-browser")
    if chromium is None:
        pytest.skip("Chromium is not installed (Debian: apt-get install chromium), so the page is not rendered")
    if shutil.which("npm") is None:
        pytest.skip("npm is not installed: the page's vega scripts (a CDN, unreachable here) cannot be fetched")
    out = subprocess.run([sys.executable, "-m", "dvc", "plots", "show", "-o", str(tmp_path / "page")], cwd=clean,
                         env=env(), capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    page = tmp_path / "page" / "index.html"
    html = page.read_text()
    for spec, local in local_vega(tmp_path / "vega").items():
        html = html.replace(f"https://cdn.jsdelivr.net/npm/{spec}", local.as_uri())
    assert "cdn.jsdelivr" not in html
    page.write_text(html)
    flags = [chromium, "--headless", "--no-sandbox", "--disable-gpu", "--virtual-time-budget=15000"]
    dom = subprocess.run([*flags, "--dump-dom", page.as_uri()], capture_output=True, text=True, timeout=120).stdout
    drawn = re.findall(r'<canvas[^>]*class="marks"', dom)
    assert len(drawn) == len(PLOTS), f"{len(drawn)} charts drawn of {len(PLOTS)}"
    shot = tmp_path / "page.png"
    subprocess.run([*flags, f"--screenshot={shot}", "--window-size=1100,2600", page.as_uri()], capture_output=True,
                   timeout=120)
    pixels = np.asarray(Image.open(shot).convert("RGB")).astype(int)
    # The series lines are the only saturated colour on the page (axes, grid and text are grey or black).
    coloured = int((pixels.max(axis=2) - pixels.min(axis=2) > 60).sum())
    assert coloured > 300 * len(PLOTS), f"only {coloured} coloured pixels: the charts' lines did not draw"
