"""GPU check: two CLI iterations of the embedded model on a GPU (EMA, a kill and a resume, 2 processes where
there are 2 GPUs), the base weights held for GPU stages, then the SD3.5-M cost at full size.

    python -m bench.gpu_check                        # a machine with CUDA GPUs; under 8 minutes (not yet run)
    python -m bench.gpu_check --device cpu --smoke   # the plumbing only, at tiny size, on a CPU

1. Pipeline: copies ``params.yaml``, ``data/base`` (the embedded model) and ``data/prompts`` into a temporary
   project with ``model.device`` and ``reward_models.device`` set to ``--device``, ``eval.every: 1``,
   ``update.ema: true``, 2 iterations and ``launch.num_processes`` = ``--processes`` (default: 2 where
   there are 2 GPUs, else 1), then runs ``tpgrpo stage eval_prompts`` once (the held-out prompts' embeddings
   every eval reads) and each stage's own command (``tpgrpo stage NAME --iter I``, under
   ``accelerate launch`` with 2 processes, as the stage starts them itself) in its own process, timed by
   ``bench/stage_timer.py`` (import / load / compute seconds). Iteration 2's rollout is killed first
   (as soon as it has loaded its model: the run dies after the first update) and must leave no trajectories;
   the resumed iteration 2 then loads the EMA and optimizer state of iteration 1 on the device. Then a 2-step
   ``tpgrpo pretrain --device``. Each must exit 0 and write its artifacts. ``--smoke`` also shrinks the
   iterations (2 prompts, T = 4; 4 samples each where params.yaml samples chains).
2. Held weights (``launch.resident_model`` on the device): ``bench/resident_load.py --device --verify`` on the
   embedded model (a stage forked from a process that holds the weights on the CPU moves its copy to the
   device and gets the weights a load from disk gets), then one smoke iteration of ``tpgrpo run`` with the
   model held, whose rollout and update must fork from the server.
3. Cost: ``bench/bench_sd3.py --full`` (SD3.5-M config, random weights, 512 px, bf16, T = 10, window 9;
   ``--smoke``: 1 block at 64 px) for seconds per trajectory and peak memory of rollout, probe and update.

Prints one summary table and ``gpu_check: ok`` (exit 0), or what failed (exit 1). Without CUDA, ``--device
cuda`` prints one line and exits 2.
"""

from __future__ import annotations

import argparse
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

from bench.common import REPO  # noqa: E402 - the checkout
STAGES = ("rollout", "probe", "credit", "update", "eval")
ARTIFACTS = {"eval_prompts": ("eval_prompt_embeds", "eval_prompts.json"),  # once per run, under data/iters
             "rollout": ("trajectories.zarr", "rollout.json"), "probe": ("probe.parquet", "probe.json"),
             "credit": ("credit.parquet", "credit.json"), "update": ("policy", "update.json"),
             "eval": ("eval.json",)}
# --smoke: an iteration small enough for a CPU (the full check runs params.yaml's own sizes).
SMOKE_PARAMS = {"sampling": {"num_steps": 4, "window_size": 3},
                "rollout": {"prompts_per_iter": 2, "group_size": 4, "batch_size": 8},
                "probe": {"batch_size": 16}, "update": {"micro_batch": 8},
                "eval": {"num_steps": 4, "num_prompts": 2, "samples_per_prompt": 1}}
BUDGET_S = {"stage": 100, "pretrain": 60, "bench": 200}  # ceilings per step (seconds)
TOTAL_S = 470.0  # and for the whole check: it must end within 8 minutes
_DEADLINE = [time.monotonic() + TOTAL_S]


def check_device(device: str) -> str | None:
    """None when ``device`` is usable, else the one-line reason."""
    import torch

    if device.startswith("cuda") and not torch.cuda.is_available():
        return (f"gpu_check: no CUDA device available (torch {torch.__version__}, built for CUDA "
                f"{torch.version.cuda}); run `python -m bench.gpu_check --device cpu --smoke` to check the plumbing")
    return None


def default_processes(device: str) -> int:
    """2 where there are 2 GPUs (the multi-process path), else 1."""
    import torch

    return 2 if device.startswith("cuda") and torch.cuda.device_count() >= 2 else 1


