"""Model backends behind one small interface (``FlowBackend``): the embedded tiny model now,
SD3.5 and FLUX later. Heavy libraries (torch, diffusers, transformers) load on first use."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:  # pragma: no cover
    from tpgrpo.models.base import FlowBackend

BACKEND_KINDS = ("tiny", "sd3", "flux")
DTYPES = ("fp32", "fp16", "bf16")


def parse_dtype(dtype):
    """``"fp32" | "fp16" | "bf16"`` (or a ``torch.dtype``) -> ``torch.dtype``."""
    import torch

    if isinstance(dtype, torch.dtype):
        return dtype
    table = {"fp32": torch.float32, "fp16": torch.float16, "bf16": torch.bfloat16}
    if dtype not in table:
        raise ValueError(f"unknown dtype {dtype!r}; expected one of {list(table)}")
    return table[dtype]


def load_backend(kind: str, path, device: str = "cpu", dtype="fp32") -> "FlowBackend":
    """Load the backend ``kind`` from the local model folder ``path``.

    Args:
        kind: ``"tiny"`` (the embedded model; ``path`` as written by ``tpgrpo pretrain``).
            ``"sd3"``/``"flux"`` are planned and raise ``NotImplementedError`` for now.
        path: local folder in the diffusers pipeline layout.
        device: torch device string, e.g. ``"cpu"``.
        dtype: weights' dtype, ``"fp32"``, ``"fp16"`` or ``"bf16"``.
    """
    if kind == "tiny":
        from tpgrpo.models.tiny import load_tiny

        return load_tiny(path, device=device, dtype=parse_dtype(dtype))
    if kind in BACKEND_KINDS:
        raise NotImplementedError(f"backend kind {kind!r} is not available yet (available: 'tiny')")
    raise ValueError(f"unknown backend kind {kind!r}; expected one of {list(BACKEND_KINDS)}")
