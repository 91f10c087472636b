"""Credit on a tree: a hand-made tree whose every number is derived by hand below."""

from __future__ import annotations

import math

import pytest
import torch

from tpgrpo.algo.tree_credit import (check_tree, leaf_means, ode_siblings, root_q, sibling_advantages,
                                     tree_advantages, tree_credit)

# One prompt, R = 1 root r, m = 1, three split depths; edges A..N (indices 0..13), ODE child listed first:
#   depth 0: r -> A (ODE), B (SDE)
#   depth 1: A -> C (ODE), D (SDE);  B -> E (ODE), F (SDE)
#   depth 2: C -> G, H;  D -> I, J;  E -> K, L;  F -> M, N   (ODE, SDE each)
# Leaves (Q of the depth-2 children): G .5, H .3, I .4, J .9, K .3, L .1, M .6, N 1.0.
# Q(node) = its ODE leaf: Q(r) = Q(A) = Q(C) = G = .5; Q(D) = I = .4; Q(B) = Q(E) = K = .3; Q(F) = M = .6.
PARENT = [-1, -1, 0, 0, 1, 1, 2, 2, 3, 3, 4, 4, 5, 5]
DEPTH = [0, 0, 1, 1, 1, 1, 2, 2, 2, 2, 2, 2, 2, 2]
SDE = [i % 2 == 1 for i in range(14)]
Q_PARENT = [.5, .5, .5, .5, .3, .3, .5, .5, .4, .4, .3, .3, .6, .6]
Q_CHILD = [.5, .3, .5, .4, .3, .6, .5, .3, .4, .9, .3, .1, .6, 1.0]
# d = Q(child) - Q(parent): 0 on every ODE edge.
D_INC = [0, -.2, 0, -.1, 0, .3, 0, -.2, 0, .5, 0, -.2, 0, .4]
# F = mean of the leaves below the child: depth 2 = Q(child); C (G,H) .4; D (I,J) .65; E (K,L) .2; F (M,N) .8;
# A (G,H,I,J) = 2.1/4 = .525; B (K,L,M,N) = 2.0/4 = .5.
F_MEAN = [.525, .5, .4, .65, .2, .8, .5, .3, .4, .9, .3, .1, .6, 1.0]
TREND = [f - .5 for f in F_MEAN]  # D = F - Q(r)
AGG = [f - q for f, q in zip(F_MEAN, Q_PARENT)]  # B = F - Q(parent)
# Turning points, tp (consistent): depth 0 needs sign(d) sign(F - Q(child)) > 0: A has d = 0; B has d = -.2,
# rest .5 - .3 = +.2: no. Depth 1 needs a flip into the trend: only F has a previous step against its trend
# (d(B) = -.2 with D(F) = +.3), its own step with it (+.3), and rest .8 - .6 = +.2 of the same sign: F is one.
# D's previous step (A) is an ODE edge, increment 0: no flip. Depth 2: rest F - Q(child) = 0: never.
TP = [i == 5 for i in range(14)]
# tp_unconstrained drops the rest condition: F again, and J (depth 2): d(D) = -.1 against D(J) = +.4, d(J) = +.5
# with it. H, L: previous step an ODE edge (0); N: previous step d(F) = +.3 already with the trend.
TP_UNCONSTRAINED = [i in (5, 9) for i in range(14)]


def _result(mode="tp", edge_return="mean", balance="group"):
    t = lambda v, dt=torch.float64: torch.tensor(v, dtype=dt)  # noqa: E731
    return tree_credit(t(Q_PARENT), t(Q_CHILD), t(PARENT, torch.int64), t(DEPTH, torch.int64),
                       t(SDE, torch.bool), torch.zeros(14, dtype=torch.int64), mode=mode, balance=balance,
                       edge_return=edge_return)


def _close(got, want):
    torch.testing.assert_close(got, torch.tensor(want, dtype=torch.float64), atol=1e-12, rtol=0)


