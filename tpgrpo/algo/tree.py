"""The ODE-anchored tree rollout: every ODE completion is also a sample of the group.

Per prompt, R roots start from independent seeded noise. At each *split step* (schedule step indices
``split_steps``, strictly increasing, all < T - 1) every node spawns one ODE child (the deterministic Euler
step) and m SDE children (the project's stochastic step, :func:`tpgrpo.algo.sampling.stochastic_step`, with
its log-prob); every other step is a deterministic ODE step. Following ODE children from any node therefore
reaches a leaf, and that leaf's reward IS the node's exact ``Q = R(ODE-complete(node))``: no probe pass, no
extra decode.

Edges are the unit of training. An edge of depth j (the j-th split step, ``k = split_steps[j]``) goes from its
parent state (at sigma ``s_k``, the lineage's latent just before step k) to its child state (at ``s_{k+1}``,
just after it). Each distinct state is kept once, as a *node* (``node_states``): a parent's state serves its
m + 1 edges, and a child that splits again at the very next step is that split's parent state too; an edge
holds its parent and child node indices. Leaves are the latents at sigma 0, one per lineage alive at the end.

Batching: at every schedule step ONE velocity call serves every lineage alive at that step, across all roots
and prompts (siblings share their parent's pass at a split; ``batch_size`` may cut the call into chunks for
memory). The device rule of :mod:`tpgrpo.algo.trajectory` holds: step maths on ``backend.device`` in float32,
random draws on per-edge CPU generators, so an edge's noise depends only on its root's seed and its place in
the tree, never on the batch.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Sequence

import torch

from tpgrpo.algo.sampling import ode_step, stochastic_step
from tpgrpo.algo.seeds import sample_seed
from tpgrpo.algo.trajectory import SamplerSpec, velocity_at
from tpgrpo.algo.tree_shape import TreeShape, parse_split_steps  # noqa: F401 - re-exported


@dataclass(frozen=True)
class TreeRollout:
    """A batch of trees, E edges, root-major (a root's edges contiguous, in creation order: by depth, then
    parent, then child with the ODE child first); V nodes (distinct states) and F leaves, root-major.

    Fields:
        node_states: ``(V, C, H, W)`` float32, each distinct state once (in creation order within a root: per
            split, the lineages' states before it when not already kept, then their children).
        parent_node / child_node: ``(E,)`` int64, the rows of ``node_states`` before / after the edge's step
            (``parent_states`` / ``child_states``: those rows); node_root: ``(V,)`` int64.
        log_probs: ``(E,)`` float32, the SDE edge's old log-prob (sampler's convention); 0 on ODE edges.
        sigmas: ``(E, 2)`` float32, ``(s_k, s_{k+1})`` of the edge's schedule step k.
        steps: ``(E,)`` int64, the schedule step k; depth: ``(E,)`` int64, the split index j (0..L-1).
        sde: ``(E,)`` bool, True for an SDE edge, False for the ODE child.
        parent_edge: ``(E,)`` int64, the edge into the parent node, -1 when the parent is a root.
        root: ``(E,)`` int64, the row of ``seeds`` the edge grows from.
        leaf: ``(E,)`` int64, the leaf reached from the child by ODE children (its reward is Q(child)).
        parent_leaf: ``(E,)`` int64, the leaf reached from the parent by ODE children (Q(parent)).
        leaves: ``(F, C, H, W)`` float32, the final latents at sigma 0; leaf_root: ``(F,)`` int64.
        root_leaf: ``(B,)`` int64, each root's all-ODE leaf (the leaf of its Q).
        calls / passes: velocity calls made / rows through them (not counting CFG's doubling).
    """

    node_states: torch.Tensor
    parent_node: torch.Tensor
    child_node: torch.Tensor
    node_root: torch.Tensor
    log_probs: torch.Tensor
    sigmas: torch.Tensor
    steps: torch.Tensor
    depth: torch.Tensor
    sde: torch.Tensor
    parent_edge: torch.Tensor
    root: torch.Tensor
    leaf: torch.Tensor
    parent_leaf: torch.Tensor
    leaves: torch.Tensor
    leaf_root: torch.Tensor
    root_leaf: torch.Tensor
    calls: int
    passes: int

    @property
    def parent_states(self) -> torch.Tensor:
        """``(E, C, H, W)``: the latent before each edge's step (a copy per edge, for tests and inspection)."""
        return self.node_states[self.parent_node.to(self.node_states.device)]

    @property
    def child_states(self) -> torch.Tensor:
        """``(E, C, H, W)``: the latent after each edge's step."""
        return self.node_states[self.child_node.to(self.node_states.device)]


def edge_noise_seed(root_seed: int, depth: int, node: int, child: int) -> int:
    """Seed of the SDE noise of child ``child`` (1..m) of node ``node`` (its index among its root's nodes at
    ``depth``, in creation order): a stable hash, so an edge can be regenerated alone."""
    return sample_seed(int(root_seed), depth, f"node{node}", child, purpose="tree-noise")


def _noise(root_seeds: list[int], positions: list[int], depth: int, m: int, shape) -> torch.Tensor:
    """(A * m, *shape) standard normals, lineage-major: lineage a's child j (1..m) at row a * m + j - 1."""
    draws = [torch.randn(shape, generator=torch.Generator().manual_seed(edge_noise_seed(r, depth, p, j)))
             for r, p in zip(root_seeds, positions) for j in range(1, m + 1)]
    return torch.stack(draws)


def _velocity(backend, x, sigma: float, embeds, guidance_scale: float, batch_size: int | None):
    """One velocity call for all rows of ``x`` (or one per ``batch_size`` rows); returns (v, calls)."""
    if batch_size is None or x.shape[0] <= batch_size:
        return velocity_at(backend, x, sigma, embeds, guidance_scale), 1
    parts = [velocity_at(backend, x[i:i + batch_size], sigma, embeds.select(torch.arange(i, min(i + batch_size,
             x.shape[0]))), guidance_scale) for i in range(0, x.shape[0], batch_size)]
    return torch.cat(parts), len(parts)


def split(x: torch.Tensor, v: torch.Tensor, s: float, s_next: float, spec: SamplerSpec, m: int,
          noise: torch.Tensor):
    """One split step for A lineages: children ``(A * (m + 1), C, H, W)`` parent-major (ODE child first,
    then the m SDE children) and their log-probs ``(A * (m + 1),)`` (0 for the ODE child).

    x, v: ``(A, C, H, W)`` states at ``s`` and their guided velocities; noise ``(A * m, C, H, W)``."""
    A = x.shape[0]
    ode_child = ode_step(x, v, s, s_next)
    out = stochastic_step(spec.step_kind, x.repeat_interleave(m, 0), v.repeat_interleave(m, 0), s, s_next,
                          spec.noise_level, sigma_at_one=float(spec.sigmas[1]), noise=noise.to(x.device))
    children = torch.cat([ode_child[:, None], out.prev_sample.reshape(A, m, *x.shape[1:])], 1)
    log_probs = torch.cat([torch.zeros(A, 1, device=x.device), out.log_prob.reshape(A, m)], 1)
    return children.reshape(A * (m + 1), *x.shape[1:]), log_probs.reshape(-1)


@torch.no_grad()
def tree_rollout(backend, embeds, seeds: Sequence[int], spec: SamplerSpec, shape: TreeShape,
                 batch_size: int | None = None) -> TreeRollout:
    """Sample B trees (one per seed; ``embeds`` one row per root, on ``backend.device``) with CFG throughout.

    Returns a :class:`TreeRollout` on ``backend.device`` (indices on the CPU). ``batch_size`` None: one
    velocity call per schedule step for every lineage of every root.
    """
    shape.check(spec.num_steps)
    sigmas, B = spec.sigmas, len(seeds)
    x = backend.initial_noise(list(seeds)).to(backend.device, torch.float32)
    lineage_root = torch.arange(B)
    position = [0] * B  # each lineage's node index among its root's nodes at the current depth
    owners: list[list[int]] = [[-1 - b] for b in range(B)]  # edges (or -1 - root) whose ODE path this lineage is
    edges: list[dict] = []
    nodes: list[tuple[torch.Tensor, torch.Tensor]] = []  # (states, their roots) per block of new nodes
    x_node = None  # node of each row of x; None once an ODE step made new states
    calls = passes = 0
    for step in range(spec.num_steps):
        s, s_next = float(sigmas[step]), float(sigmas[step + 1])
        v, n = _velocity(backend, x, s, embeds.select(lineage_root), spec.guidance_scale, batch_size)
        calls, passes = calls + n, passes + x.shape[0]
        if step not in shape.split_steps:
            x, x_node = ode_step(x, v, s, s_next), None
            continue
        if x_node is None:  # the lineages' states before this split are new nodes
            x_node = _new_nodes(nodes, x, lineage_root)
        depth = shape.split_steps.index(step)
        m = shape.counts[depth]
        noise = _noise([int(seeds[r]) for r in lineage_root], position, depth, m, tuple(x.shape[1:]))
        children, log_probs = split(x, v, s, s_next, spec, m, noise)
        first = sum(len(e["sde"]) for e in edges)
        parent_edge = [max(o[-1], -1) for o in owners]  # the edge into each lineage's current node
        child_node = _new_nodes(nodes, children, lineage_root.repeat_interleave(m + 1))
        edges.append({"parent": x_node.repeat_interleave(m + 1), "child": child_node, "log_probs": log_probs,
                      "step": step, "depth": depth, "sde": [j > 0 for _ in range(x.shape[0]) for j in range(m + 1)],
                      "parent_edge": [p for p in parent_edge for _ in range(m + 1)],
                      "root": lineage_root.repeat_interleave(m + 1).tolist()})
        owners = [(o + [first + a * (m + 1) + j]) if j == 0 else [first + a * (m + 1) + j]
                  for a, o in enumerate(owners) for j in range(m + 1)]
        position = [p * (m + 1) + j for p in position for j in range(m + 1)]
        lineage_root = lineage_root.repeat_interleave(m + 1)
        x, x_node = children, child_node
    return _assemble(edges, nodes, owners, x, lineage_root, sigmas, B, calls, passes)


def _new_nodes(nodes: list, states: torch.Tensor, roots: torch.Tensor) -> torch.Tensor:
    """Append ``states`` (A rows, of roots ``roots``) to ``nodes``; returns their (A,) node indices."""
    first = sum(block.shape[0] for block, _ in nodes)
    nodes.append((states, roots))
    return torch.arange(first, first + states.shape[0])


def _sort_nodes(nodes: list, parent: torch.Tensor, child: torch.Tensor):
    """Node states root-major (creation order within a root), their roots, and ``parent`` / ``child`` node
    indices renumbered to match."""
    states = torch.cat([block for block, _ in nodes])
    roots = torch.cat([r for _, r in nodes])
    order = torch.sort(roots, stable=True).indices
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel())
    return states[order.to(states.device)], roots[order], rank[parent], rank[child]


