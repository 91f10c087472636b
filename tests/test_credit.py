"""Tests of the credit assignment (spec section 5) against hand-made curves and a plain-loop reference."""

from __future__ import annotations

import random
from collections import Counter

import pytest
import torch
from hypothesis import event, example, given, settings
from hypothesis import strategies as st

from tpgrpo.algo.advantages import group_advantages
from tpgrpo.algo.credit import BALANCE_MODES, CREDIT_MODES, compute_credit

try:  # works whether or not tests/ is a package
    from tests.credit_reference import reference_advantages, reference_credit
except ImportError:  # pragma: no cover
    from credit_reference import reference_advantages, reference_credit


def _credit(rows, mode="tp", balance="none", groups=None):
    rewards = torch.tensor(rows, dtype=torch.float64)
    gids = torch.zeros(len(rows), dtype=torch.long) if groups is None else torch.tensor(groups)
    return compute_credit(rewards, gids, mode=mode, balance=balance)


# ----------------------------------------------------------------------------- random tables
@st.composite
def reward_tables(draw, max_rows=10, max_k=6):
    """(rows, group_ids): rewards from a discrete set (many ties/zeros), a signed grid, or floats."""
    n, k = draw(st.integers(1, max_rows)), draw(st.integers(1, max_k))
    kind = draw(st.sampled_from(["discrete", "grid", "float"]))
    if kind == "discrete":
        values = st.sampled_from([0.0, 0.25, 0.5, 1.0])
    elif kind == "grid":
        values = st.integers(-8, 8).map(lambda i: i / 4)
    else:
        values = st.floats(-5, 5, allow_nan=False, allow_subnormal=False)
    rows = draw(st.lists(st.lists(values, min_size=k + 1, max_size=k + 1), min_size=n, max_size=n))
    groups = draw(st.lists(st.sampled_from([-7, 0, 3, 1000]), min_size=n, max_size=n))
    return rows, groups


GROUP_KINDS = ("pos", "neg", "none", "mixed", "raw")


def shape_group(rows: list[list[float]], kind: str, k: int) -> list[list[float]]:
    """One prompt group's rows (each ``K+1`` rewards), reshaped so its turning points have a chosen sign.

    A row's turning points all carry the sign of its trend ``D``, and mirroring a row (``-q``) mirrors
    its credit. ``pos``/``neg``: rows with the other trend sign are mirrored and a strictly monotone row
    of the wanted sign is added (a turning point at k = 0 in ``tp_unconstrained``, and in ``tp`` when
    K >= 2), so the group's turning points share ONE sign. ``none``: every row gets ``Q_K = Q_0``
    (D = 0: no alignment, and ``d_0 (R_fin - Q_1) = -d_0^2 <= 0``), so the group has NO turning point.
    ``mixed``: adds a rising and a falling monotone row (both signs). ``raw``: rows as drawn.
    """
    monotone = [i / 4 for i in range(k + 1)]
    if kind in ("pos", "neg"):
        want = 1 if kind == "pos" else -1
        out = [[-v for v in row] if (row[-1] - row[0]) * want < 0 else list(row) for row in rows]
        return out + [[want * v for v in monotone]]
    if kind == "none":
        return [row[:-1] + [row[0]] for row in rows]
    if kind == "mixed":
        return [list(row) for row in rows] + [monotone, [-v for v in monotone]]
    return [list(row) for row in rows]


def assemble_groups(shaped: list[list[list[float]]], labels: list[int], order: list[int]):
    """``(rows, group_ids)`` of the concatenated groups, rows interleaved by the permutation ``order``."""
    flat = [(row, labels[g]) for g, rows in enumerate(shaped) for row in rows]
    flat = [flat[i] for i in order]
    return [row for row, _ in flat], [gid for _, gid in flat]


