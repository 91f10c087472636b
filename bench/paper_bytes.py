"""The pipeline's bookkeeping at the paper's bytes: what one more iteration costs besides its stages' compute.

    python -m bench.paper_bytes --scale 0.03125 --iterations 2     # 1/32 of the paper's trajectories: minutes
    python -m bench.paper_bytes --iterations 2 --json bench/results/paper_bytes.json   # full size: ~5 GiB each
    python -m bench.paper_bytes --iterations 2 --alternate launch.hash_while_writing=false,true   # before/after

What is real: DVC (``tpgrpo run`` -> ``dvc repro`` of the project's rendered dvc.yaml, its hashing, cache and
lock files, the run cache), the stage commands (``tpgrpo stage NAME --iter i``, through the stage server), the
Zarr / Parquet / safetensors writers and readers, the checks on read, sealing and retention. The artifacts have
the paper's shapes and counts: 48 prompts x 24 samples = 1,152 trajectories an iteration (x ``--scale``),
SD3.5-M latents of 16 x 64 x 64 float32 (512 px), T = 10 with a window of 9 (10 stored states and 9 stored
per-step arrays a trajectory: x0 estimates, the bytes of the exact probe's velocities), prompt embeddings of 333 x 4,096 bf16, a rank-32 LoRA adapter on
SD3's 191 attention projections (18.8M float32 weights) with its AdamW state, eval on 108 x 2 images.

What is NOT: the model's arithmetic. Its stand-in (``bench/paper_standin/standin.py``, switched in by that
folder's ``sitecustomize.py`` for a model folder holding ``standin.json``) has the real tensor shapes and
trivial maths, so "stage compute" below is the stand-in's, not SD3.5-M's, and the stages do not load SD3.5-M:
model loading is ``bench/real_size.py``'s and ``bench/load_sd3.py``'s (docs/real-size.md).

Per measured iteration (``train.iterations`` raised by one, then ``tpgrpo run``): its wall seconds split into
stage compute (the stages' logged seconds) and bookkeeping, named by timers in the DVC and ``tpgrpo run``
processes (``bench/paper_standin/paper_timers.py``: stage process starts, up-to-date checks, hashing (md5 of
bytes), cache commits (copy into the cache, relink), run-cache entries, lock writes, our checks after the
repro, sealing), and the bytes it added to the workspace and to ``.dvc/cache``.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import yaml

from bench.common import REPO

STANDIN = REPO / "bench" / "paper_standin"
STEMS = ("rollout", "probe", "credit", "update", "eval")
PAPER_PROMPTS, GROUP, EVAL_PROMPTS = 48, 24, 108


def paper_params(scale: float, block_size: int) -> dict:
    """The repo's params at the paper's recipe (x ``scale`` prompts), the stand-in's folder as the model."""
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["model"].update(kind="sd3", dtype="bf16", resolution=512)
    params["task"].update(reward="jpeg_compressibility", eval_reward="jpeg_compressibility")
    params["sampling"].update(num_steps=10, window_size=9, shift=3.0)
    params["rollout"].update(prompts_per_iter=max(1, round(PAPER_PROMPTS * scale)), group_size=GROUP, batch_size=64)
    params["tree"]["enabled"] = False  # the paper's chains, 1,152 trajectories (pinned, whatever the default)
    # x0: the rollout stores x0_estimates, exactly the shape, dtype and count of the velocities the exact probe
    # keeps (9 x 16 x 64 x 64 float32 a trajectory), and the probe scores them instead of running completions:
    # the same bytes, without hours of stand-in completions on this CPU (their compute is not measured anyway).
    params["probe"].update(completion="x0", batch_size=128)
    params["update"].update(lora_rank=32, lora_alpha=64, optimizer_steps_per_iter=2, micro_batch=64)
    params["eval"].update(every=1, num_steps=40, num_prompts=max(2, round(EVAL_PROMPTS * scale)),
                          samples_per_prompt=2)
    params["train"].update(iterations=1, block_size=block_size)
    return params


