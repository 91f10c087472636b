"""Stage eval_prompts: encode the held-out prompts once per run, for every eval and the baseline.

Writes ``data/iters/eval_prompt_embeds/`` (one ``chunk_NNNN.safetensors`` per chunk of images eval samples
together; :mod:`tpgrpo.policy.eval_embeds`), so the eval stages never load the text encoders, and its log
``data/iters/eval_prompts.json`` (chunks, images, seconds; docs/metrics.md). Loads the base model without an
adapter (LoRA sits on the transformer only: the text encoders are the base model's in every policy). One
process: the encoders run once, on ``model.device``.
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.config import Config
from tpgrpo.io.stage_logs import write_log
from tpgrpo.policy.eval_embeds import EVAL_EMBEDS_LOG, held_out, write_eval_embeddings
from tpgrpo.stage_common import resolve, stopwatch


def run(cfg: Config, iteration: int | None, root: Path) -> dict:  # noqa: ARG001 - once per run
    from tpgrpo.models import load_backend
    from tpgrpo.distributed import is_main_process

    metrics: dict = {"stage": "eval_prompts"}
    if not is_main_process():  # a single-process stage; should a launcher start several, one writes
        return metrics
    with stopwatch(metrics):
        held_out(cfg, root)  # a bad eval.num_prompts: one line before the model loads, not after
        backend = load_backend(cfg.model.kind, resolve(root, cfg.model.path), cfg.model.device, cfg.model.dtype,
                               resolution=cfg.model.resolution)
        metrics.update(write_eval_embeddings(cfg, root, backend))
    write_log(root / EVAL_EMBEDS_LOG, metrics)
    return metrics
