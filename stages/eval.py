"""Stage eval: ODE sampling of held-out prompts with the policy that iteration ``--iter`` produced.

The same seeds are used at every iteration (and for the base model), so curves compare paired samples.
Writes ``eval.json``: mean reward and strict accuracy under the eval reward, and the training reward.
With ``update.ema`` the policy scored is the EMA of the LoRA weights (``weights: ema``), else the adapter.
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.artifacts import IterationPaths, require, write_json
from tpgrpo.config import Config
from tpgrpo.distributed import chunk_bar, current, group_chunks, run_chunks, warn_if_idle
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline import check_finite, load_policy, resolve, stopwatch


def evaluate(cfg: Config, root: Path, backend, label: str, artifact: Path) -> dict | None:
    """Mean reward and strict accuracy of ``backend`` on the held-out prompts (ODE, eval.num_steps).

    Prompts (each with its ``samples_per_prompt`` seeds) are cut into chunks of at most
    ``rollout.batch_size`` images, spread over the processes; per-image rewards are merged on the main
    process (part files next to ``artifact``), which returns the metrics; other processes return None.
    """
    from tpgrpo.sample import evaluation_seeds, sample_ode
    from tpgrpo.tasks.prompts import load_prompts
    from tpgrpo.tasks.rewards import build_reward

    metas = load_prompts(require(resolve(root, cfg.task.eval_prompts), "task.eval_prompts"))
    metas = metas[:cfg.eval.num_prompts]
    S = cfg.eval.samples_per_prompt
    batch_metas = [m for m in metas for _ in range(S)]
    seeds = evaluation_seeds(cfg.eval.seed, metas, S)
    rewards = (("eval", cfg.task.eval_reward), ("train", cfg.task.reward))
    built = {key: build_reward(spec, cfg, root) for key, spec in rewards}  # before sampling: folders checked
    dist, chunks = current(), group_chunks(len(metas), S, cfg.rollout.batch_size)
    warn_if_idle(dist, len(chunks), "rollout.batch_size")

    def compute(c: int) -> dict:  # chunk c: whole prompts, the same images on any process count
        a, b = chunks[c][0] * S, chunks[c][1] * S
        images = sample_ode(backend, [m["prompt"] for m in batch_metas[a:b]], seeds[a:b],
                            num_steps=cfg.eval.num_steps, guidance_scale=cfg.sampling.guidance_scale,
                            shift=cfg.sampling.shift, batch_size=cfg.rollout.batch_size)
        scored = {key: reward(images, batch_metas[a:b]) for key, reward in built.items()}
        return {**{f"{k}_reward": v.reward for k, v in scored.items()},
                **{f"{k}_strict": v.strict for k, v in scored.items()}}

    with chunk_bar(dist, f"eval {label}") as progress:
        merged = run_chunks(dist, artifact, len(chunks), compute, f"eval of {label}", progress=progress)
    if merged is None:
        return None
    out = {"images": len(batch_metas), "forward_passes": len(batch_metas) * cfg.eval.num_steps,
           "processes": dist.world}
    for key, name in rewards:
        check_finite(f"reward {name}", merged[f"{key}_reward"], f"eval of {label}")
        out[f"{key}_reward"] = float(merged[f"{key}_reward"].mean())
        out[f"{key}_strict_accuracy"] = float(merged[f"{key}_strict"].mean())
    return out


def policy_to_score(cfg: Config, root: Path, iteration: int) -> tuple[object, str]:
    """The backend with the weights iteration ``iteration`` is scored with, and their name.

    With ``update.ema`` the EMA of the LoRA weights (``policy/ema``, spec section 7) replaces the raw
    adapter, as ``tpgrpo export --ema`` hands out; a policy without it is a one-line error.
    """
    from tpgrpo.export import EMA_FOLDER
    from tpgrpo.policy import WEIGHTS_FILE, load_lora_weights, read_adapter_weights

    if not cfg.update.ema:
        return load_policy(cfg, root, iteration + 1), "adapter"
    folder = IterationPaths(root, iteration).policy / EMA_FOLDER
    if not (folder / WEIGHTS_FILE).is_file():  # checked before the model loads: fail fast
        raise PipelineError(f"update.ema is true but {folder / WEIGHTS_FILE} is missing (the policy was "
                            f"trained with update.ema false: re-run `tpgrpo stage update --iter {iteration}`)")
    backend = load_policy(cfg, root, iteration + 1)
    load_lora_weights(backend, read_adapter_weights(folder))
    return backend, "ema"


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    every = cfg.eval.every
    scheduled = every > 0 and (iteration + 1) % every == 0
    with stopwatch(metrics):
        if scheduled:
            require(paths.policy, f"policy of iteration {iteration}: run its update first")
            backend, metrics["weights"] = policy_to_score(cfg, root, iteration)
            metrics.update(evaluate(cfg, root, backend, f"iteration {iteration}", paths.eval_metrics) or {})
    if not current().is_main:  # the main process writes eval.json
        return metrics
    metrics["evaluated"] = scheduled
    write_json(paths.eval_metrics, metrics)
    return metrics


def run_baseline(cfg: Config, root: Path) -> dict:
    """The same evaluation for the base model (no adapter): the curve's starting point."""
    metrics: dict = {"iteration": -1}
    out = root / "data" / "iters" / "baseline_eval.json"
    with stopwatch(metrics):
        result = evaluate(cfg, root, load_policy(cfg, root, 0), "base", out)
    if result is None:  # not the main process
        return metrics
    metrics.update(result)
    write_json(out, metrics)
    return metrics