@st.composite
def shaped_tables(draw, max_groups=4, max_rows=4, max_k=6):
    """``(rows, group_ids)`` whose groups are built to have one-sign, no, or both-sign turning points."""
    k = draw(st.integers(1, max_k))
    values = draw(st.sampled_from([st.sampled_from([0.0, 0.25, 0.5, 1.0]), st.integers(-8, 8).map(lambda i: i / 4),
                                   st.floats(-5, 5, allow_nan=False, allow_subnormal=False)]))
    row = st.lists(values, min_size=k + 1, max_size=k + 1)
    kinds = draw(st.lists(st.sampled_from(GROUP_KINDS), min_size=1, max_size=max_groups))
    shaped = [shape_group(draw(st.lists(row, min_size=0, max_size=max_rows)), kind, k) for kind in kinds]
    shaped = [rows if rows else [[0.0] * (k + 1)] for rows in shaped]
    labels = draw(st.lists(st.integers(-50, 50), min_size=len(kinds), max_size=len(kinds), unique=True))
    order = draw(st.permutations(range(sum(len(rows) for rows in shaped))))
    return assemble_groups(shaped, labels, list(order))


def sign_structure(candidate: list[list[bool]], trend: list[float], groups: list[int]) -> Counter:
    """Count groups by the signs of their candidate turning points: ``both``, ``one`` or ``none``."""
    counts = Counter()
    for g in set(groups):
        signs = {trend[n] > 0 for n, row in enumerate(candidate) if groups[n] == g for is_tp in row if is_tp}
        counts["both" if len(signs) == 2 else "one" if signs else "none"] += 1
    return counts


def _check_against_reference(rows, groups, dtype) -> Counter:
    """Assert ``compute_credit`` (and the advantages) equal the plain-loop reference in every mode;
    returns the groups' sign structures (``sign_structure``) summed over the two tp modes."""
    rewards = torch.tensor(rows, dtype=dtype)
    rows = rewards.double().tolist()  # the reference sees exactly the values credit sees
    gids = torch.tensor(groups)
    structure = Counter()
    for mode in CREDIT_MODES:
        for balance in BALANCE_MODES:
            got = compute_credit(rewards, gids, mode=mode, balance=balance)
            ref = reference_credit(rows, groups, mode, balance)
            assert got.turning_point.tolist() == ref["tp"], (mode, balance)
            assert got.candidate_turning_point.tolist() == ref["candidate"], (mode, balance)
            assert got.alignment.tolist() == ref["a"]
            assert torch.equal(got.step_reward, torch.tensor(ref["step_reward"], dtype=torch.float64).to(dtype))
            assert torch.equal(got.incremental, torch.tensor(ref["d"], dtype=torch.float64).to(dtype))
            assert torch.equal(got.aggregated, torch.tensor(ref["B"], dtype=torch.float64).to(dtype))
            assert torch.equal(got.trend, torch.tensor(ref["D"], dtype=torch.float64).to(dtype))
            if mode.startswith("tp") and balance == "group":
                structure += sign_structure(ref["candidate"], ref["D"], groups)
            if dtype == torch.float64:
                for global_std in (False, True):
                    adv = group_advantages(got.step_reward, gids, global_std=global_std)
                    expected = reference_advantages(ref["step_reward"], groups, global_std=global_std)
                    torch.testing.assert_close(adv, torch.tensor(expected, dtype=torch.float64), rtol=1e-7, atol=1e-9)
    return structure


# Hand-made: a one-sign group (kept whole), a group without turning points, and both signs.
@example(table=([[0.0, 0.1, 0.2], [0.0, 0.3, 0.6], [0.0, 0.0, 0.0]], [1, 1, 2]), dtype=torch.float64)
@example(table=([[0.0, -0.1, -0.2], [0.0, 0.3, 0.6], [0.0, 0.2, 0.4]], [5, 5, 5]), dtype=torch.float64)
@example(table=([[0.0, 0.0, 1.0], [0.0, 1.0, 0.0]], [0, 0]), dtype=torch.float32)
@settings(max_examples=150, deadline=None)
@given(st.one_of(reward_tables(), shaped_tables()), st.sampled_from([torch.float64, torch.float32]))
def test_matches_plain_loop_reference(table, dtype):
    rows, groups = table
    words = {"both": "both turning-point signs", "one": "one turning-point sign", "none": "no turning point"}
    for name in sorted(_check_against_reference(rows, groups, dtype)):
        event(f"has a group with {words[name]}")  # shown by pytest --hypothesis-show-statistics


