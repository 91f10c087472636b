"""Paired held-out differences at chosen iterations of a comparison's runs (the report pairs by recorded
seconds; this pairs by iteration, e.g. tp at its budget against flow_grpo at its equal-compute iteration).

Usage: ``python bench/compare_points.py [--out runs/compare] [--pair tp@12-flow_grpo@30 ...]``. Same seeds on
both sides, pooled per image over the seeds, 10,000 bootstrap resamples of prompts
(``tpgrpo.comparison_results.paired_difference``); iteration 0 is the base model.
"""

from __future__ import annotations

import argparse
from pathlib import Path

from tpgrpo.comparison_results import paired_difference

DEFAULT = ("tp@12-flow_grpo@30", "flow_grpo@30-flow_grpo@12", "flow_grpo@30-flow_grpo@0")


def side(out: Path, text: str, seeds: list[int]) -> list[tuple[Path, int]]:
    variant, _, iteration = text.partition("@")
    return [(out / variant / f"seed{s}", int(iteration)) for s in seeds]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/compare"))
    ap.add_argument("--pair", action="append", help="A@i-B@j (repeatable)")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    for pair in args.pair or DEFAULT:
        a, b = pair.split("-")
        d = paired_difference(side(args.out, a, seeds), side(args.out, b, seeds))
        print(f"{a} - {b}: {d['reward_a']:.4f} vs {d['reward_b']:.4f}: {d['reward_diff']:+.4f} "
              f"[{d['reward_lo']:+.4f}, {d['reward_hi']:+.4f}]; per seed "
              f"{', '.join(f'{x:+.4f}' for x in d['per_seed_reward_diff'])}; strict accuracy "
              f"{d['strict_diff']:+.4f} [{d['strict_lo']:+.4f}, {d['strict_hi']:+.4f}]")


if __name__ == "__main__":
    main()
