"""DVC bookkeeping at the paper's scale: runs of 12 .. 1,000 finished iterations built from ONE real iteration.

Usage: ``python -m bench.dvc_scale [--sizes 12,100,300,1000] [--flat-sizes 12,100,300] [--work DIR]
[--from PROJECT]``.

1. The real iteration: ``--from`` a project that finished ``tpgrpo run`` with train.iterations 1, or (default)
   one trained here with the repo's params (train.iterations 1, eval.every 1, 8 held-out prompts; minutes).
2. Each run of N iterations is a fresh project (same code, model, prompts, params but train.iterations N) whose
   iteration folders are real copies of that iteration's files. Its ``dvc.lock`` per-stage entries are the real
   iteration's entries with paths renumbered (the copies have the same content, so the hashes are right, and
   each iteration i > 1 gains its dep on policy i - 1). Layouts:
   - ``flat``: today's one stage per (step, iteration) (``train.block_size: 0``);
   - ``sealed``: finished blocks of ``--block-size`` sealed as ``tpgrpo run`` seals them (seal files, per-stage
     entries moved out of dvc.lock, ``dvc commit`` of the block stages and the summary);
   - ``retained``: ``sealed`` after ``tpgrpo retain`` with --keep-trajectories / --keep-adapter-every.
3. Timed in each (one process each, seconds, 2 cores shared with whatever else runs): ``dvc status``, a no-op
   ``dvc repro``, ``tpgrpo run`` with nothing to do (a resume: unseal check, render, repro, seal check),
   ``tpgrpo status``; dvc.yaml lines / stages and workspace MB per iteration. Whether the cache links
   rather than copies is measured once, on the real iteration (workspace, cache, both with links once).
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
from tpgrpo.config import load_config
from tpgrpo.io.artifacts import DVC_CACHE_TYPE
from tpgrpo.pipeline.long_runs.blocks import full_blocks, read_lock, write_lock
from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml  # noqa: E402
from tpgrpo.pipeline.long_runs.sealing import dvc_env, seal_finished  # noqa: E402

STEMS = ("rollout", "probe", "credit", "update", "eval")
ONE_MORE = True  # --no-one-more: skip training iteration n + 1 in each project
LINK = False  # --link: iteration folders hard-linked to the real one instead of copied


def sh(cwd: Path, *cmd: str) -> tuple[float, str]:
    """Run, fail loudly; returns (seconds, stdout)."""
    start = time.perf_counter()
    done = subprocess.run(list(cmd), cwd=cwd, env=dvc_env(), capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{' '.join(cmd)} in {cwd} failed: {(done.stderr or done.stdout).strip()[-400:]}")
    return time.perf_counter() - start, done.stdout


def dvc(cwd: Path, *args: str) -> tuple[float, str]:
    return sh(cwd, sys.executable, "-m", "dvc", *args)


def tpgrpo(cwd: Path, *args: str) -> tuple[float, str]:
    return sh(cwd, sys.executable, "-m", "tpgrpo", *args)


def new_project(folder: Path, params: dict, code_from: Path = REPO) -> Path:
    """Code, model, prompts (copied from ``code_from``) and params; DVC initialised as `tpgrpo run` does (no
    git: not timed)."""
    shutil.rmtree(folder, ignore_errors=True)
    (folder / "data").mkdir(parents=True)
    for code in ("stages", "tpgrpo"):
        shutil.copytree(code_from / code, folder / code, ignore=shutil.ignore_patterns("__pycache__"))
    for data in ("base", "prompts"):
        shutil.copytree(code_from / "data" / data, folder / "data" / data)
    (folder / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    dvc(folder, "init", "-q", "--no-scm", "--force")
    for key, value in (("core.analytics", "false"), ("core.check_update", "false"),
                       ("cache.type", DVC_CACHE_TYPE)):
        dvc(folder, "config", key, value)
    shutil.copy2(REPO / ".dvcignore", folder / ".dvcignore")  # dvc init wrote its own
    return folder


def train_one(work: Path) -> Path:
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    params["train"].update(iterations=1, block_size=0)
    params["eval"].update(every=1, num_prompts=8)
    root = new_project(work / "one", params)
    seconds, _ = tpgrpo(root, "run")
    print(f"trained the real iteration in {seconds:.0f} s ({root})", flush=True)
    return root


def refresh_code(source: Path) -> None:
    """Give the source project this checkout's code: copy it in, rewrite the code manifests, and record every
    stage as up to date with them (``dvc commit --force``). For a bookkeeping bench only: the artifacts stay
    those the older code made, which the bench never compares."""
    for code in ("stages", "tpgrpo"):
        shutil.rmtree(source / code)
        shutil.copytree(REPO / code, source / code, ignore=shutil.ignore_patterns("__pycache__"))
    tpgrpo(source, "dvc-yaml")
    sh(source, sys.executable, "-c", "from pathlib import Path; from tpgrpo.pipeline.rendering.code_manifest import "
                                     "write_manifests; write_manifests(Path('.').resolve())")
    dvc(source, "commit", "--force", "--quiet")


def renumbered(entry: dict, i: int, prev_policy: dict | None) -> dict:
    """Iteration 1's lock entry as iteration i's: paths and --iter renumbered, policy i - 1 as a dep."""
    text = json.dumps(entry).replace("data/iters/0001/", f"data/iters/{i:04d}/").replace("--iter 1", f"--iter {i}")
    out = json.loads(text)
    if prev_policy is not None and entry["cmd"].split()[2] in ("rollout", "probe", "update"):
        dep = dict(prev_policy, path=f"data/iters/{i - 1:04d}/policy")
        out["deps"] = sorted([*out["deps"], dep], key=lambda d: d["path"])
    return out


def build(source: Path, folder: Path, n: int, block_size: int) -> tuple[Path, float]:
    """A project with n finished iterations copied from ``source``'s iteration 1 (its code too, so that the
    code manifests match); returns (root, seconds). Sealed as `tpgrpo run` seals: block by block, each once
    DVC finds its stages up to date."""
    start = time.perf_counter()
    params = yaml.safe_load((source / "params.yaml").read_text())
    params["train"].update(iterations=n, block_size=block_size)
    root = new_project(folder, params, code_from=source)
    src_lock = read_lock(source)["stages"]
    policy = next(o for o in src_lock["update-0001"]["outs"] if o["path"].endswith("/policy"))
    for name in ("data/iters/baseline_eval.parquet", "data/iters/baseline_eval.json", "data/metrics",
                 "data/reports", "data/code", "data/iters/eval_prompt_embeds", "data/iters/eval_prompts.json"):
        copy_any(source / name, root / name)
    for i in range(1, n + 1):
        if LINK:  # hard links: DVC's state database knows every copy's md5 already, as it knows a stage's
            # outputs right after the stage (it hashed them); a real copy makes DVC hash 9.7 GB at 1,000
            sh(root, "cp", "-al", str(source / "data/iters/0001"), str(root / f"data/iters/{i:04d}"))
        else:
            shutil.copytree(source / "data/iters/0001", root / f"data/iters/{i:04d}")
    # The copies have the real iteration's content, so its cache objects are theirs (hard-linked in: instant).
    shutil.rmtree(root / ".dvc" / "cache", ignore_errors=True)
    sh(root, "cp", "-al", str(source / ".dvc" / "cache"), str(root / ".dvc" / "cache"))
    cfg = load_config(root / "params.yaml")
    stages = {name: src_lock[name] for name in ("code", "eval_prompts", "baseline", "summary")}
    write_lock(root, {"schema": "2.0", "stages": stages})
    write_dvc_yaml(cfg, root, 0)
    dvc(root, "commit", "--force", "--quiet", "code")  # its params.yaml dep differs from the source's
    ends = [b.last for b in full_blocks(block_size, n)] + ([n] if not block_size or n % block_size else [])
    done = 0
    for end in ends:
        lock = read_lock(root)
        for i in range(done + 1, end + 1):
            for stem in STEMS:
                if f"{stem}-0001" in src_lock:
                    lock["stages"][f"{stem}-{i:04d}"] = renumbered(src_lock[f"{stem}-0001"], i,
                                                                   policy if i > 1 else None)
        write_lock(root, lock)
        write_dvc_yaml(cfg, root, end)
        note = lambda line: sys.exit(f"{root}: {line}")  # noqa: E731 - the copies must be up to date
        seal_finished(root, cfg, end, note=note)  # what `tpgrpo run` does after each block's repro
        done = end
    dvc(root, "commit", "--force", "--quiet", "summary")  # the source's summary, as this run's
    return root, time.perf_counter() - start


def copy_any(src: Path, dst: Path) -> None:
    dst.parent.mkdir(parents=True, exist_ok=True)
    (shutil.copytree if src.is_dir() else shutil.copy2)(src, dst)


def workspace_mb(root: Path, n: int) -> float:
    """MB per iteration in data/iters (the copies share content, so the cache is not measured here)."""
    return int(sh(root, "du", "-sb", "data/iters")[1].split()[0]) / n / 1e6


def cache_sharing(root: Path) -> dict:
    """On the real iteration: bytes of workspace and cache, and of both with hard links counted once."""
    size = lambda *p: int(sh(root, "du", "-scb", *p)[1].splitlines()[-1].split()[0])  # noqa: E731
    return {"workspace MB": size("data/iters") / 1e6, "cache MB": size(".dvc/cache") / 1e6,
            "both, links once, MB": size("data/iters", ".dvc/cache") / 1e6,
            "cache.type": sh(root, sys.executable, "-m", "dvc", "config", "cache.type")[1].strip()}


def one_more(root: Path, n: int) -> dict:
    """Train iteration n + 1 with `tpgrpo run` (train.iterations raised by one) and split its wall time into
    its stages' own compute (the wall_seconds each stage logs, the summary's included) and the rest: process
    starts, DVC's checks and lock rewrites, sealing checks, the code stage (the bookkeeping)."""
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"]["iterations"] = n + 1
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    seconds, out = tpgrpo(root, "run")
    ran = [line.split("'")[1] for line in out.splitlines() if line.startswith("Running stage")]
    logs = [root / "data" / "iters" / f"{n + 1:04d}" / f"{s}.json" for s in STEMS]
    from tpgrpo.io.stage_logs import log_seconds

    compute = sum(log_seconds(p) for p in logs if p.is_file())  # from each timing sidecar
    summary_log = root / "data" / "iters" / "summary_log.json"
    compute += json.loads(summary_log.read_text()).get("wall_seconds", 0.0) if summary_log.is_file() else 0.0
    return {"one more iteration s": seconds, "its stages' compute s": compute, "bookkeeping s": seconds - compute,
            "stages run": len(ran)}


