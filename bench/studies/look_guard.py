"""Which iteration of the cheaper arm a planned equal-wall look reads, by a guard fixed before the runs (the
third test of results/tree_geneval_k8_issue45/plan.txt): the iteration ``compare equal-wall`` chose
(its ``equal_wall.json``), unless the target's training seconds there exceed the reference's at its budget by
more than ``--tolerance``; then the target's largest evaluated iteration whose seconds do not exceed them.

    python -m bench.studies.look_guard ROOT [--reference flow_grpo] [--target tree-tp] [--tolerance 0.10]

ROOT is a comparison root or an archive. Seconds are training seconds (rollout + probe + credit + update, as the
stages measured them: ``tpgrpo.comparison.runs.train_seconds``), summed over the iterations and averaged over
the seeds. Prints both arms' seconds, the ratio, and the iteration to read, with the reason. No model runs.
"""

from __future__ import annotations

import argparse
from pathlib import Path



def mean_seconds_through(arm: Path, iterations: int) -> float:
    """Mean over the arm's seeds of its training seconds over iterations 1..``iterations``."""
    from tpgrpo.comparison.runs import train_seconds
    from tpgrpo.comparison.store import seed_folders

    totals = [sum(train_seconds(folder, iterations)) for folder in seed_folders(arm)]
    if not totals:
        raise SystemExit(f"no seed folders under {arm}")
    return sum(totals) / len(totals)


def evaluated(arm: Path) -> list[int]:
    """The iterations every seed of the arm evaluated (a non-empty ``eval.parquet``)."""
    from tpgrpo.comparison.store import is_file, read_eval_table, run_iterations, seed_folders

    per_seed = []
    for folder in seed_folders(arm):
        tables = {i: folder / "data" / "iters" / f"{i:04d}" / "eval.parquet" for i in run_iterations(folder)}
        per_seed.append({i for i, p in tables.items() if is_file(p) and len(read_eval_table(p))})
    return sorted(set.intersection(*per_seed)) if per_seed else []


def guarded_iteration(target_seconds: dict[int, float], reference_seconds: float, planned: int,
                      tolerance: float) -> tuple[int, str]:
    """The iteration to read: ``planned`` when its seconds are within ``(1 + tolerance)`` x the reference's, else
    the largest iteration of ``target_seconds`` (evaluated ones) at or below the reference's seconds."""
    if target_seconds[planned] <= (1 + tolerance) * reference_seconds:
        return planned, f"the planned {planned}: {target_seconds[planned] / reference_seconds - 1:+.1%} seconds"
    within = [i for i, s in target_seconds.items() if s <= reference_seconds]
    if not within:
        raise SystemExit("no evaluated iteration of the target within the reference's seconds")
    chosen = max(within)
    return chosen, (f"the planned {planned} has {target_seconds[planned] / reference_seconds - 1:+.1%} seconds, over "
                    f"the tolerance: {chosen}, the largest evaluated iteration within the reference's seconds")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("root", type=Path)
    parser.add_argument("--reference", default="flow_grpo")
    parser.add_argument("--target", default="tree-tp")
    parser.add_argument("--tolerance", type=float, default=0.10)
    args = parser.parse_args()
    from tpgrpo.comparison.runs import equal_wall_records

    record = next((r for r in equal_wall_records(args.root)
                   if r.get("reference") == args.reference and r["target"] == args.target), None)
    if record is None:
        raise SystemExit(f"{args.root}/equal_wall.json has no pass {args.reference} -> {args.target}")
    reference = mean_seconds_through(args.root / args.reference, record["budget"])
    target = {i: mean_seconds_through(args.root / args.target, i) for i in evaluated(args.root / args.target)
              if i <= record["iterations"]}
    if record["iterations"] not in target:
        raise SystemExit(f"the target has no evaluated iteration {record['iterations']} on every seed")
    chosen, why = guarded_iteration(target, reference, record["iterations"], args.tolerance)
    print(f"{args.reference} at {record['budget']}: {reference:.0f} s of training (mean over seeds); "
          f"{args.target}: " + ", ".join(f"{i}: {s:.0f} s" for i, s in target.items()))
    print(f"equal-wall pass: ratio {record['ratio']}, iteration {record['iterations']}")
    print(f"read {args.target} at {chosen} against {args.reference} at {record['budget']} ({why})")


if __name__ == "__main__":
    main()
