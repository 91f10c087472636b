"""Image generation with the ODE sampler (any ``FlowBackend``), prompt-set evaluation and image grids.

Not to be confused with ``tpgrpo.algo.sampling``, the step maths (ODE, SDE and CPS steps, log-probs) this uses.

Sampling is Euler on the flow ODE over ``flow_sigmas(num_steps, shift)`` with classifier-free
guidance; a sample depends only on its prompt and its seed (not on the batch it runs in, up to
float round-off of batched matmuls). Devices as in ``tpgrpo.algo.trajectory``: the step maths runs on
``backend.device`` in float32; images come back as CPU numpy arrays.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import numpy as np


def sample_ode(backend, prompts: Sequence[str], seeds: Sequence[int], num_steps: int = 10,
               guidance_scale: float = 4.5, shift: float = 1.0, batch_size: int = 64,
               embeds=None) -> np.ndarray:
    """Images ``uint8 (N, H, W, 3)`` for ``prompts[i]`` started from the noise of ``seeds[i]``.

    Args:
        backend: a ``FlowBackend``.
        prompts, seeds: N prompts and N integer seeds (one per sample).
        num_steps: Euler steps T.
        guidance_scale: classifier-free guidance scale (1 = conditional only).
        shift: schedule shift of ``flow_sigmas`` (1 for the tiny model, 3 for SD3.5-M).
        batch_size: samples per forward pass (x2 inside the model with guidance).
        embeds: the ``PromptEmbeddings`` of ``prompts`` (N rows, e.g. read from a cache), used instead of
            encoding each batch; with N <= batch_size they are used as given (one batch).
    """
    import torch

    from tpgrpo.algo.sampling import ode_step
    from tpgrpo.algo.schedule import flow_sigmas
    from tpgrpo.algo.trajectory import velocity_at

    prompts, seeds = list(prompts), [int(s) for s in seeds]
    if len(prompts) != len(seeds):
        raise ValueError(f"got {len(prompts)} prompts but {len(seeds)} seeds")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if embeds is not None and len(embeds) != len(prompts):
        raise ValueError(f"got {len(prompts)} prompts but embeddings of {len(embeds)}")
    sigmas = flow_sigmas(num_steps, shift).tolist()
    out = []
    with torch.no_grad():
        for start in range(0, len(prompts), batch_size):
            chunk = prompts[start:start + batch_size]
            cond = _batch_embeddings(backend, chunk, embeds, start, len(prompts) <= batch_size)
            x = backend.initial_noise(seeds[start:start + batch_size]).to(backend.device, torch.float32)
            for s, s_next in zip(sigmas[:-1], sigmas[1:]):
                x = ode_step(x, velocity_at(backend, x, s, cond, guidance_scale), s, s_next)
            out.append(backend.decode(x))
    if not out:
        h, w = backend.latent_shape[1:]
        return np.zeros((0, h, w, 3), dtype=np.uint8)
    return np.concatenate(out)


def _batch_embeddings(backend, chunk: list[str], embeds, start: int, whole: bool):
    """The conditioning of one batch: ``chunk`` encoded, or rows ``start .. start + len(chunk)`` of the given
    ``embeds`` (all of them when ``whole``)."""
    if embeds is None:
        return backend.encode_prompts(chunk)
    if whole:
        return embeds
    return embeds.index(list(range(start, start + len(chunk))))


def evaluation_seeds(seed: int, metas: Sequence[dict], samples_per_prompt: int = 1) -> list[int]:
    """Per-image seeds of an evaluation: ``sample_seed(seed, 0, meta["id"], k, "eval")`` for the
    k-th sample of each prompt, so an image does not depend on which other prompts are evaluated."""
    from tpgrpo.algo.seeds import sample_seed

    return [sample_seed(seed, 0, str(m["id"]), k, "eval") for m in metas for k in range(samples_per_prompt)]


def evaluate_prompts(backend, metas: Sequence[dict], reward_name: str, num_steps: int = 10,
                     seed: int = 0, guidance_scale: float = 4.5, shift: float = 1.0,
                     batch_size: int = 64, samples_per_prompt: int = 1,
                     return_images: bool = False) -> dict:
    """Sample every prompt of ``metas`` with the ODE sampler and score it with a named reward.

    Returns a dict: ``reward_mean`` (float), ``strict_accuracy`` (fraction of strict successes),
    ``n`` (images scored), ``per_kind`` (``{kind: {reward_mean, strict_accuracy, n}}`` keyed by
    ``meta["kind"]``), the sampler settings, and ``images`` ``uint8 (n, H, W, 3)`` if asked.
    Image ``j`` is prompt ``j // samples_per_prompt`` with seed ``evaluation_seeds(...)[j]``.
    """
    from tpgrpo.tasks.rewards import get_reward

    metas_rep = [m for m in metas for _ in range(samples_per_prompt)]
    seeds = evaluation_seeds(seed, metas, samples_per_prompt)
    images = sample_ode(backend, [m["prompt"] for m in metas_rep], seeds, num_steps=num_steps,
                        guidance_scale=guidance_scale, shift=shift, batch_size=batch_size)
    result = get_reward(reward_name)(images, metas_rep)
    reward = np.asarray(result.reward, dtype=np.float64)
    strict = np.asarray(result.strict, dtype=bool)
    kinds = np.array([str(m.get("kind", "")) for m in metas_rep])
    per_kind = {}
    for kind in sorted(set(kinds.tolist())):
        sel = kinds == kind
        per_kind[kind] = {"reward_mean": float(reward[sel].mean()),
                          "strict_accuracy": float(strict[sel].mean()), "n": int(sel.sum())}
    out = {
        "reward_name": reward_name,
        "reward_mean": float(reward.mean()) if len(reward) else float("nan"),
        "strict_accuracy": float(strict.mean()) if len(strict) else float("nan"),
        "n": int(len(reward)),
        "per_kind": per_kind,
        "num_steps": num_steps, "guidance_scale": guidance_scale, "shift": shift, "seed": seed,
    }
    if return_images:
        out["images"] = images
    return out


def save_grid(images: np.ndarray, path, ncol: int = 8, upscale: int = 4, pad: int = 1) -> Path:
    """Write ``uint8 (N, H, W, 3)`` images as one PNG grid, ``ncol`` per row, each scaled by
    ``upscale`` (nearest neighbour, so pixels stay visible), ``pad`` white pixels between cells."""
    from PIL import Image

    images = np.asarray(images, dtype=np.uint8)
    if images.ndim != 4 or images.shape[-1] != 3 or len(images) == 0:
        raise ValueError(f"images must be a non-empty (N, H, W, 3) array, got shape {images.shape}")
    n, h, w, _ = images.shape
    ncol = max(1, min(ncol, n))
    nrow = -(-n // ncol)
    big_h, big_w = h * upscale, w * upscale
    grid = np.full((nrow * (big_h + pad) + pad, ncol * (big_w + pad) + pad, 3), 255, dtype=np.uint8)
    for i, img in enumerate(images):
        r, c = divmod(i, ncol)
        cell = img.repeat(upscale, axis=0).repeat(upscale, axis=1)
        y, x = pad + r * (big_h + pad), pad + c * (big_w + pad)
        grid[y:y + big_h, x:x + big_w] = cell
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    Image.fromarray(grid).save(path)
    return path
