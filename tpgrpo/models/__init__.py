"""Model backends behind one small interface (``FlowBackend``): the embedded tiny model, SD3/SD3.5
(``sd3``) and FLUX.1 (``flux``). Heavy libraries (torch, diffusers, transformers) load on first use."""

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


def load_backend(kind: str, path, device: str = "cpu", dtype="fp32", resolution: int | None = None) -> "FlowBackend":
    """Load the backend ``kind`` from the local model folder ``path`` (nothing is downloaded).

    Args:
        kind: ``"tiny"`` (the embedded model; ``path`` as written by ``tpgrpo pretrain``), ``"sd3"``
            (a ``StableDiffusion3Pipeline`` folder, e.g. SD3.5-M) or ``"flux"`` (a ``FluxPipeline``
            folder, e.g. FLUX.1-dev).
        path: local folder in the diffusers pipeline layout.
        device: torch device string, e.g. ``"cpu"``, ``"cuda"``.
        dtype: weights' dtype, ``"fp32"``, ``"fp16"`` or ``"bf16"``.
        resolution: image side in pixels (``model.resolution``); None or 0 = the backend's default
            (tiny: its own size, which is the only one it accepts; sd3/flux: 512).
    """
    from tpgrpo.models.resident import take

    held = take(kind, path, device, dtype, resolution)  # the stage server's copy, when this stage forked from it
    if held is not None:
        return held
    if kind == "tiny":
        from tpgrpo.errors import PipelineError
        from tpgrpo.models.tiny import load_tiny

        backend = load_tiny(path, device=device, dtype=parse_dtype(dtype))
        if resolution and resolution != backend.latent_shape[-1]:
            raise PipelineError(f"model.resolution = {resolution}: the tiny model at {path} makes "
                                f"{backend.latent_shape[-1]}-pixel images (expected 0 or {backend.latent_shape[-1]})")
        return backend
    if kind == "sd3":
        from tpgrpo.models.sd3 import load_sd3

        return load_sd3(path, device=device, dtype=parse_dtype(dtype), resolution=resolution)
    if kind == "flux":
        from tpgrpo.models.flux import load_flux

        return load_flux(path, device=device, dtype=parse_dtype(dtype), resolution=resolution)
    raise ValueError(f"unknown backend kind {kind!r}; expected one of {list(BACKEND_KINDS)}")
