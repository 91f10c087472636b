"""Stage update: the LoRA policy step on the iteration's trajectories and advantages (spec section 7).

Writes ``policy/`` (the LoRA adapter, loadable by peft and by a diffusers pipeline, plus the optimizer
and EMA state so the next iteration resumes exactly) and ``update.json`` (approx KL, clip fraction, the
first-pass ratio check, wall time, forward passes).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from stages.probe import read_trajectories
from tpgrpo.artifacts import IterationPaths, require, write_json
from tpgrpo.config import Config
from tpgrpo.pipeline import check_finite, load_policy, read_parquet, sampling_from_attrs, stopwatch
from tpgrpo.policy import LoraEMA
from tpgrpo.seeds import sample_seed
from tpgrpo.update import TransitionBatch, load_training_state, make_optimizer, save_policy, update_policy


def advantage_matrix(credit, n: int, k: int) -> torch.Tensor:
    """(N, K) advantages from the long credit table (rows (trajectory, step))."""
    table = credit.sort_values(["trajectory", "step"], kind="stable")
    if len(table) != n * k:
        raise ValueError(f"credit.parquet has {len(table)} rows; expected {n} trajectories x {k} steps")
    return torch.tensor(table["advantage"].to_numpy().reshape(n, k), dtype=torch.float32)


def _tick(bar, done: int, total: int) -> None:
    bar.total = total
    bar.update(done - bar.n)


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    with stopwatch(metrics):
        arrays, attrs = read_trajectories(paths.trajectories)
        credit = read_parquet(paths.credit, "credit.parquet: run the credit stage first")
        N, K1 = arrays["states"].shape[:2]
        advantages = advantage_matrix(credit, N, K1 - 1)
        check_finite("advantage", advantages.numpy(), str(paths.credit))
        backend = load_policy(cfg, root, iteration, trainable=True)
        optimizer = make_optimizer(backend, cfg.update)
        ema = LoraEMA(backend) if cfg.update.ema else None
        previous = paths.previous()
        if previous is not None:
            load_training_state(require(previous.policy, "previous policy"), optimizer, ema)
        embeds = backend.encode_prompts([m["prompt"] for m in attrs["prompts"]])
        batch = TransitionBatch(
            latents=torch.from_numpy(arrays["states"]), old_log_probs=torch.from_numpy(arrays["log_probs"]),
            sigmas=torch.from_numpy(arrays["sigmas"]), prompt_index=torch.from_numpy(arrays["prompt_index"]).long(),
            sigma_at_one=float(attrs["schedule_sigmas"][1]))
        bar = tqdm(desc=f"update {iteration}", unit="micro-batch")
        metrics.update(update_policy(backend, embeds, batch, advantages, sampling_from_attrs(attrs), cfg.update,
                                     optimizer, ema=ema, seed=sample_seed(cfg.train.seed, iteration, "update", 0),
                                     iteration=iteration, progress=lambda done, total: _tick(bar, done, total)))
        bar.close()
        save_policy(paths.policy, backend, optimizer, ema)
    write_json(paths.update_metrics, {k: v for k, v in metrics.items() if np.isscalar(v) or isinstance(v, list)})
    return metrics
