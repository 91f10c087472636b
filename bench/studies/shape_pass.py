"""A tree shape's short training pass, summarised per variant root.

    python -m bench.studies.shape_pass ROOT [ROOT ...]

Each ROOT is a `tpgrpo compare run --tree-modes tp` output (one arm, ``tree-tp``, seeds under it). Prints per
root: the tree's counts (leaves, trained SDE edges and transformer rows per prompt), the update's transitions
and AdamW steps per iteration (from ``update.json``), training seconds per iteration (the stages' timing
sidecars, :func:`tpgrpo.comparison.runs.train_seconds`), and held-out reward per evaluated iteration, per seed.
"""

from __future__ import annotations

import sys
from pathlib import Path
from statistics import mean

import yaml

from tpgrpo.algo.tree_shape import TreeShape, parse_children, parse_split_steps
from tpgrpo.comparison import store
from tpgrpo.comparison.runs import train_seconds
from tpgrpo.config_values import child_counts


def summarise(root: Path) -> None:
    seeds = store.seed_folders(root / "tree-tp")
    raw = yaml.safe_load(store.read_text(seeds[0] / "params.yaml"))
    t, T = raw["tree"], raw["sampling"]["num_steps"]
    shape = TreeShape(parse_split_steps(t["split_steps"]), parse_children(child_counts("tree.children", t["children"])), int(t["roots"]))
    prompts = raw["rollout"]["prompts_per_iter"]
    print(f"{root.name}: split {t['split_steps']} m {t['children']} R {t['roots']}, {prompts} prompts/iteration: "
          f"per prompt {shape.roots * shape.leaves_per_root()} leaves, {shape.roots * shape.sde_edges_per_root()} "
          f"SDE edges, {shape.roots * shape.passes_per_root(T)} rows")
    curves = {}
    for folder in seeds:
        iters = [i for i in store.run_iterations(folder) if store.is_file(folder / "data" / "iters" / f"{i:04d}" / "update.json")]
        if not iters:  # not started yet
            continue
        logs = [store.read_json(folder / "data" / "iters" / f"{i:04d}" / "update.json") for i in iters]
        secs = train_seconds(folder, len(iters))
        evals = {i: e["eval_reward"] for i in iters
                 if store.is_file(p := folder / "data" / "iters" / f"{i:04d}" / "eval.json")
                 and "eval_reward" in (e := store.read_json(p))}
        curves[folder.name] = evals
        print(f"  {folder.name}: {len(iters)} iterations, {mean(secs):.1f} s/iteration, transitions "
              f"{mean(g['num_transitions'] for g in logs):.0f}, steps "
              f"{mean(g['optimizer_steps'] for g in logs):.1f}; held-out "
              + ", ".join(f"{i}: {v:.4f}" for i, v in sorted(evals.items())))
    common = set.intersection(*(set(c) for c in curves.values())) if curves else set()
    print("  mean held-out: " + ", ".join(f"{i}: {mean(c[i] for c in curves.values()):.4f}" for i in sorted(common)))


if __name__ == "__main__":
    for arg in sys.argv[1:]:
        summarise(Path(arg))
