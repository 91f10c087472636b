"""Stage summary: the run at a glance, for `dvc metrics show`, `dvc plots show` and the README's figures.

Writes under ``data/metrics/``: ``history.csv`` (one row per iteration of every stage's metrics; the base
model is iteration 0), ``eval_curve.csv`` (base + every evaluated iteration), ``train_curve.csv`` (one row
per iteration) and ``summary.json`` (the dozen numbers a user scans) and, as the run's DVC metrics, the same as
a small quantity x (base, latest, best) table (:data:`tpgrpo.stage_params.GLANCE`), all cut from
:mod:`tpgrpo.reports.history`; then the figures in ``data/reports/`` (:mod:`tpgrpo.reports.figures`, also
``tpgrpo plot``).
"""

from __future__ import annotations

import json
from pathlib import Path

import pandas as pd

from tpgrpo.config import Config
from tpgrpo.io.artifacts import atomic_path, write_json
from tpgrpo.reports.figures import make_figures
from tpgrpo.reports.history import at_a_glance, eval_curve, headline, history, summary_log_path, train_curve
from tpgrpo.stage_common import stopwatch


def _write_csv(path: Path, frame: pd.DataFrame) -> None:
    with atomic_path(path) as tmp:
        frame.to_csv(tmp, index=False)


def run(cfg: Config, iteration: int | None, root: Path) -> dict:
    log: dict = {"stage": "summary"}
    with stopwatch(log):
        frame = history(cfg, root)
        out = root / "data" / "metrics"
        evals, train = eval_curve(frame), train_curve(frame)
        _write_csv(out / "history.csv", frame)
        _write_csv(out / "eval_curve.csv", evals)
        _write_csv(out / "train_curve.csv", train)
        summary = headline(evals, train)
        write_json(out / "summary.json", summary)
        for name, values in at_a_glance(evals, train).items():
            write_json(out / f"{name}.json", values)
        log["figures"] = [p.name for p in make_figures(cfg, root, frame)]
    # Its own seconds (it samples the base and last policies for the figures), as every stage logs them: a
    # log, not a DVC output (summary.json stays the same bytes for the same run).
    write_json(summary_log_path(root), log)
    print(json.dumps(summary, indent=2))
    return summary
