"""Start-up cost per stage process: wall of the command against the stage's own ``wall_seconds``.

Usage: ``python -m bench.stage_startup [--model data/base] [--repeat 3]``. In a temporary project with the
repo's params.yaml it runs iteration 1's rollout, probe and credit once, then times (best of ``--repeat``,
fresh processes, 1 torch thread): ``tpgrpo --help``; ``tpgrpo stage credit``; ``tpgrpo stage credit`` with
credit.mode flow_grpo (no probe: R_fin from the rollout); the rollout stage; and, in a fresh process, importing
the libraries and loading the policy (``tpgrpo.policy.loading.load_policy``); then the same stage commands through the stage
server ``tpgrpo run`` starts (``launch.stage_server``). "start-up" = command wall - the stage's
``wall_seconds`` (which already counts model loading inside the stage). ``--parts`` splits the served credit
stage's start-up in a finished project, as DVC runs it: the client process alone, the forked child's work outside the stage's stopwatch
(timed in a process with the server's imports, and profiled), and by difference the fork, socket and reaping.
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

from tpgrpo.io.stage_logs import log_seconds
from tpgrpo.pipeline.execution.stage_server import running

from bench.common import REPO  # noqa: E402 - the checkout
TPGRPO = [sys.executable, "-m", "tpgrpo"]
LOAD = ("import time, sys; t = time.perf_counter(); from pathlib import Path; from tpgrpo.config import load_config; "
        "from tpgrpo.policy.loading import load_policy; load_policy(load_config(sys.argv[1]), Path(sys.argv[1]).parent, "
        "int(sys.argv[2])); "
        "print(time.perf_counter() - t)")


def _timed(cmd: list[str], cwd: Path, env: dict) -> tuple[float, str]:
    start = time.perf_counter()
    out = subprocess.run(cmd, cwd=cwd, env=env, capture_output=True, text=True)
    if out.returncode:
        raise SystemExit(f"{' '.join(cmd)} failed: {out.stderr.strip().splitlines()[-1]}")
    return time.perf_counter() - start, out.stdout


def _print_best(label: str, cmd: list[str], metrics: str | None, root: Path, folder: Path, env: dict,
                repeat: int) -> None:
    best = None
    for _ in range(repeat):
        wall, _ = _timed(cmd, root, env)
        inner = log_seconds(folder / f"{metrics}.json") if metrics else 0.0  # from its timing sidecar
        if best is None or wall < best[0]:
            best = (wall, inner)
    print(f"{label:<34}{best[0]:>8.2f}{best[1]:>9.2f}{best[0] - best[1]:>12.2f}", flush=True)


PARTS = r"""
import cProfile, io, json, pstats, sys, time
from pathlib import Path
t0 = time.perf_counter()
from tpgrpo.pipeline.rendering.code_manifest import warm_caches
from tpgrpo.pipeline.execution.stage_server import preload
preload()
warm_caches(Path.cwd())  # as the server does before it forks
from tpgrpo.io.stage_logs import log_seconds
from tpgrpo.pipeline.execution.stage_runner import run_stage_command
argv, log, repeat = json.loads(sys.argv[1]), Path(sys.argv[2]), int(sys.argv[3])
outside = []
for _ in range(repeat):
    start = time.perf_counter()
    try:
        run_stage_command(argv)
    except SystemExit as exc:
        if exc.code:
            raise
    outside.append(time.perf_counter() - start - log_seconds(log))
profile = cProfile.Profile()
try:
    profile.runcall(run_stage_command, argv)
except SystemExit as exc:  # typer exits at the end of a command
    if exc.code:
        raise
