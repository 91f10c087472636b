"""The ODE-anchored tree rollout: structure, exactness of Q, one shared pass per schedule step."""

from __future__ import annotations

import pytest
import torch

from tpgrpo.algo.schedule import flow_sigmas
from tpgrpo.algo.tree import TreeShape, parse_split_steps, tree_rollout
from tpgrpo.algo.trajectory import SamplerSpec, ode_complete, rollout

T = 6
SHAPE = TreeShape(split_steps=(0, 2, 3), children=2, roots=1)


class Counting:
    """Counts velocity calls and rows, and records each call's batch size."""

    def __init__(self, inner):
        self.inner, self.rows, self.sizes = inner, 0, []

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def velocity(self, x, sigma, embeds, guidance_scale):
        self.rows += x.shape[0]
        self.sizes.append(x.shape[0])
        return self.inner.velocity(x, sigma, embeds, guidance_scale)


@pytest.fixture(scope="module")
def backend(tiny_model_dir):
    from tpgrpo.models import load_backend

    return load_backend("tiny", tiny_model_dir)


def _spec(kind="sde"):
    return SamplerSpec(sigmas=flow_sigmas(T, 1.0), window_start=0, window_size=T - 1, step_kind=kind,
                       noise_level=0.7, guidance_scale=4.5)


@pytest.fixture(scope="module")
def grown(backend):
    embeds = backend.encode_prompts(["a red circle", "two blue squares"]).select(torch.tensor([0, 1]))
    counting = Counting(backend)
    tree = tree_rollout(counting, embeds, [11, 12], _spec(), SHAPE)
    return tree, embeds, counting


def test_shape_counts_and_parsing():
    assert parse_split_steps("0,3,6") == (0, 3, 6)
    with pytest.raises(ValueError, match="comma-separated"):
        parse_split_steps("0;3")
    with pytest.raises(ValueError, match="strictly increasing"):
        TreeShape((3, 3), 1, 1).check(10)
    with pytest.raises(ValueError, match=r"\[0, 8\]"):
        TreeShape((0, 9), 1, 1).check(10)
    s = TreeShape((0, 3, 6), 1, 1)
    # steps 0 | 1-3 | 4-6 | 7-9 alive: 1 | 2 | 4 | 8 lineages: 1 + 6 + 12 + 24
    assert s.passes_per_root(10) == 43 and s.leaves_per_root() == 8
    assert s.edges_per_root() == 2 + 4 + 8 and s.sde_edges_per_root() == 1 + 2 + 4


def test_structure(grown):
    tree, _, _ = grown
    B, m = 2, SHAPE.children
    assert tree.leaves.shape[0] == B * SHAPE.leaves_per_root() == 2 * 27
    E = B * SHAPE.edges_per_root()
    assert tree.parent_states.shape[0] == E == tree.sde.numel()
    assert int(tree.sde.sum()) == B * SHAPE.sde_edges_per_root()
    assert torch.equal(tree.root, torch.sort(tree.root).values)  # root-major
    assert (tree.log_probs[~tree.sde] == 0).all() and (tree.log_probs[tree.sde] != 0).all()
    for e in range(E):  # a child of depth j hangs from an edge of depth j - 1 whose child is its parent state
        p = int(tree.parent_edge[e])
        if p < 0:
            assert tree.depth[e] == 0
            continue
        assert tree.depth[p] == tree.depth[e] - 1 and tree.root[p] == tree.root[e]
    # every node has exactly one ODE child and m SDE children
    for p in set(tree.parent_edge.tolist()) - {-1}:
        kids = tree.parent_edge == p
        assert int(kids.sum()) == m + 1 and int((kids & ~tree.sde).sum()) == 1
    ode = ~tree.sde  # an ODE edge's child reaches the same leaf as its parent: increment exactly 0
    assert torch.equal(tree.leaf[ode], tree.parent_leaf[ode])
    assert not (tree.leaf[tree.sde] == tree.parent_leaf[tree.sde]).any()
    assert len(set(tree.leaf.tolist())) == tree.leaves.shape[0]  # every leaf is some node's ODE leaf


