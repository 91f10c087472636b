"""Cost per iteration of update.objective nft / awm against Flow-GRPO (grpo, flow_grpo credit), on the tiny model.

    python -m bench.objective_cost                     # pairs at once, 1 thread each: flow_grpo with nft, with awm
    python -m bench.objective_cost --arms nft,tree-tp-nft   # other arms beside flow_grpo (names below)

Each arm is iteration 1's rollout, probe, credit and update in a fresh project built from this checkout's
params.yaml and ``data/base`` (``bench/tree_cost.py``'s ``run_arm``; eval left out: the same for every arm).
Each pair runs at once, one torch thread per arm, so both see the same load; the load average before and after
each pair and the CPU are printed. Arms: ``flow_grpo`` (chain, grpo), ``nft`` / ``awm`` (chain, Flow-GRPO's
credit under the objective: the published methods), ``tree-tp`` (grpo), ``tree-tp-nft`` / ``tree-tp-awm`` (tp
credit inside the objective, ``update.split_levels``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from bench.common import REPO
from bench.tree_cost import cpu_model, run_arm

ARMS = {
    "flow_grpo": {"tree": {"enabled": False}, "credit": {"mode": "flow_grpo"}, "update": {"objective": "grpo"}},
    "nft": {"tree": {"enabled": False}, "credit": {"mode": "flow_grpo"}, "update": {"objective": "nft"}},
    "awm": {"tree": {"enabled": False}, "credit": {"mode": "flow_grpo"}, "update": {"objective": "awm"}},
    "tree-tp": {"tree": {"enabled": True}, "credit": {"mode": "tp"}, "update": {"objective": "grpo"}},
    "tree-tp-nft": {"tree": {"enabled": True}, "credit": {"mode": "tp"},
                    "update": {"objective": "nft", "split_levels": True}},
    "tree-tp-awm": {"tree": {"enabled": True}, "credit": {"mode": "tp"},
                    "update": {"objective": "awm", "split_levels": True}},
}


def spawn(arm: str) -> subprocess.Popen:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1"}
    return subprocess.Popen([sys.executable, "-m", "bench.objective_cost", "--one", arm], cwd=REPO, env=env, stdout=subprocess.PIPE, text=True)


def pair(arm: str, baseline: str = "flow_grpo") -> None:
    """``arm`` and ``baseline`` at once; prints each one's stage walls and the ratio of their totals."""
    before = os.getloadavg()
    procs = {name: spawn(name) for name in (baseline, arm)}
    out = {name: json.loads(p.communicate()[0].strip().splitlines()[-1]) for name, p in procs.items()}
    after = os.getloadavg()
    print(f"load average (1/5/15 min) before {before}, after {after}")
    for name, r in out.items():
        print(f"  {name:<12} walls {r['walls']} total {r['total']} s; update {json.dumps(r['logs']['update'])}")
    print(f"  iteration cost {arm} / {baseline} = {out[arm]['total'] / out[baseline]['total']:.3f} "
          f"(update alone {out[arm]['walls']['update'] / out[baseline]['walls']['update']:.3f})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--arms", default="nft,awm", help=f"arms to set beside flow_grpo: {', '.join(ARMS)}")
    ap.add_argument("--one", default="", help=argparse.SUPPRESS)  # a child: one arm, its JSON on stdout
    a = ap.parse_args()
    if a.one:
        print(json.dumps(run_arm(ARMS[a.one])))
        return
    print(f"CPU: {cpu_model()}; {os.cpu_count()} logical CPUs; OMP_NUM_THREADS=1 per arm, each pair at once")
    for arm in a.arms.split(","):
        if arm not in ARMS:
            sys.exit(f"error: --arms {arm!r}: expected one of {', '.join(ARMS)}")
        pair(arm)


if __name__ == "__main__":
    main()
