"""The rollout stage for trees (``tree.enabled``): sample ODE-anchored trees, decode and score the
leaves only, write ``trajectories.zarr`` with one row per EDGE and each distinct state once.

Each edge is a "trajectory" of one window step: ``log_probs (E, 1)`` (0 on ODE edges), ``sigmas (E, 2)``,
``final_reward`` = the reward of the leaf the child reaches by ODE children, i.e. Q(child). Its two states
(parent before the split step, child after it) are rows ``tree_parent_node`` / ``tree_child_node`` of
``node_states (V, C, H, W)``, prompt-major with V / prompts nodes per prompt (``TreeShape.nodes_per_root``
per root), indices within the prompt: a parent's state is kept once for its m + 1 edges (the update reads
the pairs through :class:`tpgrpo.policy.states.NodeStates`). Attributes: ``group_size`` = edges per prompt,
``window_size`` 1, ``window_start`` the first split step, plus ``shape: tree`` and the tree's parameters.
Tree arrays, one value per edge: ``tree_parent`` (the parent edge's ``sample`` in the same prompt group, -1
below a root), ``tree_depth``, ``tree_sde``, ``tree_root`` (root within the prompt), ``tree_leaf`` /
``tree_parent_leaf`` (leaf within the prompt reached from the child / parent by ODE children). The probe
assembles every Q from these with no model (:mod:`tpgrpo.rollout_shape.tree_probe`). The chain's rollout is
:mod:`tpgrpo.rollout_shape.chain_rollout`; ``stages/rollout.py`` picks one.
"""

from __future__ import annotations

from pathlib import Path

import numpy as np
import torch

from tpgrpo.algo.seeds import sample_seed
from tpgrpo.algo.tree import tree_rollout
from tpgrpo.algo.tree_shape import TreeShape, shape_of
from tpgrpo.config import Config
from tpgrpo.distributed import chunk_bar, current, row_chunks, run_chunks, warn_if_idle
from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.io.stage_logs import write_log
from tpgrpo.io.trajectories import write_zarr
from tpgrpo.policy.loading import load_policy, prompt_embeddings, sampler_spec, select_prompts, store_attrs
from tpgrpo.policy.slow_adapter import load_sampling_adapter
from tpgrpo.rollout_shape import TREE
from tpgrpo.stage_common import check_finite, stopwatch
from tpgrpo.tasks.rewards import build_reward


def tree_shape(cfg: Config) -> TreeShape:
    """The rollout's :class:`TreeShape` from the ``tree`` params (checked by the config loader)."""
    return shape_of(cfg.tree)


