"""The results pages: an index of every archived comparison's verdicts, and one page per archive.

``write_page([results/A, results/B, ...], results/README.md)`` writes the index (one row per archive: its
rewards, arms, seeds, base model and how many claims each verdict got) and the method once, and beside each
archive's data its own ``README.md``: the report's section (:func:`tpgrpo.comparison.report.section`) without
its command lines and code commits, which stay in the archive's ``commands.txt`` and ``code/``. A page per
archive keeps each readable (one page held 1,800 lines) and shows when one browses the archive's folder.
Figures go to ``figures/`` beside the index.
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Sequence

import pandas as pd

from tpgrpo.comparison.method import method_text
from tpgrpo.comparison.archive import MARKER as ARCHIVE_MARKER
from tpgrpo.comparison.report import _table, base_model, section
from tpgrpo.comparison.results import N_BOOT
from tpgrpo.comparison.runs import discover
from tpgrpo.io.artifacts import atomic_path

VERDICTS = ("confirmed", "refuted", "not detectable", "one seed: a hint for", "one seed: a hint against",
            "not comparable", "not run")


def index_row(root: Path, md_dir: Path) -> tuple:
    """One archive's row of the index: name (linked to its page), rewards, arms, seeds, base model, verdict
    counts."""

    runs = discover(root)
    task = runs[0]["params"]["task"]
    arms = list(dict.fromkeys(r["variant"] for r in runs))
    seeds = sorted({int(r["seed"]) for r in runs})
    claims = pd.read_csv(Path(root) / "tables" / "claims.csv") if (Path(root) / "tables" / "claims.csv").is_file() \
        else pd.DataFrame(columns=["verdict"])
    counts = claims["verdict"].value_counts()
    verdicts = ", ".join(f"{v} {int(counts[v])}" for v in VERDICTS if v in counts) or "-"
    rewards = task["reward"] + ("" if task["eval_reward"] == "geneval" else f" / {task['eval_reward']}")
    marker = Path(root) / ARCHIVE_MARKER
    record = json.loads(marker.read_text()) if marker.is_file() else None
    link = os.path.relpath(Path(root) / PAGE, md_dir)
    return (f"[{Path(root).name}]({link})", rewards, ", ".join(arms), f"{len(seeds)} ({seeds[0]}-{seeds[-1]})",
            base_model(record, runs), verdicts)


PAGE = "README.md"  # each archive's own page, in its folder


def write_page(roots: Sequence[Path], md_path: Path, command: str = "", n_boot: int = N_BOOT) -> Path:
    """Write the index ``md_path``, each archive's own page (``README.md`` in its folder) and their figures
    (``figures/`` beside the index) for the archives ``roots``."""
    md_path = Path(md_path)
    fig_dir = md_path.parent / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    for root in roots:
        lines = [f"[All results]({os.path.relpath(md_path, root)})", "",
                 *section(Path(root), fig_dir, Path(root), n_boot, lab=False)]
        with atomic_path(Path(root) / PAGE) as tmp:
            tmp.write_text("\n".join(lines).rstrip() + "\n")
    lines = ["# Results: every archived comparison and its verdicts", "",
             "Generated from the compact archives in this folder" + (f" by `{command}`" if command else "")
             + "; every number, verdict and figure below is recomputed from each archive's `runs.parquet` and "
             "`evals.parquet`. An archive's own tables (curves, pairs, claims) are in its `tables/`; the experiment "
             "logs that planned and read these runs are in [journal/](journal/).", "",
             "Held-out rewards are `geneval` unless an archive's page names another. Claims are \"A beats B\"; their "
             "verdicts come from the interval of A - B over training seeds and prompts (method below).", "",
             *_table(("archive (its page)", "training / held-out reward", "arms", "training seeds", "base model",
                      "claims' verdicts"), [index_row(Path(r), md_path.parent) for r in roots]), "",
             "## How the numbers are made", "", method_text(n_boot)]
    with atomic_path(md_path) as tmp:
        tmp.write_text("\n".join(lines).rstrip() + "\n")
    return md_path
