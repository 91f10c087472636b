"""Rollout and probe loops over a model backend (spec sections 3-4). No file I/O here.

Notation: T denoising steps with sigmas ``s_0 = 1 > ... > s_T = 0`` (shape ``(T + 1,)``); a window of K
stochastic steps ``[start, start + K)``. For each trajectory the rollout keeps the K + 1 states around the
window, ``z_k`` = the latent before window step k (``z_K`` = after the last one), and the K old log-probs.

Devices (the rule every model stage follows: rollout, probe, update, eval, baseline, report-base, pretrain):
- all step maths runs on ``backend.device`` in float32: latents, velocities, sigmas, noise, log-probs;
- inputs may arrive from anywhere (states read back from ``trajectories.zarr`` are CPU tensors): each
  function moves them to ``backend.device`` on entry, on purpose, and returns its results there;
- random draws come from per-sample CPU ``torch.Generator``s and are moved to the device after drawing, so
  a sample depends only on its seed and a CPU run gives the same numbers whatever the device default is;
- prompt embeddings live on ``backend.device`` (``encode_prompts`` and the cached file load them there);
- a stage moves tensors to the CPU only where it writes an artifact or reads off a metric (``.cpu()``).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Sequence

import torch

from tpgrpo.sampling import ode_step, sde_window, stochastic_step


@dataclass(frozen=True)
class SamplerSpec:
    """What a rollout needs to know about the sampler.

    sigmas: (T + 1,) float32 schedule; window_start/window_size: the stochastic steps; step_kind: sde | cps;
    noise_level: eta; guidance_scale: CFG scale g.
    """

    sigmas: torch.Tensor
    window_start: int
    window_size: int
    step_kind: str
    noise_level: float
    guidance_scale: float

    @property
    def num_steps(self) -> int:
        return self.sigmas.numel() - 1

    def window_sigmas(self) -> torch.Tensor:
        """(K + 1,) sigmas of the states z_0..z_K kept around the window."""
        return self.sigmas[self.window_start:self.window_start + self.window_size + 1].clone()


@dataclass(frozen=True)
class Trajectories:
    """A batch of N rollouts: ``states`` (N, K+1, C, H, W) float32, ``log_probs`` (N, K) float32 (old
    log-probs of the window steps), ``final`` (N, C, H, W) the latent at sigma 0."""

    states: torch.Tensor
    log_probs: torch.Tensor
    final: torch.Tensor


def step_noise_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per sample for the SDE noise, independent of the initial-noise stream."""
    return [torch.Generator().manual_seed((seed * 2654435761 + 97) % (1 << 63)) for seed in seeds]


def _draw_noise(generators: list[torch.Generator], shape: tuple[int, ...], device) -> torch.Tensor:
    """(N, *shape) standard normals on ``device``, drawn on the CPU from one generator per sample (so a
    sample's noise depends only on its own seed, not on its batch nor on the device)."""
    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)


@torch.no_grad()
def rollout(backend, embeds, seeds: Sequence[int], spec: SamplerSpec) -> Trajectories:
    """Sample one batch of trajectories: SDE inside the window, ODE outside, CFG throughout.

    ``embeds`` holds one prompt embedding per sample (already selected to the batch's rows);
    ``seeds`` (N ints) give the initial noise and the per-step noise of each sample. The trajectories come
    back on ``backend.device`` (see the module docstring).
    """
    x = backend.initial_noise(list(seeds)).to(backend.device, torch.float32)
    generators = step_noise_generators(seeds)
    sigmas, last_window_step = spec.sigmas, spec.window_start + spec.window_size - 1
    window = sde_window(spec.num_steps, spec.window_start, spec.window_size)
    states, log_probs = [], []
    for step in range(spec.num_steps):
        s, s_next = float(sigmas[step]), float(sigmas[step + 1])
        v = velocity_at(backend, x, s, embeds, spec.guidance_scale)
        if not window[step]:
            x = ode_step(x, v, s, s_next)
            continue
        states.append(x)
        noise = _draw_noise(generators, tuple(x.shape[1:]), x.device)
        out = stochastic_step(spec.step_kind, x, v, s, s_next, spec.noise_level,
                              sigma_at_one=float(sigmas[1]), noise=noise)
        x = out.prev_sample
        log_probs.append(out.log_prob)
        if step == last_window_step:
            states.append(x)  # z_K: its ODE completion is this rollout's own final image
    return Trajectories(torch.stack(states, 1), torch.stack(log_probs, 1), x)


def velocity_at(backend, x: torch.Tensor, sigma, embeds, guidance_scale: float) -> torch.Tensor:
    """Guided velocity (B, C, H, W) float32 on ``backend.device`` for states ``x`` (any device) at scalar
    or (B,) ``sigma``; ``embeds`` one row per state, on ``backend.device``."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32).expand(x.shape[0]).contiguous()
    v = backend.velocity(x.to(backend.device, torch.float32), sigma.to(backend.device), embeds, guidance_scale)
    return v.float()


@torch.no_grad()
def ode_complete(backend, states: torch.Tensor, start_steps: torch.Tensor, sigmas: torch.Tensor,
                 embeds, guidance_scale: float, batch_size: int,
                 on_step: Callable[[int], None] | None = None) -> tuple[torch.Tensor, int]:
    """ODE-complete M states to sigma 0 (spec section 4), batching all states at the same sigma.

    states: (M, C, H, W) float32, state m sits at sigma ``sigmas[start_steps[m]]``; embeds: one row per
    state. The states advance in lockstep: at step j every state with ``start <= j`` is at ``s_j``, so
    one batched pass serves them all. Returns the (M, C, H, W) final latents on ``backend.device`` and the
    number of model forward passes (one per state per step, not counting the CFG doubling).
    """
    x = states.to(backend.device, torch.float32, copy=True)
    num_steps = sigmas.numel() - 1
    passes = 0
    for j in range(int(start_steps.min()), num_steps):
        active = torch.nonzero(start_steps <= j).flatten()
        for chunk in active.split(batch_size):
            rows = chunk.to(x.device)  # index on the states' device; embeds.select moves its own copy
            v = velocity_at(backend, x[rows], float(sigmas[j]), embeds.select(chunk), guidance_scale)
            x[rows] = ode_step(x[rows], v, float(sigmas[j]), float(sigmas[j + 1]))
            passes += chunk.numel()
        if on_step is not None:
            on_step(j)
    return x, passes


def complete_window_states(backend, states: torch.Tensor, embeds, sigmas: torch.Tensor, window_start: int,
                           guidance_scale: float, batch_size: int,
                           on_step: Callable[[int], None] | None = None) -> tuple[torch.Tensor, int]:
    """The probe (spec section 4): ODE-complete the window states z_0..z_{K-1} of N trajectories.

    states: (N, K+1, C, H, W) as a rollout stores them, on any device (z_K is left out: the rollout
    completed it); embeds: one row per trajectory. Returns final latents (N*K, C, H, W) on
    ``backend.device``, trajectory-major (row n*K + k completes z_k of trajectory n), and the number of
    model forward passes.
    """
    N, K = states.shape[0], states.shape[1] - 1
    flat = states[:, :K].reshape(N * K, *states.shape[2:])
    start_steps = torch.arange(K).repeat(N) + window_start  # z_k sits at schedule step window_start + k
    rows = embeds.select(torch.arange(N).repeat_interleave(K))
    return ode_complete(backend, flat, start_steps, sigmas, rows, guidance_scale, batch_size, on_step=on_step)
