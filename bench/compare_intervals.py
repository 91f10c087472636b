"""False exclusions of 0 under no true difference, and power at a true difference, of the comparison's two
intervals over training seeds and prompts, side by side (tpgrpo.comparison.null_model):

    bootstrap: tpgrpo.comparison.stats.seed_prompt_bootstrap (the percentile two-level bootstrap)
    t:         tpgrpo.comparison.stats.seed_prompt_t_interval (the verdicts' interval)

Usage: ``python -m bench.compare_intervals [--draws 4000] [--boot-draws 1000] [--seeds 1,3,5,6]``.
"""

from __future__ import annotations

import argparse
import time
from dataclasses import replace

from tpgrpo.comparison.null_model import NullModel, bootstrap_rates, t_rates


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--draws", type=int, default=4000, help="draws for the t interval")
    parser.add_argument("--boot-draws", type=int, default=1000, help="draws for the bootstrap (slower)")
    parser.add_argument("--seeds", default="1,3,5,6")
    parser.add_argument("--prompt-sd", default="0,0.02", help="shared prompt effects to simulate")
    parser.add_argument("--true-diff", type=float, default=0.03)
    args = parser.parse_args()
    print(f"model: {NullModel()} (seeds and prompt_sd varied); power at a true difference {args.true_diff}")
    print("seeds  prompt_sd | false exclusions: bootstrap      t   ratio | power: bootstrap      t | seconds")
    for prompt_sd in (float(x) for x in args.prompt_sd.split(",")):
        for seeds in (int(x) for x in args.seeds.split(",")):
            model = replace(NullModel(), seeds=seeds, prompt_sd=prompt_sd)
            start = time.perf_counter()
            boot = bootstrap_rates(model, args.boot_draws, seed=seeds, true_diff=args.true_diff)
            t = t_rates(model, args.draws, seed=seeds, true_diff=args.true_diff)
            ratio = boot[0] / t[0] if t[0] else float("inf")
            print(f"{seeds:5d}  {prompt_sd:9.3f} |                  {boot[0]:.3f}  {t[0]:.3f}  {ratio:5.1f} |"
                  f"          {boot[1]:.3f}  {t[1]:.3f} | {time.perf_counter() - start:.1f}")


if __name__ == "__main__":
    main()
