"""The policy update: first-pass ratio, direction of the update, NaN guards, exact resume."""

from __future__ import annotations

import dataclasses
import math

import numpy as np
import pytest
import torch

from tpgrpo.policy import lora as policy
from tpgrpo.config import SamplingConfig, UpdateConfig
from tpgrpo.errors import PipelineError
from tpgrpo.models.tiny import TinyConfig, build_tiny
from tpgrpo.algo.sampling import ode_step, stochastic_step
from tpgrpo.algo.schedule import flow_sigmas
from tpgrpo.policy.checkpoint import load_training_state, save_policy
from tpgrpo.policy.update import (TransitionBatch, make_optimizer, optimizer_steps, select_transitions,
                                   update_policy)

TINY = TinyConfig(image_size=16, patch_size=4, num_layers=2, num_heads=2, head_dim=8, text_layers=1,
                  text_hidden=16, text_heads=2, text_intermediate=32, max_length=8)
PROMPTS = ["red circle", "blue square"]
T, K = 4, 3  # steps 0..2 stochastic (the window), step 3 (-> sigma 0) ODE
UPD = UpdateConfig(lora_rank=4, lora_alpha=8, lr=1e-2, weight_decay=0.0, clip_range=0.2, kl_beta=0.0,
                   optimizer_steps_per_iter=2, micro_batch=4, max_grad_norm=1.0, ema=False,
                   min_transitions_per_step=1)


def sampling(kind: str = "sde") -> SamplingConfig:
    return SamplingConfig(num_steps=T, shift=1.0, guidance_scale=3.0, step_kind=kind, noise_level=0.7,
                          window_start=0, window_size=K)


def make_policy(seed_lora: int | None = 1):
    """Tiny backend + LoRA (random nonzero adapter weights, so 'the same policy' is not the base)."""
    backend = build_tiny(TINY, seed=0, words=["red", "blue", "circle", "square"], charset="ab")
    policy.attach_lora(backend, UPD.lora_rank, UPD.lora_alpha)
    if seed_lora is not None:
        gen = torch.Generator().manual_seed(seed_lora)
        with torch.no_grad():
            for _, p in policy.lora_parameters(backend):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    return backend, backend.encode_prompts(PROMPTS)


@torch.no_grad()
def rollout(backend, embeds, kind: str, n: int = 8, seed: int = 0) -> TransitionBatch:
    """n samples (prompts alternating) over the window with the current policy, as the rollout stores them."""
    sig = flow_sigmas(T)
    gen = torch.Generator().manual_seed(seed)
    prompt_index = torch.arange(n) % len(PROMPTS)
    emb = embeds.select(prompt_index)
    x = torch.randn(n, *backend.latent_shape, generator=gen)
    states, logps = [x], []
    for k in range(K):
        v = backend.velocity(x, sig[k].expand(n), emb, sampling(kind).guidance_scale)
        out = stochastic_step(kind, x, v, sig[k], sig[k + 1], 0.7, sigma_at_one=float(sig[1]), generator=gen)
        x = out.prev_sample
        states.append(x)
        logps.append(out.log_prob)
    assert not torch.equal(states[-1], ode_step(states[-2], v, sig[K - 1], sig[K]))  # really stochastic
    return TransitionBatch(latents=torch.stack(states, 1), old_log_probs=torch.stack(logps, 1),
                           sigmas=sig[:K + 1].expand(n, K + 1).clone(), prompt_index=prompt_index,
                           sigma_at_one=float(sig[1]))


@torch.no_grad()
def log_probs(backend, embeds, batch: TransitionBatch, kind: str) -> torch.Tensor:
    """(N, K) log-probs of the stored transitions under the current policy."""
    out = []
    for k in range(K):
        x, s = batch.latents[:, k], batch.sigmas[:, k]
        v = backend.velocity(x, s, embeds.select(batch.prompt_index), sampling(kind).guidance_scale)
        step = stochastic_step(kind, x, v, s, batch.sigmas[:, k + 1], 0.7, sigma_at_one=batch.sigma_at_one,
                               prev_sample=batch.latents[:, k + 1])
        out.append(step.log_prob)
    return torch.stack(out, 1)


