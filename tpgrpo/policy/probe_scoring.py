"""Probe scoring: every stored intermediate state's Q_k (spec section 4), as ``probe.completion`` says.

The chain's probe (:func:`run_chain_probe`; ``stages/probe.py`` picks it by the store's shape, a tree's is
:mod:`tpgrpo.rollout_shape.tree_probe`). Writes ``probe.parquet``: one row per (trajectory, step), step 0..K
(:mod:`tpgrpo.io.probe_table`); the row with step K holds the rollout's final reward (that state was completed
by the rollout itself and is not scored twice). The Parquet metadata key ``tpgrpo.completion`` names the mode
that made the table (``tpgrpo.algo.probe_modes``): ``exact`` / ``ode:M`` / ``grid:M`` / ``heun:M`` /
``heun-grid:M`` complete each state with the model, each completion's first step taken with the rollout's
stored velocity ``v_k`` (K passes per trajectory saved; a store written before the rollout kept them is
completed with that pass, as before), ``x0`` scores the rollout's one-step estimates (decodes and reward calls
only). With ``credit.mode: flow_grpo`` the probe loads no model: that credit needs only R_fin, so the table is
the rollout's final reward at every step (``final_reward_table``). Every mode has the same stages, so
``dvc exp run -S credit.mode=...`` needs no other dvc.yaml.
"""

from __future__ import annotations

from contextlib import contextmanager
from pathlib import Path

import numpy as np
import pandas as pd

from tpgrpo.algo.probe_modes import Completion, parse_completion
from tpgrpo.config import Config
from tpgrpo.distributed import chunk_bar, current, local_device, row_chunks, run_chunks, warn_if_idle
from tpgrpo.errors import PipelineError
from tpgrpo.io.artifacts import IterationPaths, write_table
from tpgrpo.io.probe_table import probe_table
from tpgrpo.io.schemas import PROBE, PROBE_COMPLETION_KEY, VELOCITIES_KEPT_ATTR, ArtifactError
from tpgrpo.io.stage_logs import write_log
from tpgrpo.io.trajectories import read_trajectories
from tpgrpo.models import load_backend  # light: the backends import torch and diffusers when one loads
from tpgrpo.policy.loading import load_policy, prompt_embeddings
from tpgrpo.stage_common import check_finite, provenance, resolve, stopwatch

LAZY = ("states", "x0_estimates", "velocities")  # read a chunk at a time


def completion_of(cfg: Config) -> Completion:
    """The probe's mode, ``probe.completion`` parsed."""
    return parse_completion(cfg.probe.completion)


def final_reward_table(trajectories: Path) -> pd.DataFrame:
    """The probe table Flow-GRPO's credit needs, from the rollout alone: ``Q_k = R_fin`` for every state
    (no state scored, no model loaded). Its step rewards and advantages equal those of any probe table
    with the same ``R_fin``; its increments are 0."""
    arrays, attrs = read_trajectories(trajectories, lazy=LAZY)
    K = arrays["states"].shape[1] - 1
    repeat = lambda a: np.repeat(np.asarray(a)[:, None], K, axis=1)  # noqa: E731 - (N,) -> (N, K)
    return probe_table(arrays, attrs["prompts"], repeat(arrays["final_reward"]), repeat(arrays["final_strict"]))


def run_final_reward(cfg: Config, iteration: int, root: Path) -> dict:
    """``credit.mode: flow_grpo``: write the final-reward table (main process only; no model, no pass)."""
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration, "completion": "final_reward", "forward_passes": 0}
    if not current().is_main:
        return metrics
    with stopwatch(metrics):
        frame = final_reward_table(paths.trajectories)
        N, K1 = frame["trajectory"].nunique(), frame["step"].nunique()
        meta = {**provenance(cfg, iteration, "probe"), PROBE_COMPLETION_KEY: "final_reward"}
        write_table(paths.probe, frame, PROBE, meta, trajectories=N, steps=K1)
    write_log(paths.probe_metrics, metrics)
    return metrics


def run_chain_probe(cfg: Config, iteration: int, root: Path) -> dict:
    """The probe of a chain: Flow-GRPO's final-reward table, or the states scored under ``probe.completion``
    into ``probe.parquet`` and ``probe.json`` (the main process writes)."""
    if cfg.credit.mode == "flow_grpo":
        return run_final_reward(cfg, iteration, root)
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    dist = current()
    completion = completion_of(cfg)
    with stopwatch(metrics):
        with rollout_hint(iteration):
            arrays, attrs = read_trajectories(paths.trajectories, lazy=LAZY)
        N, K1 = arrays["states"].shape[:2]
        K = K1 - 1
        merged, chunks = score_states(cfg, iteration, root, arrays, attrs, completion)
        if merged is None:  # not the main process: its parts are written, the main process merges
            return metrics
        check_finite(f"reward {attrs['reward']}", merged["reward"], f"probe of iteration {iteration}")
        frame = probe_table(arrays, attrs["prompts"], merged["reward"], merged["strict"])
        meta = {**provenance(cfg, iteration, "probe"), PROBE_COMPLETION_KEY: completion.name}
        write_table(paths.probe, frame, PROBE, meta, trajectories=N, steps=K1)
    d = np.diff(frame["reward"].to_numpy().reshape(N, K1), axis=1)
    metrics.update({"completion": completion.name, "forward_passes": int(merged["passes"].sum()),
                    "first_steps_reused": first_steps_reused(arrays, attrs, completion, paths.trajectories),
                    "reward_calls": N * K, "decodes": N * K, "states": N * K,
                    "zero_increment_fraction": float((d == 0).mean()),
                    "mean_q0": float(frame.loc[frame.step == 0, "reward"].mean()),
                    "processes": dist.world, "chunks": chunks})
    write_log(paths.probe_metrics, metrics)
    return metrics