def env(timers: Path | None = None) -> dict[str, str]:
    from tpgrpo.pipeline.long_runs.sealing import dvc_env

    out = dict(dvc_env(), OMP_NUM_THREADS="1", PYTHONPATH=f".{os.pathsep}{STANDIN}")
    out.pop("PAPER_BYTES_TIMERS", None)
    if timers is not None:
        out["PAPER_BYTES_TIMERS"] = str(timers)
    return out


def sh(root: Path, *cmd: str, timers: Path | None = None) -> tuple[float, str]:
    start = time.perf_counter()
    done = subprocess.run(list(cmd), cwd=root, env=env(timers), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} in {root} failed: {(done.stderr or done.stdout).strip()[-1500:]}")
    return time.perf_counter() - start, done.stdout


def make_project(folder: Path, params: dict, dvc_config: dict[str, str]) -> Path:
    """A fresh project (code, prompts, params; DVC as ``tpgrpo run`` sets it up) whose model is the stand-in."""
    from bench.dvc_scale import new_project

    root = new_project(folder, params)
    shutil.rmtree(root / "data" / "base")
    (root / "data" / "base").mkdir()
    (root / "data" / "base" / "standin.json").write_text('{"what": "bench/paper_standin/standin.py"}\n')
    for key, value in dvc_config.items():
        sh(root, sys.executable, "-m", "dvc", "config", key, value)
    return root


def du(*paths: Path) -> int:
    """Bytes of the files under ``paths``, each inode once (hard links counted once)."""
    seen, total = set(), 0
    for top in paths:
        for dirpath, _, files in os.walk(top):
            for name in files:
                st = os.lstat(os.path.join(dirpath, name))
                if (st.st_dev, st.st_ino) not in seen:
                    seen.add((st.st_dev, st.st_ino))
                    total += st.st_size
    return total


def loadavg() -> str:
    return " ".join(Path("/proc/loadavg").read_text().split()[:3])


def timer_records(folder: Path) -> list[dict]:
    return [json.loads(p.read_text()) for p in sorted(folder.glob("*.json"))]


def split(records: list[dict], wall: float, compute: float) -> dict[str, float]:
    """The bookkeeping's named parts (seconds, exclusive: they add up to ``wall``) from the timer records of
    one ``tpgrpo run`` (``paper_timers``); the last row, md5 in DVC's hashing threads, overlaps the others."""
    run = next((r for r in records if "run" in r["argv"] and not _is_dvc(r)), None)
    repros = [r for r in records if _is_dvc(r) and "repro" in r["argv"]]
    others = [r for r in records if _is_dvc(r) and "repro" not in r["argv"]]
    own = lambda rs, part: sum(r["busy"].get(part, 0.0) for r in rs)  # noqa: E731
    parts = {"stage compute (stand-in)": compute,
             "stage process starts and exits": own(repros, "stage command") - compute}
    for label, part in (("up-to-date checks", "up-to-date check"),
                        ("hashing: md5 of bytes (main thread)", "md5 of bytes"),
                        ("hashing: the rest of saving deps+outs", "save (hash deps+outs, run cache)"),
                        ("run-cache entries", "run cache entry"),
                        ("cache: copy into .dvc/cache", "transfer to cache"),
                        ("cache: relink/checkout", "checkout"),
                        ("cache: rest of commit", "commit (copy to cache, relink)"),
                        ("lock writes", "lock write")):
        parts[label] = own(repros, part)
    repro_walls = sum(r["wall"] for r in repros)
    parts["dvc repro: start, graph, the rest"] = repro_walls - sum(parts.values())
    repro = run["busy"].get("repro (dvc repro + checks)", 0.0) if run else 0.0
    parts["our checks around the repro (dvc status ...)"] = repro - repro_walls
    parts["sealing"] = run["busy"].get("sealing", 0.0) if run else 0.0
    parts["tpgrpo run: start, render, manifests, the rest"] = wall - repro - parts["sealing"]
    parts["(of the above: dvc processes other than repro, wall)"] = sum(r["wall"] for r in others)
    parts["(overlapping: md5 in DVC's hashing threads, busy wall)"] = sum(
        r.get("threads", {}).get("md5 of bytes", 0.0) for r in repros)
    return parts