def test_increments_values_and_aggregates_by_hand():
    r = _result()
    _close(r.incremental, D_INC)
    _close(r.edge_return, F_MEAN)
    _close(r.trend, TREND)
    _close(r.aggregated, AGG)
    _close(leaf_means(torch.tensor(Q_CHILD, dtype=torch.float64), torch.tensor(PARENT), torch.tensor(DEPTH)), F_MEAN)
    _close(root_q(torch.tensor(Q_PARENT, dtype=torch.float64), torch.tensor(PARENT), torch.tensor(DEPTH)), [.5] * 14)


def test_turning_points_and_step_rewards_of_every_mode_by_hand():
    tp = _result("tp")
    assert tp.turning_point.tolist() == TP
    # step reward: d everywhere but at F, where B(F) = .8 - .3 = .5 replaces d(F) = .3
    _close(tp.step_reward, [.5 if i == 5 else D_INC[i] for i in range(14)])
    free = _result("tp_unconstrained")
    assert free.turning_point.tolist() == TP_UNCONSTRAINED
    _close(free.step_reward, [.5 if i == 5 else D_INC[i] for i in range(14)])  # J: B = .9 - .4 = .5 = d(J)
    _close(_result("incremental").step_reward, D_INC)
    assert not _result("incremental").turning_point.any()
    _close(_result("flow_grpo").step_reward, F_MEAN)


def test_ode_return_makes_b_equal_d_and_tp_collapse_to_incremental():
    """The alternative edge return F = Q(child): B = d, rest = 0, so no consistent turning point and an
    unconstrained one replaces d by d."""
    for mode in ("tp", "tp_unconstrained", "incremental"):
        r = _result(mode, edge_return="ode")
        _close(r.aggregated, D_INC)
        _close(r.step_reward, D_INC)
    assert not _result("tp", edge_return="ode").turning_point.any()
    # unconstrained (trend D = Q(child) - .5): B at depth 0 (a_0 > 0: d = -.2 with D = .3 - .5 = -.2), F (d(B) =
    # -.2 against D = .6 - .5 = +.1, d(F) = +.3) and J (d(D) = -.1 against D = .4); D, H, L follow an ODE edge
    # (increment 0), N follows F (+.3, already with its trend)
    # (increment 0), N follows F (+.3, already with its trend). Balancing: one negative (B) against two positives:
    # keep B and, of F (|D| .1) and J (|D| .4), J.
    free = _result("tp_unconstrained", edge_return="ode")
    assert free.candidate_turning_point.nonzero().flatten().tolist() == [1, 5, 9]
    assert free.turning_point.nonzero().flatten().tolist() == [1, 9]
    _close(_result("flow_grpo", edge_return="ode").step_reward, Q_CHILD)


def test_balancing_runs_over_all_depths_of_a_prompt():
    """Flip the tree's rewards (Q -> 1 - Q) and add it as a second root of the same prompt: its F becomes a
    negative-trend turning point (trend -.3, |D| = .3) beside the first root's positive one (|D| = .3 too);
    one of each sign: both kept. Unconstrained: first root F (+.3), J (+.4); second root F (-.3), J (-.4):
    two of each, all kept. Then drop the second root's J: positives F, J vs negative F: keep one positive,
    the largest |D| (J, .4)."""
    t = lambda v, dt=torch.float64: torch.tensor(v, dtype=dt)  # noqa: E731
    parent = PARENT + [p + 14 if p >= 0 else -1 for p in PARENT]
    qp, qc = Q_PARENT + [1 - q for q in Q_PARENT], Q_CHILD + [1 - q for q in Q_CHILD]
    args = (t(qp), t(qc), t(parent, torch.int64), t(DEPTH * 2, torch.int64), t(SDE * 2, torch.bool),
            torch.zeros(28, dtype=torch.int64))
    assert tree_credit(*args, mode="tp").turning_point.nonzero().flatten().tolist() == [5, 19]
    assert tree_credit(*args, mode="tp_unconstrained").turning_point.nonzero().flatten().tolist() == [5, 9, 19, 23]
    qc2 = list(qc)
    qc2[23] = qp[23]  # second root's J: no increment, no turning point (its subtree mean changes too)
    args2 = (t(qp), t(qc2), *args[2:])
    r = tree_credit(*args2, mode="tp_unconstrained")
    assert r.candidate_turning_point.nonzero().flatten().tolist() == [5, 9, 19]
    assert r.turning_point.nonzero().flatten().tolist() == [9, 19]