@pytest.mark.parametrize("kind,kl_beta", [("sde", 0.0), ("cps", 0.0), ("sde", 1e-2)])
def test_first_pass_ratio_is_one_on_fresh_data(kind, kl_beta):
    backend, embeds = make_policy()
    batch = rollout(backend, embeds, kind)
    adv = torch.randn(8, K, generator=torch.Generator().manual_seed(3))
    cfg = dataclasses.replace(UPD, kl_beta=kl_beta, lr=1e-3)
    metrics = update_policy(backend, embeds, batch, adv, sampling(kind), cfg, make_optimizer(backend, cfg),
                            seed=0)
    assert metrics["first_pass_ratio_max_dev"] < 1e-5
    assert metrics["num_transitions"] == 8 * K and metrics["optimizer_steps"] == 2
    assert metrics["approx_kl_after"] > 0  # the policy moved
    assert all(v is not None and v < 1e-5 for v in metrics["first_pass_ratio_dev_per_step"])
    assert (metrics["kl"] > 0) == (kl_beta > 0)
    assert metrics["forward_passes"] == 8 * K * (2 if kl_beta else 1) + min(64, 8 * K)


def test_the_step_count_follows_the_data():
    """The step-count rule: min(max steps, max(1, transitions // min_transitions_per_step))."""
    assert optimizer_steps(576, 4, 100) == 4  # the default chain: today's 4 steps
    assert optimizer_steps(432, 4, 100) == 4  # the fewest a default geneval_soft chain trained (archived)
    assert optimizer_steps(399, 4, 100) == 3
    assert optimizer_steps(49, 4, 100) == 1  # a default tree: one step on all of it
    assert optimizer_steps(0, 4, 100) == 1 and optimizer_steps(5000, 4, 1) == 4
    with pytest.raises(ValueError, match="min_transitions_per_step must be >= 1"):
        optimizer_steps(10, 4, 0)


def test_an_update_on_few_transitions_takes_fewer_steps_and_records_them():
    backend, embeds = make_policy()
    batch = rollout(backend, embeds, "sde")  # 8 samples x 3 steps = 24 transitions
    adv = torch.randn(8, K, generator=torch.Generator().manual_seed(3))
    for floor, steps in ((1, 2), (12, 2), (13, 1), (100, 1)):
        cfg = dataclasses.replace(UPD, min_transitions_per_step=floor)
        metrics = update_policy(backend, embeds, batch, adv, sampling("sde"), cfg, make_optimizer(backend, cfg),
                                seed=0, ratio_tolerance=None)
        assert metrics["optimizer_steps"] == steps, floor
        assert metrics["transitions_per_step"] == 24 / steps


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_update_raises_positive_and_lowers_negative_log_probs(kind):
    backend, embeds = make_policy()
    batch = rollout(backend, embeds, kind)
    sign = torch.tensor([1.0, 1.0, -1.0, -1.0, 1.0, -1.0, -1.0, 1.0])  # both prompts get both signs
    adv = sign[:, None].expand(8, K).clone()
    before = log_probs(backend, embeds, batch, kind)
    torch.testing.assert_close(before, batch.old_log_probs, rtol=0, atol=1e-5)
    update_policy(backend, embeds, batch, adv, sampling(kind), UPD, make_optimizer(backend, UPD), seed=0)
    delta = (log_probs(backend, embeds, batch, kind) - before).mean(dim=1)  # (N,)
    # Per sign group (robust to the shuffle seed; single samples can move against their sign).
    assert delta[sign > 0].mean() > 0 > delta[sign < 0].mean(), delta


