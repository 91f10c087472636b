"""The update's states ``z_0..z_K``, read from ``trajectories.zarr`` a micro-batch at a time.

Holding every trajectory's states in every update process costs N x (K+1) x C x H x W x 4 bytes each: 3.0 GB
at SD3.5-M's 512 px and the paper's 1,152 trajectories (``docs/real-size.md``). A process's transitions are
a slice of one global shuffle and touch nearly every trajectory, so :class:`LazyStates` reads, per
micro-batch, only the (trajectory, state) pairs it uses. Stores written since (``write_zarr``) keep each
(trajectory, state) compressed and checksummed on its own inside the file of its 64 trajectories (a zarr
shard): a read decodes just those states. An older store (one chunk per 64 whole trajectories) reads the
same values, decoding every chunk a micro-batch's trajectories fall in. The values are the stored
float32 bytes, so the update computes the same numbers as on the materialised tensor.

A tree store keeps each distinct state once (``node_states``) and each edge its two node indices:
:class:`NodeStates` shows it as the same ``(E, 2, C, H, W)`` states. The update gets one or the other from its
shape's ``states`` (:mod:`tpgrpo.rollout_shape.chain_update` / ``tree_update``;
``rollout_shape.stored_states.store_states`` by name).
"""

from __future__ import annotations

import numpy as np
import torch

from tpgrpo.errors import PipelineError
from tpgrpo.io.trajectories import CheckedArray


