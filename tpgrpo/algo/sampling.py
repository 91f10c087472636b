"""Sampler steps of a flow-matching model (spec sections 1-2), as pure functions on tensors.

Shapes: latents ``x`` and velocities ``v`` are ``(B, C, H, W)``; a sigma is a Python float, a 0-d
tensor or a ``(B,)`` tensor (one noise level per sample). All step maths runs in float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


def _as_batch_sigma(sigma: float | torch.Tensor, x: torch.Tensor) -> torch.Tensor:
    """Broadcast a scalar or ``(B,)`` sigma to ``(B, 1, 1, 1)`` float32 on ``x``'s device."""
    s = torch.as_tensor(sigma, dtype=torch.float32, device=x.device)
    if s.ndim == 0:
        s = s.expand(x.shape[0])
    return s.reshape(-1, *([1] * (x.ndim - 1)))


def cfg(v_uncond: torch.Tensor, v_cond: torch.Tensor, scale: float) -> torch.Tensor:
    """Classifier-free guidance ``v = v_uncond + g * (v_cond - v_uncond)``; shapes ``(B, C, H, W)``."""
    return v_uncond + scale * (v_cond - v_uncond)


def ode_step(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next) -> torch.Tensor:
    """Deterministic Euler step ``x' = x + v * (s_{k+1} - s_k)``; returns float32 ``(B, C, H, W)``."""
    s = _as_batch_sigma(sigma, x)
    s_next = _as_batch_sigma(sigma_next, x)
    return x.float() + v.float() * (s_next - s)


# ---------------------------------------------------------------------------------------------
# Stochastic steps (spec section 2)
# ---------------------------------------------------------------------------------------------

STEP_KINDS = ("sde", "cps")


@dataclass(frozen=True)
class StepOutput:
    """Result of one stochastic sampler step ``x -> x'``.

    Fields:
        prev_sample: ``(B, ...)`` float32, the next latent ``x'`` (the given one when ``prev_sample``
            was passed in).
        log_prob: ``(B,)`` float32, the step's log-probability of ``x'`` averaged over all non-batch
            elements (its exact form depends on the step kind; see ``sde_step`` / ``cps_step``).
        mean: ``(B, ...)`` float32, the mean of the Gaussian ``x'`` is drawn from (carries the gradient
            with respect to the velocity).
        std: ``(B,)`` float32, the standard deviation of that Gaussian, per element, i.e. the actual
            scale multiplying ``z``: ``std_sde * sqrt(-dt)`` for ``sde`` and ``s_{k+1} sin(eta pi/2)``
            for ``cps``. 0 means the step was deterministic. It is NOT the ``std_k`` of the spec's KL
            term (section 7): that is ``sde_std`` (no ``sqrt(-dt)``) for both step kinds.
    """

    prev_sample: torch.Tensor
    log_prob: torch.Tensor
    mean: torch.Tensor
    std: torch.Tensor


def _step_sigmas(x: torch.Tensor, v: torch.Tensor, sigma, sigma_next, eta: float):
    """Validate the common step inputs; return ``(s, s_next)`` as ``(B, 1, ...)`` float32."""
    if x.ndim < 2 or x.shape != v.shape:
        raise ValueError(f"v must have the shape of x (B, ...), got x {tuple(x.shape)} and v {tuple(v.shape)}")
    if not math.isfinite(float(eta)) or eta < 0:
        raise ValueError(f"eta must be a finite number >= 0, got {eta}")
    sigmas = []
    for name, value in (("sigma", sigma), ("sigma_next", sigma_next)):
        t = torch.as_tensor(value)
        if t.ndim > 1 or (t.ndim == 1 and t.shape[0] != x.shape[0]):
            raise ValueError(f"{name} must be a scalar or a ({x.shape[0]},) tensor, got shape {tuple(t.shape)}")
        sigmas.append(_as_batch_sigma(value, x))
    s, s_next = sigmas
    # Every step goes strictly down in noise from a positive sigma; s == 0 would divide by zero below.
    if not bool(((s > 0) & (s <= 1) & (s_next >= 0) & (s_next < s)).all()):
        raise ValueError("sigma, sigma_next must satisfy 0 <= sigma_next < sigma <= 1 for every sample")
    return s, s_next