text = io.StringIO()
pstats.Stats(profile, stream=text).sort_stats("cumulative").print_stats(25)
print(json.dumps({"outside": min(outside), "profile": text.getvalue()}))
"""
CLIENT = "import tpgrpo.pipeline.execution.stage_client"


def print_parts(case: list[str], log: Path, root: Path, env: dict, repeat: int) -> None:
    """Split a served stage's start-up: the client's interpreter and import, the forked child's work around
    the stage's stopwatch (run in-process after the server's imports, and its profile), and the rest (fork,
    socket, the server's reaping)."""
    client = min(_timed([sys.executable, "-c", CLIENT], root, env)[0] for _ in range(repeat))
    child = json.loads(_timed([sys.executable, "-c", PARTS, json.dumps(case), str(log), str(repeat)], root,
                              env)[1].splitlines()[-1])
    print(f"  client: interpreter start, import and exit {client:.3f} s; the child's work outside the stage's "
          f"stopwatch {child['outside']:.3f} s (best of {repeat}); the rest of the served start-up is the fork, "
          "the socket and the server's reaping")
    print("  profile of the child's whole command (cumulative):")
    print("\n".join("    " + line for line in child["profile"].splitlines()[:40]))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "data" / "base")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--first", type=int, default=1, help="number of the first iteration (0 on older checkouts)")
    parser.add_argument("--parts", type=Path, metavar="PROJECT", help="only split the start-up of the credit stage "
                        "of PROJECT's last iteration (a finished `tpgrpo run`: its DVC project and code manifests), "
                        "as DVC runs it; it rewrites that stage's outputs with the same bytes")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true", PYTHONPATH=str(REPO))
    if args.parts:
        last = max(int(p.name) for p in args.parts.glob("data/iters/[0-9]*") if (p / "credit.json").is_file())
        env.update(PYTHONPATH=str(args.parts.resolve()), DVC_STAGE=f"credit-{last:04d}")  # as `dvc repro` runs it
        case, log = ["stage", "credit", "--iter", str(last)], args.parts / "data" / "iters" / f"{last:04d}" / "credit.json"
        os.environ.update(env)  # the server imports with the callers' environment
        print(f"{'command':<34}{'wall s':>8}{'stage s':>9}{'start-up s':>12}   (best of {args.repeat}, 1 thread)")
        with running(args.parts) as server_env:
            _print_best("stage credit (stage server)", [*TPGRPO, *case], "credit", args.parts, args.parts / "data" /
                        "iters" / f"{last:04d}", {**env, **server_env}, args.repeat)
        print_parts(case, log, args.parts, env, args.repeat)
        return
    with tempfile.TemporaryDirectory(prefix="stage-startup-") as tmp:
        root = Path(tmp)
        shutil.copytree(REPO / "data" / "prompts", root / "data" / "prompts")
        shutil.copytree(args.model, root / "data" / "base")
        shutil.copy(REPO / "params.yaml", root / "params.yaml")
        flow = yaml.safe_load((REPO / "params.yaml").read_text())
        flow["credit"]["mode"] = "flow_grpo"
        (root / "flow.yaml").write_text(yaml.safe_dump(flow))
        def stage(name: str, params: str = "params.yaml") -> list[str]:
            return [*TPGRPO, "stage", name, "--iter", str(args.first), "--params", params]

        for name in ("rollout", "probe", "credit"):
            _timed(stage(name), root, env)
        folder = root / "data" / "iters" / f"{args.first:04d}"
        cases = [("tpgrpo --help", [*TPGRPO, "--help"], None), ("stage credit", stage("credit"), "credit"),
                 ("stage credit (flow_grpo)", stage("credit", "flow.yaml"), "credit"),
                 ("stage rollout", stage("rollout"), "rollout")]
        print(f"{'command':<34}{'wall s':>8}{'stage s':>9}{'start-up s':>12}   (best of {args.repeat}, 1 thread)")
        for label, cmd, metrics in cases:
            _print_best(label, cmd, metrics, root, folder, env, args.repeat)
        os.environ.update(env)  # the server imports with the callers' environment
        with running(root) as server_env:  # what `tpgrpo run` starts (launch.stage_server)
            for label, cmd, metrics in cases[1:]:
                _print_best(f"{label} (stage server)", cmd, metrics, root, folder, {**env, **server_env},
                            args.repeat)
        log = (root / ".dvc" / "tmp" / "stage_server.log").read_text().splitlines()
        forked = sum(line.startswith("forked") for line in log)
        print(f"(the server forked {forked} of the {3 * args.repeat} calls)")
        loads = [float(_timed([sys.executable, "-c", LOAD, str(root / "params.yaml"), str(args.first)], root, env)[1])
                 for _ in range(args.repeat)]
        print(f"{'imports + load_policy':<26}{min(loads):>8.2f}   (fresh process: libraries and weights)")


if __name__ == "__main__":
    main()
