"""What the update reads of a chain store (the update's part of :mod:`tpgrpo.rollout_shape`'s interface,
``ShapeStates``): its ``states (N, K+1, C, H, W)`` read on use, and under ``update.objective`` nft / awm one
unit per trajectory on its ``final_latents``."""

from __future__ import annotations

import torch

from tpgrpo.algo.objective_units import Units, chain_units
from tpgrpo.policy.objective_update import clean_latents
from tpgrpo.policy.states import LazyStates

LATENTS = "final_latents"  # the clean samples the rollout keeps under nft / awm


def states(arrays: dict, num_prompts: int) -> LazyStates:
    """The store's ``states`` (read with ``states`` lazy), as :class:`LazyStates` (``num_prompts`` unused)."""
    return LazyStates.from_store(arrays, num_prompts)


def units(arrays: dict, attrs: dict, advantages: torch.Tensor, split_levels: bool,
          source: str) -> tuple[Units, torch.Tensor]:
    """One unit per trajectory (``tpgrpo.algo.objective_units.chain_units``: its credit ``advantages``
    ``(N, K)`` averaged over the window steps with a policy) and the ``final_latents`` ``(N, C, H, W)`` they
    index; ``attrs`` and ``split_levels`` unused (a chain's units have no split level)."""
    latents = clean_latents(arrays, LATENTS, source)
    sigmas = torch.from_numpy(arrays["sigmas"])
    return chain_units(advantages, sigmas[:, 1:] > 0, torch.from_numpy(arrays["prompt_index"]).long()), latents
