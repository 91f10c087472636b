"""Evaluation: ODE sampling of the held-out prompts with a policy, scored under the eval and training rewards.

What the ``eval`` and ``baseline`` stages run (``stages/eval.py``, ``stages/baseline.py`` call
:func:`run_eval` and :func:`run_baseline`). The same seeds are used at every iteration (and for the base
model), so curves compare paired samples. Writes ``eval.json``: mean reward and strict accuracy under the eval
reward, and the training reward, and ``eval.parquet``: per image (prompt_id, prompt, sample, seed) its reward
and strict result under both (:mod:`tpgrpo.io.eval_table`), so two runs on the same eval params compare image
by image. An iteration that is not evaluated (``eval.every``) writes the table with no rows.
With ``update.ema`` the policy scored is the EMA of the LoRA weights (``weights: ema``), else the adapter.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from tpgrpo.config import Config
from tpgrpo.distributed import chunk_bar, current, run_chunks, warn_if_idle
from tpgrpo.io.artifacts import IterationPaths, require, write_parquet
from tpgrpo.io.eval_table import EVAL_TABLE, EVAL_TABLE_COLUMNS, empty_table
from tpgrpo.io.stage_logs import write_log
from tpgrpo.policy.loading import load_policy, policy_to_score
from tpgrpo.stage_common import check_finite, provenance, stopwatch
from tpgrpo.stage_params import BASELINE_LOG, BASELINE_TABLE


def eval_images(cfg: Config, root: Path, backend, label: str, artifact: Path):
    """Per-image results of ``backend`` on the held-out prompts (ODE, eval.num_steps), a DataFrame with
    ``EVAL_TABLE_COLUMNS`` (one row per prompt and eval seed, prompt order then sample order).

    The images (each prompt with its ``samples_per_prompt`` seeds) are cut into chunks of at most
    ``rollout.batch_size`` images (whole prompts when one fits), spread over the processes; each chunk's prompt
    embeddings are read from the ``eval_prompts`` stage's cache (:mod:`tpgrpo.policy.eval_embeds`: the text
    encoders never load), or encoded when it does not hold them (one line on stderr); per-image rewards
    are merged on the main process (part files next to ``artifact``), which returns the table; other processes
    return None. Non-finite rewards are a one-line error.
    """
    import pandas as pd

    from tpgrpo.policy.eval_embeds import chunk_embeddings, held_out
    from tpgrpo.policy.generate import evaluation_seeds, sample_ode
    from tpgrpo.tasks.rewards import build_reward

    batch_metas, chunks = held_out(cfg, root)
    S = cfg.eval.samples_per_prompt
    metas = batch_metas[::S]
    seeds = evaluation_seeds(cfg.eval.seed, metas, S)
    rewards = (("eval", cfg.task.eval_reward), ("train", cfg.task.reward))
    built = {key: build_reward(spec, cfg, root) for key, spec in rewards}  # before sampling: folders checked
    dist = current()
    warn_if_idle(dist, len(chunks), "rollout.batch_size")

    def compute(c: int) -> dict:  # chunk c: fixed images, the same on any process count
        a, b = chunks[c]
        prompts = [m["prompt"] for m in batch_metas[a:b]]
        embeds = chunk_embeddings(cfg, root, backend, c, prompts)  # the eval_prompts stage's cache
        images = sample_ode(backend, prompts, seeds[a:b], num_steps=cfg.eval.num_steps,
                            guidance_scale=cfg.eval.guidance_scale, shift=cfg.sampling.shift,
                            batch_size=cfg.rollout.batch_size, embeds=embeds)
        scored = {key: reward(images, batch_metas[a:b]) for key, reward in built.items()}
        return {**{f"{k}_reward": v.reward for k, v in scored.items()},
                **{f"{k}_strict": v.strict for k, v in scored.items()}}

    with chunk_bar(dist, f"eval {label}") as progress:
        merged = run_chunks(dist, artifact, len(chunks), compute, f"eval of {label}", progress=progress)
    if merged is None:
        return None
    for key, name in rewards:
        check_finite(f"reward {name}", merged[f"{key}_reward"], f"eval of {label}")
    frame = pd.DataFrame({
        "prompt_id": [str(m["id"]) for m in batch_metas], "prompt": [m["prompt"] for m in batch_metas],
        "sample": np.tile(np.arange(S, dtype=np.int64), len(metas)), "seed": np.asarray(seeds, dtype=np.int64),
        **{f"{k}_{what}": merged[f"{k}_{what}"] for k, _ in rewards for what in ("reward", "strict")}})
    return frame.astype(EVAL_TABLE_COLUMNS)[list(EVAL_TABLE_COLUMNS)]


def summarize(cfg: Config, frame) -> dict:
    """eval.json's numbers from a per-image table: mean reward and strict accuracy per reward."""
    out = {"images": len(frame), "forward_passes": len(frame) * cfg.eval.num_steps, "processes": current().world}
    for key in ("eval", "train"):
        out[f"{key}_reward"] = float(frame[f"{key}_reward"].mean())
        out[f"{key}_strict_accuracy"] = float(frame[f"{key}_strict"].mean())
    return out


def evaluate(cfg: Config, root: Path, backend, label: str, artifact: Path) -> dict | None:
    """Mean reward and strict accuracy of ``backend`` on the held-out prompts (main process; else None)."""
    frame = eval_images(cfg, root, backend, label, artifact)
    return None if frame is None else summarize(cfg, frame)


def write_table(cfg: Config, path: Path, frame, iteration: int, stage: str, weights: str) -> None:
    """The per-image table as Parquet, atomically, with provenance and the rewards' names."""
    meta = {**provenance(cfg, iteration, stage), "eval_reward": cfg.task.eval_reward,
            "train_reward": cfg.task.reward, "weights": weights}
    write_parquet(path, frame, meta)


def run_eval(cfg: Config, iteration: int, root: Path) -> dict:
    """The eval stage of ``iteration``: its policy scored (when ``eval.every`` schedules it) into ``eval.json``
    and ``eval.parquet`` (an empty table when not scheduled); main process writes."""
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    every = cfg.eval.every
    scheduled = every > 0 and iteration % every == 0
    frame, weights = None, None
    with stopwatch(metrics):
        if scheduled:
            require(paths.policy, f"policy of iteration {iteration}: run its update first")
            backend, weights = policy_to_score(cfg, root, iteration)
            frame = eval_images(cfg, root, backend, f"iteration {iteration}", paths.eval_metrics)
    if not current().is_main:  # the main process writes eval.json and eval.parquet
        return metrics
    if scheduled:
        metrics.update({"weights": weights, **summarize(cfg, frame)})
    metrics["evaluated"] = scheduled
    write_table(cfg, paths.folder / EVAL_TABLE, empty_table() if frame is None else frame, iteration, "eval",
                weights or "none")
    write_log(paths.eval_metrics, metrics)
    return metrics


def run_baseline(cfg: Config, root: Path) -> dict:
    """The same evaluation for the base model (no adapter): the curve's starting point."""
    metrics: dict = {"iteration": -1}
    out = root / BASELINE_LOG
    with stopwatch(metrics):
        frame = eval_images(cfg, root, load_policy(cfg, root, 1), "base", out)  # iteration 1 samples the base model
    if frame is None:  # not the main process
        return metrics
    metrics.update(summarize(cfg, frame))
    write_table(cfg, root / BASELINE_TABLE, frame, -1, "baseline", "base")
    write_log(out, metrics)
    return metrics
