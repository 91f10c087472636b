"""The update's states ``z_0..z_K``, read from ``trajectories.zarr`` a micro-batch at a time.

Holding every trajectory's states in every update process costs N x (K+1) x C x H x W x 4 bytes each: 3.0 GB
at SD3.5-M's 512 px and the paper's 1,152 trajectories (``docs/real-size.md``). A process's transitions are
a slice of one global shuffle and touch nearly every trajectory, so :class:`LazyStates` reads, per
micro-batch, only the (trajectory, state) pairs it uses. The store is chunked along the trajectory axis,
64 whole trajectories a chunk (``tpgrpo.io.artifacts.write_zarr``): a read decodes every chunk its
trajectories fall in (checksums verified) and keeps only the states it needs. The values are the stored
float32 bytes, so the update computes the same numbers as on the materialised tensor.
"""

from __future__ import annotations

import numpy as np
import torch

from tpgrpo.errors import PipelineError
from tpgrpo.io.artifacts import CheckedArray


class LazyStates:
    """``(N, K+1, C, H, W)`` float32 states of a trajectory store, read on use (``pairs``).

    ``verify()`` decodes the store one chunk at a time and refuses non-finite or out-of-bound values with
    the line ``read_trajectories`` gives on the whole array (the index in the whole array). ``pairs``
    checks what it reads again. ``peak_read_bytes``: the largest block one read returned (bytes).
    """

    def __init__(self, array: CheckedArray):
        self.array, self.shape, self.ndim = array, tuple(array.shape), len(array.shape)
        self.verified, self.reads, self.peak_read_bytes = False, 0, 0

    def verify(self) -> "LazyStates":
        """Check every stored state (one chunk of ``array`` in memory at a time); idempotent."""
        if not self.verified:
            for start in range(0, self.shape[0], self.array.chunk_rows):
                self.array[start:start + self.array.chunk_rows]  # decoded, checksummed and value-checked, then dropped
            self.verified = True
        return self

    def pairs(self, n_idx: torch.Tensor, k_idx: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(states[n, k], states[n, k + 1])`` for the B transitions ``(n_idx[i], k_idx[i])``: two
        ``(B, C, H, W)`` float32 CPU tensors. Reads the ``(U, S, C, H, W)`` block of the U distinct
        trajectories and S distinct states they use, nothing else (a damaged chunk is one line)."""
        n, k = n_idx.numpy(), k_idx.numpy()
        rows, at_row = np.unique(n, return_inverse=True)
        cols, at_col = np.unique(np.concatenate([k, k + 1]), return_inverse=True)
        block = self.array.oindex((rows, cols))
        self.reads += 1
        self.peak_read_bytes = max(self.peak_read_bytes, int(block.nbytes))
        _check_block(block, rows, cols, self.array)
        b = len(k)
        return torch.from_numpy(block[at_row, at_col[:b]]), torch.from_numpy(block[at_row, at_col[b:]])


def _check_block(block: np.ndarray, rows: np.ndarray, cols: np.ndarray, array: CheckedArray) -> None:
    """Refuse a non-finite read (a store changed after ``verify``, or never verified): one line naming the
    store and the first bad (trajectory, state)."""
    lo, hi = block.min(), block.max()  # NaN and inf propagate: no block-sized temporaries on the good path
    if np.isfinite(lo) and np.isfinite(hi):
        return
    bad = ~np.isfinite(block)
    first = np.argwhere(bad)[0]
    raise PipelineError(f"{array.source}: array '{array.name}' has {int(bad.sum())} non-finite value(s) in the "
                        f"states one micro-batch read (first at trajectory {int(rows[first[0]])}, state "
                        f"{int(cols[first[1]])})")


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