@pytest.mark.parametrize("kind", ["sde", "cps"])
def test_kl_metric_uses_the_sde_std_without_sqrt_dt(kind):
    """Spec section 7: KL_k = mean((mean_theta - mean_ref)^2) / (2 std_k^2), std_k = eta sqrt(s / (1 - s~))
    for both step kinds (the release's scale, so its kl_beta carries over), on one pre-step chunk."""
    backend, embeds = make_policy()  # random LoRA weights: the policy's mean differs from the reference's
    batch = rollout(backend, embeds, kind)
    expected = []
    with torch.no_grad():
        for k in range(K):
            x, s = batch.latents[:, k], batch.sigmas[:, k]
            emb, g = embeds.select(batch.prompt_index), sampling(kind).guidance_scale

            def mean(v):
                return stochastic_step(kind, x, v, s, batch.sigmas[:, k + 1], 0.7, sigma_at_one=batch.sigma_at_one,
                                       prev_sample=batch.latents[:, k + 1]).mean

            theta = mean(backend.velocity(x, s, emb, g))
            with policy.reference_mode(backend):
                ref = mean(backend.velocity(x, s, emb, g))
            s_tilde = torch.where(s == 1, torch.tensor(batch.sigma_at_one), s)
            std = 0.7 * torch.sqrt(s / (1 - s_tilde))  # no sqrt(-dt), whatever the step kind
            expected.append((theta - ref).pow(2).mean((1, 2, 3)) / (2 * std**2))
    cfg = dataclasses.replace(UPD, kl_beta=1e-2, optimizer_steps_per_iter=1)
    metrics = update_policy(backend, embeds, batch, torch.ones(8, K), sampling(kind), cfg,
                            make_optimizer(backend, cfg), seed=0)
    want = float(torch.stack(expected).mean())
    assert want > 0 and metrics["kl"] == pytest.approx(want, rel=1e-4)


@pytest.mark.parametrize("step", [0, 2])
def test_log_probs_not_the_sampling_policys_stop_the_update_before_any_step(step):
    """Stored log-probs that are not the sampling policy's (once seen: first-pass ratio 27.1, trained on, rc 0):
    past the tolerance the update stops on the first pass with one line, and no weight changes. (The first
    chunk is checked, the transitions seen before any step: a sampler or policy mismatch shows in all of
    them; random damage on disk is the Zarr checksums' to catch.)"""
    from tpgrpo.policy.update import FIRST_PASS_RATIO_TOLERANCE

    backend, embeds = make_policy()
    batch = rollout(backend, embeds, "sde")
    batch.old_log_probs[:, step] += 0.05  # |exp(-0.05) - 1| = 0.049: far past the tolerance, a plausible value
    adv = torch.ones(8, K)
    before = policy.lora_state_dict(backend)
    with pytest.raises(PipelineError) as err:
        update_policy(backend, embeds, batch, adv, sampling(), UPD, make_optimizer(backend, UPD), seed=0, iteration=3)
    message = str(err.value)
    assert "\n" not in message and message.startswith("update (iteration 3): the stored log-probs do not match")
    assert f"window step {step}" in message and f"tolerance {FIRST_PASS_RATIO_TOLERANCE:g}" in message
    after = policy.lora_state_dict(backend)
    assert all(torch.equal(before[k], after[k]) for k in before)
    # A pass over data the policy has moved on from (a later epoch) is not checked:
    metrics = update_policy(backend, embeds, batch, adv, sampling(), UPD, make_optimizer(backend, UPD), seed=0,
                            ratio_tolerance=None)
    assert metrics["first_pass_ratio_max_dev"] == pytest.approx(-np.expm1(-0.05), rel=1e-3)  # rho = exp(-0.05)