def make_project(root: Path, device: str, smoke: bool, processes: int = 1) -> Path:
    """A temporary project: params (device, eval every iteration, EMA, 2 iterations, processes, smoke sizes),
    the model and the prompts."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    overrides = {"model": {"device": device}, "reward_models": {"device": device}, "eval": {"every": 1},
                 "update": {"ema": True, "objective": "grpo"}, "train": {"iterations": 2},
                 "launch": {"num_processes": processes},
                 # TP-GRPO's tree path (guided SDE steps, log-probs, tp credit), whatever the default run trains
                 "sampling": {"guidance_scale": 4.5}, "tree": {"enabled": True}, "credit": {"mode": "tp"}}
    for section_values in ((SMOKE_PARAMS if smoke else {}), overrides):
        for section, values in section_values.items():
            params[section].update(values)
    for name in ("base", "prompts"):
        shutil.copytree(REPO / "data" / name, root / "data" / name)
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    return root / "params.yaml"


def _env() -> dict:
    return dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true", PYTHONPATH=str(REPO),
                PYTHONUNBUFFERED="1")


def kill_step(label: str, command: list[str], marker: Path, timeout: float) -> dict:
    """Start ``command`` and SIGKILL its whole process group as soon as ``marker`` exists (the stage has
    loaded its model: a run that dies mid-stage); ``ok`` when it was still running then."""
    start = time.perf_counter()
    proc = subprocess.Popen(command, cwd=REPO, env=_env(), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)
    while proc.poll() is None and not marker.exists() and time.perf_counter() - start < timeout:
        time.sleep(0.02)
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
        seconds = round(time.perf_counter() - start, 1)
        return {"label": label, "ok": True, "seconds": seconds, "error": None,
                "note": f"killed {'after its model load' if marker.exists() else 'at the timeout'}"}
    return {"label": label, "ok": False, "seconds": round(time.perf_counter() - start, 1),
            "error": f"exited ({proc.returncode}) before the kill: nothing was interrupted"}


def run_step(label: str, command: list[str], timeout: float) -> dict:
    """Run one command from the repo root; ``{label, ok, seconds, error}`` (error: its last output line)."""
    env = _env()
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
    if name == "eval_prompts":
        return f"{metrics['chunks']} chunks of held-out prompts encoded, {metrics['images']} images"
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


def timed_command(params: Path, name: str, iteration: int | None, timings: Path) -> list[str]:
    """The stage as ``tpgrpo stage ...`` runs it (dvc.yaml's command; a model stage on several processes starts
    them through ``tpgrpo.pipeline.execution.launch.launch_argv``: ``accelerate launch ... -m tpgrpo stage ...``), with
    ``tpgrpo`` run through ``bench/stage_timer.py`` in every process."""
    from tpgrpo.config import load_config
    from tpgrpo.pipeline.rendering.dvcfile import MULTI_PROCESS_STAGES, stage_command
    from tpgrpo.pipeline.execution.launch import launch_argv

    cfg = load_config(params)
    words = shlex.split(stage_command(cfg, name, iteration)) + ["--params", str(params)]
    timer = [str(REPO / "bench" / "stage_timer.py"), "--timings", str(timings)]
    launcher = launch_argv(cfg, params.parent, words[1:], env={}) if name in MULTI_PROCESS_STAGES else None
    if launcher is None:
        return [sys.executable, *timer, *words[1:]]
    at = launcher.index("-m", 3)  # ... -m tpgrpo stage ...: each process runs the timer instead
    return [*launcher[:at], *timer, *launcher[at + 2:]]


def stage_row(params: Path, name: str, iteration: int | None) -> dict:
    """Run one stage (timed; ``iteration`` None: a stage run once per run); its row, with import / load /
    compute seconds and its artifacts checked."""
    folder = params.parent / "data" / "iters" / ("" if iteration is None else f"{iteration:04d}")
    timings = params.parent / f".{name}-{iteration}.times.json"
    label = name if iteration is None else f"iter {iteration} {name}"
    row = run_step(label, timed_command(params, name, iteration, timings), BUDGET_S["stage"])
    missing = [a for a in ARTIFACTS[name] if not (folder / a).exists()]
    if row["ok"] and missing:
        row.update(ok=False, error=f"exit 0 but no {', '.join(missing)} in {folder}")
    row["note"] = stage_note(name, folder) if row["ok"] else ""
    if row["ok"] and timings.is_file():
        t = json.loads(timings.read_text())
        load = t["load_s"] + t["text_load_s"]
        row.update(import_s=round(t["import_s"], 1), load_s=round(load, 1),
                   compute_s=round(row["seconds"] - t["import_s"] - load, 1))
    return row


def pipeline_check(device: str, smoke: bool, tmp: Path, processes: int = 1) -> list[dict]:
    """Step 1: two iterations' stages (iteration 2's rollout killed once, then resumed) and a short
    pretraining, each through the CLI in its own process."""
    params = make_project(tmp / "project", device, smoke, processes)
    rows = [stage_row(params, "eval_prompts", None)]  # once per run: every eval reads its embeddings
    if not rows[-1]["ok"]:
        return rows
    for iteration in (1, 2):
        for name in STAGES:
            if iteration == 2 and name == "rollout":
                command = timed_command(params, name, iteration, tmp / "killed.json")
                rows.append(kill_step("iter 2 rollout, killed", command, tmp / "killed.json.loaded", BUDGET_S["stage"]))
                left = params.parent / "data" / "iters" / "0002" / "trajectories.zarr"
                if rows[-1]["ok"] and left.exists():
                    rows[-1].update(ok=False, error=f"the killed rollout left {left} behind")
            rows.append(stage_row(params, name, iteration))
            if not rows[-1]["ok"]:
                return rows  # later stages need this one's artifacts
    out = tmp / "pretrained"
    row = run_step("pretrain", [sys.executable, "-m", "tpgrpo", "pretrain", "--steps", "2", "--batch-size", "8",
                                "--device", device, "--out-dir", str(out)], BUDGET_S["pretrain"])
    if row["ok"] and not (out / "tpgrpo_model.json").is_file():
        row.update(ok=False, error=f"exit 0 but no model in {out}")
    row["note"] = "2 steps, model saved" if row["ok"] else ""
    return rows + [row]


def resident_check(device: str, tmp: Path) -> list[dict]:
    """Step 3: the base weights held on the CPU for GPU stages (``launch.resident_model``). A forked load
    moves the held copy to ``device`` and must get the weights a load from disk gets (bench/resident_load.py
    --verify, its medians in the note); then one smoke iteration of ``tpgrpo run`` with the model held, whose
    rollout and update must have forked from the server that held it (its log, .dvc/tmp/stage_server.log)."""
    row = run_step("held weights: forked load", [sys.executable, str(REPO / "bench" / "resident_load.py"),
                                                 str(REPO / "data" / "base"), "--device", device, "--repeats", "3",
                                                 "--verify"], BUDGET_S["stage"])
    medians = [line for line in row.get("stdout", "").splitlines() if line.startswith("per stage")]
    if row["ok"] and "equal" not in row.get("stdout", ""):
        row.update(ok=False, error="no weights check in its output")
    row["note"] = medians[0] if medians else ""
    root = tmp / "resident"
    params = make_project(root, device, True)
    raw = yaml.safe_load(params.read_text())
    raw["train"]["iterations"], raw["launch"]["resident_model"], raw["eval"]["every"] = 1, True, 0
    params.write_text(yaml.safe_dump(raw, sort_keys=False))
    for code in ("stages", "tpgrpo"):  # the project's code (its code stage hashes it)
        shutil.copytree(REPO / code, root / code, ignore=shutil.ignore_patterns("__pycache__"))
    run = run_step("held weights: tpgrpo run", [sys.executable, "-m", "tpgrpo", "run", "--params", str(params)],
                   BUDGET_S["pretrain"] * 2)
    log = root / ".dvc" / "tmp" / "stage_server.log"
    text = log.read_text() if log.is_file() else ""
    lines = [line for line in text.splitlines() if line.startswith("forked ")]
    forked = [name for name in ("rollout", "update") if any(f"stage {name} " in line and "--iter 1" in line
                                                            for line in lines)]
    if run["ok"] and ("model held: none" in text or forked != ["rollout", "update"] or "refused" in text):
        why = [line for line in text.splitlines() if line.startswith("refused") or "model held: none" in line]
        run.update(ok=False, error=f"the server's log shows no held model, a refusal or unforked stages: "
                                   f"{why[0] if why else 'forked ' + (', '.join(forked) or 'none')}")
    run["note"] = f"forked from the holder: {', '.join(forked) or 'none'}"
    return [row, run]


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
    lines = [f"gpu_check on {device}", "| step | ok | seconds | import s | load s | compute s | note |",
             "|---|---|---|---|---|---|---|"]
    lines += [f"| {r['label']} | {'yes' if r['ok'] else 'NO'} | {r['seconds']} | {r.get('import_s', '')} | "
              f"{r.get('load_s', '')} | {r.get('compute_s', '')} | {r.get('note') or r['error'] or ''} |" for r in rows]
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
    parser.add_argument("--processes", type=int, default=None,
                        help="processes per model stage (default: 2 where there are 2 GPUs, else 1)")
    args = parser.parse_args()
    reason = check_device(args.device)
    if reason:
        print(reason)
        return 2
    start = time.perf_counter()
    _DEADLINE[0] = time.monotonic() + (float("inf") if args.smoke else TOTAL_S)  # a CPU's smoke may be slower
    with tempfile.TemporaryDirectory(prefix="gpu_check-") as tmp:
        processes = args.processes or default_processes(args.device)
        rows = pipeline_check(args.device, args.smoke, Path(tmp), processes)
        rows += resident_check(args.device, Path(tmp))
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
