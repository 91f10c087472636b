"""Throughput of each reward (images/s) on clean renders of the held-out prompts.

Usage: ``python -m bench.bench_rewards [--n 512] [--n-ocr 200] [--repeats 3]``.
Scores one batch per reward; the first call is a warm-up (it also loads the OCR models) and is not
timed; prints the best of `repeats` timed calls, one line per reward.
"""

from __future__ import annotations

import argparse
import time

import numpy as np

from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.render import render_prompt
from tpgrpo.tasks.rewards import get_reward

# The embedded rewards (the model and remote rewards need folders / a server: see tests/test_rewards_*.py).
_TASK = {"geneval": "compositional", "geneval_soft": "compositional", "ocr": "text",
         "jpeg_compressibility": "compositional"}


def _batch(task: str, n: int, seed: int = 0) -> tuple[np.ndarray, list[dict]]:
    """n clean renders (uint8 (n, 32, 32, 3)) of the task's eval prompts, cycled."""
    prompts = build_prompt_sets()[f"{task}_eval"]
    metas = [prompts[i % len(prompts)] for i in range(n)]
    rng = np.random.default_rng(seed)
    return np.stack([render_prompt(m, rng) for m in metas]), metas


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=512, help="images per compositional batch")
    parser.add_argument("--n-ocr", type=int, default=200, help="images per OCR batch")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()

    for name in _TASK:
        task = _TASK[name]
        images, metas = _batch(task, args.n_ocr if task == "text" else args.n)
        reward = get_reward(name)
        reward(images[:8], metas[:8])  # warm-up
        best = float("inf")
        for _ in range(args.repeats):
            t0 = time.perf_counter()
            result = reward(images, metas)
            best = min(best, time.perf_counter() - t0)
        print(f"{name:>12}: {len(images) / best:8.1f} images/s  ({len(images)} images, "
              f"mean reward {result.reward.mean():.3f}, strict {result.strict.mean():.3f})")


if __name__ == "__main__":
    main()