def test_advantages_by_depth_by_hand():
    r = _result("tp")
    adv = tree_advantages(r.step_reward, torch.tensor(DEPTH), torch.tensor(SDE), torch.zeros(14, dtype=torch.int64))
    want = [0.0] * 14
    # depth 0: A 0, B -.2 -> mean -.1, std .1: B -> -.1 / (.1 + 1e-4)
    want[1] = -0.1 / (0.1 + 1e-4)
    # depth 1: C 0, D -.1, E 0, F .5 -> mean .1, var (.01 + .04 + .01 + .16) / 4 = .055
    s1 = math.sqrt(0.055) + 1e-4
    want[3], want[5] = -0.2 / s1, 0.4 / s1
    # depth 2: 0, -.2, 0, .5, 0, -.2, 0, .4 -> mean .0625; var (4 * .0625^2 + 2 * .2625^2 + .4375^2 + .3375^2) / 8
    var2 = (4 * 0.0625**2 + 2 * 0.2625**2 + 0.4375**2 + 0.3375**2) / 8
    s2 = math.sqrt(var2) + 1e-4
    want[7], want[9], want[11], want[13] = -0.2625 / s2, 0.4375 / s2, -0.2625 / s2, 0.3375 / s2
    _close(adv, want)  # ODE edges (even indices) are 0: no policy


# Each edge's ODE sibling (the ODE edge out of the same parent node): A for A and B, C for C and D, ...
SIBLING = [i - i % 2 for i in range(14)]


def _sibling_adv(step_reward):
    sib = ode_siblings(torch.tensor(PARENT), torch.zeros(14, dtype=torch.int64), torch.tensor(SDE))
    assert sib.tolist() == SIBLING
    return sibling_advantages(step_reward, torch.tensor(DEPTH), torch.tensor(SDE), sib)


def _centred_by_depth(adv):
    """The trained (SDE) advantages of each depth sum to 0; ODE edges are 0."""
    depth, sde = torch.tensor(DEPTH), torch.tensor(SDE)
    assert (adv[~sde] == 0).all()
    for j in range(3):
        assert abs(float(adv[(depth == j) & sde].sum())) < 1e-12, j


def test_ode_sibling_advantages_are_centred_by_hand():
    """tree.baseline ode_sibling: u = r - r(ODE sibling), centred and scaled per depth over the
    SDE edges. tp step rewards: B -.2; D -.1, F .5 (a turning point: B = .8 - .3); H -.2, J .5, L -.2, N .4;
    ODE edges 0 (d = 0, never a turning point), so u = r."""
    adv = _sibling_adv(_result("tp").step_reward)
    want = [0.0] * 14
    # depth 0: B alone: nothing to compare it with, 0 (the old rule gave it -.1 / (.1 + 1e-4) = -1: its sign)
    # depth 1: D -.1, F .5 -> mean .2, std .3
    want[3], want[5] = -0.3 / (0.3 + 1e-4), 0.3 / (0.3 + 1e-4)
    # depth 2: -.2, .5, -.2, .4 -> mean .125, var (2 * .325^2 + .375^2 + .275^2) / 4
    s2 = math.sqrt((2 * 0.325**2 + 0.375**2 + 0.275**2) / 4) + 1e-4
    want[7], want[9], want[11], want[13] = -0.325 / s2, 0.375 / s2, -0.325 / s2, 0.275 / s2
    _close(adv, want)
    _centred_by_depth(adv)
    # The old rule's trained advantages are not centred: depth 2's sum to (2 * -.2625 + .4375 + .3375) / s > 0.
    old = tree_advantages(_result("tp").step_reward, torch.tensor(DEPTH), torch.tensor(SDE),
                          torch.zeros(14, dtype=torch.int64))
    assert float(old[torch.tensor(DEPTH) == 2].sum()) > 0.1


