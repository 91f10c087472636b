"""Stage credit: a pure function of ``probe.parquet`` and the ``credit`` params (spec sections 5-6).

Needs no model, so every credit mode can be recomputed offline in seconds. For ``credit.mode: flow_grpo``
the probe stage wrote a table whose every ``Q_k`` is ``R_fin`` (spec section 5's flow_grpo row).
The shape comes from the probe table, checked against ``tree.enabled``; the work is its tables' module,
:mod:`tpgrpo.rollout_shape.chains` or :mod:`tpgrpo.rollout_shape.trees`. Writes ``credit.parquet`` (one row per
(trajectory, window step), or per edge of a tree) and ``credit.json``
(:func:`tpgrpo.algo.credit_table.credit_metrics`).
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo import rollout_shape
from tpgrpo.algo.credit_table import credit_metrics
from tpgrpo.config import Config
from tpgrpo.io.artifacts import IterationPaths, write_table
from tpgrpo.io.schemas import CREDIT
from tpgrpo.io.stage_logs import write_log
from tpgrpo.rollout_shape import chains, trees
from tpgrpo.stage_common import check_finite, provenance, stopwatch


def run(cfg: Config, iteration: int, root: Path) -> dict:
    paths = IterationPaths(root, iteration)
    metrics: dict = {"iteration": iteration}
    with stopwatch(metrics):
        tables = rollout_shape.implementation("credit", cfg, paths, chain=chains, tree=trees)
        probe = tables.read_probe(paths.probe)
        table = tables.credit_table(probe, cfg)
        check_finite("advantage", table["advantage"], f"credit of iteration {iteration}")
        N, K1 = probe["trajectory"].nunique(), probe["step"].nunique()
        write_table(paths.credit, table, CREDIT, provenance(cfg, iteration, "credit"), trajectories=N, steps=K1 - 1)
    metrics.update(credit_metrics(cfg, tables.trained_rows(table, probe)))
    write_log(paths.credit_metrics, metrics)
    return metrics
