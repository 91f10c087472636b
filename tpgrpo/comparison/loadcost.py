"""Model loading in a comparison's training seconds: measured once per root, taken out for the equal-wall pair.

A stage's ``wall_seconds`` include loading the model (``tpgrpo.policy.loading.load_policy``: the backend from
disk, the LoRA policy attached). tp loads it three times per iteration (rollout, probe, update) and
flow_grpo twice (its probe runs no model), so on a GPU, where a load costs seconds to minutes, fixed costs
make tp look dearer per iteration than its work is. ``measure`` times the load in one of the root's run
folders, on this machine, and writes ``OUT/load_cost.json``; ``with_net_seconds`` then gives every curve row
its seconds without loading (``train_seconds - model_loads x load_seconds``), which the ``equal_wall_net``
pair plans with.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path

import numpy as np
import pandas as pd

from tpgrpo.errors import PipelineError

LOAD_FILE = "load_cost.json"


def measure(folder: Path, iterations: list[int], repeats: int, threads: int) -> dict:
    """Seconds ``load_policy`` takes in the run folder ``folder`` for each of ``iterations`` (policy i - 1's
    adapter; once as the rollout loads it, once trainable as the update does), ``repeats`` times each after
    one untimed warm-up load, in a process that imported torch, diffusers, transformers and peft first (as
    the stage server has before a stage forks). Returns the record: the median as ``load_seconds``."""
    import diffusers  # noqa: F401 - imported before timing, as in the stage server
    import peft  # noqa: F401
    import torch
    import transformers  # noqa: F401

    from tpgrpo.config import load_config
    from tpgrpo.policy.loading import load_policy

    torch.set_num_threads(threads)
    cfg = load_config(folder / "params.yaml")
    missing = [i for i in iterations if i > 1 and not (folder / "data" / "iters" / f"{i - 1:04d}" / "policy").is_dir()]
    if missing or repeats < 1:
        raise PipelineError(f"{folder}: no policy adapter for iterations {missing} (or repeats < 1): measure in "
                            "a run folder whose iterations are trained")
    start = time.perf_counter()
    load_policy(cfg, folder, iterations[0])
    first, samples = time.perf_counter() - start, []
    for _ in range(repeats):
        for i in iterations:
            for trainable in (False, True):
                start = time.perf_counter()
                load_policy(cfg, folder, i, trainable=trainable)
                samples.append(time.perf_counter() - start)
    return {"load_seconds": round(float(np.median(samples)), 4), "min": round(min(samples), 4),
            "max": round(max(samples), 4), "first_load_seconds": round(first, 4), "loads_timed": len(samples),
            "iterations": iterations, "threads": threads, "load_average_1min": round(os.getloadavg()[0], 2),
            "folder": f"{folder.parent.name}/{folder.name}", "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def load_record(out: Path) -> dict | None:
    path = Path(out) / LOAD_FILE
    return json.loads(path.read_text()) if path.is_file() else None


def with_net_seconds(curves: pd.DataFrame, record: dict | None) -> pd.DataFrame:
    """``curves`` with ``net_seconds`` (an iteration's training seconds less its model loads x the measured
    load seconds; iteration 0: 0) and ``net_cum_seconds`` (their sum per run); NaN without a record."""
    out = curves.copy()
    if record is None:
        out["net_seconds"] = out["net_cum_seconds"] = np.nan
        return out
    net = out["train_seconds"] - out["model_loads"].fillna(0) * float(record["load_seconds"])
    out["net_seconds"] = net.where(out["iteration"] > 0, 0.0)
    out["net_cum_seconds"] = out.groupby(["variant", "seed"], sort=False)["net_seconds"].cumsum()
    return out