@pytest.mark.parametrize("seed", range(4))
def test_matches_reference_on_groups_built_for_each_sign_structure(seed):
    """Seeded (not shrinkable, but certain): one-sign and empty groups really occur, many times."""
    rng = random.Random(seed)
    total = Counter()
    for _ in range(40):
        k = rng.randint(1, 6)
        grid = rng.random() < 0.5
        draw = (lambda: rng.randint(-8, 8) / 4) if grid else (lambda: rng.uniform(-5, 5))
        kinds = [rng.choice(GROUP_KINDS) for _ in range(rng.randint(1, 4))]
        shaped = [shape_group([[draw() for _ in range(k + 1)] for _ in range(rng.randint(1, 4))], kind, k)
                  for kind in kinds]
        labels = rng.sample(range(-50, 50), len(kinds))
        order = list(range(sum(len(rows) for rows in shaped)))
        rng.shuffle(order)
        rows, groups = assemble_groups(shaped, labels, order)
        total += _check_against_reference(rows, groups, rng.choice([torch.float64, torch.float32]))
    assert total["one"] >= 20 and total["none"] >= 10 and total["both"] >= 20, total


@settings(max_examples=100, deadline=None)
@given(st.one_of(reward_tables(max_rows=12, max_k=8), shaped_tables()))
def test_random_invariants(table):
    rows, groups = table
    # Exact signed grid values so that |B| > |d| cannot be blurred by rounding.
    rows = [[round(v * 4) / 4 for v in row] for row in rows]
    gids = torch.tensor(groups)
    for mode in ("tp", "tp_unconstrained"):
        res = _credit(rows, mode=mode, balance="group", groups=groups)
        cand, tp = res.candidate_turning_point, res.turning_point
        assert (res.alignment[cand] > 0).all() and (res.trend[cand.any(1)] != 0).all()
        assert not (tp & ~cand).any()
        assert torch.equal(res.step_reward, torch.where(tp, res.aggregated, res.incremental))
        if mode == "tp":
            assert not cand[:, -1].any(), "the last window step is never a consistent turning point"
            assert (res.aggregated[cand].abs() > res.incremental[cand].abs()).all()
        for g in set(groups):
            rows_g = gids == g
            d_abs = res.trend.abs()[:, None].expand_as(tp)
            pos = rows_g[:, None] & (res.trend > 0)[:, None]
            neg = rows_g[:, None] & (res.trend < 0)[:, None]
            n_pos, n_neg = int((tp & pos).sum()), int((tp & neg).sum())
            c_pos, c_neg = int((cand & pos).sum()), int((cand & neg).sum())
            if c_pos and c_neg:  # both signs: balanced
                assert n_pos == n_neg == min(c_pos, c_neg)
            else:  # one sign or none: the group's turning points stay as they are
                assert torch.equal(tp & rows_g[:, None], cand & rows_g[:, None])
            for side in (pos, neg):
                kept, dropped = d_abs[tp & side], d_abs[cand & ~tp & side]
                if kept.numel() and dropped.numel():
                    assert kept.min() >= dropped.max(), "balancing keeps the largest |D|"


@settings(max_examples=40, deadline=None)
@given(reward_tables())
def test_group_balance_ignores_other_groups_and_labels(table):
    rows, groups = table
    full = _credit(rows, mode="tp_unconstrained", balance="group", groups=groups)
    relabelled = _credit(rows, mode="tp_unconstrained", balance="group", groups=[g * 13 + 5 for g in groups])
    assert torch.equal(full.turning_point, relabelled.turning_point)
    for g in set(groups):
        idx = [n for n, h in enumerate(groups) if h == g]
        alone = _credit([rows[n] for n in idx], mode="tp_unconstrained", balance="group")
        assert torch.equal(alone.turning_point, full.turning_point[idx])
        assert torch.equal(alone.step_reward, full.step_reward[idx])