def _draw_noise(x, noise, prev_sample, generator) -> torch.Tensor | None:
    """Return the standard-normal ``z`` to use, or None when ``prev_sample`` fixes ``x'``."""
    for name, t in (("noise", noise), ("prev_sample", prev_sample)):
        if t is not None and t.shape != x.shape:
            raise ValueError(f"{name} must have the shape of x {tuple(x.shape)}, got {tuple(t.shape)}")
    if prev_sample is not None:
        return None
    if noise is not None:
        return noise.float()
    return torch.randn(x.shape, generator=generator, device=x.device, dtype=torch.float32)


def _flat_mean(t: torch.Tensor) -> torch.Tensor:
    """Mean over every non-batch dimension: ``(B, ...) -> (B,)``."""
    return t.flatten(1).mean(dim=1)


def sde_std(sigma, sigma_at_one, eta: float) -> torch.Tensor:
    """Flow-GRPO's ``std = eta * sqrt(s / (1 - s~))`` (spec section 2), float32, WITHOUT ``sqrt(-dt)``.

    ``s~ = s`` except ``s~ = sigma_at_one`` (the schedule's second sigma ``s_1``) where ``s == 1``, in
    the denominator only. ``sde_step`` draws ``x'`` with ``sde_std * sqrt(-dt)``; this factor alone is
    the ``std_k`` of the KL term (spec section 7) for BOTH step kinds, as the release computes it, so
    the release's ``kl_beta`` carries over.

    Args:
        sigma: float, 0-d or ``(B,)`` (or any shape) tensor of noise levels in ``(0, 1]``.
        sigma_at_one: ``s_1`` (float or tensor broadcastable to ``sigma``); must be < 1 where ``s == 1``.
        eta: noise level >= 0.

    Returns: float32 tensor of ``sigma``'s shape (on its device), unitless like the sigmas.
    """
    s = torch.as_tensor(sigma, dtype=torch.float32)
    s_one = torch.as_tensor(sigma_at_one, dtype=torch.float32, device=s.device)
    if not bool(((s > 0) & (s <= 1)).all()):
        raise ValueError(f"sigma must lie in (0, 1] for the sde std, got {s.flatten()[:8].tolist()}")
    s_tilde = torch.where(s == 1, s_one, s)
    if not bool((s_tilde < 1).all()):
        raise ValueError("sigma_at_one must be < 1 (the schedule's second sigma s_1)")
    return eta * torch.sqrt(s / (1 - s_tilde))


def sde_step(x, v, sigma, sigma_next, eta: float, sigma_at_one, noise=None, prev_sample=None,
             generator=None) -> StepOutput:
    """Flow-GRPO's stochastic step (spec section 2, ``sde``), in float32.

    With ``s = sigma``, ``dt = sigma_next - s < 0``:
    ``std = eta * sqrt(s / (1 - s~))`` where ``s~ = s`` except ``s~ = sigma_at_one`` (the schedule's
    second sigma ``s_1``) where ``s == 1`` -- in the denominator only, the numerator keeps ``s``;
    ``mean = x + (v + std^2 / (2 s) * (x + (1 - s) v)) * dt``; ``x' = mean + std * sqrt(-dt) * z``.
    ``log_prob`` = mean over the non-batch elements of ``log N(x'; mean, (std * sqrt(-dt))^2)``; ``x'``
    is detached there (it is data, the gradient flows through ``mean`` and ``std`` only).

    Args:
        x, v: ``(B, ...)`` latent and (guided) velocity at ``sigma``.
        sigma, sigma_next: floats, 0-d or ``(B,)`` tensors (per-sample noise levels).
        eta: noise level >= 0 (paper's alpha, default 0.7).
        sigma_at_one: ``s_1``, float/0-d/``(B,)``; must be < 1 wherever ``sigma == 1``.
        noise: optional ``(B, ...)`` standard-normal ``z``; else drawn with ``generator``.
        prev_sample: optional given ``x'`` (training: re-score a stored transition); returned as is.

    Convention for a zero scale (``eta == 0``): ``x'`` equals ``ode_step`` bit for bit (the extra drift
    term is exactly 0) and ``log_prob`` is 0 -- a deterministic step carries no policy; the density is
    evaluated with a placeholder scale of 1 and masked, so neither values nor gradients become NaN.
    """
    s, s_next = _step_sigmas(x, v, sigma, sigma_next, eta)
    x, v = x.float(), v.float()
    dt = s_next - s
    std = sde_std(s, _as_batch_sigma(sigma_at_one, x), eta)
    mean = x + (v + std**2 / (2 * s) * (x + (1 - s) * v)) * dt
    scale = std * torch.sqrt(-dt)  # (B, 1, ...): the Gaussian's std per element
    z = _draw_noise(x, noise, prev_sample, generator)
    x_next = prev_sample.float() if z is None else mean + scale * z
    deterministic = scale == 0
    safe = torch.where(deterministic, torch.ones_like(scale), scale)
    elem = (-((x_next.detach() - mean) ** 2) / (2 * safe**2) - torch.log(safe)
            - 0.5 * math.log(2 * math.pi))
    log_prob = torch.where(deterministic.flatten(), torch.zeros((), device=x.device), _flat_mean(elem))
    return StepOutput(prev_sample=x_next, log_prob=log_prob, mean=mean, std=scale.flatten())


