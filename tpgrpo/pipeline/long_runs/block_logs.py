"""A sealed block's log digest: what the summary of a sealed block depends on.

The summary reads every iteration's stage JSONs (``rollout.json`` ... ``eval.json``) and eval table. For open
iterations dvc.yaml lists them as the summary's dependencies; a sealed block stood for its iterations with
its last credit table alone, so a re-run of the block that changed only a logged number (approx KL, grad
norm) left ``summary.json`` and the curves stale. The block now also writes
``data/iters/<last iteration>/block_logs.json``: the md5 of each file of its iterations the summary reads. It is an output
of the block's stage (rewritten by ``tpgrpo block`` after its stages and at sealing) and the summary's
dependency, so any re-run of a block re-runs the summary.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tpgrpo.pipeline.long_runs.blocks import Block
from tpgrpo.stage_params import SUMMARY, outputs_read_by

READ_BY_SUMMARY = outputs_read_by(SUMMARY)  # tpgrpo.stage_params.ITERATION_STAGES


def digest_path(block: Block) -> str:
    """The digest's path relative to the project root."""
    return f"data/iters/{block.last:04d}/block_logs.json"  # in an iteration folder, as every block output


def write_digest(root: Path, block: Block) -> Path:
    """Write the block's digest: ``{"NNNN/name": md5 or null (missing)}`` over its iterations."""
    from tpgrpo.io.artifacts import atomic_path

    files = {}
    for i in block.iterations:
        for name in READ_BY_SUMMARY:
            path = root / "data" / "iters" / f"{i:04d}" / name
            files[f"{i:04d}/{name}"] = hashlib.md5(path.read_bytes()).hexdigest() if path.is_file() else None
    out = root / digest_path(block)
    with atomic_path(out) as tmp:
        tmp.write_text(json.dumps(files, indent=0, sort_keys=True) + "\n")
    return out
