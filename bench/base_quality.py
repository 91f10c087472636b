"""Held-out quality of a base model (or a pretraining checkpoint) across sampler settings.

    python -m bench.base_quality --model data/base --guidance 3,4.5,6 --steps 10,20,40
    python -m bench.base_quality --checkpoint data/.base.pretrain-ckpt.pt --guidance 4.5 --steps 40

Prints one row per (guidance, steps): mean `geneval` reward, strict accuracy, and strict accuracy per prompt
kind (single object, counting, two objects, position) on every held-out compositional prompt, at eval's
seeds (`eval.seed` of params.yaml, `--samples` per prompt). A checkpoint is scored with its EMA weights, as
the finished run would save them. Used to choose the base's pretraining budget and the sampler's guidance.
"""

from __future__ import annotations

import argparse
import json
import time
from collections import defaultdict
from pathlib import Path

import numpy as np
import torch


def _backend_from_checkpoint(path: Path):
    """A TinyBackend holding a pretraining checkpoint's EMA weights (the live ones without an EMA)."""
    from tpgrpo.models.tiny import TinyBackend, TinyConfig, build_tiny

    state = torch.load(path, map_location="cpu", weights_only=False)
    config = TinyConfig.from_dict(state["identity"]["config"])
    built = build_tiny(config, seed=0)
    backend = TinyBackend(built.transformer, built.text_encoder, built.tokenizer, config)
    for module, saved in zip(backend.modules(), state["modules"]):
        module.load_state_dict(saved)
    if state["ema"] is not None:
        params = [p for m in backend.modules() for p in m.parameters()]
        for p, shadow in zip(params, state["ema"]["shadow"]):
            p.data.copy_(shadow)
    for module in backend.modules():
        module.eval()
    return backend, state["n_steps"]


def _kind(meta: dict) -> str:
    """The GenEval-style task of a prompt's metadata (its `tag`, `kind` or `task` field)."""
    for key in ("tag", "kind", "type", "task_kind"):
        if key in meta:
            return str(meta[key])
    return "all"


def score(backend, metas, seed: int, samples: int, guidance: float, steps: int) -> dict:
    """Sample every held-out prompt `samples` times at eval's seeds and score with `geneval`."""
    from tpgrpo.policy.generate import evaluation_seeds, sample_ode
    from tpgrpo.tasks.rewards import get_reward

    reps = [m for m in metas for _ in range(samples)]
    images = sample_ode(backend, [m["prompt"] for m in reps], evaluation_seeds(seed, metas, samples),
                        num_steps=steps, guidance_scale=guidance, shift=1.0)
    scored = get_reward("geneval")(images, reps)
    per_kind = defaultdict(list)
    for meta, strict in zip(reps, scored.strict):
        per_kind[_kind(meta)].append(float(strict))
    return {"guidance": guidance, "steps": steps, "images": len(reps),
            "reward": round(float(scored.reward.mean()), 4), "strict": round(float(scored.strict.mean()), 4),
            "strict_by_kind": {k: round(float(np.mean(v)), 3) for k, v in sorted(per_kind.items())}}


def main() -> None:
    from tpgrpo.models import load_backend
    from tpgrpo.tasks.prompts import load_prompts

    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    src = ap.add_mutually_exclusive_group(required=True)
    src.add_argument("--model", type=Path, help="a model folder (save_pretrained layout)")
    src.add_argument("--checkpoint", type=Path, help="a pretraining checkpoint (.pt)")
    ap.add_argument("--guidance", default="4.5", help="comma-separated CFG scales")
    ap.add_argument("--steps", default="40", help="comma-separated ODE step counts")
    ap.add_argument("--samples", type=int, default=2, help="seeds per held-out prompt (eval's 2)")
    ap.add_argument("--seed", type=int, default=0, help="eval seed (eval.seed)")
    ap.add_argument("--prompts", type=Path, default=Path("data/prompts/compositional_eval.jsonl"))
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--export", type=Path, default=None,
                    help="also save the scored weights as a model folder here (e.g. to try RL on a checkpoint)")
    args = ap.parse_args()
    torch.set_num_threads(args.threads)
    if args.model:
        backend, label = load_backend("tiny", args.model, "cpu", "fp32"), str(args.model)
    else:
        backend, n = _backend_from_checkpoint(args.checkpoint)
        label = f"{args.checkpoint} (step {n})"
    if args.export:
        backend.save_pretrained(args.export)
    metas = load_prompts(args.prompts)
    for guidance in (float(g) for g in args.guidance.split(",")):
        for steps in (int(s) for s in args.steps.split(",")):
            t0 = time.monotonic()
            row = score(backend, metas, args.seed, args.samples, guidance, steps)
            row.update(model=label, seconds=round(time.monotonic() - t0, 1), threads=args.threads)
            print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
