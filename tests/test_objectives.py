"""update.objective nft / awm: each loss against a hand-computed example, the implicit-policy algebra, the slow
adapter's decay, the noise levels, the units of a hand-made tree, and the params' one-line errors."""

from __future__ import annotations

import pytest
import torch

from tpgrpo.algo import objectives as obj
from tpgrpo.algo.objective_units import chain_units, tree_units

X0, EPS = torch.tensor([[1.0, 0.0]]), torch.tensor([[0.0, 2.0]])  # one sample of two latent values


def test_nft_loss_matches_a_hand_computed_example():
    """t = 0.5: x_t = (0.5, 1). v = (1, 1), v_old = 0, b = 1: v+ = (1, 1), v- = (-1, -1).
    x0+ = x_t - t v+ = (0, 0.5): e+ = (-1, 0.5), mean e^2 0.625, mean |e| 0.75, L+ = 5/6.
    x0- = (1, 1.5): e- = (0, 1.5), mean e^2 1.125, mean |e| 0.75, L- = 1.5.
    A = 2.5: r = 0.75; 0.75 * 5/6 + 0.25 * 1.5 = 1.0; x 5 = 5.0. KL to v_base (0, 1): 0.5, x 0.1 = 0.05."""
    t = torch.tensor([0.5])
    x_t = obj.noised(X0, EPS, t)
    assert torch.equal(x_t, torch.tensor([[0.5, 1.0]]))
    v = torch.tensor([[1.0, 1.0]], requires_grad=True)
    out = obj.nft_loss(v, torch.zeros(1, 2), x_t, X0, t, torch.tensor([2.5]), beta=1.0,
                       v_base=torch.tensor([[0.0, 1.0]]), kl_weight=0.1)
    assert out.policy_loss.item() == pytest.approx(5.0, abs=1e-6)
    assert out.kl.item() == pytest.approx(0.5) and out.loss.item() == pytest.approx(5.05, abs=1e-6)
    assert out.anchor.item() == pytest.approx(1.0)  # mean (v - v_old)^2, reported only


def test_nft_advantage_weight_picks_the_positive_or_negative_policy():
    assert torch.allclose(obj.nft_weight(torch.tensor([-9.0, -5.0, 0.0, 2.5, 5.0, 7.0])),
                          torch.tensor([0.0, 0.0, 0.5, 0.75, 1.0, 1.0]))
    t, x_t = torch.tensor([0.5]), obj.noised(X0, EPS, torch.tensor([0.5]))
    v, old = torch.tensor([[1.0, 1.0]]), torch.zeros(1, 2)
    pos = obj.nft_loss(v, old, x_t, X0, t, torch.tensor([5.0]), 1.0).policy_loss
    neg = obj.nft_loss(v, old, x_t, X0, t, torch.tensor([-5.0]), 1.0).policy_loss
    assert pos.item() == pytest.approx(5 * 5 / 6, abs=1e-6) and neg.item() == pytest.approx(5 * 1.5, abs=1e-6)


def test_implicit_policies_average_to_the_old_policy_and_differ_by_2b_times_the_step():
    g = torch.Generator().manual_seed(0)
    v, old = torch.randn(3, 4, generator=g), torch.randn(3, 4, generator=g)
    for beta in (0.1, 1.0, 2.0):
        pos, neg = obj.implicit_policies(v, old, beta)
        assert torch.allclose((pos + neg) / 2, old, atol=1e-6)
        assert torch.allclose(pos - neg, 2 * beta * (v - old), atol=1e-5)
    pos, neg = obj.implicit_policies(old, old, 1.0)  # at v = v_old both are the old policy
    assert torch.allclose(pos, old) and torch.allclose(neg, old)
    with pytest.raises(ValueError, match="beta must be a finite number > 0"):
        obj.implicit_policies(v, old, 0.0)


def test_nft_gradient_pulls_toward_positive_samples_and_away_from_negative_ones():
    """The old policy predicts x0 = 0; the sample is X0. With A > 0 a step along -grad moves v's x0 prediction
    toward X0; with A < 0 away from it (the implicit negative policy takes the fit)."""
    t = torch.tensor([0.5])
    x_t = obj.noised(X0, EPS, t)
    old = x_t / t  # x_t - t v_old = 0
    for adv, closer in ((4.0, True), (-4.0, False)):
        v = old.clone().requires_grad_(True)
        obj.nft_loss(v, old, x_t, X0, t, torch.tensor([adv]), 1.0).loss.backward()
        moved = v.detach() - 0.01 * v.grad
        before, after = (x_t - t * old - X0).norm(), (x_t - t * moved - X0).norm()
        assert (after < before) == closer