def score_states(cfg: Config, iteration: int, root: Path, arrays: dict, attrs: dict, completion: Completion):
    """Q_k for k < K of every trajectory: ``({"reward", "strict"}: (N, K), "passes": (chunks,)) `` merged
    on the main process (None on the others), and the number of chunks."""
    import torch

    from tpgrpo.tasks.rewards import build_reward
    from tpgrpo.algo.trajectory import complete_window_states

    dist = current()
    metas = attrs["prompts"]
    reward = build_reward(attrs["reward"], cfg, root)  # the rollout's reward spec, this run's folders
    if completion.kind == "x0" and "x0_estimates" not in arrays:
        raise PipelineError(f"{IterationPaths(root, iteration).trajectories} has no x0_estimates: probe.completion "
                            "x0 scores the rollout's own estimates; rerun the rollout with probe.completion x0")
    reuse = first_steps_reused(arrays, attrs, completion, IterationPaths(root, iteration).trajectories)
    backend, prompt_embeds = _load(cfg, iteration, root, metas, completion)
    N, K1 = arrays["states"].shape[:2]
    K, G = K1 - 1, int(attrs["group_size"])
    rows = torch.from_numpy(arrays["prompt_index"]).long()
    sigmas = torch.tensor(attrs["schedule_sigmas"], dtype=torch.float32)
    chunks = row_chunks(N, G, max(1, cfg.probe.batch_size // K))  # at most probe.batch_size states a chunk (K each)
    warn_if_idle(dist, len(chunks), "probe.batch_size")

    def compute(c: int) -> dict:  # chunk c: fixed trajectories, the same shapes on any process count
        a, b = chunks[c]
        if completion.kind == "x0":  # the rollout's z_k - s_k v_k: decode and score, no transformer pass
            x0 = np.asarray(arrays["x0_estimates"][a:b])
            final, passes = torch.from_numpy(x0.reshape(-1, *x0.shape[2:])).to(backend.device), 0
        else:
            with rollout_hint(iteration):
                v = torch.from_numpy(np.asarray(arrays["velocities"][a:b])) if reuse else None
            final, passes = complete_window_states(
                backend, torch.from_numpy(np.asarray(arrays["states"][a:b])), prompt_embeds.select(rows[a:b]),
                sigmas, attrs["window_start"], attrs["guidance_scale"], cfg.probe.batch_size,
                velocities=v, completion=completion)
        images = backend.decode(final)
        scored = reward(images, [metas[p] for p in rows[a:b].repeat_interleave(K).tolist()])
        return {"reward": scored.reward.reshape(b - a, K), "strict": scored.strict.reshape(b - a, K),
                "passes": np.array([passes], dtype=np.int64)}

    with chunk_bar(dist, f"probe {iteration}") as progress:
        merged = run_chunks(dist, IterationPaths(root, iteration).probe, len(chunks), compute,
                            f"probe of iteration {iteration}", progress=progress)
    return merged, len(chunks)


def first_steps_reused(arrays: dict, attrs: dict, completion: Completion, path: Path) -> bool:
    """Whether the completions take their first step with the rollout's stored ``velocities`` (every mode
    but ``x0``). A store written before the rollout kept them (no ``velocities_kept`` attribute) is
    completed with that first pass instead (the same Q_k up to float round-off); a store whose rollout kept
    them but lacks the array is damaged: one line naming it and what to do."""
    if not completion.runs_transformer:
        return False
    if "velocities" in arrays:
        return True
    if attrs.get(VELOCITIES_KEPT_ATTR):
        raise ArtifactError(f"{path}: array 'velocities' is missing though attribute {VELOCITIES_KEPT_ATTR} says "
                            f"the rollout stored it: the store is damaged; {_rerun(attrs.get('iteration'))}")
    return False


def _rerun(iteration) -> str:
    return f"rerun its rollout (tpgrpo stage rollout --iter {iteration if iteration is not None else 'N'})"


@contextmanager
def rollout_hint(iteration: int):
    """Add what to do to a damaged trajectory store's one-line error: rerun the rollout that wrote it."""
    try:
        yield
    except ArtifactError as exc:
        raise ArtifactError(f"{exc}; {_rerun(iteration)}") from None


def _load(cfg: Config, iteration: int, root: Path, metas: list[dict], completion: Completion):
    """The backend (and prompt embeddings) a mode needs. ``x0`` only decodes: the base model without the
    policy's LoRA (which sits on the transformer alone) and no embeddings."""
    if completion.kind == "x0":
        m = cfg.model
        return load_backend(m.kind, resolve(root, m.path), local_device(m.device, current()), m.dtype,
                            resolution=m.resolution), None
    backend = load_policy(cfg, root, iteration)
    return backend, prompt_embeddings(cfg, root, iteration, backend, [m["prompt"] for m in metas])