def per_iteration(records: list[dict], root: Path, i: int) -> dict[str, float]:
    """What iteration ``i``'s five stages cost DVC besides their compute: the parts counted inside each
    stage's ``reproduce`` and lock write (exclusive seconds), and each stage's process start and exit (its
    command's wall less its logged compute; the repro's first stage also waits for the stage server's
    imports, a once-per-``tpgrpo run`` cost)."""
    from tpgrpo.io.stage_logs import log_seconds

    out: dict[str, float] = {}
    for record in records:
        for stage, parts in record.get("by_stage", {}).items():
            stem, _, number = stage.partition("-")
            if number != f"{i:04d}" or stem not in STEMS:
                continue
            log = root / "data" / "iters" / number / f"{stem}.json"
            out[f"{stem}: process start and exit"] = parts.get("stage command", 0.0) - log_seconds(log)
            for part, seconds in parts.items():
                if part != "stage command":
                    out[part] = out.get(part, 0.0) + seconds
    return out


def _is_dvc(record: dict) -> bool:
    from bench.paper_standin.paper_timers import is_dvc_argv

    return is_dvc_argv(record["argv"])


def compute_seconds(root: Path, i: int) -> float:
    from tpgrpo.io.stage_logs import log_seconds

    logs = [root / "data" / "iters" / f"{i:04d}" / f"{s}.json" for s in STEMS]
    seconds = sum(log_seconds(p) for p in logs if p.is_file())
    summary = root / "data" / "iters" / "summary_log.json"
    return seconds + (json.loads(summary.read_text()).get("wall_seconds", 0.0) if summary.is_file() else 0.0)


