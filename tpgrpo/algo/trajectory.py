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

from tpgrpo.algo.probe_modes import EXACT, Completion, visits
from tpgrpo.algo.sampling import ode_step, sde_window, stochastic_step


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
    log-probs of the window steps), ``final`` (N, C, H, W) the latent at sigma 0; ``x0_estimates``
    (N, K, C, H, W) float32 ``z_k - s_k v_k`` with the guided velocity of window step k, when asked for
    (``probe.completion: x0`` scores them), else None; ``velocities`` (N, K, C, H, W) float32 the guided
    velocity ``v_k`` at ``z_k`` (latent units per unit of sigma), when asked for (the probe's completions
    take their first step with it instead of a pass), else None."""

    states: torch.Tensor
    log_probs: torch.Tensor
    final: torch.Tensor
    x0_estimates: torch.Tensor | None = None
    velocities: torch.Tensor | None = None


def step_noise_generators(seeds: Sequence[int]) -> list[torch.Generator]:
    """One CPU generator per sample for the SDE noise, independent of the initial-noise stream."""
    return [torch.Generator().manual_seed((seed * 2654435761 + 97) % (1 << 63)) for seed in seeds]


def _draw_noise(generators: list[torch.Generator], shape: tuple[int, ...], device) -> torch.Tensor:
    """(N, *shape) standard normals on ``device``, drawn on the CPU from one generator per sample (so a
    sample's noise depends only on its own seed, not on its batch nor on the device)."""
    return torch.stack([torch.randn(shape, generator=g) for g in generators]).to(device)


@torch.no_grad()
def rollout(backend, embeds, seeds: Sequence[int], spec: SamplerSpec, keep_x0: bool = False,
            keep_velocities: bool = False) -> Trajectories:
    """Sample one batch of trajectories: SDE inside the window, ODE outside, CFG throughout.

    ``embeds`` holds one prompt embedding per sample (already selected to the batch's rows);
    ``seeds`` (N ints) give the initial noise and the per-step noise of each sample; ``keep_x0``: also
    keep each window state's one-step estimate ``z_k - s_k v_k`` (costs memory, no pass);
    ``keep_velocities``: also keep each window state's guided velocity ``v_k`` (as much memory as the states;
    no pass, and the numbers drawn are unchanged). The trajectories come back on ``backend.device`` (see the
    module docstring).
    """
    x = backend.initial_noise(list(seeds)).to(backend.device, torch.float32)
    generators = step_noise_generators(seeds)
    sigmas, last_window_step = spec.sigmas, spec.window_start + spec.window_size - 1
    window = sde_window(spec.num_steps, spec.window_start, spec.window_size)
    states, log_probs, x0, velocities = [], [], [], []
    for step in range(spec.num_steps):
        s, s_next = float(sigmas[step]), float(sigmas[step + 1])
        v = velocity_at(backend, x, s, embeds, spec.guidance_scale)
        if not window[step]:
            x = ode_step(x, v, s, s_next)
            continue
        states.append(x)
        if keep_x0:  # the one Euler step to sigma 0 with this very velocity: what ode:1 would compute
            x0.append(ode_step(x, v, s, 0.0))
        if keep_velocities:
            velocities.append(v)
        noise = _draw_noise(generators, tuple(x.shape[1:]), x.device)
        out = stochastic_step(spec.step_kind, x, v, s, s_next, spec.noise_level,
                              sigma_at_one=float(sigmas[1]), noise=noise)
        x = out.prev_sample
        log_probs.append(out.log_prob)
        if step == last_window_step:
            states.append(x)  # z_K: its ODE completion is this rollout's own final image
    return Trajectories(torch.stack(states, 1), torch.stack(log_probs, 1), x,
                        torch.stack(x0, 1) if keep_x0 else None,
                        torch.stack(velocities, 1) if keep_velocities else None)


def velocity_at(backend, x: torch.Tensor, sigma, embeds, guidance_scale: float) -> torch.Tensor:
    """Guided velocity (B, C, H, W) float32 on ``backend.device`` for states ``x`` (any device) at scalar
    or (B,) ``sigma``; ``embeds`` one row per state, on ``backend.device``."""
    sigma = torch.as_tensor(sigma, dtype=torch.float32).expand(x.shape[0]).contiguous()
    v = backend.velocity(x.to(backend.device, torch.float32), sigma.to(backend.device), embeds, guidance_scale)
    return v.float()


@torch.no_grad()
def ode_complete(backend, states: torch.Tensor, start_steps: torch.Tensor, sigmas: torch.Tensor,
                 embeds, guidance_scale: float, batch_size: int,
                 on_step: Callable[[int], None] | None = None,
                 first_velocities: torch.Tensor | None = None,
                 completion: Completion = EXACT) -> tuple[torch.Tensor, int]:
    """ODE-complete M states to sigma 0 (spec section 4), batching all states at the same sigma.

    states: (M, C, H, W) float32, state m sits at sigma ``sigmas[start_steps[m]]``; embeds: one row per
    state. ``completion`` (:mod:`tpgrpo.algo.probe_modes`) says which schedule steps each state visits
    (``visits``) and whether each step is Euler or Heun (default ``exact``: every remaining step).
    The states advance in lockstep over the schedule's steps: at step j every state whose path visits
    ``s_j`` (and has not ended) is there, so one batched pass serves them all, each then stepping to its own
    next sigma. ``first_velocities``: (M, C, H, W) float32, the guided velocity at each state as given (the
    rollout's ``v_k``): each completion's first step uses it instead of a pass, which saves one pass per
    state and gives the same step up to the round-off of a differently composed batch. Returns the
    (M, C, H, W) final latents on ``backend.device`` and the number of model forward passes (one per state
    per evaluation, not counting the CFG doubling).
    """
    x = states.to(backend.device, torch.float32, copy=True)
    num_steps = sigmas.numel() - 1
    after = _next_steps(start_steps, num_steps, completion)  # (M, T): schedule step each state goes to, or -1
    passes = 0
    for j in range(int(start_steps.min()), num_steps):
        active = torch.nonzero(after[:, j] >= 0).flatten()  # grid / ode:M may skip step j altogether
        given = start_steps[active] == j if first_velocities is not None else torch.zeros_like(active, dtype=bool)
        v = torch.empty((active.numel(), *x.shape[1:]), device=x.device)
        if given.any():  # states starting here step with their given velocity, no pass
            v[given.to(x.device)] = first_velocities[active[given]].to(x.device, torch.float32)
        for part in _batches(torch.nonzero(~given).flatten(), batch_size):
            rows = active[part]
            v[part.to(x.device)] = velocity_at(backend, x[rows.to(x.device)], float(sigmas[j]), embeds.select(rows),
                                               guidance_scale)
            passes += part.numel()
        if completion.order == 2:
            passes += _heun_average(backend, x, active, v, sigmas[j], sigmas[after[active, j]], embeds,
                                    guidance_scale, batch_size)
        _step_rows(x, active, v, sigmas, j, after)
        if on_step is not None:
            on_step(j)
    return x, passes


def _heun_average(backend, x: torch.Tensor, active: torch.Tensor, v: torch.Tensor, sigma, targets: torch.Tensor,
                  embeds, guidance_scale: float, batch_size: int) -> int:
    """Heun's corrector, in place on ``v`` (len(active), C, H, W): for each row of ``x`` in ``active`` whose
    target sigma (``targets``, (len(active),) float32) is above 0, ``v <- (v + v(x + (t - s) v, t)) / 2`` with
    one more pass at the Euler predictor; rows stepping to sigma 0 keep Euler's ``v``. Returns the passes."""
    passes = 0
    for part in _batches(torch.nonzero(targets > 0).flatten(), batch_size):
        rows, at = active[part].to(x.device), part.to(x.device)
        t = targets[part].to(x.device)
        predicted = ode_step(x[rows], v[at], float(sigma), t)
        v[at] = (v[at] + velocity_at(backend, predicted, t, embeds.select(active[part]), guidance_scale)) / 2
        passes += part.numel()
    return passes


def _batches(index: torch.Tensor, batch_size: int) -> tuple[torch.Tensor, ...]:
    """``index`` (n,) cut into pieces of at most ``batch_size``; none when it is empty."""
    return index.split(batch_size) if index.numel() else ()


def _step_rows(x: torch.Tensor, chunk: torch.Tensor, v: torch.Tensor, sigmas: torch.Tensor, j: int,
               after: torch.Tensor) -> None:
    """In place: rows ``chunk`` (CPU int64) of ``x`` (M, C, H, W) take an Euler step from ``s_j`` to each
    row's own target ``sigmas[after[row, j]]`` with velocities ``v`` (len(chunk), C, H, W)."""
    if not chunk.numel():
        return
    rows = chunk.to(x.device)  # index on the states' device
    targets = after[chunk, j]
    for target in torch.unique(targets).tolist():  # exact: one target, s_{j+1}, for the whole chunk
        mine = (targets == target).to(x.device)
        x[rows[mine]] = ode_step(x[rows[mine]], v[mine], float(sigmas[j]), float(sigmas[target]))


def _next_steps(start_steps: torch.Tensor, num_steps: int, completion: Completion) -> torch.Tensor:
    """(M, T) int64: entry [m, j] is the schedule step state m moves to from step j, -1 where its
    completion does not pass through step j (before its start, skipped, or done)."""
    after = torch.full((start_steps.numel(), num_steps), -1, dtype=torch.int64)
    for start in torch.unique(start_steps).tolist():  # states with the same start share one path
        path = visits(completion, start, num_steps)
        rows = torch.nonzero(start_steps == start).flatten()
        for here, there in zip(path[:-1], path[1:]):
            after[rows, here] = there
    return after


def complete_window_states(backend, states: torch.Tensor, embeds, sigmas: torch.Tensor, window_start: int,
                           guidance_scale: float, batch_size: int,
                           on_step: Callable[[int], None] | None = None,
                           velocities: torch.Tensor | None = None,
                           completion: Completion = EXACT) -> tuple[torch.Tensor, int]:
    """The probe (spec section 4): ODE-complete the window states z_0..z_{K-1} of N trajectories.

    states: (N, K+1, C, H, W) as a rollout stores them, on any device (z_K is left out: the rollout
    completed it); embeds: one row per trajectory; ``completion``: as in :func:`ode_complete` (default
    exact); ``velocities``: (N, K, C, H, W) the rollout's guided ``v_k``
    at each ``z_k``, or None: with them every completion's first step reuses ``v_k`` (K passes fewer per
    trajectory, the same completion up to float round-off). Returns final latents (N*K, C, H, W) on
    ``backend.device``, trajectory-major (row n*K + k completes z_k of trajectory n), and the number of
    model forward passes.
    """
    N, K = states.shape[0], states.shape[1] - 1
    flat = states[:, :K].reshape(N * K, *states.shape[2:])
    first = None if velocities is None else velocities.reshape(N * K, *velocities.shape[2:])
    start_steps = torch.arange(K).repeat(N) + window_start  # z_k sits at schedule step window_start + k
    rows = embeds.select(torch.arange(N).repeat_interleave(K))
    return ode_complete(backend, flat, start_steps, sigmas, rows, guidance_scale, batch_size, on_step=on_step,
                        first_velocities=first, completion=completion)
