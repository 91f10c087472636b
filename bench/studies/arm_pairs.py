"""Held-out reward of one arm against another, from any two comparison roots or archives: controls
(an arm that changes one thing, trained in a root of its own, against the archived arm it changes).

    python -m bench.studies.arm_pairs A_ROOT/ARM B_ROOT/ARM [--at IA:IB ...] [--seeds 0,1,2] [--level 0.975]

Each ``ROOT/ARM`` is a folder of ``seedK`` run folders (a ``tpgrpo compare run`` root's arm, or an archive's
under ``results/``, compact: :mod:`tpgrpo.comparison.store`). Prints, per evaluated iteration of each, the mean held-out reward over the
seeds both have and each seed's, the base model's; and for each ``--at IA:IB`` the paired difference A at IA -
B at IB over those seeds and the held-out images, with the 95% interval over seeds and prompts
(``tpgrpo.comparison.stats.seed_prompt_t_interval``, as the report) and how many seeds A is above B. No model
runs: it reads ``eval.parquet`` and ``baseline_eval.parquet`` tables only.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import numpy as np


def eval_tables(arm: Path, seeds: list[int]) -> dict[int, dict[int, object]]:
    """``{seed: {iteration: table}}``, iteration 0 the base model, of every evaluated iteration."""
    from tpgrpo.comparison.store import is_file, read_eval_table, run_iterations

    out: dict[int, dict[int, object]] = {}
    for seed in seeds:
        data = arm / f"seed{seed}" / "data"
        tables = {0: read_eval_table(data / "iters" / "baseline_eval.parquet")}
        for it in run_iterations(arm / f"seed{seed}"):
            path = data / "iters" / f"{it:04d}" / "eval.parquet"
            table = read_eval_table(path) if is_file(path) else []
            if len(table):  # an iteration eval.every skipped writes an empty table
                tables[int(path.parent.name)] = table
        out[seed] = tables
    return out


def seed_list(arm: Path) -> list[int]:
    from tpgrpo.comparison.store import is_file, seed_folders

    return [int(p.name[4:]) for p in seed_folders(arm) if is_file(p / "data" / "iters" / "baseline_eval.parquet")]


def curve(tables: dict[int, dict[int, object]]) -> list[str]:
    """One line per iteration evaluated in every seed: mean and per-seed mean ``eval_reward``."""
    common = set.intersection(*(set(t) for t in tables.values()))
    lines = []
    for it in sorted(common):
        per_seed = [float(t[it]["eval_reward"].mean()) for t in tables.values()]
        lines.append(f"  {'base' if it == 0 else f'iter {it:2d}'}: {np.mean(per_seed):.4f}   seeds "
                     + " ".join(f"{v:.3f}" for v in per_seed))
    return lines


def paired_row(ta, tb, column: str = "eval_reward"):
    """``(A - B of column per image, prompt id per image)`` of two eval tables, images in (prompt_id, sample,
    seed) order; None when the tables hold other images."""
    from tpgrpo.comparison.stats import PAIR_KEYS

    ta, tb = (t.sort_values(list(PAIR_KEYS)).reset_index(drop=True) for t in (ta, tb))
    if not ta[list(PAIR_KEYS)].equals(tb[list(PAIR_KEYS)]):
        return None
    return (ta[column] - tb[column]).to_numpy(), ta["prompt_id"].to_numpy()


def pair(a: dict, b: dict, ia: int, ib: int, level: float = 0.95) -> str:
    """A at ``ia`` - B at ``ib`` over the seeds both have, paired by (prompt, sample, seed) image; the interval
    at ``level`` (0.975 for one of two looks at the same hypothesis, Bonferroni)."""
    from tpgrpo.comparison.stats import seed_prompt_t_interval

    diffs, prompts = [], None
    for seed in sorted(set(a) & set(b)):
        if ia not in a[seed] or ib not in b[seed]:
            return f"  A@{ia} - B@{ib}: not evaluated in seed {seed}"
        paired = paired_row(a[seed][ia], b[seed][ib])
        if paired is None:
            return f"  A@{ia} - B@{ib}: seed {seed}'s tables hold other images"
        diff, prompts = paired
        diffs.append(diff)
    d = np.stack(diffs)
    mean, lo, hi = seed_prompt_t_interval(d, prompts, level=level)
    above = int((d.mean(axis=1) > 0).sum())
    return (f"  A@{ia} - B@{ib}: {mean:+.4f} [{lo:+.4f}, {hi:+.4f}] ({level:.1%}) over {d.shape[0]} seeds x {d.shape[1]} images; "
            f"A above B in {above} of {d.shape[0]} seeds")


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("a", type=Path)
    parser.add_argument("b", type=Path)
    parser.add_argument("--at", action="append", default=[], help="IA:IB, iterations of A and B to pair")
    parser.add_argument("--seeds", default="", help="seeds to use (default: those both arms have)")
    parser.add_argument("--level", type=float, default=0.95, help="the intervals' level (default 0.95)")
    args = parser.parse_args(argv)
    seeds = ([int(s) for s in args.seeds.split(",")] if args.seeds
             else sorted(set(seed_list(args.a)) & set(seed_list(args.b))))
    if not seeds:
        raise SystemExit(f"error: no seed with data in both {args.a} and {args.b}")
    a, b = eval_tables(args.a, seeds), eval_tables(args.b, seeds)
    print(f"seeds {seeds}\nA = {args.a}")
    print("\n".join(curve(a)))
    print(f"B = {args.b}")
    print("\n".join(curve(b)))
    for spec in args.at:
        ia, _, ib = spec.partition(":")
        print(pair(a, b, int(ia), int(ib), args.level))


if __name__ == "__main__":
    main()
