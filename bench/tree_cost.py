"""Cost of the tree rollout against a Flow-GRPO chain, on the embedded tiny model.

    python -m bench.tree_cost counts                       # passes / decodes / trained transitions per sample
    python -m bench.tree_cost arm --shape tree --mode tp   # one timed iteration (rollout, probe, credit, update)
    python -m bench.tree_cost side-by-side                 # chain flow_grpo and tree tp at once, 1 thread each
    python -m bench.tree_cost sweep                        # (split steps, m, R): counts and a timed iteration each

Each timed arm builds a fresh project in a temporary folder from this checkout's params.yaml (the defaults: 8
prompts, T = 10, window 9, G = 8) and ``data/base``, with only the given overrides, and runs iteration 1's
stages in one process through the stage functions (what ``tpgrpo stage`` runs, without the CLI start-up).
Eval is left out: it is the same for both shapes. Walls depend on the load: the side-by-side run prints the
load average before and after, and the CPU model.
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

from bench.common import REPO, run_stage

STAGES = ("rollout", "probe", "credit", "update")
SWEEP = [("0,3,6", 1, 1), ("0,4", 1, 2), ("0,2,4", 1, 1), ("0", 7, 1), ("0,5", 2, 1), ("2,5", 1, 2), ("0,3,6", 1, 2)]


def children_value(m: int | str) -> int | str:
    """``tree.children`` as params.yaml holds it: an int (``3``, every split) or a string (``"3,1"``, per split)."""
    return int(m) if str(m).isdigit() else str(m)


def counts(num_steps: int, window: int, group: int, split: str, m: int | str, roots: int) -> dict:
    """Per-prompt and per-sample counts (transformer rows without CFG's doubling) for the chain and a tree;
    ``m``: one child count for every split, or one per split (``"3,1"``)."""
    from tpgrpo.algo.tree_shape import TreeShape, parse_children, parse_split_steps

    shape = TreeShape(parse_split_steps(split), parse_children(children_value(m)), roots)
    leaves = roots * shape.leaves_per_root()
    probe_exact = sum(num_steps - k for k in range(window))  # chain tp: ODE completions of z_0..z_{K-1}
    return {
        "chain": {"samples": group, "passes": group * num_steps, "decodes": group, "trained": group * window},
        "chain_tp_exact": {"samples": group, "passes": group * (num_steps + probe_exact),
                           "decodes": group * (1 + window), "trained": group * window},
        "tree": {"samples": leaves, "passes": roots * shape.passes_per_root(num_steps), "decodes": leaves,
                 "trained": roots * shape.sde_edges_per_root(), "edges": roots * shape.edges_per_root()},
    }


def print_counts(rows: list[tuple[str, dict]]) -> None:
    print(f"{'setting':<34} {'samples':>7} {'passes/sample':>13} {'decodes/sample':>14} {'trained/sample':>14}")
    for name, c in rows:
        s = c["samples"]
        print(f"{name:<34} {s:>7} {c['passes'] / s:>13.2f} {c['decodes'] / s:>14.2f} {c['trained'] / s:>14.2f}")


def make_project(folder: Path, overrides: dict) -> Path:
    """A project folder: this checkout's params.yaml with ``overrides`` ({section: {key: value}}), its prompts
    and its tiny model."""
    import yaml

    (folder / "data").mkdir(parents=True)
    for sub in ("prompts", "base"):
        shutil.copytree(REPO / "data" / sub, folder / "data" / sub)
    raw = yaml.safe_load((REPO / "params.yaml").read_text())
    for section, values in overrides.items():
        raw[section].update(values)
    (folder / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return folder


def run_arm(overrides: dict) -> dict:
    """Iteration 1's stages in this process; per-stage walls (s) and the stages' own counts."""
    from tpgrpo.config import load_config

    with tempfile.TemporaryDirectory() as tmp:
        root = make_project(Path(tmp) / "project", overrides)
        cfg = load_config(root / "params.yaml")
        walls, logs = {}, {}
        for name in STAGES:
            start = time.perf_counter()
            logs[name] = run_stage(name, cfg, 1, root)
            walls[name] = round(time.perf_counter() - start, 2)
    keep = ("forward_passes", "decodes", "trajectories", "sde_edges", "leaves", "num_transitions", "mean_reward")
    return {"walls": walls, "total": round(sum(walls.values()), 2),
            "logs": {n: {k: v for k, v in logs[n].items() if k in keep} for n in logs}}


def arm_overrides(shape: str, mode: str, split: str = "0,3,6", m: int | str = 1, roots: int = 1) -> dict:
    """The params overrides of one arm: ``shape`` chain | tree (the params' ``tree.enabled``), the tree's
    split steps, m and R, and the credit mode."""
    return {"tree": {"enabled": shape == "tree", "split_steps": split, "children": children_value(m), "roots": roots},
            "credit": {"mode": mode}}


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return "unknown"


def spawn(args: list[str]) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "bench.tree_cost", "arm", *args], env=env, cwd=REPO, stdout=subprocess.PIPE,
                            text=True)


def side_by_side(split: str, m: str, roots: int) -> None:
    load_before = os.getloadavg()
    procs = {"chain flow_grpo": spawn(["--shape", "chain", "--mode", "flow_grpo"]),
             f"tree tp ({split}; m={m}; R={roots})": spawn(["--shape", "tree", "--mode", "tp", "--split", split,
                                                              "--m", str(m), "--roots", str(roots)])}
    results = {name: json.loads(p.communicate()[0].strip().splitlines()[-1]) for name, p in procs.items()}
    load_after = os.getloadavg()
    print(f"CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; OMP_NUM_THREADS=1 per arm, both at once")
    print(f"load average (1/5/15 min) before {load_before}, after {load_after}")
    for name, r in results.items():
        print(f"{name:<34} walls {r['walls']} total {r['total']} s  counts {json.dumps(r['logs'])}")
    chain, tree = (r["total"] for r in results.values())
    print(f"iteration cost ratio tree / chain = {tree / chain:.3f}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("what", choices=("counts", "arm", "side-by-side", "sweep"))
    ap.add_argument("--shape", default="tree")
    ap.add_argument("--mode", default="tp")
    ap.add_argument("--split", default="0,3,6")
    ap.add_argument("--m", default="1", help='SDE children per split: "3" for every split, "3,1" per split')
    ap.add_argument("--roots", type=int, default=1)
    a = ap.parse_args()
    if a.what == "counts":
        c = counts(10, 9, 8, a.split, a.m, a.roots)
        print_counts([("chain flow_grpo (G=8, T=10, w=9)", c["chain"]), ("chain tp, exact probe", c["chain_tp_exact"]),
                      (f"tree {a.split}; m={a.m}; R={a.roots}", c["tree"])])
    elif a.what == "arm":
        print(json.dumps(run_arm(arm_overrides(a.shape, a.mode, a.split, a.m, a.roots))))
    elif a.what == "side-by-side":
        side_by_side(a.split, a.m, a.roots)
    else:
        print(f"CPU: {cpu_model()}; OMP_NUM_THREADS={os.environ.get('OMP_NUM_THREADS')}; load {os.getloadavg()}")
        rows = [(f"tree {s}; m={m}; R={r}", counts(10, 9, 8, s, m, r)["tree"]) for s, m, r in SWEEP]
        print_counts([("chain flow_grpo", counts(10, 9, 8, "0", 1, 1)["chain"])] + rows)
        for s, m, r in SWEEP:
            out = run_arm(arm_overrides("tree", "tp", s, m, r))
            print(f"tree {s}; m={m}; R={r}: walls {out['walls']} total {out['total']} s; load {os.getloadavg()}",
                  flush=True)


if __name__ == "__main__":
    main()