def edge_arrays(tree, leaf_reward: np.ndarray, leaf_strict: np.ndarray, roots_per_prompt: int,
                per_root: tuple[int, int, int]) -> dict[str, np.ndarray]:
    """The store's arrays of one chunk of whole prompt groups (``tree`` a :class:`TreeRollout` of those roots,
    root-major): per edge, and ``node_states``; ``leaf_reward`` / ``leaf_strict`` ``(F,)`` of its leaves;
    ``per_root`` = (edges, leaves, nodes) per root. Indices become prompt-local (``tree_parent``, ...)."""
    edges_per_root, leaves_per_root, nodes_per_root = per_root
    first_root = (tree.root // roots_per_prompt) * roots_per_prompt  # each edge's prompt's first root
    edge_base, leaf_base, node_base = (first_root * n for n in per_root[:3])
    parent = torch.where(tree.parent_edge >= 0, tree.parent_edge - edge_base, tree.parent_edge)
    return {
        "node_states": tree.node_states.cpu().numpy(),
        "tree_parent_node": (tree.parent_node - node_base).numpy().astype(np.int32),
        "tree_child_node": (tree.child_node - node_base).numpy().astype(np.int32),
        "log_probs": tree.log_probs[:, None].cpu().numpy(), "sigmas": tree.sigmas.numpy(),
        "final_reward": leaf_reward[tree.leaf.numpy()].astype(np.float64),
        "final_strict": leaf_strict[tree.leaf.numpy()].astype(bool),
        "tree_parent": parent.numpy().astype(np.int32), "tree_depth": tree.depth.numpy().astype(np.int32),
        "tree_sde": tree.sde.numpy(), "tree_root": (tree.root % roots_per_prompt).numpy().astype(np.int32),
        "tree_leaf": (tree.leaf - leaf_base).numpy().astype(np.int32),
        "tree_parent_leaf": (tree.parent_leaf - leaf_base).numpy().astype(np.int32),
        "calls": np.array([tree.calls]), "passes": np.array([tree.passes]),
        "decodes": np.array([tree.leaves.shape[0]]),
    }


def run(cfg: Config, iteration: int, root: Path) -> dict:
    """The tree rollout stage of ``iteration`` (module docstring); the main process writes, and returns the
    metrics (``rollout.json``)."""
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration, "shape": TREE}
    dist = current()
    with stopwatch(metrics):
        metas = select_prompts(cfg, root, iteration)
        reward = build_reward(cfg.task.reward, cfg, root)
        backend = load_policy(cfg, root, iteration)
        load_sampling_adapter(cfg, root, iteration, backend)  # nft: the old adapter samples
        shape = tree_shape(cfg)  # its window: the first split step on (the params' window is the chain's)
        spec = sampler_spec(cfg, window=(shape.split_steps[0], 1))
        R, P = shape.roots, len(metas)
        per_root = (shape.edges_per_root(), shape.leaves_per_root(), shape.nodes_per_root())
        root_prompt = np.repeat(np.arange(P), R)
        seeds = [sample_seed(cfg.train.seed, iteration, metas[p]["id"], int(r), purpose="tree-root")
                 for p, r in zip(root_prompt, np.tile(np.arange(R), P))]
        embeds = prompt_embeddings(cfg, root, iteration, backend, [m["prompt"] for m in metas], write=True)
        # whole prompt groups per chunk, at most rollout.batch_size leaves (final lineages) where a group fits
        chunks = row_chunks(P * R, R, max(R, cfg.rollout.batch_size // per_root[1]))
        warn_if_idle(dist, len(chunks), "rollout.batch_size")

        def compute(c: int) -> dict:
            rows = np.arange(*chunks[c])
            tree = tree_rollout(backend, embeds.select(torch.as_tensor(root_prompt[rows])), [seeds[i] for i in rows],
                                spec, shape, batch_size=cfg.rollout.batch_size)
            leaf_prompts = [metas[root_prompt[rows[int(r)]]] for r in tree.leaf_root]
            scored = reward(backend.decode(tree.leaves), leaf_prompts)
            check_finite(f"reward {reward.name}", scored.reward, "rollout leaves")
            out = edge_arrays(tree, scored.reward, scored.strict, R, per_root)  # prompt-local indices
            if cfg.update.objective != "grpo":  # nft / awm train on the leaves (root-major: prompt-major)
                out["leaf_latents"] = tree.leaves.cpu().numpy()
            return out

        with chunk_bar(dist, f"rollout {iteration}") as progress:
            merged = run_chunks(dist, paths.trajectories, len(chunks), compute, f"rollout of iteration {iteration}",
                                progress=progress)
        if merged is None:
            return metrics
        arrays, attrs = _store(cfg, merged, metas, spec, shape, seeds, iteration)
        check_finite("old log-probs", arrays["log_probs"], f"rollout of iteration {iteration}")
        write_zarr(paths.trajectories, arrays, attrs, hash_for_dvc=cfg.launch.hash_while_writing,
                   cache_for_dvc=cfg.launch.cache_while_writing)
    leaves = P * R * per_root[1]
    sde = arrays["tree_sde"]
    last = arrays["tree_depth"] == shape.depth - 1  # one last-depth edge per leaf: its final reward is the leaf's
    metrics.update({"mean_reward": float(arrays["final_reward"][last].mean()),
                    "strict_accuracy": float(arrays["final_strict"][last].mean()),
                    "trajectories": int(sde.size), "sde_edges": int(sde.sum()), "leaves": leaves, "roots": P * R,
                    "forward_passes": int(merged["passes"].sum()), "velocity_calls": int(merged["calls"].sum()),
                    "decodes": int(merged["decodes"].sum()),
                    "cfg_doubled": backend.cfg_doubles_batch and spec.guidance_scale != 1.0,
                    "processes": dist.world, "chunks": len(chunks)})
    write_log(paths.rollout_metrics, metrics)
    return metrics


def _store(cfg: Config, merged: dict, metas: list[dict], spec, shape: TreeShape, seeds: list[int], iteration: int):
    """The arrays and attributes of ``trajectories.zarr`` from the merged chunks (edges prompt-major)."""
    E_prompt = shape.roots * shape.edges_per_root()
    prompt_index = np.repeat(np.arange(len(metas)), E_prompt)
    root_row = prompt_index * shape.roots + merged["tree_root"]
    arrays = {k: merged[k] for k in ("node_states", "log_probs", "sigmas", "final_reward", "final_strict",
                                     "tree_parent", "tree_depth", "tree_sde", "tree_root", "tree_leaf",
                                     "tree_parent_leaf", "tree_parent_node", "tree_child_node", "leaf_latents")
              if k in merged}
    arrays.update({"seeds": np.asarray(seeds, dtype=np.int64)[root_row], "prompt_index": prompt_index.astype(np.int32),
                   "sample": np.tile(np.arange(E_prompt), len(metas)).astype(np.int32)})
    children = shape.children if isinstance(shape.children, int) else list(shape.children)  # an int as before
    attrs = store_attrs(cfg, iteration, spec, metas, E_prompt, shape=TREE, tree_split_steps=list(shape.split_steps),
                        tree_children=children, tree_roots=shape.roots)
    return arrays, attrs
