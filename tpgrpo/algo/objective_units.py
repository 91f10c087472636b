"""What the forward-process objectives (``update.objective`` nft / awm) train on, from the credit table: one
*unit* per clean sample with its advantage and the highest noise level it is trained at (docs/objectives.md).

- A chain: one unit per trajectory, its final latent, the mean of its advantages over the window steps that
  have a policy (under ``flow_grpo`` credit every step holds the group-normalised final reward, DiffusionNFT's
  and AWM's own advantage), trained at every level (ceiling 1).
- A tree: one unit per SDE edge (an ODE edge has no policy and advantage 0), the leaf its child reaches by ODE
  children, the edge's advantage (the tree's step credit against its ODE sibling), trained at every level or,
  with ``split_levels``, only at levels at or below the split's (ceiling = the edge's parent noise level).

No model, no file: tensors in, :class:`Units` out.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class Units:
    """U training units: ``latent_row`` ``(U,)`` int64, rows of the store's clean latents (``final_latents`` of a
    chain, ``leaf_latents`` of a tree); ``prompt_index`` ``(U,)`` int64, rows of the prompt embeddings;
    ``advantage`` ``(U,)`` float32; ``ceiling`` ``(U,)`` float32, the highest noise level trained (1 = all)."""

    latent_row: torch.Tensor
    prompt_index: torch.Tensor
    advantage: torch.Tensor
    ceiling: torch.Tensor

    def __len__(self) -> int:
        return int(self.latent_row.numel())


def chain_units(advantages: torch.Tensor, stochastic: torch.Tensor, prompt_index: torch.Tensor) -> Units:
    """One unit per chain trajectory: ``advantages`` ``(N, K)``, ``stochastic`` ``(N, K)`` bool (the window steps
    with a policy), ``prompt_index`` ``(N,)``. Advantage = the mean over its stochastic steps (0 if none)."""
    if advantages.shape != stochastic.shape or advantages.shape[0] != prompt_index.numel():
        raise ValueError(f"advantages {tuple(advantages.shape)}, stochastic {tuple(stochastic.shape)} and "
                         f"prompt_index {tuple(prompt_index.shape)} do not agree")
    mask = stochastic.to(advantages.dtype)
    mean = (advantages * mask).sum(1) / mask.sum(1).clamp_min(1.0)
    n = advantages.shape[0]
    return Units(torch.arange(n, dtype=torch.int64), prompt_index.long(), mean.float(), torch.ones(n))


def tree_units(advantages: torch.Tensor, sde: torch.Tensor, split_sigma: torch.Tensor, leaf: torch.Tensor,
               prompt_index: torch.Tensor, leaves_per_prompt: int, split_levels: bool) -> Units:
    """One unit per SDE edge of a tree store (E edges, each ``(E,)``): ``advantages`` (the credit table's, step
    0), ``sde`` bool, ``split_sigma`` the edge's parent noise level, ``leaf`` the leaf (within its prompt) its
    child reaches, ``prompt_index``; ``leaves_per_prompt`` rows of ``leaf_latents`` per prompt. With
    ``split_levels`` the ceiling is ``split_sigma``, else 1."""
    edges = torch.nonzero(sde.bool()).flatten()
    rows = prompt_index[edges].long() * leaves_per_prompt + leaf[edges].long()
    ceiling = split_sigma[edges].float() if split_levels else torch.ones(edges.numel())
    return Units(rows, prompt_index[edges].long(), advantages[edges].float(), ceiling)
