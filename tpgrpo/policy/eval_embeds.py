"""The held-out prompts' text embeddings, encoded once per run (stage ``eval_prompts``) and read by every
``eval`` and the ``baseline``, so those stages never load the text encoders (at real size CLIP-L, CLIP-G and
T5-XXL, about 10 GB in bf16: most of eval's load with T5, docs/real-size.md).

The images of an evaluation (each held-out prompt ``eval.samples_per_prompt`` times) are cut into the chunks
:func:`held_out` says; before this cache each chunk encoded its own prompt list (repeats included) with the
empty prompt in one batch. The cache stores exactly those encodings, one file per chunk
(``data/iters/eval_prompt_embeds/chunk_NNNN.safetensors``, :func:`tpgrpo.io.artifacts.write_embeddings`):
batched encoding need not be bitwise equal across batch compositions, so the chunks are the same and an eval
reading the cache samples from the same bytes as one that encodes (tests/test_eval_embeds.py compares the
tables).

A chunk file is used only when its metadata holds exactly that chunk's prompts and the hash of the ``model``
params; its tensors' sha256 is checked on read. A file that is missing or holds other prompts or model params
(an eval run by hand after a params edit, before ``eval_prompts`` ran again) is encoded again, with one line on
stderr: encoding the same chunk is the same computation, so the numbers do not change, only the load does. A
damaged file is one :class:`ArtifactError` line (DVC restores it from its cache on the next ``dvc repro``).
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

from tpgrpo.io.artifacts import EVAL_EMBEDS, EVAL_EMBEDS_LOG  # noqa: F401 - the folder and the stage's log


def held_out(cfg, root: Path) -> tuple[list[dict], list[tuple[int, int]]]:
    """``(image_metas, chunks)``: one prompt meta per evaluated image (each of the first ``eval.num_prompts``
    held-out prompts ``eval.samples_per_prompt`` times in a row) and the chunks ``[(first, end), ...]`` of at
    most ``rollout.batch_size`` images (whole prompts when one fits) that eval samples, encodes and scores
    together, the same on any process count. More prompts asked than the file holds is a one-line
    ``PipelineError`` (as ``rollout.prompts_per_iter`` is): cut silently, the eval would report a mean over
    fewer prompts than the params say."""
    from tpgrpo.errors import PipelineError
    from tpgrpo.io.artifacts import require
    from tpgrpo.distributed import row_chunks
    from tpgrpo.stage_common import resolve
    from tpgrpo.tasks.prompts import load_prompts

    metas = load_prompts(require(resolve(root, cfg.task.eval_prompts), "task.eval_prompts"))
    n = cfg.eval.num_prompts
    if n > len(metas):
        raise PipelineError(f"eval.num_prompts = {n} but task.eval_prompts {cfg.task.eval_prompts} has "
                            f"{len(metas)} prompts: expected at most {len(metas)}")
    metas = metas[:n]
    S = cfg.eval.samples_per_prompt
    image_metas = [m for m in metas for _ in range(S)]
    return image_metas, row_chunks(len(image_metas), S, cfg.rollout.batch_size)


def chunk_file(folder: Path, c: int) -> Path:
    """Chunk ``c``'s embeddings file in the cache folder."""
    return folder / f"chunk_{c:04d}.safetensors"


def chunk_key(cfg, prompts: list[str]) -> dict[str, str]:
    """The metadata a chunk file must hold to be used: the chunk's prompts (JSON list, one per image) and the
    hash of the ``model`` params but the device, an execution knob (kind, folder, dtype, resolution)."""
    from tpgrpo.stage_params import MODEL_PARAMS

    return {"prompts": json.dumps(list(prompts)), "model": cfg.params_hash(MODEL_PARAMS)}


def _tensors(embeds) -> dict:
    from tpgrpo.io.schemas import EMBEDDING_FIELDS

    return {name: getattr(embeds, name) for name in EMBEDDING_FIELDS if getattr(embeds, name) is not None}


def write_eval_embeddings(cfg, root: Path, backend) -> dict[str, int]:
    """Encode every chunk of :func:`held_out` with ``backend`` (one ``encode_prompts`` call per chunk, as eval
    did) and write the folder :data:`EVAL_EMBEDS` atomically: all files into a temporary sibling, then one
    rename. Returns ``{"chunks", "images"}`` (counts). Tensors: ``embeds (n, L, D)``, ``pooled (n, P)``,
    ``uncond_embeds (1, L, D)``, ``uncond_pooled (1, P)`` in the encoders' dtype, n the chunk's images."""
    import torch

    from tpgrpo.io.artifacts import atomic_path, write_embeddings

    image_metas, chunks = held_out(cfg, root)
    with atomic_path(root / EVAL_EMBEDS) as tmp:
        tmp.mkdir()
        for c, (a, b) in enumerate(chunks):
            prompts = [m["prompt"] for m in image_metas[a:b]]
            with torch.no_grad():
                embeds = backend.encode_prompts(prompts)
            write_embeddings(chunk_file(tmp, c), _tensors(embeds), chunk_key(cfg, prompts))
    return {"chunks": len(chunks), "images": len(image_metas)}


def chunk_embeddings(cfg, root: Path, backend, c: int, prompts: list[str]):
    """The ``PromptEmbeddings`` of chunk ``c`` (``prompts``: its images' prompts) on ``backend.device``: read
    from the cache when its file holds exactly these prompts and model params (sha256 checked), else encoded
    with ``backend`` (one line on stderr saying why). A damaged file is an ``ArtifactError``."""
    from tpgrpo.io.artifacts import read_embeddings
    from tpgrpo.io.schemas import EMBEDDING_FIELDS
    from tpgrpo.models.base import PromptEmbeddings

    path = chunk_file(root / EVAL_EMBEDS, c)
    cached = read_embeddings(path, chunk_key(cfg, prompts)) if path.is_file() else None
    if cached is not None:
        return PromptEmbeddings(**{name: cached[name].to(backend.device) if name in cached else None
                                   for name in EMBEDDING_FIELDS})
    why = "is missing" if not path.is_file() else "holds other prompts or model params"
    print(f"eval: {path.relative_to(root)} {why}: encoding chunk {c} again (run `tpgrpo stage eval_prompts` "
          "to cache it)", file=sys.stderr)
    return backend.encode_prompts(list(prompts))
