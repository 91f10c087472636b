"""Stage eval: ODE sampling of held-out prompts with the policy that iteration ``--iter`` produced.

The same seeds are used at every iteration (and for the base model), so curves compare paired samples.
Writes ``eval.json``: mean reward and strict accuracy under the eval reward, and the training reward.
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.artifacts import IterationPaths, require, write_json
from tpgrpo.config import Config
from tpgrpo.pipeline import check_finite, load_policy, resolve, stopwatch


def evaluate(cfg: Config, root: Path, backend, label: str) -> dict:
    """Mean reward and strict accuracy of ``backend`` on the held-out prompts (ODE, eval.num_steps)."""
    from tpgrpo.sample import evaluation_seeds, sample_ode
    from tpgrpo.tasks.prompts import load_prompts
    from tpgrpo.tasks.rewards import get_reward

    metas = load_prompts(require(resolve(root, cfg.task.eval_prompts), "task.eval_prompts"))
    metas = metas[:cfg.eval.num_prompts]
    S = cfg.eval.samples_per_prompt
    batch_metas = [m for m in metas for _ in range(S)]
    images = sample_ode(backend, [m["prompt"] for m in batch_metas], evaluation_seeds(cfg.eval.seed, metas, S),
                        num_steps=cfg.eval.num_steps, guidance_scale=cfg.sampling.guidance_scale,
                        shift=cfg.sampling.shift, batch_size=cfg.rollout.batch_size)
    out = {"images": len(batch_metas), "forward_passes": len(batch_metas) * cfg.eval.num_steps}
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
    scheduled = every > 0 and (iteration + 1) % every == 0
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
