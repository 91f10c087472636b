"""Policy-update losses (spec section 7): PPO clipped surrogate, KL to the reference, diagnostics.

Per window step the batch is ``B`` transitions; log-probs and advantages are ``(B,)`` tensors. The KL
term lives here (not in ``sampling``) because it is part of the loss, not of the sampler.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class LossOutput:
    """Result of ``policy_loss``.

    Fields: ``loss`` (0-d, differentiable: ``policy_loss + kl_beta * kl``), ``policy_loss`` (0-d,
    differentiable PPO term), ``kl`` (0-d, differentiable; 0 without a reference), ``ratio`` ``(B,)``
    (differentiable), ``approx_kl`` and ``clip_fraction`` (0-d, detached diagnostics).
    """

    loss: torch.Tensor
    policy_loss: torch.Tensor
    kl: torch.Tensor
    ratio: torch.Tensor
    approx_kl: torch.Tensor
    clip_fraction: torch.Tensor


def _check_same_shape(**tensors: torch.Tensor) -> None:
    """Raise ValueError unless all given tensors have one shape."""
    names = list(tensors)
    first = tensors[names[0]].shape
    for name in names[1:]:
        if tensors[name].shape != first:
            got = tuple(tensors[name].shape)
            raise ValueError(f"{name} must have the shape of {names[0]} {tuple(first)}, got {got}")


def ppo_clip_loss(log_prob: torch.Tensor, old_log_prob: torch.Tensor, advantages: torch.Tensor,
                  clip_range: float) -> tuple[torch.Tensor, torch.Tensor]:
    """PPO clipped surrogate ``mean(max(-A rho, -A clip(rho, 1 - eps, 1 + eps)))`` (spec section 7).

    Args:
        log_prob: ``(B,)`` current log-probs of the stored transitions (carries the gradient).
        old_log_prob: ``(B,)`` log-probs from the rollout; treated as a constant (detached here).
        advantages: ``(B,)`` advantages of those transitions (constant).
        clip_range: eps > 0 (1e-5 for ``cps``, 1e-4 for ``sde``).

    Returns: ``(loss, ratio)``: 0-d loss and ``(B,)`` ratio ``rho = exp(log_prob - old_log_prob)``.
    The max of the two terms is pessimistic: once rho has moved past the clip bound in the
    direction the advantage favours, the gradient of that sample is zero.
    """
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob, advantages=advantages)
    if not (math.isfinite(clip_range) and clip_range > 0):
        raise ValueError(f"clip_range must be a finite number > 0, got {clip_range}")
    ratio = torch.exp(log_prob - old_log_prob.detach())
    adv = advantages.detach()
    unclipped = -adv * ratio
    clipped = -adv * torch.clamp(ratio, 1.0 - clip_range, 1.0 + clip_range)
    return torch.maximum(unclipped, clipped).mean(), ratio


def kl_to_reference(mean_theta: torch.Tensor, mean_ref: torch.Tensor, std: torch.Tensor) -> torch.Tensor:
    """Per-sample KL term to the reference policy, ``(B,)`` (spec section 7).

    ``KL_k = mean((mean_theta - mean_ref)^2 over non-batch dims) / (2 std_k^2)``. ``mean_*`` are
    ``(B, ...)``; ``std`` is ``(B,)`` or broadcastable ``(B, 1, ...)``: the spec's ``std_k``, i.e.
    ``tpgrpo.algo.sampling.sde_std(s_k, s_1, eta)`` = ``eta sqrt(s / (1 - s~))`` WITHOUT the ``sqrt(-dt)``
    factor, for both step kinds, as the release computes it (so its ``kl_beta`` = 1e-4 carries over).
    It is not ``StepOutput.std``: for ``sde`` this value is the exact Gaussian KL per element times
    ``-dt``. Where ``std == 0`` (``eta = 0``: no policy to regularise) the KL is defined as 0, not inf.
    """
    _check_same_shape(mean_theta=mean_theta, mean_ref=mean_ref)
    std = std.reshape(-1).float()
    if std.shape[0] != mean_theta.shape[0]:
        raise ValueError(f"std must have one value per sample ({mean_theta.shape[0]},), got {tuple(std.shape)}")
    sq = (mean_theta.float() - mean_ref.float()).pow(2).flatten(1).mean(dim=1)
    zero = std == 0
    safe = torch.where(zero, torch.ones_like(std), std)
    return torch.where(zero, torch.zeros_like(sq), sq / (2 * safe**2))


def approx_kl(log_prob: torch.Tensor, old_log_prob: torch.Tensor) -> torch.Tensor:
    """Diagnostic ``0.5 * mean((log_prob - old_log_prob)^2)``, 0-d, detached (spec section 7)."""
    _check_same_shape(log_prob=log_prob, old_log_prob=old_log_prob)
    return 0.5 * (log_prob.detach() - old_log_prob.detach()).pow(2).mean()


def clip_fraction(ratio: torch.Tensor, clip_range: float) -> torch.Tensor:
    """Diagnostic: fraction of ratios with ``|rho - 1| > clip_range``, 0-d float, detached."""
    return ((ratio.detach() - 1.0).abs() > clip_range).float().mean()


def policy_loss(log_prob, old_log_prob, advantages, clip_range: float, mean_theta=None, mean_ref=None,
                std=None, kl_beta: float = 0.0) -> LossOutput:
    """Full update loss ``L_pg + kl_beta * mean_B(KL)`` with diagnostics (spec section 7).

    Args: as ``ppo_clip_loss``; for the KL term also ``mean_theta`` (current step mean, ``(B, ...)``),
    ``mean_ref`` (the same with the LoRA adapter disabled, no gradient needed) and ``std`` (``(B,)``,
    ``sampling.sde_std(s_k, s_1, eta)``, see ``kl_to_reference``), and ``kl_beta >= 0`` (1e-4 in the
    release). With ``kl_beta == 0`` the
    reference may be omitted; ``kl`` is then computed if given (for logging) and 0 otherwise.
    """
    if not (math.isfinite(kl_beta) and kl_beta >= 0):
        raise ValueError(f"kl_beta must be a finite number >= 0, got {kl_beta}")
    given = [t is not None for t in (mean_theta, mean_ref, std)]
    if any(given) and not all(given):
        raise ValueError("mean_theta, mean_ref and std must be given together (for the KL term)")
    if kl_beta > 0 and not all(given):
        raise ValueError("kl_beta > 0 needs mean_theta, mean_ref and std")
    pg, ratio = ppo_clip_loss(log_prob, old_log_prob, advantages, clip_range)
    if all(given):
        kl = kl_to_reference(mean_theta, mean_ref.detach(), std.detach()).mean()
    else:
        kl = torch.zeros((), dtype=pg.dtype, device=pg.device)
    return LossOutput(
        loss=pg + kl_beta * kl, policy_loss=pg, kl=kl, ratio=ratio,
        approx_kl=approx_kl(log_prob, old_log_prob), clip_fraction=clip_fraction(ratio, clip_range),
    )
