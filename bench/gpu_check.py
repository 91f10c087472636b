"""GPU check: one CLI iteration of the embedded model on a GPU, then the SD3.5-M cost at full size.

    python bench/gpu_check.py                        # a machine with one CUDA GPU; under 8 minutes
    python bench/gpu_check.py --device cpu --smoke   # the plumbing only, at tiny size, on a CPU

1. Pipeline: copies ``params.yaml``, ``data/base`` (the embedded model) and ``data/prompts`` into a temporary
   project with ``model.device`` and ``reward_models.device`` set to ``--device`` and ``eval.every: 1`` (so
   the iteration is evaluated), then runs ``tpgrpo stage rollout|probe|credit|update|eval --iter 1`` through
   the CLI, one process per stage as ``dvc repro`` would, and a 2-step ``tpgrpo pretrain --device``. Each
   must exit 0 and write its artifacts. ``--smoke`` also shrinks the iteration (2 prompts x 4 samples, T = 4).
2. Cost: ``bench/bench_sd3.py --full`` (SD3.5-M config, random weights, 512 px, bf16, T = 10, window 9;
   ``--smoke``: 1 block at 64 px) for seconds per trajectory and peak memory of rollout, probe and update.

Prints one summary table and ``gpu_check: ok`` (exit 0), or what failed (exit 1). Without CUDA, ``--device
cuda`` prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
STAGES = ("rollout", "probe", "credit", "update", "eval")
ARTIFACTS = {"rollout": ("trajectories.zarr", "rollout.json"), "probe": ("probe.parquet", "probe.json"),
             "credit": ("credit.parquet", "credit.json"), "update": ("policy", "update.json"),
             "eval": ("eval.json",)}
# --smoke: an iteration small enough for a CPU (the full check runs params.yaml's own sizes).
SMOKE_PARAMS = {"sampling": {"num_steps": 4, "window_size": 3},
                "rollout": {"prompts_per_iter": 2, "group_size": 4, "batch_size": 8},
                "probe": {"batch_size": 16}, "update": {"micro_batch": 8},
                "eval": {"num_steps": 4, "num_prompts": 2, "samples_per_prompt": 1}}
BUDGET_S = {"stage": 150, "pretrain": 90, "bench": 330}  # ceilings per step (seconds)
TOTAL_S = 470.0  # and for the whole check: it must end within 8 minutes
_DEADLINE = [time.monotonic() + TOTAL_S]


def check_device(device: str) -> str | None:
    """None when ``device`` is usable, else the one-line reason."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return (f"gpu_check: no CUDA device available (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda}); run `python bench/gpu_check.py --device cpu --smoke` to check the plumbing")
    return None


def make_project(root: Path, device: str, smoke: bool) -> Path:
    """A temporary project: params (device, eval every iteration, smoke sizes), the model and the prompts."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    overrides = {"model": {"device": device}, "reward_models": {"device": device}, "eval": {"every": 1}}
    for section_values in ((SMOKE_PARAMS if smoke else {}), overrides):
        for section, values in section_values.items():
            params[section].update(values)
    for name in ("base", "prompts"):
        shutil.copytree(REPO / "data" / name, root / "data" / name)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root / "params.yaml"


def run_step(label: str, command: list[str], timeout: float) -> dict:
    """Run one command from the repo root; ``{label, ok, seconds, error}`` (error: its last output line)."""
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true", PYTHONPATH=str(REPO), PYTHONUNBUFFERED="1")
    timeout = min(timeout, _DEADLINE[0] - time.monotonic())
    if timeout < 5:
        return {"label": label, "ok": False, "seconds": 0.0, "error": f"not run: the check's {TOTAL_S:.0f} s are spent"}
    start = time.perf_counter()
    try:
        done = subprocess.run(command, cwd=REPO, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"label": label, "ok": False, "seconds": round(time.perf_counter() - start, 1),
                "error": f"timed out after {timeout:.0f} s"}
    seconds = round(time.perf_counter() - start, 1)
    lines = [line for line in (done.stderr + done.stdout).splitlines() if line.strip()]
    error = None if done.returncode == 0 else f"exit {done.returncode}: {lines[-1] if lines else '(no output)'}"
    return {"label": label, "ok": done.returncode == 0, "seconds": seconds, "error": error, "stdout": done.stdout}


def stage_note(name: str, folder: Path) -> str:
    """The figure worth reading off a stage's metrics JSON."""
    metrics = json.loads((folder / f"{name}.json").read_text())
    if name == "rollout":
        return f"mean reward {metrics['mean_reward']:.3f}, {metrics['trajectories']} trajectories"
    if name == "probe":
        return f"{metrics['forward_passes']} forward passes"
    if name == "credit":
        return f"turning-point rate {metrics.get('turning_point_rate', float('nan')):.3f}"
    if name == "update":
        return (f"first-pass |ratio - 1| {metrics['first_pass_ratio_max_dev']:.1e}, "
                f"approx KL after {metrics['approx_kl_after']:.1e}")
    return f"evaluated {metrics.get('evaluated')}, eval reward {metrics.get('eval_reward', float('nan')):.3f}"