def cps_step(x, v, sigma, sigma_next, eta: float, noise=None, prev_sample=None,
             generator=None) -> StepOutput:
    """Coefficients-preserving step (spec section 2, ``cps``; what the TP-GRPO release runs), float32.

    ``x0_hat = x - s v``, ``x1_hat = x + (1 - s) v``, ``n = s_{k+1} sin(eta pi / 2)``,
    ``mean = (1 - s_{k+1}) x0_hat + s_{k+1} cos(eta pi / 2) x1_hat``, ``x' = mean + n z``.
    The mean is evaluated as the algebraically identical ``ode_step(x) + s_{k+1} (cos - 1) x1_hat`` so
    that ``eta == 0`` reproduces ``ode_step`` bit for bit. At ``s_{k+1} = 0`` (last step) ``n = 0``:
    the step is deterministic whatever ``z`` is.

    ``log_prob = -mean((x' - mean)^2)`` over the non-batch elements, with NO variance scaling and no
    normalising constant: this is the release's form. It is not a normalised log-density; its scale
    (1 instead of ``1 / (2 n^2)``) sets the effective weighting of the steps in the PPO ratio, which is
    why the spec keeps it. It is 0 for a deterministic step. Arguments as in ``sde_step``.
    """
    s, s_next = _step_sigmas(x, v, sigma, sigma_next, eta)
    x, v = x.float(), v.float()
    angle = eta * math.pi / 2
    x1_hat = x + (1 - s) * v
    # (1 - s')(x - s v) + s' x1_hat == x + v (s' - s): the ODE step; the cosine shrinks the x1 part.
    mean = x + v * (s_next - s) + s_next * (math.cos(angle) - 1.0) * x1_hat
    n = s_next * math.sin(angle)
    z = _draw_noise(x, noise, prev_sample, generator)
    x_next = prev_sample.float() if z is None else mean + n * z
    log_prob = -_flat_mean((x_next.detach() - mean) ** 2)
    return StepOutput(prev_sample=x_next, log_prob=log_prob, mean=mean, std=n.flatten())


def stochastic_step(kind: str, x, v, sigma, sigma_next, eta: float, sigma_at_one=None, noise=None,
                    prev_sample=None, generator=None) -> StepOutput:
    """Dispatch to ``sde_step`` (``kind="sde"``, needs ``sigma_at_one``) or ``cps_step`` (``"cps"``).

    Shapes and units as in those functions; ``sigma_at_one`` is ignored for ``cps``.
    """
    if kind == "sde":
        if sigma_at_one is None:
            raise ValueError("sigma_at_one is required for kind='sde' (the schedule's second sigma s_1)")
        return sde_step(x, v, sigma, sigma_next, eta, sigma_at_one, noise=noise,
                        prev_sample=prev_sample, generator=generator)
    if kind == "cps":
        return cps_step(x, v, sigma, sigma_next, eta, noise=noise, prev_sample=prev_sample,
                        generator=generator)
    raise ValueError(f"kind must be one of {STEP_KINDS}, got {kind!r}")


def sde_window(num_steps: int, start: int, size: int) -> torch.Tensor:
    """Boolean mask ``(num_steps,)``: True for the stochastic steps ``[start, start + size)`` (spec 2).

    The paper's default is T = 10, start 0, size 9 (step 9, ``s -> 0``, stays ODE).
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if start < 0 or size < 0 or start + size > num_steps:
        raise ValueError(f"window [start, start + size) must lie in [0, {num_steps}], got start={start}, size={size}")
    mask = torch.zeros(num_steps, dtype=torch.bool)
    mask[start:start + size] = True
    return mask