def test_awm_loss_and_gradient_match_a_hand_computed_example():
    """Target eps - x0 = (-1, 2); v = 0: ell = (1 + 4) / 2 = 2.5. A = 2, t = 0.4, p = 0.5:
    A (t / p) ell^p = 1.6 sqrt(2.5). d/dv = A t ell^(p-1) (v - target) = 0.8 / sqrt(2.5) x (1, -2).
    EMA (0, 1): mean (v - v_ema)^2 = 0.5 (weight 1); base (1, 0): 0.5 (weight 0.01)."""
    v = torch.zeros(1, 2, requires_grad=True)
    out = obj.awm_loss(v, X0, EPS, torch.tensor([0.4]), torch.tensor([2.0]), p=0.5,
                       v_base=torch.tensor([[1.0, 0.0]]), kl_weight=0.01,
                       v_ema=torch.tensor([[0.0, 1.0]]), ema_weight=1.0)
    assert out.policy_loss.item() == pytest.approx(1.6 * 2.5 ** 0.5, rel=1e-6)
    assert out.anchor.item() == pytest.approx(0.5) and out.kl.item() == pytest.approx(0.5)
    assert out.loss.item() == pytest.approx(1.6 * 2.5 ** 0.5 + 0.5 + 0.005, rel=1e-6)
    v2 = torch.zeros(1, 2, requires_grad=True)
    obj.awm_loss(v2, X0, EPS, torch.tensor([0.4]), torch.tensor([2.0]), p=0.5).loss.backward()
    assert torch.allclose(v2.grad, 0.8 / 2.5 ** 0.5 * torch.tensor([[1.0, -2.0]]), atol=1e-6)


def test_awm_at_p_one_is_advantage_weighted_flow_matching():
    g = torch.Generator().manual_seed(1)
    v, x0, eps = (torch.randn(4, 3, 2, 2, generator=g) for _ in range(3))
    t, adv = torch.rand(4, generator=g), torch.randn(4, generator=g)
    got = obj.awm_loss(v, x0, eps, t, adv, p=1.0).policy_loss
    want = (adv * t * ((v - (eps - x0)) ** 2).flatten(1).mean(1)).mean()
    assert got.item() == pytest.approx(want.item(), rel=1e-6)
    with pytest.raises(ValueError, match="p must be a finite number > 0"):
        obj.awm_loss(v, x0, eps, t, adv, p=0.0)
    with pytest.raises(ValueError, match="needs its velocity"):
        obj.awm_loss(v, x0, eps, t, adv, p=1.0, kl_weight=0.1)


def test_slow_decay_and_blend():
    assert obj.slow_decay(0, 0.001, 0.5) == 0.0
    assert obj.slow_decay(100, 0.001, 0.5) == pytest.approx(0.1)
    assert obj.slow_decay(10_000, 0.001, 0.5) == 0.5 and obj.slow_decay(10_000, 0.001, 0.3) == 0.3
    slow, cur = {"a": torch.tensor([1.0, 2.0])}, {"a": torch.tensor([3.0, 6.0])}
    assert torch.equal(obj.blend(slow, cur, 0.25)["a"], torch.tensor([2.5, 5.0]))
    assert torch.equal(obj.blend(slow, cur, 0.0)["a"], cur["a"])
    with pytest.raises(ValueError, match="different LoRA weights"):
        obj.blend(slow, {"b": cur["a"]}, 0.5)


def test_noise_levels_respect_the_candidates_the_ceiling_and_the_count():
    schedule = torch.tensor([1.0, 0.9, 0.75, 0.6, 0.4, 0.2, 0.0])  # T = 6
    assert obj.level_candidates(schedule, "nft").tolist() == pytest.approx([1.0, 0.9, 0.75, 0.6, 0.4, 0.2])
    assert obj.level_candidates(schedule, "awm").tolist() == pytest.approx([0.9, 0.75, 0.6])  # no 1, no 2 lowest
    cand = obj.level_candidates(schedule, "nft")
    unit, t = obj.choose_levels(cand, torch.tensor([1.0, 0.6, 0.1]), 4, torch.Generator().manual_seed(0))
    assert (unit == 0).sum() == 4 and (unit == 1).sum() == 3 and (unit == 2).sum() == 0  # 0.6, 0.4, 0.2 only
    assert (t[unit == 1] <= 0.6 + 1e-6).all() and t[unit == 0].unique().numel() == 4  # distinct levels


def hand_tree():
    """One prompt, one root, splits at schedule steps 0 (sigma 1.0) and 2 (sigma 0.6), one SDE child each:
    edges 0 (ODE) and 1 (SDE) from the root; 2 (ODE), 3 (SDE) below edge 0; 4 (ODE), 5 (SDE) below edge 1.
    Leaves: 0 = ODE all the way, 1 = edge 3's, 2 = edge 1's ODE path, 3 = edge 5's; rewards 0.2, 0.5, 0.9, 0.1."""
    leaf_reward = torch.tensor([0.2, 0.5, 0.9, 0.1], dtype=torch.float64)
    parent_edge = torch.tensor([-1, -1, 0, 0, 1, 1])
    depth = torch.tensor([0, 0, 1, 1, 1, 1])
    sde = torch.tensor([False, True, False, True, False, True])
    leaf = torch.tensor([0, 2, 0, 1, 2, 3])  # the leaf each child reaches by ODE children
    parent_leaf = torch.tensor([0, 0, 0, 0, 2, 2])
    split_sigma = torch.tensor([1.0, 1.0, 0.6, 0.6, 0.6, 0.6])
    return leaf_reward, parent_edge, depth, sde, leaf, parent_leaf, split_sigma


