"""Tests of the group-relative advantages (spec section 6)."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from tpgrpo.algo.advantages import group_advantages, informative_samples
from tpgrpo.algo.credit import compute_credit

try:  # works whether or not tests/ is a package
    from tests.credit_reference import reference_advantages
except ImportError:  # pragma: no cover
    from credit_reference import reference_advantages


@st.composite
def step_tables(draw, max_rows=16, max_k=5):
    n, k = draw(st.integers(1, max_rows)), draw(st.integers(1, max_k))
    values = draw(st.sampled_from([st.sampled_from([0.0, 0.25, 0.5, 1.0]),
                                   st.floats(-100, 100, allow_nan=False, allow_subnormal=False)]))
    rows = draw(st.lists(st.lists(values, min_size=k, max_size=k), min_size=n, max_size=n))
    groups = draw(st.lists(st.sampled_from([-1, 2, 5, 11]), min_size=n, max_size=n))
    return rows, groups


@settings(max_examples=100, deadline=None)
@given(step_tables(), st.booleans(), st.sampled_from([5.0, 1.0]))
def test_matches_reference(table, global_std, clip):
    rows, groups = table
    adv = group_advantages(torch.tensor(rows, dtype=torch.float64), torch.tensor(groups), global_std, clip=clip)
    expected = torch.tensor(reference_advantages(rows, groups, global_std, clip=clip), dtype=torch.float64)
    torch.testing.assert_close(adv, expected, rtol=1e-7, atol=1e-9)


@settings(max_examples=60, deadline=None)
@given(step_tables(max_rows=20))
def test_zero_mean_within_each_group_and_step(table):
    rows, groups = table  # <= 20 members per group: |z| <= sqrt(19) < 5, so clipping never fires
    r = torch.tensor(rows, dtype=torch.float64)
    gids = torch.tensor(groups)
    adv = group_advantages(r, gids)
    assert adv.abs().max() <= 5.0
    for g in set(groups):
        members = adv[gids == g]
        torch.testing.assert_close(members.mean(0), torch.zeros(r.shape[1], dtype=torch.float64), atol=1e-9, rtol=0)


def test_per_group_z_score_by_hand():
    r = torch.tensor([[1.0, 0.0], [3.0, 0.0], [10.0, 2.0], [20.0, 4.0], [30.0, 6.0]])
    gids = torch.tensor([7, 7, 42, 42, 42])
    adv = group_advantages(r, gids)
    g1 = torch.tensor([1.0, 3.0])
    torch.testing.assert_close(adv[:2, 0], (g1 - 2.0) / (1.0 + 1e-4))  # population std of {1, 3} is 1
    assert torch.equal(adv[:2, 1], torch.zeros(2))  # constant group at that step
    g2 = torch.tensor([10.0, 20.0, 30.0])
    torch.testing.assert_close(adv[2:, 0], (g2 - 20.0) / (g2.std(correction=0) + 1e-4))
    torch.testing.assert_close(adv[2:, 1], (g2 / 5 - 4.0) / ((g2 / 5).std(correction=0) + 1e-4))


def test_global_std_uses_all_samples_per_step():
    r = torch.tensor([[1.0, 5.0], [3.0, 5.0], [10.0, 1.0], [30.0, 2.0]])
    gids = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(r, gids, global_std=True)
    for k in range(2):
        std = r[:, k].std(correction=0)
        group_mean = torch.tensor([r[:2, k].mean()] * 2 + [r[2:, k].mean()] * 2)
        expected = (r[:, k] - group_mean) / (std + 1e-4)
        expected[:2] = 0.0 if k == 1 else expected[:2]  # group 0 is constant at step 1
        torch.testing.assert_close(adv[:, k], expected)


def test_clipping_at_five():
    r = torch.zeros(50, 1)
    r[0] = 1.0  # one outlier among 49 equal values: z = +7 before clipping
    adv = group_advantages(r, torch.zeros(50, dtype=torch.long))
    assert float(adv[0, 0]) == 5.0
    adv_neg = group_advantages(-r, torch.zeros(50, dtype=torch.long))
    assert float(adv_neg[0, 0]) == -5.0
    unclipped = group_advantages(r, torch.zeros(50, dtype=torch.long), clip=10.0)
    assert float(unclipped[0, 0]) == pytest.approx(7.0, rel=1e-3)


def test_flow_grpo_mode_is_per_prompt_z_score_of_final_reward():
    g = torch.Generator().manual_seed(0)
    rewards = torch.rand(12, 6, generator=g, dtype=torch.float64)
    gids = torch.tensor([3] * 4 + [9] * 5 + [1] * 3)
    adv = group_advantages(compute_credit(rewards, gids, mode="flow_grpo").step_reward, gids)
    r_fin = rewards[:, -1]
    expected = torch.empty_like(r_fin)
    for gid in (3, 9, 1):
        m = gids == gid
        expected[m] = (r_fin[m] - r_fin[m].mean()) / (r_fin[m].std(correction=0) + 1e-4)
    torch.testing.assert_close(adv, expected[:, None].expand(-1, 5))


def test_informative_samples():
    r = torch.tensor([[0.5, 1.0], [0.5, 0.0], [0.2, 0.2], [0.2, 0.2]])
    gids = torch.tensor([0, 0, 1, 1])
    adv = group_advantages(r, gids)
    assert informative_samples(adv).tolist() == [True, True, False, False]
    # Constant groups give exact zeros even where the computed mean is off by rounding.
    r = torch.full((3, 2), 0.1)
    assert not informative_samples(group_advantages(r, torch.zeros(3, dtype=torch.long))).any()


def test_dtype_kept_and_bad_inputs_raise():
    r, gids = torch.rand(4, 3), torch.tensor([0, 0, 1, 1])
    assert group_advantages(r, gids).dtype == torch.float32
    with pytest.raises(ValueError, match="step_reward"):
        group_advantages(r[0], gids)
    with pytest.raises(ValueError, match="group_ids"):
        group_advantages(r, gids[:3])
    with pytest.raises(ValueError, match="eps"):
        group_advantages(r, gids, eps=-1.0)
    with pytest.raises(ValueError, match="clip"):
        group_advantages(r, gids, clip=0.0)
    with pytest.raises(ValueError, match="adv"):
        informative_samples(r[0])