def _assemble(edges, nodes, owners, leaves, leaf_root, sigmas, B: int, calls: int, passes: int) -> TreeRollout:
    """Concatenate the per-depth edge records, resolve each edge's leaves, and sort root-major."""
    E = sum(len(e["sde"]) for e in edges)
    leaf, root_leaf = torch.empty(E, dtype=torch.int64), torch.empty(B, dtype=torch.int64)
    for a, chain in enumerate(owners):  # lineage a ends at leaf a; every owner's ODE path ends there
        for o in chain:
            if o >= 0:
                leaf[o] = a
            else:
                root_leaf[-1 - o] = a
    cat = lambda key: [v for e in edges for v in e[key]]  # noqa: E731
    parent_edge = torch.tensor(cat("parent_edge"), dtype=torch.int64)
    root = torch.tensor(cat("root"), dtype=torch.int64)
    parent_leaf = torch.where(parent_edge >= 0, leaf[parent_edge.clamp(min=0)], root_leaf[root])
    steps = torch.tensor([e["step"] for e in edges for _ in e["sde"]], dtype=torch.int64)
    order = torch.sort(root, stable=True).indices  # root-major, creation order within a root
    rank = torch.empty_like(order)
    rank[order] = torch.arange(E)
    leaf_order = torch.sort(leaf_root, stable=True).indices
    leaf_rank = torch.empty_like(leaf_order)
    leaf_rank[leaf_order] = torch.arange(leaf_order.numel())
    pe = parent_edge[order]
    dev = leaves.device
    node_states, node_root, parent_node, child_node = _sort_nodes(
        nodes, torch.cat([e["parent"] for e in edges])[order], torch.cat([e["child"] for e in edges])[order])
    return TreeRollout(
        node_states=node_states, parent_node=parent_node, child_node=child_node, node_root=node_root,
        log_probs=torch.cat([e["log_probs"] for e in edges])[order.to(dev)],
        sigmas=torch.stack([sigmas[steps], sigmas[steps + 1]], 1)[order].float(), steps=steps[order],
        depth=torch.tensor([e["depth"] for e in edges for _ in e["sde"]], dtype=torch.int64)[order],
        sde=torch.tensor(cat("sde"), dtype=torch.bool)[order],
        parent_edge=torch.where(pe >= 0, rank[pe.clamp(min=0)], pe), root=root[order],
        leaf=leaf_rank[leaf[order]], parent_leaf=leaf_rank[parent_leaf[order]],
        leaves=leaves[leaf_order.to(dev)], leaf_root=leaf_root[leaf_order], root_leaf=leaf_rank[root_leaf],
        calls=calls, passes=passes)