def test_later_epochs_are_not_held_to_the_first_pass_tolerance():
    """update.epochs 2 with a large lr: the second epoch's first step sees a moved policy (ratio far from 1)
    and must not stop the update; only the first epoch's first step carries the tolerance."""
    from tpgrpo.policy.update import FIRST_PASS_RATIO_TOLERANCE, UpdateInputs, train_iteration

    backend, embeds = make_policy()
    batch = rollout(backend, embeds, "sde")
    adv = torch.randn(8, K, generator=torch.Generator().manual_seed(3))
    cfg = dataclasses.replace(UPD, lr=5e-2, epochs=2, optimizer_steps_per_iter=2)
    inputs = UpdateInputs(backend, embeds, batch, adv, sampling(), cfg)
    ticks = []
    result = train_iteration(inputs, make_optimizer(backend, cfg), [11, 12], progress=lambda d, t: ticks.append((d, t)))
    log = result.as_log()
    assert log["first_pass_ratio_max_dev"] < 1e-5 < FIRST_PASS_RATIO_TOLERANCE
    # The second epoch measured, before its step, a policy far past the tolerance (rms of log rho > 3x it).
    assert log["approx_kl_per_epoch"][1] > 0.5 * (3 * math.log1p(FIRST_PASS_RATIO_TOLERANCE)) ** 2
    assert log["epochs"] == 2 and log["optimizer_steps"] == 2 and len(log["policy_loss_per_epoch"]) == 2
    # one tick per micro-batch, over both epochs: 24 transitions in micro-batches of 4, twice
    assert ticks == [(i, 12) for i in range(1, 13)]


def test_select_transitions_drops_whole_zero_samples_only():
    # Spec section 6: only a sample whose advantage is 0 at EVERY window step may be dropped; a kept
    # sample keeps all its transitions, zeros included (its KL term counts, the loss mean includes it).
    adv = torch.tensor([[0.0, 1.5, 0.0], [0.0, 0.0, 0.0], [-2.0, 0.0, 3.0], [0.0, 0.0, 0.0]])
    n_idx, k_idx = select_transitions(adv, seed=7)
    assert sorted(zip(n_idx.tolist(), k_idx.tolist())) == [(0, 0), (0, 1), (0, 2), (2, 0), (2, 1), (2, 2)]
    again = select_transitions(adv, seed=7)
    assert torch.equal(again[0], n_idx) and torch.equal(again[1], k_idx)  # the shuffle is seeded
    assert select_transitions(torch.zeros(2, 3), seed=0)[0].numel() == 0


def test_zero_advantage_samples_are_dropped():
    backend, embeds = make_policy()
    batch = rollout(backend, embeds, "sde")
    adv = torch.zeros(8, K)
    adv[0, 1], adv[3] = 1.0, -1.0
    opt = make_optimizer(backend, UPD)
    metrics = update_policy(backend, embeds, batch, adv, sampling(), UPD, opt, seed=0)
    assert metrics["num_transitions"] == 2 * K and metrics["num_samples"] == 2


def test_policy_loss_is_the_mean_over_every_transition_of_kept_samples():
    """Sample 0 has A = 0 at two of its steps: those transitions count in the loss mean (and the KL)."""
    backend, embeds = make_policy()
    batch = rollout(backend, embeds, "sde")
    adv = torch.zeros(8, K)
    adv[0, 1], adv[3] = 2.0, torch.tensor([1.0, -1.0, 0.5])
    cfg = dataclasses.replace(UPD, optimizer_steps_per_iter=1, micro_batch=64)
    metrics = update_policy(backend, embeds, batch, adv, sampling(), cfg, make_optimizer(backend, cfg), seed=0)
    # First pass: rho == 1, so the PPO loss is -mean(A) over the kept transitions: -(2 + 0.5) / (2 K).
    assert metrics["policy_loss"] == pytest.approx(-(2.0 + 0.5) / (2 * K), abs=1e-5)
    assert metrics["num_transitions"] == 2 * K


@pytest.mark.parametrize("where", ["advantages", "latents", "velocity"])
def test_non_finite_values_raise_and_leave_weights_untouched(where, monkeypatch):
    backend, embeds = make_policy()
    batch = rollout(backend, embeds, "sde")
    adv = torch.ones(8, K)
    if where == "advantages":
        adv[2, 1] = float("nan")
    elif where == "latents":
        batch.latents[5, 2, 0, 3, 3] = float("inf")
    else:  # the model itself produces NaN during the update
        monkeypatch.setattr(backend, "velocity", lambda x, *a, **k: torch.full_like(x, float("nan")))
    before = policy.lora_state_dict(backend)
    message = {"advantages": "advantages has 1 non-finite value.*sample 2, window step 1",
               "latents": "latents has 1 non-finite value.*sample 5, window step 2",
               "velocity": r"iteration 7, optimizer step 1/2\): non-finite loss"}[where]
    with pytest.raises(PipelineError, match=message):
        update_policy(backend, embeds, batch, adv, sampling(), UPD, make_optimizer(backend, UPD), iteration=7)
    after = policy.lora_state_dict(backend)
    assert all(torch.equal(before[k], after[k]) for k in before)