# ----------------------------------------------------------------------------- hand-made curves
def test_definitions_on_a_small_curve():
    res = _credit([[0.0, -0.1, 0.4, 0.2, 1.0]])
    torch.testing.assert_close(res.incremental, torch.tensor([[-0.1, 0.5, -0.2, 0.8]], dtype=torch.float64))
    torch.testing.assert_close(res.aggregated, torch.tensor([[1.0, 1.1, 0.6, 0.8]], dtype=torch.float64))
    torch.testing.assert_close(res.trend, torch.tensor([1.0], dtype=torch.float64))
    assert res.alignment.tolist() == [[-1, 1, -1, 1]] and res.alignment.dtype == torch.int8


def test_flip_into_trend_is_turning_point_flip_away_is_not():
    rows = [[0.0, -0.1, 0.4, 0.2, 1.0]]  # d = [-.1, .5, -.2, .8], D = 1 > 0
    tp = _credit(rows, mode="tp").turning_point
    assert tp.tolist() == [[False, True, False, False]]  # k=1 into the trend; k=2 away; k=3 is last
    free = _credit(rows, mode="tp_unconstrained").turning_point
    assert free.tolist() == [[False, True, False, True]]  # without the constraint the last flip counts
    res = _credit(rows, mode="tp")
    assert res.step_reward[0].tolist() == pytest.approx([-0.1, 1.1, -0.2, 0.8])  # B_1 replaces d_1
    # Mirror image: a falling trajectory flips into its (negative) trend.
    mirrored = _credit([[-v for v in rows[0]]], mode="tp").turning_point
    assert mirrored.tolist() == tp.tolist()


def test_consistency_constraint_rejects_a_flip_undone_later():
    # d = [-.2, .5, -.4], D = -.1 < 0: a = [1, -1, 1]. k=2 flips into the trend but is the last step;
    # k=1 flips away. Constrained: nothing; unconstrained: k=2 and (a_0 > 0) k=0.
    rows = [[0.0, -0.2, 0.3, -0.1]]
    assert _credit(rows, mode="tp").turning_point.tolist() == [[False, False, False]]
    assert _credit(rows, mode="tp_unconstrained").turning_point.tolist() == [[True, False, True]]
    # A flip into the trend that the rest of the trajectory reverses is not consistent.
    rows = [[0.0, -0.1, 0.5, 0.2, 0.3]]  # d = [-.1, .6, -.3, .1], D = .3; k=1: R - Q_2 = -.2
    assert not _credit(rows, mode="tp").turning_point[0, 1]
    assert _credit(rows, mode="tp_unconstrained").turning_point[0, 1]


def test_first_step_rules():
    rows = [[0.0, 0.6, 0.5]]  # d_0 = .6 > 0, D = .5 > 0, but R - Q_1 = -.1
    assert _credit(rows, mode="tp_unconstrained").turning_point.tolist() == [[True, False]]
    assert _credit(rows, mode="tp").turning_point.tolist() == [[False, False]]
    rows = [[0.0, 0.3, 0.1, 0.5]]  # d_0 = .3, R - Q_1 = .2: consistent first step, no flip needed
    for mode in ("tp", "tp_unconstrained"):
        assert _credit(rows, mode=mode).turning_point[0, 0]
    rows = [[0.0, -0.3, 0.5]]  # d_0 against the trend: never a first-step turning point
    for mode in ("tp", "tp_unconstrained"):
        assert not _credit(rows, mode=mode).turning_point[0, 0]


