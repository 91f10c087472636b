"""The slow adapter of the forward-process objectives (``update.objective`` nft / awm, docs/objectives.md):
DiffusionNFT's old policy (it samples the next rollout and anchors the implicit policies) or AWM's EMA (a
regulariser). It is a LoRA adapter folder inside the policy folder, ``policy/slow/``: an output of the update
that the next iteration's rollout and update read through their dependency on the previous policy, so a stage
re-run by hand rewrites it byte for byte and ``dvc status`` stays exact.
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Iterator

import torch

from tpgrpo.errors import PipelineError
from tpgrpo.io.artifacts import IterationPaths
from tpgrpo.policy.lora import WEIGHTS_FILE, load_lora_weights, lora_state_dict, read_adapter_weights

SLOW_FOLDER = "slow"  # in a policy folder (beside ema/)


def previous_slow(root, iteration: int, backend) -> dict[str, torch.Tensor]:
    """The slow adapter iteration ``iteration`` starts from: policy ``iteration - 1``'s ``slow/`` weights, or at
    iteration 1 a copy of the backend's freshly attached LoRA (lora_B = 0: the base model). A policy trained
    under ``update.objective: grpo`` has none: one line saying so."""
    previous = IterationPaths(root, iteration).previous()
    if previous is None:
        return lora_state_dict(backend)
    folder = previous.policy / SLOW_FOLDER
    if not (folder / WEIGHTS_FILE).is_file():
        raise PipelineError(f"{folder / WEIGHTS_FILE} is missing: policy {iteration - 1} was not trained under "
                            f"update.objective nft or awm (re-run `tpgrpo stage update --iter {iteration - 1}`)")
    weights = read_adapter_weights(folder)
    device = next(iter(lora_state_dict(backend).values())).device
    return {k: v.to(device) for k, v in weights.items()}


def load_sampling_adapter(cfg, root, iteration: int, backend) -> None:
    """Under ``update.objective: nft`` the rollout samples with the old adapter: load policy ``iteration - 1``'s
    slow weights into ``backend`` (nothing at iteration 1, where both are the base model). Other objectives sample
    with the policy itself: nothing to do."""
    if cfg.update.objective != "nft" or IterationPaths(root, iteration).previous() is None:
        return
    load_lora_weights(backend, previous_slow(root, iteration, backend))


@contextmanager
def weights_applied(backend, weights: dict[str, torch.Tensor] | None) -> Iterator[None]:
    """Run with the LoRA weights ``weights`` loaded (the current ones restored on exit, exactly); None: as is.
    For no-gradient passes only (the old adapter's, the EMA's velocity)."""
    if weights is None:
        yield
        return
    saved = lora_state_dict(backend)
    load_lora_weights(backend, weights)
    try:
        yield
    finally:
        load_lora_weights(backend, saved)
