"""Tests of the sampler steps (spec section 2): ODE limits, log-probs, the s == 1 rule, batching."""

from __future__ import annotations

import math

import pytest
import torch

from tpgrpo.algo.sampling import cps_step, ode_step, sde_std, sde_step, sde_window, stochastic_step
from tpgrpo.algo.schedule import flow_sigmas

# SD3.5-M's training schedule: T = 10, shift = 3.
SIGMAS = flow_sigmas(10, shift=3.0)
S1 = float(SIGMAS[1])
STEPS = list(range(len(SIGMAS) - 1))  # includes s == 1 (k = 0) and the last step (s_next == 0)


def _xv(batch=2, seed=0, shape=(4, 8, 8)):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(batch, *shape, generator=g), torch.randn(batch, *shape, generator=g)


@pytest.mark.parametrize("k", STEPS)
def test_eta_zero_equals_ode(k):
    x, v = _xv()
    s, s_next = float(SIGMAS[k]), float(SIGMAS[k + 1])
    ode = ode_step(x, v, s, s_next)
    z = torch.randn_like(x)
    sde = sde_step(x, v, s, s_next, 0.0, S1, noise=z)
    cps = cps_step(x, v, s, s_next, 0.0, noise=z)
    # Both are built so that the ODE limit holds bit for bit, not only to rounding.
    torch.testing.assert_close(sde.prev_sample, ode, rtol=0, atol=0)
    torch.testing.assert_close(cps.prev_sample, ode, rtol=0, atol=0)
    for out in (sde, cps):
        assert torch.equal(out.log_prob, torch.zeros(2))
        assert torch.equal(out.std, torch.zeros(2))


def test_eta_zero_sde_gradients_are_finite():
    x, v = _xv()
    v.requires_grad_(True)
    out = sde_step(x, v, float(SIGMAS[3]), float(SIGMAS[4]), 0.0, S1, prev_sample=x * 0.9)
    (out.log_prob.sum() + out.mean.sum()).backward()
    assert torch.isfinite(v.grad).all()


