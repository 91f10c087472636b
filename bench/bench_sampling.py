"""Throughput of ODE sampling with the tiny model: images/s at 10 steps with guidance, batch 64.

Usage: ``python -m bench.bench_sampling [--model data/base] [--n 128] [--steps 10] [--batch 64]``.
Uses the shipped weights when the folder exists, else a freshly built default-size model (same
speed). Prints one line per setting; the first batch is a warm-up and is not timed.
"""

from __future__ import annotations

import argparse
import time
from pathlib import Path


def _backend(model: Path):
    from tpgrpo.models.tiny import TinyConfig, build_tiny, load_tiny

    if model.is_dir():
        return load_tiny(model), str(model)
    try:
        return build_tiny(TinyConfig(), seed=0), "random init (default TinyConfig)"
    except ImportError:  # tpgrpo.tasks missing: any vocabulary has the same speed
        return build_tiny(TinyConfig(), seed=0, words=["a", "red", "circle"], charset="0123"), "random init"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", type=Path, default=Path("data/base"))
    parser.add_argument("--n", type=int, default=128, help="images per timed run")
    parser.add_argument("--steps", type=int, default=10)
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--guidance", type=float, default=4.5)
    parser.add_argument("--threads", type=int, default=0, help="torch threads (0: torch default)")
    args = parser.parse_args()

    import torch

    from tpgrpo.policy.generate import sample_ode

    if args.threads:
        torch.set_num_threads(args.threads)
    backend, source = _backend(args.model)
    prompts = ["a red circle", 'a sign that says "42"'] * (args.n // 2 + 1)
    sample_ode(backend, prompts[:args.batch], list(range(args.batch)), num_steps=args.steps,
               guidance_scale=args.guidance, batch_size=args.batch)  # warm-up
    t0 = time.perf_counter()
    sample_ode(backend, prompts[:args.n], list(range(args.n)), num_steps=args.steps,
               guidance_scale=args.guidance, batch_size=args.batch)
    dt = time.perf_counter() - t0
    print(f"sample_ode: {args.n / dt:.1f} images/s ({args.n} images, {args.steps} steps, "
          f"guidance {args.guidance}, batch {args.batch}, {torch.get_num_threads()} threads, model: {source})")


if __name__ == "__main__":
    main()
