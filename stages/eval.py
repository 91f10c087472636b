"""Stage eval: ODE sampling of held-out prompts with the policy that iteration ``--iter`` produced.

The same seeds are used at every iteration (and for the base model), so curves compare paired samples.
Writes ``eval.json``: mean reward and strict accuracy under the eval reward, and the training reward.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tpgrpo.artifacts import IterationPaths, require, write_json
from tpgrpo.config import Config
from tpgrpo.pipeline import check_finite, load_policy, resolve, sampler_spec, stopwatch
from tpgrpo.seeds import sample_seed
from tpgrpo.trajectory import rollout


def evaluate(cfg: Config, root: Path, backend, label: str) -> dict:
    """Mean reward and strict accuracy of ``backend`` on the held-out prompts (ODE, eval.num_steps)."""
    from tpgrpo.tasks.prompts import load_prompts
    from tpgrpo.tasks.rewards import get_reward

    metas = load_prompts(require(resolve(root, cfg.task.eval_prompts), "task.eval_prompts"))
    metas = metas[:cfg.eval.num_prompts]
    S = cfg.eval.samples_per_prompt
    rows = np.repeat(np.arange(len(metas)), S)
    seeds = [sample_seed(cfg.train.seed, 0, metas[p]["id"], i % S, purpose="eval") for i, p in enumerate(rows)]
    spec = sampler_spec(cfg, num_steps=cfg.eval.num_steps, stochastic=False)
    embeds = backend.encode_prompts([m["prompt"] for m in metas])
    finals = []
    for chunk in tqdm(np.array_split(np.arange(len(seeds)), max(1, -(-len(seeds) // cfg.rollout.batch_size))),
                      desc=f"eval {label}", unit="batch"):
        finals.append(rollout(backend, embeds.select(torch.as_tensor(rows[chunk])),
                              [seeds[i] for i in chunk], spec).final)
    images = backend.decode(torch.cat(finals))
    batch_metas = [metas[p] for p in rows]
    out = {"images": len(seeds), "forward_passes": len(seeds) * cfg.eval.num_steps}
    for key, name in (("eval", cfg.task.eval_reward), ("train", cfg.task.reward)):
        scored = get_reward(name)(images, batch_metas)
        check_finite(f"reward {name}", scored.reward, f"eval of {label}")
        out[f"{key}_reward"] = float(scored.reward.mean())
        out[f"{key}_strict_accuracy"] = float(scored.strict.mean())
    return out


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    every = cfg.eval.every
    scheduled = every > 0 and ((iteration + 1) % every == 0 or iteration + 1 == cfg.train.iterations)
    with stopwatch(metrics):
        if scheduled:
            require(paths.policy, f"policy of iteration {iteration}: run its update first")
            metrics.update(evaluate(cfg, root, load_policy(cfg, root, iteration + 1), f"iteration {iteration}"))
    metrics["evaluated"] = scheduled
    write_json(paths.eval_metrics, metrics)
    return metrics


def run_baseline(cfg: Config, root: Path) -> dict:
    """The same evaluation for the base model (no adapter): the curve's starting point."""
    metrics: dict = {"iteration": -1}
    with stopwatch(metrics):
        metrics.update(evaluate(cfg, root, load_policy(cfg, root, 0), "base"))
    write_json(root / "data" / "iters" / "baseline_eval.json", metrics)
    return metrics