@pytest.mark.parametrize("k", STEPS)
def test_sde_log_prob_is_gaussian_density(k):
    x, v = _xv(seed=k)
    eta = 0.7
    s, s_next = float(SIGMAS[k]), float(SIGMAS[k + 1])
    out = sde_step(x, v, s, s_next, eta, S1, generator=torch.Generator().manual_seed(1))
    denom_sigma = S1 if s == 1.0 else s
    scale = eta * math.sqrt(s / (1 - denom_sigma)) * math.sqrt(s - s_next)
    expected = torch.distributions.Normal(out.mean, scale).log_prob(out.prev_sample).mean((1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.std, torch.full((2,), scale), rtol=1e-6, atol=1e-7)


@pytest.mark.parametrize("k", STEPS)
def test_sde_mean_matches_flow_grpo_form(k):
    # Flow-GRPO writes the mean as x (1 + std^2 dt / (2s)) + v (1 + std^2 (1 - s) / (2s)) dt.
    x, v = _xv(seed=10 + k)
    eta = 0.7
    s, s_next = float(SIGMAS[k]), float(SIGMAS[k + 1])
    std = eta * math.sqrt(s / (1 - (S1 if s == 1.0 else s)))
    dt = s_next - s
    expected = x * (1 + std**2 / (2 * s) * dt) + v * (1 + std**2 * (1 - s) / (2 * s)) * dt
    out = sde_step(x, v, s, s_next, eta, S1, noise=torch.zeros_like(x))
    torch.testing.assert_close(out.mean, expected, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(out.prev_sample, out.mean)


def test_sde_sigma_one_rule_uses_s1_in_denominator_only():
    x, v = _xv(seed=3)
    eta, s, s_next = 0.7, 1.0, S1
    out = sde_step(x, v, s, s_next, eta, S1, noise=torch.zeros_like(x))
    std = eta * math.sqrt(1.0 / (1 - S1))  # numerator keeps s = 1
    wrong_std = eta * math.sqrt(S1 / (1 - S1))  # if s_1 replaced the numerator too
    expected_mean = x + (v + std**2 / 2 * x) * (s_next - s)  # (1 - s) v vanishes at s = 1
    torch.testing.assert_close(out.mean, expected_mean, rtol=1e-6, atol=1e-6)
    torch.testing.assert_close(out.std, torch.full((2,), std * math.sqrt(s - s_next)))
    assert not torch.allclose(out.std, torch.full((2,), wrong_std * math.sqrt(s - s_next)))
    # Away from s == 1 the value of sigma_at_one must not matter.
    a = sde_step(x, v, 0.5, 0.4, eta, 0.9, noise=x)
    b = sde_step(x, v, 0.5, 0.4, eta, 0.1, noise=x)
    assert torch.equal(a.prev_sample, b.prev_sample) and torch.equal(a.log_prob, b.log_prob)


def test_sde_std_is_the_step_std_without_sqrt_dt():
    # The KL scale of spec section 7: the sde std of section 2 before the sqrt(-dt) factor.
    x, v = _xv(batch=len(STEPS), seed=11)
    s, s_next = SIGMAS[:-1], SIGMAS[1:]
    kl_std = sde_std(s, S1, 0.7)
    assert kl_std.shape == (len(STEPS),) and kl_std.dtype == torch.float32
    out = sde_step(x, v, s, s_next, 0.7, S1, noise=torch.zeros_like(x))
    torch.testing.assert_close(kl_std * torch.sqrt(s - s_next), out.std)
    assert float(sde_std(1.0, S1, 0.7)) == pytest.approx(0.7 * math.sqrt(1.0 / (1 - S1)))  # s_1 below only
    assert float(sde_std(0.5, 0.1, 0.7)) == pytest.approx(0.7)  # away from s == 1, s_1 does not matter
    assert torch.equal(sde_std(s, S1, 0.0), torch.zeros(len(STEPS)))
    for bad in ((0.0, S1), (1.2, S1), (1.0, 1.0)):
        with pytest.raises(ValueError, match="sigma"):
            sde_std(bad[0], bad[1], 0.7)


def test_cps_mean_matches_literal_formula():
    x, v = _xv(seed=4)
    eta = 0.7
    for k in STEPS:
        s, s_next = float(SIGMAS[k]), float(SIGMAS[k + 1])
        x0_hat, x1_hat = x - s * v, x + (1 - s) * v
        literal = (1 - s_next) * x0_hat + s_next * math.cos(eta * math.pi / 2) * x1_hat
        out = cps_step(x, v, s, s_next, eta, noise=torch.zeros_like(x))
        torch.testing.assert_close(out.mean, literal, rtol=1e-5, atol=1e-6)
        torch.testing.assert_close(out.std, torch.full((2,), s_next * math.sin(eta * math.pi / 2)))


def test_cps_last_step_is_deterministic():
    x, v = _xv(seed=5)
    s = float(SIGMAS[-2])
    a = cps_step(x, v, s, 0.0, 0.7, noise=torch.randn_like(x))
    b = cps_step(x, v, s, 0.0, 0.7, noise=torch.randn_like(x) * 3)
    torch.testing.assert_close(a.prev_sample, b.prev_sample, rtol=0, atol=0)
    assert torch.equal(a.log_prob, torch.zeros(2))


def test_cps_log_prob_has_no_variance_scaling():
    x, v = _xv(seed=6)
    out = cps_step(x, v, 0.8, 0.7, 0.7, generator=torch.Generator().manual_seed(0))
    expected = -((out.prev_sample - out.mean) ** 2).mean((1, 2, 3))
    torch.testing.assert_close(out.log_prob, expected)


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_prev_sample_path_reproduces_log_prob(kind):
    x, v = _xv(seed=7)
    g = torch.Generator().manual_seed(123)
    sampled = stochastic_step(kind, x, v, 0.86, 0.79, 0.7, sigma_at_one=S1, generator=g)
    rescored = stochastic_step(kind, x, v, 0.86, 0.79, 0.7, sigma_at_one=S1, prev_sample=sampled.prev_sample)
    assert torch.equal(rescored.prev_sample, sampled.prev_sample)
    torch.testing.assert_close(rescored.log_prob, sampled.log_prob, rtol=1e-6, atol=1e-6)
    # A different velocity scores the same transition lower: the log-prob depends on the policy.
    other = stochastic_step(kind, x, v + 20.0, 0.86, 0.79, 0.7, sigma_at_one=S1, prev_sample=sampled.prev_sample)
    assert (other.log_prob < sampled.log_prob).all()


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_noise_has_the_documented_scale(kind):
    x, v = _xv(batch=2, seed=8, shape=(4, 64, 64))
    out = stochastic_step(kind, x, v, 0.86, 0.79, 0.7, sigma_at_one=S1, generator=torch.Generator().manual_seed(0))
    z = (out.prev_sample - out.mean) / out.std.view(-1, 1, 1, 1)
    assert abs(float(z.std()) - 1.0) < 0.02 and abs(float(z.mean())) < 0.02


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_per_sample_sigmas_match_separate_calls(kind):
    ks = [0, 3, 8]
    x, v = _xv(batch=3, seed=9)
    z = torch.randn_like(x)
    s = SIGMAS[ks]
    s_next = SIGMAS[[k + 1 for k in ks]]
    batched = stochastic_step(kind, x, v, s, s_next, 0.7, sigma_at_one=S1, noise=z)
    for i, k in enumerate(ks):
        single = stochastic_step(kind, x[i:i + 1], v[i:i + 1], float(SIGMAS[k]), float(SIGMAS[k + 1]), 0.7,
                                 sigma_at_one=S1, noise=z[i:i + 1])
        torch.testing.assert_close(batched.prev_sample[i:i + 1], single.prev_sample)
        torch.testing.assert_close(batched.log_prob[i:i + 1], single.log_prob)
        torch.testing.assert_close(batched.std[i:i + 1], single.std)


def test_outputs_are_float32_from_half_inputs():
    x, v = _xv()
    out = sde_step(x.bfloat16(), v.bfloat16(), 0.5, 0.4, 0.7, S1, generator=torch.Generator().manual_seed(0))
    assert out.prev_sample.dtype == out.log_prob.dtype == out.mean.dtype == out.std.dtype == torch.float32


def test_sde_window_masks():
    assert sde_window(10, 0, 9).tolist() == [True] * 9 + [False]
    assert sde_window(10, 2, 4).tolist() == [False, False, True, True, True, True] + [False] * 4
    assert not sde_window(10, 3, 0).any()
    assert sde_window(10, 0, 10).all()
    for start, size in [(-1, 2), (0, -1), (5, 6), (10, 1)]:
        with pytest.raises(ValueError, match="window"):
            sde_window(10, start, size)


def test_bad_inputs_raise():
    x, v = _xv()
    with pytest.raises(ValueError, match="eta"):
        sde_step(x, v, 0.5, 0.4, -0.1, S1)
    with pytest.raises(ValueError, match="v must"):
        cps_step(x, v[:, :2], 0.5, 0.4, 0.7)
    with pytest.raises(ValueError, match="kind"):
        stochastic_step("ode", x, v, 0.5, 0.4, 0.7)
    with pytest.raises(ValueError, match="sigma_at_one"):
        stochastic_step("sde", x, v, 0.5, 0.4, 0.7)
    with pytest.raises(ValueError, match="sigma_at_one"):
        sde_step(x, v, 1.0, 0.9, 0.7, 1.0)
    with pytest.raises(ValueError, match="sigma_next"):
        cps_step(x, v, 0.4, 0.5, 0.7)
    with pytest.raises(ValueError, match="sigma must"):
        cps_step(x, v, torch.tensor([0.5, 0.5, 0.5]), 0.4, 0.7)
    with pytest.raises(ValueError, match="noise"):
        cps_step(x, v, 0.5, 0.4, 0.7, noise=x[:1])