def one_more(root: Path, i: int, work: Path, setting: tuple[str, object] | None = None) -> dict:
    """Train iteration ``i`` (``train.iterations`` = i, then ``tpgrpo run``), timed and split; ``setting``
    (``("section.key", value)``) is written into params.yaml first (a knob no stage declares: it re-runs
    nothing, so iterations side by side differ in that knob only)."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"]["iterations"] = i
    if setting is not None:
        section, name = setting[0].split(".", 1)
        params[section][name] = setting[1]
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    timers = work / f"timers-{i:04d}"
    shutil.rmtree(timers, ignore_errors=True)
    timers.mkdir(parents=True)
    ws0, cache0, load0 = du(root / "data"), du(root / ".dvc" / "cache"), loadavg()
    wall, out = sh(root, sys.executable, "-m", "tpgrpo", "run", timers=timers)
    compute = compute_seconds(root, i)
    row = {"iteration": i, "setting": f"{setting[0]}={setting[1]}" if setting else "", "wall s": wall, "load before": load0, "load after": loadavg(),
           "workspace bytes added": du(root / "data") - ws0, "cache bytes added": du(root / ".dvc" / "cache") - cache0,
           "sealed": [line for line in out.splitlines() if line.startswith("sealed")]}
    from tpgrpo.io.stage_logs import log_seconds

    row["rollout compute s"] = log_seconds(root / "data" / "iters" / f"{i:04d}" / "rollout.json")
    records = timer_records(timers)
    row["parts s"] = split(records, wall, compute)
    row["iteration stages' DVC parts s"] = per_iteration(records, root, i)
    row["timer records"] = records
    return row


def report(rows: list[dict]) -> None:
    print("\nstage compute is the STAND-IN's (the model's arithmetic is not SD3.5-M's); the rest is real")
    names = list(rows[0]["parts s"])
    print(f"{'part (seconds)':52s}" + "".join(f"{'iter ' + str(r['iteration']):>12s}" for r in rows))
    if any(r.get("setting") for r in rows):
        print(f"{'setting':52s}" + "".join(f"{r['setting'].rpartition('.')[2][-12:]:>12s}" for r in rows))
    for name in names:
        print(f"{name:52s}" + "".join(f"{r['parts s'][name]:12.2f}" for r in rows))
    book = lambda r: r["wall s"] - r["parts s"]["stage compute (stand-in)"]  # noqa: E731
    print("(the parts add up to the wall time but for the two rows in brackets)")
    for label, fn in (("wall", lambda r: r["wall s"]), ("bookkeeping (wall - stage compute)", book),
                      ("workspace GiB added", lambda r: r["workspace bytes added"] / 2**30),
                      ("cache GiB added", lambda r: r["cache bytes added"] / 2**30),
                      ("(of stage compute: the rollout's, hashing included)", lambda r: r["rollout compute s"])):
        print(f"{label:52s}" + "".join(f"{fn(r):12.2f}" for r in rows))
    print("\niteration's own five stages (exclusive seconds; the rest of the wall is per repro or per run):")
    own = "iteration stages' DVC parts s"
    for name in sorted({k for r in rows for k in r[own]}):
        print(f"{name:52s}" + "".join(f"{r[own].get(name, 0.0):12.2f}" for r in rows))
    print(f"{'total':52s}" + "".join(f"{sum(r[own].values()):12.2f}" for r in rows))
    for r in rows:
        print(f"iteration {r['iteration']}: load average {r['load before']} -> {r['load after']} {r['sealed']}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--scale", type=float, default=1.0, help="fraction of the paper's 1,152 trajectories")
    ap.add_argument("--iterations", type=int, default=2, help="iterations measured after the first")
    ap.add_argument("--block-size", type=int, default=2, help="train.block_size (2: a block seals in the run)")
    ap.add_argument("--dvc-config", action="append", default=[], metavar="KEY=VALUE",
                    help="a `dvc config` setting of the project (e.g. core.checksum_jobs=4)")
    ap.add_argument("--params", action="append", default=[], metavar="SECTION.KEY=YAML",
                    help="a params.yaml value (e.g. retention.keep_trajectories=1)")
    ap.add_argument("--alternate", metavar="SECTION.KEY=YAML1,YAML2",
                    help="a knob no stage declares, cycled over the measured iterations (before/after side by side)")
    ap.add_argument("--work", type=Path, default=REPO / ".cache" / "paper_bytes")
    ap.add_argument("--keep", action="store_true", help="leave the project (GBs) on disk")
    ap.add_argument("--json", type=Path)
    args = ap.parse_args()
    params = paper_params(args.scale, args.block_size)
    for item in args.params:
        key, value = item.split("=", 1)
        section, name = key.split(".", 1)
        params[section][name] = yaml.safe_load(value)
    dvc_config = dict(item.split("=", 1) for item in args.dvc_config)
    alternate = []
    if args.alternate:
        key, values = args.alternate.split("=", 1)
        alternate = [(key, yaml.safe_load(v)) for v in values.split(",")]
    print(f"paper bytes x {args.scale}: {params['rollout']['prompts_per_iter'] * GROUP} trajectories an "
          f"iteration; dvc config {dvc_config or 'as tpgrpo init'}; load average {loadavg()}", flush=True)
    result: dict = {"scale": args.scale, "dvc_config": dvc_config, "params": args.params,
                    "alternate": args.alternate, "rows": []}
    root = make_project(args.work / "project", params, dvc_config)
    try:
        seconds, _ = sh(root, sys.executable, "-m", "tpgrpo", "run")
        print(f"set-up run (code, eval_prompts, baseline, iteration 1, summary): {seconds:.1f} s", flush=True)
        for i in range(2, 2 + args.iterations):
            row = one_more(root, i, args.work, alternate[(i - 2) % len(alternate)] if alternate else None)
            result["rows"].append(row)
            print(json.dumps(row), flush=True)
        report(result["rows"])
    finally:
        if not args.keep:
            shutil.rmtree(args.work, ignore_errors=True)
    if args.json:
        args.json.write_text(json.dumps(result, indent=1) + "\n")


if __name__ == "__main__":
    main()
