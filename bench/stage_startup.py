"""Start-up cost per stage process: wall of the command against the stage's own ``wall_seconds``.

Usage: ``python bench/stage_startup.py [--model data/base] [--repeat 3]``. In a temporary project with the
repo's params.yaml it runs iteration 1's rollout, probe and credit once, then times (best of ``--repeat``,
fresh processes, 1 torch thread): ``tpgrpo --help``; ``tpgrpo stage credit``; ``tpgrpo stage credit`` with
credit.mode flow_grpo (no probe: R_fin from the rollout); the rollout stage; and, in a fresh process, importing
the libraries and loading the policy (``tpgrpo.policy.loading.load_policy``); then the same stage commands through the stage
server ``tpgrpo run`` starts (``launch.stage_server``). "start-up" = command wall - the stage's
``wall_seconds`` (which already counts model loading inside the stage).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
from tpgrpo.io.stage_logs import log_seconds  # noqa: E402
from tpgrpo.pipeline.stage_server import running  # noqa: E402

REPO = Path(__file__).resolve().parents[1]
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


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=REPO / "data" / "base")
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--first", type=int, default=1, help="number of the first iteration (0 before issue 11)")
    args = parser.parse_args()
    env = dict(os.environ, OMP_NUM_THREADS="1", DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true", PYTHONPATH=str(REPO))
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
