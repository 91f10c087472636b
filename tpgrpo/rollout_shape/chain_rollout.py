"""The rollout stage for chains (``tree.enabled: false``): sample prompts_per_iter x group_size trajectories with
the current policy.

Writes ``trajectories.zarr`` (states around the SDE window ``(N, K+1, C, H, W)``, old log-probs ``(N, K)``,
sigmas ``(N, K+1)``, seeds, final rewards ``(N,)``, and with ``probe.completion: x0`` each window state's
one-step estimate ``z_k - s_k v_k``, which that probe scores, or with any other mode each window state's guided
velocity ``v_k``, which those probes take their first step with instead of a pass; schema
``tpgrpo.io.schemas.TRAJECTORY_ARRAYS``, dimensions and meanings in the attributes) and ``rollout.json``
(metrics). The tree's rollout is :mod:`tpgrpo.rollout_shape.tree_rollout`; ``stages/rollout.py`` picks one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.io.stage_logs import write_log
from tpgrpo.io.trajectories import write_zarr
from tpgrpo.config import Config
from tpgrpo.distributed import chunk_bar, current, row_chunks, run_chunks, warn_if_idle
from tpgrpo.policy.loading import load_policy, prompt_embeddings, sampler_spec, select_prompts, store_attrs
from tpgrpo.policy.slow_adapter import load_sampling_adapter
from tpgrpo.stage_common import check_finite, stopwatch
from tpgrpo.algo.seeds import sample_seed
from tpgrpo.tasks.rewards import build_reward
from tpgrpo.algo.trajectory import rollout
from tpgrpo.algo.probe_modes import parse_completion
from tpgrpo.io.schemas import VELOCITIES_KEPT_ATTR


def run(cfg: Config, iteration: int, root: Path) -> dict:
    """The chain rollout stage of ``iteration`` (module docstring); the main process writes, and returns the
    metrics (``rollout.json``)."""
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    dist = current()
    with stopwatch(metrics):
        metas = select_prompts(cfg, root, iteration)
        reward = build_reward(cfg.task.reward, cfg, root)  # checks reward-model folders before sampling
        backend = load_policy(cfg, root, iteration)
        load_sampling_adapter(cfg, root, iteration, backend)  # nft: the old adapter samples
        spec = sampler_spec(cfg)
        G = cfg.rollout.group_size
        prompt_index = np.repeat(np.arange(len(metas)), G)
        sample = np.tile(np.arange(G), len(metas))
        seeds = [sample_seed(cfg.train.seed, iteration, metas[p]["id"], int(g))
                 for p, g in zip(prompt_index, sample)]
        embeds = prompt_embeddings(cfg, root, iteration, backend, [m["prompt"] for m in metas], write=True)
        chunks = row_chunks(len(seeds), G, cfg.rollout.batch_size)
        warn_if_idle(dist, len(chunks), "rollout.batch_size")
        keep_x0 = cfg.probe.completion == "x0"  # the probe then scores these instead of running the model
        keep_v = parse_completion(cfg.probe.completion).runs_transformer  # its completions' first steps
        keep_final = cfg.update.objective != "grpo"  # nft / awm train on the clean samples

        def compute(c: int) -> dict:  # chunk c: fixed rows, the same shapes on any process count
            rows = np.arange(*chunks[c])
            parts = [rollout(backend, embeds.select(torch.as_tensor(prompt_index[b])), [seeds[i] for i in b], spec,
                             keep_x0=keep_x0, keep_velocities=keep_v)
                     for b in np.array_split(rows, -(-len(rows) // cfg.rollout.batch_size))]
            images = backend.decode(torch.cat([p.final for p in parts]))
            scored = _score(reward, images, [metas[p] for p in prompt_index[rows]])
            # The trajectories live on the model's device; they come to the CPU here, to be written.
            out = {"states": torch.cat([p.states for p in parts]).cpu().numpy(),
                   "log_probs": torch.cat([p.log_probs for p in parts]).cpu().numpy(),
                   "final_reward": scored.reward.astype(np.float64), "final_strict": scored.strict.astype(bool)}
            if keep_x0:
                out["x0_estimates"] = torch.cat([p.x0_estimates for p in parts]).cpu().numpy()
            if keep_v:
                out["velocities"] = torch.cat([p.velocities for p in parts]).cpu().numpy()
            if keep_final:
                out["final_latents"] = torch.cat([p.final for p in parts]).cpu().numpy()
            return out

        with chunk_bar(dist, f"rollout {iteration}") as progress:
            merged = run_chunks(dist, paths.trajectories, len(chunks), compute, f"rollout of iteration {iteration}",
                                progress=progress)
        if merged is None:  # not the main process: its parts are written, the main process merges
            return metrics
        check_finite("old log-probs", merged["log_probs"], f"rollout of iteration {iteration}")
        arrays = _store_arrays(merged, spec, seeds, prompt_index, sample)
        attrs = store_attrs(cfg, iteration, spec, metas, G, **{VELOCITIES_KEPT_ATTR: keep_v})
        write_zarr(paths.trajectories, arrays, attrs, hash_for_dvc=cfg.launch.hash_while_writing,
                   cache_for_dvc=cfg.launch.cache_while_writing)
    metrics.update(_metrics(arrays, spec, len(seeds), backend.cfg_doubles_batch), processes=dist.world,
                   chunks=len(chunks))
    write_log(paths.rollout_metrics, metrics)
    return metrics


def _store_arrays(merged: dict, spec, seeds: list[int], prompt_index: np.ndarray, sample: np.ndarray) -> dict:
    """``trajectories.zarr``'s arrays from the merged chunks (``schemas.TRAJECTORY_ARRAYS``), N = len(seeds)."""
    arrays = {
        "states": merged["states"], "log_probs": merged["log_probs"],
        "sigmas": np.tile(spec.window_sigmas().numpy(), (len(seeds), 1)),
        "seeds": np.asarray(seeds, dtype=np.int64), "prompt_index": prompt_index.astype(np.int32),
        "sample": sample.astype(np.int32), "final_reward": merged["final_reward"],
        "final_strict": merged["final_strict"],
    }
    arrays.update({name: merged[name] for name in ("x0_estimates", "velocities", "final_latents") if name in merged})
    return arrays


def _score(reward, images: np.ndarray, metas: list[dict]):
    scored = reward(images, metas)
    check_finite(f"reward {reward.name}", scored.reward, "rollout final images")
    return scored


def _metrics(arrays: dict, spec, n: int, cfg_doubles_batch: bool) -> dict:
    T = spec.num_steps
    return {"mean_reward": float(arrays["final_reward"].mean()),
            "strict_accuracy": float(arrays["final_strict"].mean()), "trajectories": n, "forward_passes": n * T,
            "cfg_doubled": cfg_doubles_batch and spec.guidance_scale != 1.0}
