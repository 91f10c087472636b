"""Offline replay of a tree's credit under both edge returns: the stage's ``mean`` against ``ode``.

    python -m bench.studies.tree_credit_replay data/iters/0001/probe.parquet   # a tree run's probe table
    python -m bench.studies.tree_credit_replay                                 # makes one: tree rollout + probe, tiny model

No model runs for a given table: ``tpgrpo.algo.tree_credit.tree_credit_table`` is called on it for every credit
mode with ``edge_return`` mean (the credit stage's choice) and ode (F = Q(child): B = d, so the TP modes equal
incremental). Printed per mode and return: turning points among the SDE edges (before / after balancing), mean
|step reward| of the SDE edges, and how the SDE edges' advantages compare between the two returns.
"""

from __future__ import annotations

import sys
import tempfile
from pathlib import Path

import numpy as np
import pandas as pd

MODES = ("flow_grpo", "incremental", "tp", "tp_unconstrained")


def make_probe_table(folder: Path) -> Path:
    """A tree rollout and probe of iteration 1 with this checkout's params and tree_cost's tree arm (split steps
    0,3,6, m 1: its own shape, not the params' default tree) in ``folder``."""
    from bench.common import run_stage
    from bench.tree_cost import arm_overrides, make_project
    from tpgrpo.config import load_config

    root = make_project(folder / "project", arm_overrides("tree", "tp"))
    cfg = load_config(root / "params.yaml")
    for name in ("rollout", "probe"):
        run_stage(name, cfg, 1, root)
    return root / "data" / "iters" / "0001" / "probe.parquet"


def replay(path: Path) -> None:
    from tpgrpo.algo.tree_credit import tree_credit_table
    from tpgrpo.io.artifacts import read_table
    from tpgrpo.io.schemas import PROBE_TREE

    probe = read_table(path, PROBE_TREE, "a tree probe.parquet")
    sde = probe[probe.step == 0].sort_values("trajectory")["sde"].to_numpy()
    print(f"{path}: {sde.size} edges, {int(sde.sum())} SDE")
    print(f"{'mode':<17} {'return':<6} {'TP rate (SDE)':>13} {'mean |r| (SDE)':>14} {'adv corr':>9} {'sign flips':>10}")
    for mode in MODES:
        tables = {ret: tree_credit_table(probe, mode, "group", False, 5.0, edge_return=ret) for ret in ("mean", "ode")}
        a, b = (tables[r]["advantage"].to_numpy()[sde] for r in ("mean", "ode"))
        corr = float(np.corrcoef(a, b)[0, 1]) if a.std() > 0 and b.std() > 0 else float("nan")
        flips = float((np.sign(a) != np.sign(b)).mean())
        for ret, t in tables.items():
            tp = t["turning_point"].to_numpy()[sde].mean()
            r = np.abs(t["step_reward"].to_numpy()[sde]).mean()
            extra = f" {corr:>9.3f} {flips:>10.3f}" if ret == "ode" else ""
            print(f"{mode:<17} {ret:<6} {tp:>13.3f} {r:>14.5f}{extra}")


def main() -> None:
    if len(sys.argv) > 1:
        replay(Path(sys.argv[1]))
        return
    with tempfile.TemporaryDirectory() as tmp:
        replay(make_probe_table(Path(tmp)))


if __name__ == "__main__":
    pd.set_option("display.width", 160)
    main()
