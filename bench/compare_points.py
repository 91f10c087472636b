"""Paired held-out differences at chosen iterations of a comparison's runs (the report pairs by recorded
seconds; this pairs by iteration, e.g. tp at its budget against flow_grpo at its equal-compute iteration).

Usage: ``python -m bench.compare_points [--out runs/compare] [--pair tp@12-flow_grpo@30 ...] [--seeds 0,1,2]``;
a side may name another root (``runs/compare_long/tp@36``). Same seeds on
both sides, pooled per image over the seeds, 10,000 bootstrap resamples of prompts
(``tpgrpo.comparison.results.paired_difference``); iteration 0 is the base model.
"""

from __future__ import annotations

import argparse
import re
from pathlib import Path

from tpgrpo.comparison.results import paired_difference

DEFAULT = ("tp@12-flow_grpo@30", "flow_grpo@30-flow_grpo@12", "flow_grpo@30-flow_grpo@0")


def side(out: Path, text: str, seeds: list[int]) -> list[tuple[Path, int]]:
    """``variant@i`` under OUT, or ``ROOT/variant@i`` (a path with a slash: another comparison root)."""
    variant, _, iteration = text.rpartition("@")
    folder = Path(variant) if "/" in variant else out / variant
    return [(folder / f"seed{s}", int(iteration)) for s in seeds]


def split_pair(pair: str) -> tuple[str, str]:
    """``A@i-B@j`` -> (``A@i``, ``B@j``); variant names may hold hyphens (``flow_grpo-lr0.0003@30``)."""
    match = re.fullmatch(r"(.+@\d+)-(.+@\d+)", pair)
    if not match:
        raise SystemExit(f"--pair {pair!r}: expected A@i-B@j")
    return match.group(1), match.group(2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path("runs/compare"))
    ap.add_argument("--pair", action="append", help="A@i-B@j (repeatable)")
    ap.add_argument("--seeds", default="0,1,2")
    args = ap.parse_args()
    seeds = [int(s) for s in args.seeds.split(",")]
    for pair in args.pair or DEFAULT:
        a, b = split_pair(pair)
        d = paired_difference(side(args.out, a, seeds), side(args.out, b, seeds))
        print(f"{a} - {b}: {d['reward_a']:.4f} vs {d['reward_b']:.4f}: {d['reward_diff']:+.4f} "
              f"[{d['reward_lo']:+.4f}, {d['reward_hi']:+.4f}] over prompts, "
              f"[{d['reward_seed_lo']:+.4f}, {d['reward_seed_hi']:+.4f}] over seeds and prompts; per seed "
              f"{', '.join(f'{x:+.4f}' for x in d['per_seed_reward_diff'])}; strict accuracy "
              f"{d['strict_diff']:+.4f} [{d['strict_lo']:+.4f}, {d['strict_hi']:+.4f}]")


if __name__ == "__main__":
    main()