def measure(root: Path, n: int, train_one_more: bool) -> dict:
    lines = (root / "dvc.yaml").read_text().count("\n")
    row = {"dvc.yaml lines": lines, "stages": len(yaml.safe_load((root / "dvc.yaml").read_text())["stages"])}
    row["dvc status s"], out = dvc(root, "status")
    assert "up to date" in out, out[-500:]
    row["no-op dvc repro s"], out = dvc(root, "repro")
    assert "Running stage" not in out, out[-500:]
    row["no-op tpgrpo run s"], out = tpgrpo(root, "run")
    assert "Running stage" not in out, out[-500:]
    row["no-op tpgrpo run again s"], out = tpgrpo(root, "run")  # the sealed blocks now vouched for
    assert "Running stage" not in out, out[-500:]
    row["tpgrpo status s"], _ = tpgrpo(root, "status")
    row["MB/iter"] = workspace_mb(root, n)
    if ONE_MORE and train_one_more:
        row.update(one_more(root, n))
    return row


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sizes", default="12,100,300,1000")
    ap.add_argument("--flat-sizes", default="12,100,300", help="sizes also measured in today's flat layout")
    ap.add_argument("--block-size", type=int, default=25)
    ap.add_argument("--keep-trajectories", type=int, default=10)
    ap.add_argument("--keep-adapter-every", type=int, default=50)
    ap.add_argument("--work", type=Path, default=Path("/tmp/tpgrpo_dvc_scale"))
    ap.add_argument("--from", dest="source", type=Path, help="project that finished 1 iteration")
    ap.add_argument("--out", type=Path, default=REPO / "bench" / "results" / "dvc_scale.json")
    ap.add_argument("--refresh-code", action="store_true", help="give the --from project this checkout's code first")
    ap.add_argument("--link", action="store_true", help="hard-link the iteration folders (builds 1,000 in minutes)")
    ap.add_argument("--no-one-more", action="store_true", help="skip training one more iteration per project")
    args = ap.parse_args()
    global ONE_MORE, LINK
    ONE_MORE, LINK = not args.no_one_more, args.link
    args.work.mkdir(parents=True, exist_ok=True)
    source = args.source.resolve() if args.source else train_one(args.work)
    if args.refresh_code:
        refresh_code(source)
    sharing = cache_sharing(source)
    print(json.dumps(sharing), flush=True)
    rows = []
    for n in map(int, args.sizes.split(",")):
        layouts = (["flat"] if str(n) in args.flat_sizes.split(",") else []) + ["sealed", "retained"]
        for layout in layouts:
            if layout != "retained":
                root, built = build(source, args.work / f"{layout}_{n}", n, 0 if layout == "flat" else args.block_size)
            else:
                params = yaml.safe_load((root / "params.yaml").read_text())
                params["retention"] = {"keep_trajectories": args.keep_trajectories,
                                       "keep_adapter_every": args.keep_adapter_every}
                (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
                built, _ = tpgrpo(root, "retain")
                dvc(root, "commit", "--force", "--quiet", "code")  # params.yaml changed: what `tpgrpo run` re-runs
            done = n + 1 if ONE_MORE and layout == "retained" else n  # the sealed project trained one more
            row = {"iterations": done, "layout": layout, "build/retain s": built,
                   **measure(root, done, train_one_more=layout != "retained")}
            rows.append(row)
            print(json.dumps({k: round(v, 2) if isinstance(v, float) else v for k, v in row.items()}), flush=True)
            if layout in ("flat", "retained"):
                shutil.rmtree(root)  # 1,000 copied iterations are a few GB
    args.out.parent.mkdir(parents=True, exist_ok=True)
    args.out.write_text(json.dumps({"block_size": args.block_size, "keep_trajectories": args.keep_trajectories,
                                    "keep_adapter_every": args.keep_adapter_every, "cpus": os.cpu_count(),
                                    "cache_sharing": sharing,
                                    "rows": rows}, indent=1))
    print_table(rows)


def print_table(rows: list[dict]) -> None:
    keys = list(dict.fromkeys(k for row in rows for k in row))  # the retained rows train no more iteration
    print("| " + " | ".join(keys) + " |")
    print("|" + "---|" * len(keys))
    for row in rows:
        print("| " + " | ".join(f"{row[k]:.1f}" if isinstance(row.get(k), float) else str(row.get(k, "-"))
                                for k in keys) + " |")


if __name__ == "__main__":
    main()