def pipeline_check(device: str, smoke: bool, tmp: Path) -> list[dict]:
    """Step 1: the iteration's stages and a short pretraining, each through the CLI in its own process."""
    params = make_project(tmp / "project", device, smoke)
    folder = tmp / "project" / "data" / "iters" / "0001"
    rows = []
    for name in STAGES:
        row = run_step(f"stage {name}", [sys.executable, "-m", "tpgrpo", "stage", name, "--iter", "1",
                                          "--params", str(params)], BUDGET_S["stage"])
        missing = [a for a in ARTIFACTS[name] if not (folder / a).exists()]
        if row["ok"] and missing:
            row.update(ok=False, error=f"exit 0 but no {', '.join(missing)} in {folder}")
        row["note"] = stage_note(name, folder) if row["ok"] else ""
        rows.append(row)
        if not row["ok"]:
            return rows  # later stages need this one's artifacts
    out = tmp / "pretrained"
    row = run_step("pretrain", [sys.executable, "-m", "tpgrpo", "pretrain", "--steps", "2", "--batch-size", "8",
                                "--device", device, "--out-dir", str(out)], BUDGET_S["pretrain"])
    if row["ok"] and not (out / "tpgrpo_model.json").is_file():
        row.update(ok=False, error=f"exit 0 but no model in {out}")
    row["note"] = "2 steps, model saved" if row["ok"] else ""
    return rows + [row]


def bench_check(device: str, smoke: bool, tmp: Path) -> tuple[dict, dict | None]:
    """Step 2: bench_sd3.py at full size (or its smoke size); its figures or None."""
    out = tmp / "bench.json"
    size = ["--device", device, "--smoke"] if smoke else ["--full"]
    row = run_step("bench_sd3", [sys.executable, str(REPO / "bench" / "bench_sd3.py"), *size, "--out", str(out)],
                   BUDGET_S["bench"])
    figures = json.loads(out.read_text()) if row["ok"] and out.is_file() else None
    if row["ok"] and figures is None:
        row.update(ok=False, error=f"exit 0 but no {out}")
    return row, figures


def summary(rows: list[dict], figures: dict | None, device: str) -> str:
    lines = [f"gpu_check on {device}", "| step | ok | seconds | note |", "|---|---|---|---|"]
    lines += [f"| {r['label']} | {'yes' if r['ok'] else 'NO'} | {r['seconds']} | {r.get('note') or r['error'] or ''} |"
              for r in rows]
    if figures:
        lines += ["", f"SD3.5-M bench: {figures['device']}, {figures['dtype']}, {figures['resolution']} px, "
                      f"{figures['layers']} blocks ({figures['transformer_parameters'] / 1e9:.2f}B), "
                      f"T = {figures['steps']}, window {figures['window']}, {figures['trajectories']} trajectories, "
                      f"build {figures['build_s']} s",
                  "| phase | s / trajectory | peak memory GiB |", "|---|---|---|"]
        lines += [f"| {p} | {figures[f'{p}_s_per_trajectory']:.2f} | {figures[f'{p}_peak_gib']:.2f} |"
                  for p in ("rollout", "probe", "update")]
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--device", default="cuda", help="torch device (default cuda)")
    parser.add_argument("--smoke", action="store_true", help="tiny sizes: checks the plumbing, e.g. on a CPU")
    parser.add_argument("--out", type=Path, default=None, help="also write the summary as JSON here")
    args = parser.parse_args()
    reason = check_device(args.device)
    if reason:
        print(reason)
        return 2
    start = time.perf_counter()
    _DEADLINE[0] = time.monotonic() + TOTAL_S
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        rows = pipeline_check(args.device, args.smoke, Path(tmp))
        bench_row, figures = bench_check(args.device, args.smoke, Path(tmp))
    rows.append(bench_row)
    print(summary(rows, figures, args.device))
    failed = [r["label"] for r in rows if not r["ok"]]
    total = round(time.perf_counter() - start, 1)
    if args.out:
        args.out.write_text(json.dumps({"device": args.device, "smoke": args.smoke, "seconds": total,
                                        "steps": [{k: v for k, v in r.items() if k != "stdout"} for r in rows],
                                        "bench": figures}, indent=2) + "\n")
    print(f"gpu_check: {'FAILED: ' + ', '.join(failed) if failed else 'ok'} ({total} s)")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
