"""A policy folder: the LoRA adapter, its EMA and the training state (optimizer moments, EMA, step), written
atomically and read back verified, so that resuming an update is exact.

Layout of ``data/iters/NNNN/policy/``: the adapter at the top level (:mod:`tpgrpo.policy.lora`), ``ema/`` (the EMA
weights as an adapter, with ``update.ema``), ``training_state.pt`` and ``sha256.json`` over the folder's files.
"""

from __future__ import annotations

from pathlib import Path

import torch

from tpgrpo.errors import PipelineError
from tpgrpo.io.artifacts import atomic_path, first_line, verify_file, write_manifest
from tpgrpo.io.schemas import ArtifactError
from tpgrpo.policy.export import EMA_FOLDER
from tpgrpo.policy.lora import LoraEMA, save_adapter

TRAINING_STATE_FILE = "training_state.pt"


def optimizer_step_count(optimizer) -> int:
    """Optimizer steps taken so far (AdamW's per-parameter ``step``; 0 before the first step)."""
    for group in optimizer.param_groups:
        for p in group["params"]:
            if "step" in optimizer.state.get(p, {}):
                return int(optimizer.state[p]["step"])
    return 0


def save_training_state(folder, optimizer, ema: LoraEMA | None, step: int | None = None) -> Path:
    """Write ``folder/training_state.pt`` (optimizer state, EMA state, global ``step``), atomically.

    ``step`` defaults to the optimizer's own step count (``optimizer_step_count``).
    """
    path = Path(folder) / TRAINING_STATE_FILE
    step = optimizer_step_count(optimizer) if step is None else step
    state = {"format": 1, "step": int(step), "optimizer": optimizer.state_dict(),
             "ema": None if ema is None else ema.state_dict()}
    with atomic_path(path) as tmp:
        torch.save(state, tmp)
    write_manifest(path.parent)  # the folder's sha256.json now covers the state too
    return path


def load_training_state(folder, optimizer, ema: LoraEMA | None = None) -> int:
    """Restore what ``save_training_state`` wrote; returns the saved global ``step``.

    The optimizer's moments and step counts are restored exactly; its hyperparameters (lr, weight
    decay, ...) stay those it was built with (the current config). An EMA given here but absent
    from the file keeps its fresh start (a copy of the current weights).
    """
    path = Path(folder) / TRAINING_STATE_FILE
    if not path.is_file():
        raise PipelineError(f"missing training state {path} (written by the previous update stage)")
    verify_file(path)  # against the folder's sha256.json: damage is one line, before unpickling
    try:
        state = torch.load(path, map_location="cpu", weights_only=True)
        optimizer_state, step = state["optimizer"], int(state["step"])
    except Exception as exc:  # noqa: BLE001 - torch raises zip, pickle and runtime errors on a damaged file
        raise ArtifactError(f"{path}: not a readable training state ({first_line(exc)})") from None
    hyper = [{k: v for k, v in g.items() if k != "params"} for g in optimizer.param_groups]
    try:
        optimizer.load_state_dict(optimizer_state)
    except (ValueError, KeyError) as exc:
        raise ArtifactError(f"{path}: its optimizer state does not fit this policy's LoRA weights "
                            f"({first_line(exc)})") from None
    for group, saved in zip(optimizer.param_groups, hyper):
        group.update(saved)
    if ema is not None and state.get("ema") is not None:
        ema.load_state_dict(state["ema"])
    return step


def save_policy(folder, backend, optimizer, ema: LoraEMA | None, step: int | None = None,
                slow: dict[str, torch.Tensor] | None = None) -> Path:
    """Write the whole policy folder atomically: the adapter (top level, see ``tpgrpo.policy.lora``),
    ``ema/`` (the EMA weights as an adapter, when ``ema`` is given), ``slow/`` (the slow adapter of
    ``update.objective`` nft / awm, when ``slow`` is given: ``tpgrpo.policy.slow_adapter``) and
    ``training_state.pt``."""
    folder = Path(folder)
    with atomic_path(folder) as tmp:
        save_adapter(backend, tmp)
        if ema is not None:
            ema.save_adapter(backend, tmp / EMA_FOLDER)
        if slow is not None:
            from tpgrpo.policy.slow_adapter import SLOW_FOLDER

            save_adapter(backend, tmp / SLOW_FOLDER, state_dict={k: v.cpu() for k, v in slow.items()})
        save_training_state(tmp, optimizer, ema, step)
    return folder
