"""The results page: every archived comparison's verdicts on one generated Markdown page.

``write_page([results/A, results/B, ...], results/README.md)`` writes an index (one row per archive: its
rewards, arms, seeds, base model and how many claims each verdict got), the method once, and per archive the
report's section (:func:`tpgrpo.comparison.report.section`) without its command lines and code commits, which
stay in the archive's ``commands.txt`` and ``code/``. Figures go to ``figures/`` beside the page.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import pandas as pd

from tpgrpo.comparison.method import method_text
from tpgrpo.comparison.report import _table, section
from tpgrpo.comparison.results import N_BOOT
from tpgrpo.comparison.runs import discover
from tpgrpo.io.artifacts import atomic_path

VERDICTS = ("confirmed", "refuted", "not detectable", "one seed: a hint for", "one seed: a hint against",
            "not comparable", "not run")


def _anchor(root: Path) -> str:
    """GitHub's anchor of the section heading ``## `results/NAME`: training reward ...``."""
    heading = f"{root}: training reward"
    return "".join(c for c in heading.lower().replace(" ", "-") if c.isalnum() or c in "-_")


def index_row(root: Path) -> tuple:
    """One archive's row of the index: name (linked), rewards, arms, seeds, verdict counts."""
    runs = discover(root)
    task = runs[0]["params"]["task"]
    arms = list(dict.fromkeys(r["variant"] for r in runs))
    seeds = sorted({int(r["seed"]) for r in runs})
    claims = pd.read_csv(Path(root) / "tables" / "claims.csv") if (Path(root) / "tables" / "claims.csv").is_file() \
        else pd.DataFrame(columns=["verdict"])
    counts = claims["verdict"].value_counts()
    verdicts = ", ".join(f"{v} {int(counts[v])}" for v in VERDICTS if v in counts) or "-"
    rewards = task["reward"] + ("" if task["eval_reward"] == "geneval" else f" / {task['eval_reward']}")
    return (f"[{Path(root).name}](#{_anchor(root)})", rewards, ", ".join(arms), f"{len(seeds)} ({seeds[0]}-{seeds[-1]})",
            verdicts)


def write_page(roots: Sequence[Path], md_path: Path, command: str = "", n_boot: int = N_BOOT) -> Path:
    """Write the results page ``md_path`` and its figures (``figures/`` beside it) for the archives ``roots``."""
    md_path = Path(md_path)
    fig_dir = md_path.parent / "figures"
    fig_dir.mkdir(parents=True, exist_ok=True)
    sections = []
    for root in roots:
        sections += section(Path(root), fig_dir, md_path.parent, n_boot, lab=False)
    lines = ["# Results: every archived comparison and its verdicts", "",
             "Generated from the compact archives in this folder" + (f" by `{command}`" if command else "")
             + "; every number, verdict and figure below is recomputed from each archive's `runs.parquet` and "
             "`evals.parquet`. An archive's own tables (curves, pairs, claims) are in its `tables/`; the experiment "
             "logs that planned and read these runs are in [journal/](journal/).", "",
             "Held-out rewards are `geneval` unless a section names another. Claims are \"A beats B\"; their "
             "verdicts come from the interval of A - B over training seeds and prompts (method below).", "",
             *_table(("archive", "training / held-out reward", "arms", "training seeds", "claims' verdicts"),
                     [index_row(Path(r)) for r in roots]), "",
             "## How the numbers are made", "", method_text(n_boot), *sections]
    with atomic_path(md_path) as tmp:
        tmp.write_text("\n".join(lines).rstrip() + "\n")
    return md_path