def test_zero_increments_and_zero_trend_fire_nothing():
    for mode in ("tp", "tp_unconstrained"):
        # d = [0, 1, 0]: a zero step is neither against the trend nor a turning point itself.
        res = _credit([[0.0, 0.0, 1.0, 1.0]], mode=mode)
        assert res.turning_point.tolist() == [[False, False, False]]
        assert res.step_reward.tolist() == [[0.0, 1.0, 0.0]]
        # D = 0: alignment is 0 everywhere, so no turning point anywhere.
        res = _credit([[0.0, 1.0, -1.0, 0.0], [0.5, 0.5, 0.5, 0.5]], mode=mode)
        assert not res.turning_point.any() and not res.alignment.any()


def test_modes_step_rewards():
    rows = [[0.0, -0.1, 0.4, 0.2, 1.0]]
    assert _credit(rows, mode="flow_grpo").step_reward.tolist() == [[1.0] * 4]
    inc = _credit(rows, mode="incremental")
    assert torch.equal(inc.step_reward, inc.incremental)
    for mode in ("flow_grpo", "incremental"):
        assert not _credit(rows, mode=mode, balance="group").turning_point.any()


def test_balancing_keeps_equal_counts_and_prefers_large_trend():
    # Single-TP trajectories: first-step consistent turning points with trend D = row[-1].
    def up(D):
        return [0.0, D / 2, D]

    rows = [up(0.2), up(0.8), up(0.5), up(-0.3), up(0.8)]
    res = _credit(rows, mode="tp", balance="group", groups=[4, 4, 4, 4, 4])
    assert res.candidate_turning_point[:, 0].tolist() == [True] * 5
    # One negative -> keep one positive: the largest |D| (0.8), the tie going to the smaller index.
    assert res.turning_point[:, 0].tolist() == [False, True, False, True, False]
    assert res.step_reward[2].tolist() == pytest.approx([0.25, 0.25])  # dropped: back to d_k
    # Groups are balanced separately; a group whose turning points share one sign keeps them all.
    res = _credit(rows + [up(0.9)], mode="tp", balance="group", groups=[1, 1, 1, 1, 1, 2])
    assert res.turning_point[:, 0].tolist() == [False, True, False, True, False, True]
    assert res.step_reward[5].tolist() == pytest.approx([0.9, 0.45])  # B_0 = 0.9 replaces d_0 = 0.45
    assert _credit(rows, mode="tp", balance="none").turning_point[:, 0].all()


def test_one_sign_or_no_turning_points_leave_a_group_unchanged():
    # Spec section 5 (the release): balance only where a group has turning points of both signs.
    def up(D):
        return [0.0, D / 2, D]

    for sign in (1, -1):
        rows = [up(sign * 0.2), up(sign * 0.7), [0.0, 0.0, 0.0], up(sign * 0.4)]
        for mode in ("tp", "tp_unconstrained"):
            res = _credit(rows, mode=mode, balance="group", groups=[3, 3, 3, 3])
            assert res.turning_point.tolist() == res.candidate_turning_point.tolist()
            assert res.turning_point[:, 0].tolist() == [True, True, False, True]
            assert torch.equal(res.step_reward, _credit(rows, mode=mode, balance="none").step_reward)
    flat = [[0.0, 0.0, 1.0], [0.5, 1.0, 0.5]]  # no turning point at all in tp
    res = _credit(flat, mode="tp", balance="group", groups=[0, 0])
    assert not res.turning_point.any() and torch.equal(res.step_reward, res.incremental)


def test_bad_inputs_raise():
    rewards, gids = torch.zeros(3, 4), torch.zeros(3, dtype=torch.long)
    with pytest.raises(ValueError, match="mode"):
        compute_credit(rewards, gids, mode="tp_grpo")
    with pytest.raises(ValueError, match="balance"):
        compute_credit(rewards, gids, balance="batch")
    with pytest.raises(ValueError, match="group_ids"):
        compute_credit(rewards, gids[:2])
    with pytest.raises(ValueError, match="group_ids"):
        compute_credit(rewards, gids.float())
    with pytest.raises(ValueError, match="rewards"):
        compute_credit(torch.zeros(3, 1), gids)
    bad = rewards.clone()
    bad[2, 1] = float("nan")
    with pytest.raises(ValueError, match="row 2"):
        compute_credit(bad, gids)
