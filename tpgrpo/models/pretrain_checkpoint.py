"""Resumable pretraining: one checkpoint file holding everything a run needs to go on bit for bit.

A checkpoint holds the live weights, AdamW's state, the EMA shadow and its count, every random state
(the noise generator, torch's global generator, numpy's data generator), the step count, the log rows and
the seconds spent so far. Resuming from it and training to the same step count gives the same weights as
an uninterrupted run (``tests/test_pretrain.py``), so pretraining can run in pieces of a few hours on a
shared machine. The checkpoint lives beside the model folder, never inside it: only the final base is
saved to the model folder (and committed); the checkpoint is deleted when the run completes.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np

# What must match between a checkpoint and the run that resumes it (else the schedule or data differ).
IDENTITY_KEYS = ("seed", "hparams", "config", "max_steps", "minutes")


def default_checkpoint_path(out_dir: Path) -> Path:
    """``data/base`` -> ``data/.base.pretrain-ckpt.pt`` (hidden, beside the model folder, git-ignored)."""
    return out_dir.parent / f".{out_dir.name}.pretrain-ckpt.pt"


def run_identity(run) -> dict:
    """The fields a resumed run must share with the checkpoint it resumes (see ``IDENTITY_KEYS``)."""
    from dataclasses import asdict

    return {"seed": run.seed, "hparams": run.hparams, "config": asdict(run.backend.config),
            "max_steps": run.max_steps, "minutes": run.minutes}


def save_checkpoint(run, rng: np.random.Generator, path: Path, elapsed_s: float) -> None:
    """Write ``run``'s full state and ``rng``'s state to ``path`` atomically (temp file, then rename)."""
    import torch

    state = {
        "identity": run_identity(run),
        "modules": [m.state_dict() for m in run.backend.modules()],
        "optimizer": run.opt.state_dict(),
        "ema": None if run.ema is None else {"shadow": run.ema.shadow, "n": run.ema.n},
        "noise_generator": run.gen.get_state(),
        "torch_rng": torch.get_rng_state(),
        "data_rng": rng.bit_generator.state,
        "n_steps": run.n_steps, "window": run.window, "log_rows": run.log_rows,
        "last_loss": run.last_loss, "elapsed_s": elapsed_s, "budget_changes": run.budget_changes,
    }
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f"{path.name}.tmp-{os.getpid()}")
    torch.save(state, tmp)
    os.replace(tmp, path)


def load_checkpoint(run, rng: np.random.Generator, path: Path, change_budget: bool = False) -> float:
    """Restore ``run`` and ``rng`` from ``path``; returns the seconds already spent.

    Raises ValueError (one line naming the file and the first differing field) when the checkpoint was
    written by a run with another seed, hyper-parameters, architecture or budget. With ``change_budget``
    a different step budget is taken instead and recorded in ``run.budget_changes`` (``{at_step,
    from_steps, to_steps}``): the lr schedule follows the new budget from that step on, so the run is
    reproduced by stopping a run of the old budget at that step (``stop_at_step``) and resuming.
    """
    import torch

    state = torch.load(path, map_location="cpu", weights_only=False)
    mine = run_identity(run)
    for key in IDENTITY_KEYS:
        theirs = state["identity"].get(key)
        if theirs != mine[key] and not (key == "max_steps" and change_budget and theirs and mine[key]):
            raise ValueError(f"{path}: checkpoint of another run ({key} = {theirs!r}, "
                             f"this run has {mine[key]!r}); delete it to start afresh")
    run.budget_changes = list(state.get("budget_changes", []))
    if state["identity"]["max_steps"] != mine["max_steps"]:
        run.budget_changes.append({"at_step": state["n_steps"], "from_steps": state["identity"]["max_steps"],
                                   "to_steps": mine["max_steps"]})
    for module, saved in zip(run.backend.modules(), state["modules"]):
        module.load_state_dict(saved)
    run.opt.load_state_dict(state["optimizer"])
    if run.ema is not None:
        for shadow, saved in zip(run.ema.shadow, state["ema"]["shadow"]):
            shadow.copy_(saved.to(shadow.device))
        run.ema.n = state["ema"]["n"]
    run.gen.set_state(state["noise_generator"])
    torch.set_rng_state(state["torch_rng"])
    rng.bit_generator.state = state["data_rng"]
    run.n_steps, run.window = state["n_steps"], list(state["window"])
    run.log_rows, run.last_loss = list(state["log_rows"]), state["last_loss"]
    return float(state["elapsed_s"])
