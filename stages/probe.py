"""Stage probe: ODE-complete every stored intermediate state, decode, score (spec section 4).

Writes ``probe.parquet``: one row per (trajectory, step), step 0..K; the row with step K holds the
rollout's final reward (that state was completed by the rollout itself and is not scored twice).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pandas as pd
import torch
from tqdm import tqdm

from tpgrpo.artifacts import IterationPaths, require, write_json
from tpgrpo.config import Config
from tpgrpo.pipeline import check_finite, load_policy, provenance, stopwatch, write_parquet
from tpgrpo.trajectory import complete_window_states


def read_trajectories(path: Path) -> tuple[dict[str, np.ndarray], dict]:
    """All arrays of a ``trajectories.zarr`` as numpy, and its attributes."""
    import zarr

    group = zarr.open_group(str(require(path, "trajectories.zarr: run the rollout stage first")), mode="r")
    return {name: arr[:] for name, arr in group.arrays()}, dict(group.attrs)


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    with stopwatch(metrics):
        arrays, attrs = read_trajectories(paths.trajectories)
        metas = attrs["prompts"]
        backend = load_policy(cfg, root, iteration)
        N, K1 = arrays["states"].shape[:2]
        K = K1 - 1
        rows = torch.from_numpy(arrays["prompt_index"]).long()
        embeds = backend.encode_prompts([m["prompt"] for m in metas]).select(rows)
        sigmas = torch.tensor(attrs["schedule_sigmas"], dtype=torch.float32)
        bar = tqdm(total=len(sigmas) - 1 - attrs["window_start"], desc=f"probe {iteration}", unit="sigma")
        final, passes = complete_window_states(backend, torch.from_numpy(arrays["states"]), embeds, sigmas,
                                               attrs["window_start"], attrs["guidance_scale"],
                                               cfg.probe.batch_size, on_step=lambda j: bar.update())
        bar.close()
        images = backend.decode(final)
        from tpgrpo.tasks.rewards import get_reward

        scored = get_reward(attrs["reward"])(images, [metas[p] for p in rows.repeat_interleave(K).tolist()])
        check_finite(f"reward {attrs['reward']}", scored.reward, f"probe of iteration {iteration}")
        frame = probe_table(arrays, metas, scored.reward.reshape(N, K), scored.strict.reshape(N, K))
        write_parquet(paths.probe, frame, provenance(cfg, iteration, "probe"))
    d = np.diff(frame["reward"].to_numpy().reshape(N, K1), axis=1)
    metrics.update({"forward_passes": passes, "reward_calls": N * K, "states": N * K,
                    "zero_increment_fraction": float((d == 0).mean()),
                    "mean_q0": float(frame.loc[frame.step == 0, "reward"].mean())})
    write_json(paths.probe_metrics, metrics)
    return metrics


def probe_table(arrays: dict, metas: list[dict], rewards: np.ndarray, strict: np.ndarray) -> pd.DataFrame:
    """Long table: rows (trajectory, step) for step 0..K; rewards/strict (N, K) for steps 0..K-1."""
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
