"""Stage update: the LoRA policy step on the iteration's trajectories and advantages (spec section 7).

Writes ``policy/`` (the LoRA adapter, loadable by peft and by a diffusers pipeline, plus the optimizer
and EMA state so the next iteration resumes exactly) and ``update.json`` (approx KL, clip fraction, the
first-pass ratio check, wall time, forward passes). The store's shape (its attributes) picks what reads its
states and clean samples: :mod:`tpgrpo.rollout_shape.chain_update` or :mod:`tpgrpo.rollout_shape.tree_update`.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from tqdm import tqdm

from tpgrpo import rollout_shape
from tpgrpo.io.artifacts import IterationPaths, read_table, require
from tpgrpo.io.stage_logs import write_log
from tpgrpo.io.trajectories import read_trajectories
from tpgrpo.config import Config
from tpgrpo.distributed import current
from tpgrpo.policy.loading import load_policy, prompt_embeddings, sampling_from_attrs
from tpgrpo.stage_common import stopwatch
from tpgrpo.policy.lora import LoraEMA
from tpgrpo.io.schemas import CREDIT
from tpgrpo.algo.seeds import sample_seed
from tpgrpo.policy.checkpoint import load_training_state, save_policy
from tpgrpo.rollout_shape import chain_update, tree_update
from tpgrpo.policy.update import TransitionBatch, UpdateInputs, make_optimizer, train_iteration


UNREAD = ("x0_estimates", "velocities", "states", "node_states")  # read lazily: the probe's, or per micro-batch


def advantage_matrix(credit, n: int, k: int) -> torch.Tensor:
    """(N, K) advantages from the long credit table (rows (trajectory, step), as ``read_table`` checks)."""
    table = credit.sort_values(["trajectory", "step"], kind="stable")
    if len(table) != n * k:
        raise ValueError(f"credit.parquet has {len(table)} rows; expected {n} trajectories x {k} steps")
    return torch.tensor(table["advantage"].to_numpy().reshape(n, k), dtype=torch.float32)


def read_store(cfg: Config, paths: IterationPaths):
    """``(arrays, attrs, reads)``: the iteration's trajectory store (states and the probe's arrays lazy) and its
    shape's update reads (``chain_update`` / ``tree_update``), picked once from the store's attributes."""
    arrays, attrs = read_trajectories(paths.trajectories, lazy=UNREAD)
    reads = rollout_shape.implementation("update", cfg, paths, chain=chain_update, tree=tree_update, attrs=attrs)
    return arrays, attrs, reads


def _tick(bar, done: int, total: int) -> None:
    bar.total = total
    bar.update(done - bar.n)


def run(cfg: Config, iteration: int, root: Path) -> dict:
    if cfg.update.objective != "grpo":  # DiffusionNFT / AWM on the clean samples (docs/objectives.md)
        return _run_objective(cfg, iteration, root)
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    dist = current()
    with stopwatch(metrics):
        # x0_estimates, velocities: the probe's, never read here; a tree's edges read its node_states
        arrays, attrs, reads = read_store(cfg, paths)
        states = reads.states(arrays, len(attrs["prompts"])).verify()  # checked a file at a time; read per micro-batch
        N, K1 = states.shape[:2]
        metas = attrs["prompts"]
        credit = read_table(  # rows must be this store's trajectories x window steps, in its prompt groups
            paths.credit, CREDIT, "credit.parquet: run the credit stage first", trajectories=N, steps=K1 - 1,
            expect={"sample": arrays["sample"], "prompt_id": [metas[p]["id"] for p in arrays["prompt_index"]]})
        advantages = advantage_matrix(credit, N, K1 - 1)
        backend = load_policy(cfg, root, iteration, trainable=True)
        optimizer = make_optimizer(backend, cfg.update)
        ema = LoraEMA(backend) if cfg.update.ema else None
        previous = paths.previous()
        if previous is not None:
            load_training_state(require(previous.policy, "previous policy"), optimizer, ema)
        embeds = prompt_embeddings(cfg, root, iteration, backend, [m["prompt"] for m in attrs["prompts"]])
        batch = TransitionBatch(
            latents=states, old_log_probs=torch.from_numpy(arrays["log_probs"]),
            sigmas=torch.from_numpy(arrays["sigmas"]), prompt_index=torch.from_numpy(arrays["prompt_index"]).long(),
            sigma_at_one=float(attrs["schedule_sigmas"][1]))
        inputs = UpdateInputs(backend, embeds, batch, advantages, sampling_from_attrs(attrs), cfg.update, dist)
        # One seed per epoch: each pass over the transitions is reshuffled reproducibly.
        seeds = [sample_seed(cfg.train.seed, iteration, "update", e) for e in range(cfg.update.epochs)]
        with tqdm(desc=f"update {iteration}", unit="micro-batch", disable=not dist.is_main) as bar:
            # (closed on an error too: the one-line error then starts its own line)
            result = train_iteration(inputs, optimizer, seeds, ema=ema, iteration=iteration,
                                     progress=lambda done, total: _tick(bar, done, total))
        metrics.update(result.as_log())
        if not dist.is_main:  # every process holds the same weights; the main process writes them
            return metrics
        save_policy(paths.policy, backend, optimizer, ema)
    write_log(paths.update_metrics, {k: v for k, v in metrics.items() if np.isscalar(v) or isinstance(v, list)})
    return metrics


def _run_objective(cfg: Config, iteration: int, root: Path) -> dict:
    """The update under ``update.objective`` nft / awm: the credit table's advantages on the store's clean
    samples (``tpgrpo.algo.objective_units``), trained by ``tpgrpo.policy.objective_update``; the policy folder
    gains ``slow/`` (NFT's old adapter / AWM's EMA)."""
    from tpgrpo.policy.objective_update import ObjectiveInputs, train_objective
    from tpgrpo.policy.slow_adapter import previous_slow

    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    dist = current()
    with stopwatch(metrics):
        arrays, attrs, reads = read_store(cfg, paths)
        N, K = arrays["log_probs"].shape
        metas = attrs["prompts"]
        credit = read_table(
            paths.credit, CREDIT, "credit.parquet: run the credit stage first", trajectories=N, steps=K,
            expect={"sample": arrays["sample"], "prompt_id": [metas[p]["id"] for p in arrays["prompt_index"]]})
        units, latents = reads.units(arrays, attrs, advantage_matrix(credit, N, K), cfg.update.split_levels,
                                     str(paths.trajectories))
        backend = load_policy(cfg, root, iteration, trainable=True)
        optimizer = make_optimizer(backend, cfg.update)
        ema = LoraEMA(backend) if cfg.update.ema else None
        previous = paths.previous()
        if previous is not None:
            load_training_state(require(previous.policy, "previous policy"), optimizer, ema)
        slow = previous_slow(root, iteration, backend)
        embeds = prompt_embeddings(cfg, root, iteration, backend, [m["prompt"] for m in metas])
        inputs = ObjectiveInputs(backend, embeds, units, latents, float(attrs["guidance_scale"]),
                                 torch.tensor(attrs["schedule_sigmas"], dtype=torch.float32), cfg.update, dist)
        seeds = [sample_seed(cfg.train.seed, iteration, "update", e) for e in range(cfg.update.epochs)]
        with tqdm(desc=f"update {iteration}", unit="micro-batch", disable=not dist.is_main) as bar:
            result = train_objective(inputs, optimizer, seeds, slow, ema=ema, iteration=iteration,
                                     progress=lambda done, total: _tick(bar, done, total))
        metrics.update(result.log)
        if not dist.is_main:
            return metrics
        save_policy(paths.policy, backend, optimizer, ema, slow=result.slow)
    write_log(paths.update_metrics, {k: v for k, v in metrics.items() if np.isscalar(v) or isinstance(v, list)})
    return metrics
