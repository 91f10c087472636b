"""A fast in-process RL loop on the embedded model, outside the pipeline: which update moves the reward?

Not the product: no DVC, no stages, no artifacts. It exists to choose the default run's recipe by short
measured passes (the pipeline adds its own bookkeeping per iteration; the maths here uses the same library
pieces: the tiny backend, LoRA via peft, the ODE sampler, the geneval rewards, DiffusionNFT's loss).

Each iteration: P training prompts x G samples drawn with the ODE sampler (guidance as eval, fresh noise),
scored with ``--reward``; group-normalised advantages; then K AdamW steps on the LoRA adapter, each on a
minibatch of (sample, noise level, noise) items:
- ``raft``: flow-matching loss weighted by max(A, 0) (fine-tuning on the group's better samples);
- ``correct``: flow-matching loss on the samples the eval's rules call right (self-training on successes);
- ``nft``: DiffusionNFT's loss, the old policy = the adapter at the iteration's start (the sampler).
Prints one JSON line per iteration (training reward, strict, and the share of left/right samples drawn on the
asked side: `tpgrpo.tasks.clauses.side_sign`) and per eval (held-out, eval's settings).

    python -m bench.studies.quick_rl --method nft --iters 30 --lr 1e-3 --steps 8 --threads 1
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def read_metas(path: Path) -> list[dict]:
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def sample_latents(backend, embeds, seeds, steps: int, guidance: float):
    """Clean latents ``(N, C, H, W)`` from the ODE sampler (no grad)."""
    import torch

    from tpgrpo.algo.sampling import ode_step
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import velocity_at

    sigmas = flow_sigmas(steps, 1.0).tolist()
    with torch.no_grad():
        x = backend.initial_noise(seeds).float()
        for s, s_next in zip(sigmas[:-1], sigmas[1:]):
            x = ode_step(x, velocity_at(backend, x, s, embeds, guidance), s, s_next)
    return x


def group_advantages(reward: np.ndarray, group: int) -> np.ndarray:
    r = reward.reshape(-1, group)
    a = (r - r.mean(1, keepdims=True)) / (r.std(1, keepdims=True) + 1e-4)
    return a.reshape(-1)


def train_steps(backend, args, x0, adv, embeds, old_state, gen):
    """K AdamW steps on minibatches of (sample, t, eps); returns the mean loss."""
    import torch

    from tpgrpo.algo import objectives as obj
    from tpgrpo.policy.lora import load_lora_weights, lora_state_dict

    n = x0.shape[0]
    losses = []
    for _ in range(args.steps):
        idx = torch.randint(0, n, (args.batch,), generator=gen)
        t = torch.rand(args.batch, generator=gen) * (args.t_max - args.t_min) + args.t_min
        eps = torch.randn(x0[idx].shape, generator=gen)
        xt = obj.noised(x0[idx], eps, t)
        emb = embeds.index(idx.tolist())
        a = torch.as_tensor(adv, dtype=torch.float32)[idx]
        if args.method == "nft":
            current = lora_state_dict(backend)
            load_lora_weights(backend, old_state)
            with torch.no_grad():
                v_old = backend.velocity(xt, t, emb, args.train_guidance)
            load_lora_weights(backend, current)
        v = backend.velocity(xt, t, emb, args.train_guidance)
        if args.method == "nft":
            loss = obj.nft_loss(v, v_old, xt, x0[idx], t, a, args.beta).loss
        else:
            w = a.clamp_min(0.0)
            loss = (w * obj.flow_matching_error(v, x0[idx], eps)).sum() / max(float(w.sum()), 1e-6)
        args.optimizer.zero_grad()
        loss.backward()
        torch.nn.utils.clip_grad_norm_(args.params, 1.0)
        args.optimizer.step()
        losses.append(float(loss.detach()))
    return float(np.mean(losses))


def held_out(backend, metas, args) -> dict:
    from tpgrpo.policy.generate import evaluate_prompts

    guidance = args.eval_guidance or args.guidance
    r = evaluate_prompts(backend, metas, "geneval", num_steps=20, seed=0, guidance_scale=guidance,
                         samples_per_prompt=2, batch_size=108)
    return {"geneval": round(r["reward_mean"], 4), "strict": round(r["strict_accuracy"], 4),
            "per_kind": {k: round(v["strict_accuracy"], 3) for k, v in r["per_kind"].items()}}


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--method", choices=["raft", "correct", "nft"], default="nft")
    p.add_argument("--iters", type=int, default=30)
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--group", type=int, default=8)
    p.add_argument("--steps", type=int, default=8, help="AdamW steps per iteration")
    p.add_argument("--batch", type=int, default=32)
    p.add_argument("--lr", type=float, default=1e-3)
    p.add_argument("--rank", type=int, default=16)
    p.add_argument("--beta", type=float, default=1.0)
    p.add_argument("--t-min", type=float, default=0.0)
    p.add_argument("--t-max", type=float, default=1.0)
    p.add_argument("--reward", default="geneval_soft",
                   help="geneval, geneval_soft, or names joined by + (their mean; strict: geneval's)")
    p.add_argument("--train-guidance", type=float, default=4.5, help="guidance of the trained velocity")
    p.add_argument("--guidance", type=float, default=4.5, help="guidance of the rollout's sampler")
    p.add_argument("--sample-steps", type=int, default=10)
    p.add_argument("--eval-every", type=int, default=10)
    p.add_argument("--eval-guidance", type=float, default=0.0, help="guidance at eval (0 = the rollout's)")
    p.add_argument("--only", default="", help="comma-separated training prompt ids to train on (a check)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--threads", type=int, default=1)
    return p.parse_args()


def side_rate(images, metas: list[dict]) -> float | None:
    """Of the left/right samples drawn with a clear offset, the fraction on the asked side (0.5 = chance)."""
    from tpgrpo.tasks.clauses import clause_table

    side = clause_table(images, metas).get("position", {}).get("side_right")
    return None if side is None else round(side, 4)


def mean_reward(parts):
    """The mean of several rewards' scores (strict: the first's, every geneval reward's is the same)."""
    from types import SimpleNamespace

    def score(images, metas):
        scored = [part(images, metas) for part in parts]
        reward = np.mean([np.asarray(s.reward, dtype=np.float64) for s in scored], axis=0)
        return SimpleNamespace(reward=reward, strict=scored[0].strict)

    return score


