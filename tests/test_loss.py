"""Tests of the PPO / KL losses and diagnostics (spec section 7)."""

from __future__ import annotations

import pytest
import torch

from tpgrpo.algo.loss import approx_kl, clip_fraction, kl_to_reference, policy_loss, ppo_clip_loss
from tpgrpo.algo.sampling import sde_std, sde_step


def _policy(seed=0, batch=6):
    """A tiny differentiable 'policy': log-probs of stored sde transitions as a function of v."""
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(batch, 2, 4, 4, generator=g)
    v = torch.randn(batch, 2, 4, 4, generator=g).requires_grad_(True)
    x_next = sde_step(x, v.detach(), 0.8, 0.7, 0.7, 0.96, generator=g).prev_sample
    return x, v, x_next


def _log_prob(x, v, x_next):
    return sde_step(x, v, 0.8, 0.7, 0.7, 0.96, prev_sample=x_next).log_prob


def test_gradient_at_ratio_one_is_plain_policy_gradient():
    x, v, x_next = _policy()
    adv = torch.tensor([1.0, -2.0, 0.5, 0.0, 3.0, -0.7])
    log_prob = _log_prob(x, v, x_next)
    loss, ratio = ppo_clip_loss(log_prob, log_prob.detach(), adv, 1e-4)
    torch.testing.assert_close(ratio, torch.ones(6), rtol=0, atol=0)  # first pass: rho == 1 exactly
    (grad_ppo,) = torch.autograd.grad(loss, v)
    (grad_pg,) = torch.autograd.grad(-(adv * _log_prob(x, v, x_next)).mean(), v)
    torch.testing.assert_close(grad_ppo, grad_pg)
    assert grad_pg.abs().sum() > 0


@pytest.mark.parametrize(
    "adv, shift, kept",
    [
        (1.0, 0.1, False),   # A > 0, rho > 1 + eps: already pushed up enough -> no gradient
        (-1.0, -0.1, False),  # A < 0, rho < 1 - eps: already pushed down enough -> no gradient
        (1.0, -0.1, True),   # A > 0, rho < 1 - eps: still needs raising -> gradient kept
        (-1.0, 0.1, True),   # A < 0, rho > 1 + eps: still needs lowering -> gradient kept
    ],
)
def test_clipping_direction_per_sign(adv, shift, kept):
    log_prob = torch.zeros(1, requires_grad=True)
    loss, ratio = ppo_clip_loss(log_prob, torch.tensor([-shift]), torch.tensor([adv]), 0.01)
    (grad,) = torch.autograd.grad(loss, log_prob)
    if kept:
        # d/dlogp of -A rho is -A rho.
        torch.testing.assert_close(grad, -adv * ratio.detach())
    else:
        assert torch.equal(grad, torch.zeros(1))


def test_loss_value():
    log_prob = torch.log(torch.tensor([1.5, 0.5, 1.0]))
    loss, _ = ppo_clip_loss(log_prob, torch.zeros(3), torch.tensor([2.0, 2.0, -1.0]), 0.2)
    # max(-2*1.5, -2*1.2) = -2.4; max(-2*0.5, -2*0.8) = -1.0; max(1, 1) = 1.
    torch.testing.assert_close(loss, torch.tensor((-2.4 - 1.0 + 1.0) / 3))


def test_kl_term():
    g = torch.Generator().manual_seed(1)
    m = torch.randn(3, 2, 4, 4, generator=g)
    std = torch.tensor([0.1, 0.2, 0.3])
    assert torch.equal(kl_to_reference(m, m.clone(), std), torch.zeros(3))
    shifted = m + 0.05
    kl = kl_to_reference(shifted, m, std)
    assert (kl > 0).all()
    torch.testing.assert_close(kl, 0.05**2 / (2 * std**2))
    torch.testing.assert_close(kl_to_reference(shifted, m, std.view(3, 1, 1, 1)), kl)
    # Deterministic steps (std == 0) contribute 0, not inf/NaN.
    assert torch.equal(kl_to_reference(shifted, m, torch.zeros(3)), torch.zeros(3))


