"""Stage probe: ODE-complete every stored intermediate state, decode, score (spec section 4).

Writes ``probe.parquet``: one row per (trajectory, step), step 0..K; the row with step K holds the
rollout's final reward (that state was completed by the rollout itself and is not scored twice).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch

from tpgrpo.artifacts import IterationPaths, read_trajectories, write_json, write_table
from tpgrpo.config import Config
from tpgrpo.distributed import chunk_bar, current, group_chunks, run_chunks, warn_if_idle
from tpgrpo.pipeline import check_finite, load_policy, prompt_embeddings, provenance, stopwatch
from tpgrpo.schemas import PROBE
from tpgrpo.tasks.rewards import build_reward
from tpgrpo.trajectory import complete_window_states


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    dist = current()
    with stopwatch(metrics):
        arrays, attrs = read_trajectories(paths.trajectories, lazy=("states",))
        metas = attrs["prompts"]
        reward = build_reward(attrs["reward"], cfg, root)  # the rollout's reward spec, this run's folders
        backend = load_policy(cfg, root, iteration)
        N, K1 = arrays["states"].shape[:2]
        K, G = K1 - 1, int(attrs["group_size"])
        rows = torch.from_numpy(arrays["prompt_index"]).long()
        prompt_embeds = prompt_embeddings(cfg, root, iteration, backend, [m["prompt"] for m in metas])
        sigmas = torch.tensor(attrs["schedule_sigmas"], dtype=torch.float32)
        chunks = group_chunks(N // G, G * K, cfg.probe.batch_size)  # at most probe.batch_size states a chunk
        warn_if_idle(dist, len(chunks), "probe.batch_size")

        def compute(c: int) -> dict:  # chunk c: whole groups, the same shapes on any process count
            a, b = chunks[c][0] * G, chunks[c][1] * G
            final, passes = complete_window_states(
                backend, torch.from_numpy(np.asarray(arrays["states"][a:b])), prompt_embeds.select(rows[a:b]),
                sigmas, attrs["window_start"], attrs["guidance_scale"], cfg.probe.batch_size)
            images = backend.decode(final)
            scored = reward(images, [metas[p] for p in rows[a:b].repeat_interleave(K).tolist()])
            return {"reward": scored.reward.reshape(b - a, K), "strict": scored.strict.reshape(b - a, K),
                    "passes": np.array([passes], dtype=np.int64)}

        with chunk_bar(dist, f"probe {iteration}") as progress:
            merged = run_chunks(dist, paths.probe, len(chunks), compute, f"probe of iteration {iteration}",
                                progress=progress)
        if merged is None:  # not the main process: its parts are written, the main process merges
            return metrics
        check_finite(f"reward {attrs['reward']}", merged["reward"], f"probe of iteration {iteration}")
        frame = probe_table(arrays, metas, merged["reward"], merged["strict"])
        write_table(paths.probe, frame, PROBE, provenance(cfg, iteration, "probe"), trajectories=N, steps=K1)
    d = np.diff(frame["reward"].to_numpy().reshape(N, K1), axis=1)
    metrics.update({"forward_passes": int(merged["passes"].sum()), "reward_calls": N * K, "states": N * K,
                    "zero_increment_fraction": float((d == 0).mean()),
                    "mean_q0": float(frame.loc[frame.step == 0, "reward"].mean()),
                    "processes": dist.world, "chunks": len(chunks)})
    write_json(paths.probe_metrics, metrics)
    return metrics


def probe_table(arrays: dict, metas: list[dict], rewards: np.ndarray, strict: np.ndarray) -> pd.DataFrame:
    """Long table (``schemas.PROBE``): rows (trajectory, step) for step 0..K; rewards/strict (N, K) for
    steps 0..K-1."""
    N, K1 = arrays["sigmas"].shape
    reward = np.concatenate([rewards, arrays["final_reward"][:, None]], axis=1)
    strict_all = np.concatenate([strict, arrays["final_strict"][:, None]], axis=1)
    prompt_index = arrays["prompt_index"].astype(np.int64)
    return pd.DataFrame({
        "trajectory": np.repeat(np.arange(N), K1),
        "prompt_id": np.repeat([metas[p]["id"] for p in prompt_index], K1),
        "prompt": np.repeat([metas[p]["prompt"] for p in prompt_index], K1),
        "sample": np.repeat(arrays["sample"].astype(np.int64), K1),
        "seed": np.repeat(arrays["seeds"].astype(np.int64), K1),
        "step": np.tile(np.arange(K1), N),
        "sigma": arrays["sigmas"].reshape(-1).astype(np.float64),
        "reward": reward.reshape(-1).astype(np.float64),
        "strict": strict_all.reshape(-1),
    })