def test_tree_units_train_each_sde_leaf_with_its_step_credit_below_its_split():
    """The TP arm on a hand-made tree: incremental credit against the ODE sibling, per depth. Depth 1's two
    SDE edges: edge 3 gained 0.5 - 0.2 = +0.3 over its sibling's leaf, edge 5 lost 0.1 - 0.9 = -0.8: advantages
    +1 and -1; depth 0 has one SDE edge (nothing to compare it with): 0. Each unit is the SDE child's leaf,
    trained at levels <= its split's sigma."""
    from tpgrpo.algo.tree_credit import ode_siblings, sibling_advantages, tree_credit

    reward, parent_edge, depth, sde, leaf, parent_leaf, split_sigma = hand_tree()
    credit = tree_credit(reward[parent_leaf], reward[leaf], parent_edge, depth, sde, torch.zeros(6, dtype=torch.int64),
                         mode="incremental")
    assert credit.incremental.tolist() == pytest.approx([0, 0.7, 0, 0.3, 0, -0.8])
    adv = sibling_advantages(credit.step_reward, depth, sde, ode_siblings(parent_edge, torch.zeros(6), sde))
    units = tree_units(adv.float(), sde, split_sigma, leaf, torch.zeros(6, dtype=torch.int64), 4, split_levels=True)
    assert units.latent_row.tolist() == [2, 1, 3]  # edges 1, 3, 5: their children's leaves
    assert units.advantage.tolist() == pytest.approx([0.0, 1.0, -1.0], abs=1e-3)
    assert units.ceiling.tolist() == pytest.approx([1.0, 0.6, 0.6])
    assert tree_units(adv.float(), sde, split_sigma, leaf, torch.zeros(6, dtype=torch.int64), 4,
                      split_levels=False).ceiling.tolist() == [1.0, 1.0, 1.0]
    two = tree_units(adv.float().repeat(2), sde.repeat(2), split_sigma.repeat(2), leaf.repeat(2),
                     torch.tensor([0] * 6 + [1] * 6), 4, split_levels=True)
    assert two.latent_row.tolist() == [2, 1, 3, 6, 5, 7]  # prompt-major leaf rows


def test_chain_units_average_the_advantages_of_the_steps_with_a_policy():
    adv = torch.tensor([[1.0, 1.0, 4.0], [-2.0, 0.0, 0.0]])
    stochastic = torch.tensor([[True, True, False], [True, True, True]])
    units = chain_units(adv, stochastic, torch.tensor([0, 1]))
    assert units.advantage.tolist() == pytest.approx([1.0, -2 / 3]) and units.ceiling.tolist() == [1.0, 1.0]
    assert units.latent_row.tolist() == [0, 1] and units.prompt_index.tolist() == [0, 1]


@pytest.mark.parametrize("key, value, words", [
    ("objective", "ppo", "update.objective = 'ppo': expected one of grpo, nft, awm"),
    ("nft_beta", 0.0, "update.nft_beta = 0.0: expected a value > 0"),
    ("nft_beta", -1.0, "update.nft_beta = -1.0: expected a value > 0"),
    ("awm_p", 0, "update.awm_p = 0.0: expected a value > 0"),
    ("nft_decay_max", 1.5, "update.nft_decay_max = 1.5: expected a value in [0, 1]"),
    ("awm_levels", 0, "update.awm_levels = 0: expected a value > 0"),
])
def test_bad_objective_values_are_one_line_errors(key, value, words):
    from conftest import tiny_params

    from tpgrpo.config import ConfigError, config_from_dict

    with pytest.raises(ConfigError) as err:
        config_from_dict(tiny_params(update={key: value}))
    assert str(err.value) == f"params: {words}" and "\n" not in str(err.value)


def test_compare_arms_for_the_objectives():
    """`tpgrpo compare --modes flow_grpo,nft,awm --tree-modes tp,tp-nft`: plain NFT / AWM are Flow-GRPO's credit
    under the objective; a MODE-OBJECTIVE tree arm trains the mode's credit inside it at the splits' levels."""
    from tpgrpo.comparison.variants import main_variants, tree_variants

    from tpgrpo.config import ConfigError

    arms = {v.name: (v.mode, v.overrides) for v in main_variants(["flow_grpo", "nft", "awm"], [0, 1])}
    assert arms == {"flow_grpo": ("flow_grpo", {}), "nft": ("flow_grpo", {"update.objective": "nft"}),
                    "awm": ("flow_grpo", {"update.objective": "awm"})}
    tree = {v.name: (v.mode, v.overrides) for v in tree_variants(["tp", "tp-awm"], [0])}
    assert tree["tree-tp-awm"] == ("tp", {"update.objective": "awm", "update.split_levels": True, "tree.enabled": True})
    assert tree["tree-tp"] == ("tp", {"tree.enabled": True})
    for bad in (["ppo"], ["tp-ppo"], ["foo-nft"]):
        with pytest.raises(ConfigError, match="expected some of"):
            main_variants(bad, [0])
