"""Stage eval: ODE sampling of held-out prompts with the policy that iteration ``--iter`` produced.

Writes ``eval.json`` (mean reward and strict accuracy under the eval and training rewards) and
``eval.parquet`` (one row per held-out prompt and eval seed; no rows when ``eval.every`` skips the
iteration). The work is :func:`tpgrpo.policy.evaluation.run_eval`.
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.config import Config
from tpgrpo.policy.evaluation import run_eval


def run(cfg: Config, iteration: int, root: Path) -> dict:
    return run_eval(cfg, iteration, root)