def test_each_state_is_one_node(grown):
    """Each distinct state is kept once: siblings share their parent's node; splits 2 and 3 are adjacent, so a
    depth-1 child IS the parent state of its depth-2 edges (the same node); splits 0 and 2 are not."""
    tree, _, _ = grown
    B, m1 = 2, SHAPE.children + 1
    assert SHAPE.nodes_per_root() == (1 + 3) + (3 + 9) + (0 + 27)
    assert tree.node_states.shape[0] == B * SHAPE.nodes_per_root() == tree.node_root.numel()
    used = torch.cat([tree.parent_node, tree.child_node]).unique()
    assert torch.equal(used, torch.arange(tree.node_states.shape[0]))  # every node is some edge's end
    assert len(set(tree.child_node.tolist())) == tree.child_node.numel()  # a child state is its edge's own
    assert torch.equal(tree.node_root[tree.parent_node], tree.root)
    for e in range(tree.sde.numel()):
        p = int(tree.parent_edge[e])
        if p >= 0 and int(tree.depth[e]) == 2:
            assert tree.parent_node[e] == tree.child_node[p]  # adjacent splits: one state, one node
        elif p >= 0:
            assert tree.parent_node[e] != tree.child_node[p]  # ODE steps in between: two states
    assert (tree.parent_node.bincount(minlength=tree.node_states.shape[0])[tree.parent_node] == m1).all()
    _, first = torch.unique(tree.node_states.flatten(1), dim=0, return_inverse=True)
    assert first.unique().numel() == tree.node_states.shape[0]  # no two nodes hold the same latent


def test_one_velocity_call_per_schedule_step_siblings_share_it(grown):
    tree, _, counting = grown
    assert tree.calls == T == len(counting.sizes)  # not one call per node
    # lineages alive per step for 2 roots: splits at 0, 2, 3 with m = 2 -> 1, 3, 3, 9, 27, 27
    assert counting.sizes == [2 * SHAPE.lineages_at(t) for t in range(T)] == [2, 6, 6, 18, 54, 54]
    assert counting.rows == tree.passes == 2 * SHAPE.passes_per_root(T)


def test_q_of_every_node_is_the_ode_completion_of_its_state(grown, backend):
    """The exactness claim: ODE-completing a stored child (parent) state with the probe's own code reaches
    the leaf the tree assigns as Q(child) (Q(parent)), to float round-off; hence the leaf rewards are the Q's."""
    tree, embeds, _ = grown
    sigmas = flow_sigmas(T, 1.0)
    rows = embeds.select(tree.root)
    for states, start, leaf in ((tree.child_states, tree.steps + 1, tree.leaf),
                                (tree.parent_states, tree.steps, tree.parent_leaf)):
        final, _ = ode_complete(backend, states, start, sigmas, rows, 4.5, batch_size=64)
        torch.testing.assert_close(final, tree.leaves[leaf], atol=2e-5, rtol=0)
        images = backend.decode(final)
        expected = backend.decode(tree.leaves[leaf])
        q = torch.tensor(images, dtype=torch.float64).flatten(1).mean(1)  # a smooth reward: mean pixel
        assert torch.allclose(q, torch.tensor(expected, dtype=torch.float64).flatten(1).mean(1), atol=1e-5)
    # and a different leaf is really different (the test can fail)
    assert (tree.leaves[tree.leaf] - tree.leaves[tree.parent_leaf]).abs().amax() > 1e-2


def test_root_ode_path_is_the_plain_ode_sample(grown, backend):
    """A root's all-ODE leaf is the eta = 0 rollout of the same seed (the chain sampler's own code)."""
    tree, embeds, _ = grown
    spec = _spec()
    ode_spec = SamplerSpec(spec.sigmas, 0, T - 1, "sde", 0.0, 4.5)
    chain = rollout(backend, embeds, [11, 12], ode_spec)
    torch.testing.assert_close(tree.leaves[tree.root_leaf], chain.final, atol=2e-5, rtol=0)


@pytest.mark.parametrize("kind", ["cps"])
def test_cps_trees_are_exact_too(backend, kind):
    """The cps step at the split steps: log-probs in the release's form, Q still the ODE completion."""
    embeds = backend.encode_prompts(["a red circle"]).select(torch.tensor([0]))
    tree = tree_rollout(backend, embeds, [5], _spec(kind), TreeShape((1, 3), 1, 1))
    final, _ = ode_complete(backend, tree.child_states, tree.steps + 1, flow_sigmas(T, 1.0),
                            embeds.select(tree.root), 4.5, batch_size=64)
    torch.testing.assert_close(final, tree.leaves[tree.leaf], atol=2e-5, rtol=0)
    assert (tree.log_probs[tree.sde] < 0).all() and (tree.log_probs[~tree.sde] == 0).all()


