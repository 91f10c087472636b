"""Training runs of several probe / credit settings, side by side: held-out reward and cost per iteration.

Usage: ``python -m bench.studies.probe_mode_runs LABEL=RUN_FOLDER,RUN_FOLDER,... [...] [--reference LABEL]
[--iteration 12] [--n-boot 10000]``: each label names run folders of one setting, one per training seed, in
the same seed order for every label (seed i pairs with seed i). Prints, per label, the held-out reward at
``--iteration`` per seed and pooled over seeds, its paired difference against the base model and against
``--reference`` (mean over seeds per image, 95% bootstrap interval over prompts,
``tpgrpo.comparison.results.paired_difference``), and the per-iteration seconds of rollout, probe, credit and
update (each stage's own ``wall_seconds``, mean over iterations and seeds).
"""

from __future__ import annotations

import argparse
from pathlib import Path

from bench.common import REPO
from tpgrpo.comparison.results import paired_difference, seed_scores
from tpgrpo.io.stage_logs import log_seconds

STAGES = ("rollout", "probe", "credit", "update")


def stage_seconds(folders: list[Path], iterations: int) -> dict[str, float]:
    """Mean wall seconds per iteration of each stage over the runs (0 for a stage a run does not have)."""
    sums = dict.fromkeys(STAGES, 0.0)
    for folder in folders:
        for i in range(1, iterations + 1):
            for stage in STAGES:
                path = folder / "data" / "iters" / f"{i:04d}" / f"{stage}.json"
                if path.is_file():
                    sums[stage] += log_seconds(path)  # its timing sidecar, or the log of an older run
    return {s: v / (len(folders) * iterations) for s, v in sums.items()}


def interval(d: dict) -> str:
    return f"{d['reward_diff']:+.3f} [{d['reward_lo']:+.3f}, {d['reward_hi']:+.3f}]"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("settings", nargs="+", help="LABEL=FOLDER,FOLDER,...")
    ap.add_argument("--reference", default=None, help="label every other is compared with")
    ap.add_argument("--iteration", type=int, default=12)
    ap.add_argument("--n-boot", type=int, default=10_000)
    args = ap.parse_args()
    runs = {}
    for spec in args.settings:
        label, _, folders = spec.partition("=")
        runs[label] = [Path(f) for f in folders.split(",")]
    print("| setting | seeds | held-out reward per seed | pooled | vs base | vs " + str(args.reference)
          + " | rollout s | probe s | credit s | update s | sum s |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for label, folders in runs.items():
        side = [(f, args.iteration) for f in folders]
        per_seed = [seed_scores([s])[0]["eval_reward"].mean() for s in side]
        base = paired_difference(side, [(f, 0) for f in folders], n_boot=args.n_boot)
        ref = ""
        if args.reference and label != args.reference:
            other = [(f, args.iteration) for f in runs[args.reference]]
            ref = interval(paired_difference(side, other, n_boot=args.n_boot))
        secs = stage_seconds(folders, args.iteration)
        print(f"| {label} | {len(folders)} | {' / '.join(f'{r:.3f}' for r in per_seed)} | {base['reward_a']:.3f} | "
              f"{interval(base)} | {ref} | " + " | ".join(f"{secs[s]:.1f}" for s in STAGES)
              + f" | {sum(secs.values()):.1f} |")


if __name__ == "__main__":
    main()
