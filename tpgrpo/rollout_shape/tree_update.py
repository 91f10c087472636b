"""What the update reads of a tree store (the update's part of :mod:`tpgrpo.rollout_shape`'s interface,
``ShapeStates``): each edge's (parent, child) states from ``node_states`` read on use, and under
``update.objective`` nft / awm one unit per SDE edge on the ``leaf_latents`` its child reaches."""

from __future__ import annotations

import torch

from tpgrpo.algo.objective_units import Units, tree_units
from tpgrpo.policy.objective_update import clean_latents
from tpgrpo.policy.states import NodeStates

LATENTS = "leaf_latents"  # the leaves the rollout keeps under nft / awm, prompt-major


def states(arrays: dict, num_prompts: int) -> NodeStates:
    """The edges' ``(E, 2, C, H, W)`` states mapped onto ``node_states`` (:meth:`NodeStates.from_store`)."""
    return NodeStates.from_store(arrays, num_prompts)


def units(arrays: dict, attrs: dict, advantages: torch.Tensor, split_levels: bool,
          source: str) -> tuple[Units, torch.Tensor]:
    """One unit per SDE edge (``tpgrpo.algo.objective_units.tree_units``: its credit advantage ``(E, 1)``,
    ceiling its split level with ``split_levels``) and the ``leaf_latents`` ``(F, C, H, W)`` they index (F /
    ``attrs['prompts']`` leaves per prompt)."""
    latents = clean_latents(arrays, LATENTS, source)
    sigmas = torch.from_numpy(arrays["sigmas"])
    return tree_units(advantages[:, 0], torch.from_numpy(arrays["tree_sde"]), sigmas[:, 0],
                      torch.from_numpy(arrays["tree_leaf"]), torch.from_numpy(arrays["prompt_index"]).long(),
                      latents.shape[0] // len(attrs["prompts"]), split_levels), latents