@pytest.mark.parametrize("s, std", [(0.8, 1.4), (1.0, 3.5)])
def test_kl_of_hand_made_means_is_the_spec_formula(s, std):
    # Spec section 7: KL = mean((m_theta - m_ref)^2) / (2 std^2), std = eta sqrt(s / (1 - s~)), no
    # sqrt(-dt). eta = 0.7, s_1 = 0.96: s = 0.8 -> 0.7 sqrt(0.8 / 0.2) = 1.4; s = 1 uses s~ = s_1 in the
    # denominator only -> 0.7 sqrt(1 / 0.04) = 3.5. The same std for sde and cps (update passes sde_std).
    m_ref = torch.zeros(2, 1, 2, 2)
    m_theta = torch.tensor([[0.3, 0.1, -0.3, 0.1], [0.2, 0.2, 0.2, -0.2]]).view(2, 1, 2, 2)
    mean_sq = torch.tensor([0.05, 0.04])  # (0.09 + 0.01 + 0.09 + 0.01) / 4, 4 * 0.04 / 4
    by_hand = mean_sq / (2 * std**2)
    kl_std = sde_std(torch.tensor([s, s]), 0.96, 0.7)
    torch.testing.assert_close(kl_std, torch.tensor([std, std]))
    torch.testing.assert_close(kl_to_reference(m_theta, m_ref, kl_std), by_hand)
    res = policy_loss(torch.zeros(2), torch.zeros(2), torch.ones(2), 0.1, m_theta, m_ref, kl_std, kl_beta=0.5)
    torch.testing.assert_close(res.kl, by_hand.mean())


def test_policy_loss_combines_ppo_and_kl():
    x, v, x_next = _policy(seed=2)
    adv = torch.linspace(-1, 1, 6)
    out = sde_step(x, v, 0.8, 0.7, 0.7, 0.96, prev_sample=x_next)
    ref = sde_step(x, v.detach() + 0.1, 0.8, 0.7, 0.7, 0.96, prev_sample=x_next)
    old = out.log_prob.detach() - 0.01
    res = policy_loss(out.log_prob, old, adv, 1e-4, out.mean, ref.mean, out.std, kl_beta=0.5)
    pg, ratio = ppo_clip_loss(out.log_prob, old, adv, 1e-4)
    kl = kl_to_reference(out.mean, ref.mean, out.std).mean()
    torch.testing.assert_close(res.policy_loss, pg)
    torch.testing.assert_close(res.kl, kl)
    torch.testing.assert_close(res.loss, pg + 0.5 * kl)
    assert res.kl > 0
    torch.testing.assert_close(res.approx_kl, torch.tensor(0.5 * 0.01**2))
    assert float(res.clip_fraction) == 1.0 and not res.clip_fraction.requires_grad
    res.loss.backward()
    assert torch.isfinite(v.grad).all()
    no_ref = policy_loss(out.log_prob, old, adv, 1e-4)
    assert float(no_ref.kl) == 0.0
    torch.testing.assert_close(no_ref.loss, pg)


def test_diagnostics():
    lp, old = torch.tensor([0.0, 0.2, -0.4]), torch.zeros(3)
    torch.testing.assert_close(approx_kl(lp, old), torch.tensor(0.5 * (0.04 + 0.16) / 3))
    assert float(clip_fraction(torch.tensor([1.0, 1.05, 0.95, 1.2]), 0.1)) == 0.25


def test_bad_inputs_raise():
    lp = torch.zeros(3)
    with pytest.raises(ValueError, match="old_log_prob"):
        ppo_clip_loss(lp, torch.zeros(2), lp, 0.1)
    with pytest.raises(ValueError, match="advantages"):
        ppo_clip_loss(lp, lp, torch.zeros(3, 1), 0.1)
    with pytest.raises(ValueError, match="clip_range"):
        ppo_clip_loss(lp, lp, lp, 0.0)
    with pytest.raises(ValueError, match="kl_beta"):
        policy_loss(lp, lp, lp, 0.1, kl_beta=-1.0)
    with pytest.raises(ValueError, match="kl_beta > 0"):
        policy_loss(lp, lp, lp, 0.1, kl_beta=1e-4)
    with pytest.raises(ValueError, match="together"):
        policy_loss(lp, lp, lp, 0.1, mean_theta=torch.zeros(3, 1, 2, 2))
    with pytest.raises(ValueError, match="std"):
        kl_to_reference(torch.zeros(3, 1, 2, 2), torch.zeros(3, 1, 2, 2), torch.ones(2))