def test_resume_is_exact(tmp_path):
    """Two iterations in one process == one iteration, save, fresh process state, load, one more."""
    cfg = dataclasses.replace(UPD, lr=1e-3, optimizer_steps_per_iter=1, weight_decay=1e-2)
    backend, embeds = make_policy(seed_lora=None)
    batch = rollout(backend, embeds, "sde")
    adv = torch.randn(8, K, generator=torch.Generator().manual_seed(4))

    def iterate(b, e, opt, ema, it):
        update_policy(b, e, batch, adv, sampling(), cfg, opt, ema=ema, seed=it, iteration=it)

    opt, ema = make_optimizer(backend, cfg), policy.LoraEMA(backend, every=1)
    iterate(backend, embeds, opt, ema, 0)
    save_policy(tmp_path / "policy", backend, opt, ema, step=1)
    iterate(backend, embeds, opt, ema, 1)

    fresh, fresh_embeds = make_policy(seed_lora=None)
    policy.load_lora_weights(fresh, policy.read_adapter_weights(tmp_path / "policy"))  # == attach(dir)
    fresh_opt, fresh_ema = make_optimizer(fresh, cfg), policy.LoraEMA(fresh, every=1)
    assert load_training_state(tmp_path / "policy", fresh_opt, fresh_ema) == 1
    iterate(fresh, fresh_embeds, fresh_opt, fresh_ema, 1)

    expected, got = policy.lora_state_dict(backend), policy.lora_state_dict(fresh)
    assert all(torch.equal(expected[k], got[k]) for k in expected)
    assert all(torch.equal(ema.shadow[k], fresh_ema.shadow[k]) for k in ema.shadow)
    assert (tmp_path / "policy" / "ema" / policy.WEIGHTS_FILE).is_file()


def test_a_cps_window_reaching_the_last_step_trains_only_its_stochastic_steps():
    """A cps step to sigma 0 is deterministic (rollout log-prob exactly 0): no policy, so no PPO term.
    The update on a window of all T steps equals the update on its first T - 1 steps, weight for weight."""
    sig = flow_sigmas(T)
    full = []
    for window in (T, T - 1):
        backend, embeds = make_policy()
        gen = torch.Generator().manual_seed(0)
        n, idx = 8, torch.arange(8) % len(PROMPTS)
        x, states, logps = torch.randn(n, *backend.latent_shape, generator=gen), [], []
        with torch.no_grad():
            for k in range(T):
                states.append(x)
                v = backend.velocity(x, sig[k].expand(n), embeds.select(idx), 3.0)
                out = stochastic_step("cps", x, v, sig[k], sig[k + 1], 0.7, generator=gen)
                x = out.prev_sample
                logps.append(out.log_prob)
        states.append(x)
        assert bool((logps[-1] == 0).all())  # the last step has no policy
        batch = TransitionBatch(latents=torch.stack(states[:window + 1], 1),
                                old_log_probs=torch.stack(logps[:window], 1),
                                sigmas=sig[:window + 1].expand(n, window + 1).clone(), prompt_index=idx,
                                sigma_at_one=float(sig[1]))
        adv = torch.randn(n, T, generator=torch.Generator().manual_seed(5))[:, :window]
        cfg = dataclasses.replace(sampling("cps"), window_size=window)
        metrics = update_policy(backend, embeds, batch, adv, cfg, UPD, make_optimizer(backend, UPD), seed=0)
        assert metrics["num_transitions"] == n * (T - 1)
        full.append(policy.lora_state_dict(backend))
    assert all(torch.equal(full[0][k], full[1][k]) for k in full[0])