def test_ode_sibling_baseline_subtracts_the_ode_edges_own_reward():
    """flow_grpo gives ODE edges a step reward too (their leaf mean F): u = F - F(ODE sibling).
    Depth 1: D .65 - .4 = .25, F .8 - .2 = .6 -> mean .425, std .175; depth 2 as tp's (F = Q(child) there)."""
    adv = _sibling_adv(_result("flow_grpo").step_reward)
    assert float(adv[1]) == 0.0
    _close(adv[[3, 5]], [-0.175 / (0.175 + 1e-4), 0.175 / (0.175 + 1e-4)])
    _centred_by_depth(adv)


def test_ode_siblings_at_depth_zero_are_per_root_and_a_missing_ode_child_is_one_line():
    # Two roots (ids 7, 9), each: an ODE and an SDE edge at depth 0 (parent -1).
    parent, root = torch.tensor([-1, -1, -1, -1]), torch.tensor([7, 7, 9, 9])
    assert ode_siblings(parent, root, torch.tensor([False, True, False, True])).tolist() == [0, 0, 2, 2]
    with pytest.raises(ValueError, match=r"^tree edge 2: no ODE sibling[^\n]*$"):
        ode_siblings(parent, root, torch.tensor([False, True, True, True]))


def test_malformed_trees_are_one_line_errors():
    bad_parent = list(PARENT)
    bad_parent[6] = 0  # a depth-2 edge hanging from a depth-0 edge
    with pytest.raises(ValueError, match="tree edge 6: parent edge 0"):
        check_tree(torch.tensor(bad_parent), torch.tensor(DEPTH), torch.tensor(SDE))
    two_ode = list(SDE)
    two_ode[7] = False  # C's child then has two ODE children
    with pytest.raises(ValueError, match="tree edge 2: its child has 2 ODE children"):
        check_tree(torch.tensor(PARENT), torch.tensor(DEPTH), torch.tensor(two_ode))
    with pytest.raises(ValueError, match="edge_return"):
        _result(edge_return="max")


def _store_arrays():
    """The hand-made tree above as a tree store's arrays (one prompt, edges A..N as rows 0..13)."""
    import numpy as np

    # leaves in the order G H I J K L M N = 0..7; a depth-2 edge's child is its leaf; others reach their ODE leaf
    leaf = [0, 4, 0, 2, 4, 6, 0, 1, 2, 3, 4, 5, 6, 7]
    parent_leaf = [0, 0, 0, 0, 4, 4, 0, 0, 2, 2, 4, 4, 6, 6]
    return {"prompt_index": np.zeros(14, np.int32), "tree_parent": np.array(PARENT, np.int32),
            "tree_leaf": np.array(leaf, np.int32), "tree_parent_leaf": np.array(parent_leaf, np.int32),
            "final_reward": np.array(Q_CHILD), "final_strict": np.zeros(14, bool), "sample": np.arange(14),
            "seeds": np.zeros(14, np.int64), "sigmas": np.tile([1.0, 0.5], (14, 1)),
            "tree_depth": np.array(DEPTH, np.int32), "tree_sde": np.array(SDE)}


def test_the_probe_assembles_q_parent_from_the_leaves_and_refuses_a_damaged_tree():
    import numpy as np

    from tpgrpo.io.schemas import ArtifactError
    from tpgrpo.rollout_shape.tree_probe import tree_probe_table

    metas = [{"id": "p0", "prompt": "a red circle"}]
    table = tree_probe_table(_store_arrays(), metas, "store")
    np.testing.assert_array_equal(table[table.step == 0]["reward"].to_numpy(), Q_PARENT)
    np.testing.assert_array_equal(table[table.step == 1]["reward"].to_numpy(), Q_CHILD)
    damaged = _store_arrays()
    damaged["tree_parent_leaf"][9] = 1  # J's parent (D's child) said to reach leaf H: another edge's reward
    with pytest.raises(ArtifactError, match="store: Q\\(parent\\) from tree_parent_leaf differs"):
        tree_probe_table(damaged, metas, "store")