def iteration(backend, args, train: list[dict], reward, rng, gen) -> dict:
    """One iteration: sample, score (the reward's strict is geneval's), advantages, ``args.steps`` updates."""
    from tpgrpo.policy.lora import lora_state_dict

    picks = rng.choice(len(train), args.prompts, replace=len(train) < args.prompts)
    metas = [train[i] for i in picks for _ in range(args.group)]
    seeds = rng.integers(0, 2**31 - 1, len(metas)).tolist()
    embeds = backend.encode_prompts([m["prompt"] for m in metas])
    x0 = sample_latents(backend, embeds, seeds, args.sample_steps, args.guidance)
    images = backend.decode(x0)
    scored = reward(images, metas)
    r = np.asarray(scored.reward, dtype=np.float64)
    strict = np.asarray(scored.strict, dtype=bool)
    adv = strict.astype(np.float64) if args.method == "correct" else group_advantages(r, args.group)
    loss = train_steps(backend, args, x0, adv, embeds, lora_state_dict(backend), gen)
    return {"train_reward": round(float(r.mean()), 4), "train_strict": round(float(strict.mean()), 4),
            "train_side": side_rate(images, metas), "loss": round(loss, 5)}


def main() -> None:
    args = parse_args()

    import torch

    from tpgrpo.models import load_backend
    from tpgrpo.policy.lora import attach_lora, lora_parameters
    from tpgrpo.tasks.rewards import get_reward

    torch.set_num_threads(args.threads)
    torch.manual_seed(args.seed)
    backend = load_backend("tiny", ROOT / "data/base")
    attach_lora(backend, args.rank, 2 * args.rank)
    args.params = [q for _, q in lora_parameters(backend)]
    args.optimizer = torch.optim.AdamW(args.params, lr=args.lr, weight_decay=1e-4)
    train = read_metas(ROOT / "data/prompts/compositional_train.jsonl")
    if args.only:
        train = [m for m in train if m["id"] in args.only.split(",")]
    evals = read_metas(ROOT / "data/prompts/compositional_eval.jsonl")
    parts = [get_reward(name) for name in args.reward.split("+")]
    reward = parts[0] if len(parts) == 1 else mean_reward(parts)
    rng, gen = np.random.default_rng(args.seed), torch.Generator().manual_seed(args.seed)
    start = time.time()
    print(json.dumps({"args": {k: v for k, v in vars(args).items() if k not in ("params", "optimizer")}}), flush=True)
    for it in range(1, args.iters + 1):
        row = {"iter": it, **iteration(backend, args, train, reward, rng, gen), "s": round(time.time() - start, 1)}
        if args.eval_every and it % args.eval_every == 0:
            row["held_out"] = held_out(backend, evals, args)
        print(json.dumps(row), flush=True)


if __name__ == "__main__":
    main()