class LazyStates:
    """``(N, K+1, C, H, W)`` float32 states of a trajectory store, read on use (``pairs``).

    ``verify()`` decodes the store one chunk file at a time and refuses non-finite or out-of-bound values
    with the line ``read_trajectories`` gives on the whole array (the index in the whole array). ``pairs``
    checks what it reads again. ``reads``: ``pairs`` calls; ``peak_read_bytes``: the most state bytes one
    ``pairs`` call read (its two outputs are as large again).
    """

    def __init__(self, array: CheckedArray):
        self.array, self.shape, self.ndim = array, tuple(array.shape), len(array.shape)
        self.verified, self.reads, self.peak_read_bytes = False, 0, 0

    @classmethod
    def from_store(cls, arrays: dict, num_prompts: int) -> "LazyStates":
        """A chain store's ``states`` (``arrays`` read by ``read_trajectories`` with ``states`` lazy);
        ``num_prompts`` unused (the same signature as :meth:`NodeStates.from_store`)."""
        return cls(arrays["states"])

    def verify(self) -> "LazyStates":
        """Check every stored state (one chunk file of ``array`` in memory at a time); idempotent."""
        rows = self.array.chunk_rows
        if not self.verified:
            for start in range(0, self.shape[0], rows):
                self.array[start:start + rows]  # decoded, checksummed and value-checked, then dropped
            self.verified = True
        return self

    def pairs(self, n_idx: torch.Tensor, k_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(states[n, k], states[n, k + 1])`` for the B transitions ``(n_idx[i], k_idx[i])``: two
        ``(B, C, H, W)`` float32 CPU tensors. Reads, per distinct trajectory, the distinct states its
        transitions use (at most 2B states in all), nothing else; a damaged chunk is one line."""
        n, k = n_idx.numpy(), k_idx.numpy()
        x, x_next = (np.empty((len(n), *self.shape[2:]), dtype=np.float32) for _ in range(2))
        read = 0
        for row in np.unique(n):
            mine = np.flatnonzero(n == row)
            cols, at = np.unique(np.concatenate([k[mine], k[mine] + 1]), return_inverse=True)
            block = self.array.oindex((np.array([row]), cols))[0]  # (S, C, H, W)
            _check_block(block, self.array, lambda s: f"trajectory {int(row)}, state {int(cols[s])}")
            x[mine], x_next[mine] = block[at[:len(mine)]], block[at[len(mine):]]
            read += block.nbytes
        self.reads += 1
        self.peak_read_bytes = max(self.peak_read_bytes, read)
        return torch.from_numpy(x), torch.from_numpy(x_next)


class NodeStates(LazyStates):
    """A tree store's ``(E, 2, C, H, W)`` edge states, read on use from ``node_states (V, C, H, W)``: edge e's
    (parent, child) states are rows ``nodes[e]`` (global rows), each node read once per ``pairs`` call."""

    def __init__(self, array: CheckedArray, nodes: np.ndarray):
        super().__init__(array)
        self.nodes = nodes
        self.shape, self.ndim = (nodes.shape[0], 2, *array.shape[1:]), 5

    @classmethod
    def from_store(cls, arrays: dict, num_prompts: int) -> "NodeStates":
        """A tree store's edges mapped onto its ``node_states`` (read lazy): ``node_states`` rows / ``num_prompts``
        nodes per prompt, each edge's prompt-local ``tree_parent_node`` / ``tree_child_node`` made global
        (indices checked in range by ``read_trajectories``)."""
        per_prompt = arrays["node_states"].shape[0] // num_prompts
        base = arrays["prompt_index"].astype(np.int64)[:, None] * per_prompt
        nodes = np.stack([arrays["tree_parent_node"], arrays["tree_child_node"]], 1).astype(np.int64) + base
        return cls(arrays["node_states"], nodes)

    def verify(self) -> "NodeStates":
        """Check every stored node (one chunk file of ``array`` in memory at a time); idempotent."""
        if not self.verified:
            for start in range(0, self.array.shape[0], self.array.chunk_rows):
                self.array[start:start + self.array.chunk_rows]
            self.verified = True
        return self

    def pairs(self, n_idx: torch.Tensor, k_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """As :meth:`LazyStates.pairs`; reads the distinct nodes the B transitions use (at most 2B)."""
        n, k = n_idx.numpy(), k_idx.numpy()
        rows, at = np.unique(np.concatenate([self.nodes[n, k], self.nodes[n, k + 1]]), return_inverse=True)
        block = self.array.oindex((rows,))  # (S, C, H, W)
        _check_block(block, self.array, lambda i: f"node {int(rows[i])}")
        self.reads += 1
        self.peak_read_bytes = max(self.peak_read_bytes, block.nbytes)
        out = block[at]
        return torch.from_numpy(out[:len(n)]), torch.from_numpy(out[len(n):])


def _check_block(block: np.ndarray, array: CheckedArray, where) -> None:
    """Refuse non-finite states ``block`` (S, C, H, W) (a store changed after ``verify``, or never verified):
    one line naming the store and the first bad state, ``where(s)`` for block row s."""
    lo, hi = block.min(), block.max()  # NaN and inf propagate: no block-sized temporaries on the good path
    if np.isfinite(lo) and np.isfinite(hi):
        return
    bad = ~np.isfinite(block)
    first = np.argwhere(bad)[0]
    raise PipelineError(f"{array.source}: array '{array.name}' has {int(bad.sum())} non-finite value(s) in the "
                        f"states one micro-batch read (first at {where(first[0])})")


def state_pairs(latents, n_idx: torch.Tensor, k_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``(latents[n_idx, k_idx], latents[n_idx, k_idx + 1])`` from a materialised ``(N, K+1, C, H, W)``
    tensor or a :class:`LazyStates`; ``(B, C, H, W)`` each, on the CPU."""
    if isinstance(latents, LazyStates):
        return latents.pairs(n_idx, k_idx)
    return latents[n_idx, k_idx], latents[n_idx, k_idx + 1]


def all_finite(values) -> bool:
    """Whether every value is finite: a tensor is checked whole; :class:`LazyStates` are verified chunk by
    chunk (``verify`` raises its own line, naming the store, on a bad value, so this returns True)."""
    if isinstance(values, LazyStates):
        return values.verify().verified
    return bool(torch.isfinite(values).all())
