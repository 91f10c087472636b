"""The flow-matching noise schedule (spec section 1).

Rectified-flow convention: ``x_s = (1 - s) * x0 + s * noise``; the model predicts the velocity
``v ~ noise - x0``. Step ``k`` maps sigma ``s_k`` to ``s_{k+1}`` with ``dt = s_{k+1} - s_k < 0``.
"""

from __future__ import annotations

import torch


def flow_sigmas(num_steps: int, shift: float = 1.0) -> torch.Tensor:
    """Sigmas ``s_0 = 1 > s_1 > ... > s_{T-1} > s_T = 0`` for ``num_steps`` (T) Euler steps.

    Taken from diffusers' ``FlowMatchEulerDiscreteScheduler`` (the same schedule SD3.5 samples with;
    SD3.5-M uses ``shift=3``) so that training and inference agree with stock pipelines. The result is
    meant to be stored beside every trajectory, never re-derived from scheduler state.

    Returns: float32 tensor of shape ``(T + 1,)``, unitless noise levels in [0, 1].
    """
    if num_steps < 1:
        raise ValueError(f"num_steps must be >= 1, got {num_steps}")
    if shift <= 0:
        raise ValueError(f"shift must be > 0, got {shift}")
    from diffusers import FlowMatchEulerDiscreteScheduler  # lazy: importing diffusers costs seconds

    scheduler = FlowMatchEulerDiscreteScheduler(shift=shift)
    scheduler.set_timesteps(num_steps, device="cpu")
    return scheduler.sigmas.detach().to(torch.float32).clone()