def test_sde_edges_log_probs_rescore_and_noise_is_batch_independent(grown, backend):
    from tpgrpo.algo.sampling import stochastic_step
    from tpgrpo.algo.trajectory import velocity_at

    tree, embeds, _ = grown
    e = tree.sde.nonzero().flatten()
    v = velocity_at(backend, tree.parent_states[e], tree.sigmas[e, 0], embeds.select(tree.root[e]), 4.5)
    out = stochastic_step("sde", tree.parent_states[e], v, tree.sigmas[e, 0], tree.sigmas[e, 1], 0.7,
                          sigma_at_one=float(flow_sigmas(T, 1.0)[1]), prev_sample=tree.child_states[e])
    torch.testing.assert_close(out.log_prob, tree.log_probs[e], atol=1e-4, rtol=1e-5)
    alone = tree_rollout(backend, embeds.select(torch.tensor([1])), [12], _spec(), SHAPE)  # root 1 alone
    torch.testing.assert_close(alone.leaves, tree.leaves[tree.leaves.shape[0] // 2:], atol=2e-5, rtol=0)


def test_per_split_child_counts_count_and_check():
    """``children`` one count per split: m_j SDE children at split j; the counts follow P_j."""
    s = TreeShape((0, 3, 6), (3, 1, 1), 1)
    s.check(10)
    # steps 0 | 1-3 | 4-6 | 7-9 alive: 1 | 4 | 8 | 16 lineages
    assert [s.lineages_at(t) for t in (0, 1, 4, 7)] == [1, 4, 8, 16]
    assert s.passes_per_root(10) == 1 + 3 * 4 + 3 * 8 + 3 * 16 and s.leaves_per_root() == 16
    assert s.edges_per_root() == 4 + 8 + 16 and s.sde_edges_per_root() == 3 * 1 + 1 * 4 + 1 * 8
    assert s.nodes_per_root() == (1 + 4) + (4 + 8) + (8 + 16)
    uniform = TreeShape((0, 3, 6), (2, 2, 2), 1)  # a tuple of equal counts counts as the int
    assert [getattr(uniform, f)() for f in ("leaves_per_root", "edges_per_root", "sde_edges_per_root",
                                            "nodes_per_root")] == \
        [getattr(TreeShape((0, 3, 6), 2, 1), f)() for f in ("leaves_per_root", "edges_per_root",
                                                             "sde_edges_per_root", "nodes_per_root")]
    with pytest.raises(ValueError, match=r"one count per split step \[0, 3\] \(2\)"):
        TreeShape((0, 3), (3, 1, 1), 1).check(10)
    with pytest.raises(ValueError, match=">= 1"):
        TreeShape((0, 3), (3, 0), 1).check(10)


def test_a_per_split_tree_has_m_j_sde_children_per_node_and_exact_q(backend):
    """A tree with 2 SDE children at its first split and 1 at its second: each node of depth j has one ODE
    and m_j SDE children, every Q is its state's ODE completion, and equal counts give the int's tree."""
    embeds = backend.encode_prompts(["a red circle"]).select(torch.tensor([0]))
    shape = TreeShape((0, 2), (2, 1), 1)
    tree = tree_rollout(backend, embeds, [7], _spec(), shape)
    assert tree.leaves.shape[0] == shape.leaves_per_root() == 3 * 2
    assert int(tree.sde.sum()) == shape.sde_edges_per_root() == 2 + 3
    for depth, m in enumerate(shape.counts):
        at = tree.depth == depth
        kids = torch.bincount(tree.parent_node[at])
        assert set(kids[kids > 0].tolist()) == {m + 1}  # every parent at this depth: 1 ODE + m SDE children
    final, _ = ode_complete(backend, tree.child_states, tree.steps + 1, flow_sigmas(T, 1.0),
                            embeds.select(tree.root), 4.5, batch_size=64)
    torch.testing.assert_close(final, tree.leaves[tree.leaf], atol=2e-5, rtol=0)
    as_int = tree_rollout(backend, embeds, [7], _spec(), TreeShape((0, 2), 1, 1))
    as_tuple = tree_rollout(backend, embeds, [7], _spec(), TreeShape((0, 2), (1, 1), 1))
    assert torch.equal(as_int.leaves, as_tuple.leaves) and torch.equal(as_int.log_probs, as_tuple.log_probs)
