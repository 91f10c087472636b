"""The compact archives under results/ give the same verdict tables as the per-file archives they replaced.

tests/data/old_reports/ holds the claims, pairs and headline tables every archive gave in its older layout
(see its README). Here the report's tables are recomputed from the compact archives (a copy, so the test
writes nothing into the repository) at the report's 10,000 bootstrap resamples and compared as the text the
report writes (12 significant digits): two archives in the fast suite, every archive in the slow one.
"""

from __future__ import annotations

import shutil
from pathlib import Path

import pandas as pd
import pytest

from tpgrpo.comparison.claims import collect

REPO = Path(__file__).resolve().parents[1]
OLD = REPO / "tests" / "data" / "old_reports"
KINDS = ("claims", "pairs", "headline")
ARCHIVES = sorted(p.name for p in (REPO / "results").iterdir() if (p / "runs.parquet").is_file())


def old_table(kind: str, archive: str) -> pd.DataFrame:
    table = pd.read_csv(OLD / f"{kind}.csv", dtype=str, keep_default_na=False)
    table = table[table.pop("archive") == archive].reset_index(drop=True)
    # a note on runs not comparable names their folders: the archive's path then, its copy's now
    table = table.apply(lambda c: c.str.replace(f"docs/replication/runs/{archive}", "ARCHIVE", regex=False))
    return table.loc[:, [c for c in table.columns if (table[c] != "").any() or len(table) == 0]]


def new_tables(archive: str, tmp_path: Path) -> dict[str, pd.DataFrame]:
    copy = tmp_path / archive
    shutil.copytree(REPO / "results" / archive, copy, ignore=shutil.ignore_patterns("tables"))
    collect(copy)  # writes copy/tables/*.csv as the report does
    out = {}
    for kind in KINDS:
        table = pd.read_csv(copy / "tables" / f"{kind}.csv", dtype=str, keep_default_na=False)
        table = table.apply(lambda c: c.str.replace(str(copy), "ARCHIVE", regex=False))
        out[kind] = table.loc[:, [c for c in table.columns if (table[c] != "").any() or len(table) == 0]]
    return out


def check_archive(archive: str, tmp_path: Path) -> None:
    new = new_tables(archive, tmp_path)
    for kind in KINDS:
        pd.testing.assert_frame_equal(new[kind], old_table(kind, archive), check_like=True, obj=f"{archive} {kind}")


REPORTED = sorted(set(pd.read_csv(OLD / "claims.csv", usecols=["archive"])["archive"]))  # had a report before
NEWER = [a for a in ARCHIVES if a not in REPORTED]  # archived since: their committed tables/ are the record


def test_every_archive_with_a_report_has_its_old_tables():
    assert len(REPORTED) == 24 and set(REPORTED) <= set(ARCHIVES)


def committed_tables(archive: str) -> dict[str, pd.DataFrame]:
    folder = REPO / "results" / archive / "tables"
    return {kind: pd.read_csv(folder / f"{kind}.csv", dtype=str, keep_default_na=False) for kind in KINDS}


@pytest.mark.slow
@pytest.mark.parametrize("archive", NEWER)
def test_a_newer_archive_gives_its_committed_tables(archive, tmp_path):
    """An archive made after the old reports: recomputed from its two tables, its committed claims, pairs and
    headline come back (the results page is generated from the same computation)."""
    copy = tmp_path / archive
    shutil.copytree(REPO / "results" / archive, copy, ignore=shutil.ignore_patterns("tables"))
    collect(copy)
    for kind, table in committed_tables(archive).items():
        new = pd.read_csv(copy / "tables" / f"{kind}.csv", dtype=str, keep_default_na=False)
        pd.testing.assert_frame_equal(new, table, check_like=True, obj=f"{archive} {kind}")


@pytest.mark.parametrize("archive", ["tree_geneval_lr1e-4", "compare_geneval"])
def test_a_compact_archive_gives_the_old_reports_numbers(archive, tmp_path):
    check_archive(archive, tmp_path)


@pytest.mark.slow
@pytest.mark.parametrize("archive", [a for a in REPORTED if a not in ("tree_geneval_lr1e-4", "compare_geneval")])
def test_every_compact_archive_gives_the_old_reports_numbers(archive, tmp_path):
    check_archive(archive, tmp_path)


def test_a_changed_eval_row_changes_the_numbers(tmp_path):
    """The comparison can fail: one run's held-out rewards raised by 0.01 move the pairs' numbers."""
    archive = "tree_geneval_lr1e-4"
    copy = tmp_path / archive
    shutil.copytree(REPO / "results" / archive, copy, ignore=shutil.ignore_patterns("tables"))
    evals = pd.read_parquet(copy / "evals.parquet")
    trained = (evals["variant"] == "flow_grpo") & (evals["train_seed"] == 0) & (evals["iteration"] > 0)
    assert trained.any()
    evals.loc[trained, "eval_reward"] += 0.01
    evals.to_parquet(copy / "evals.parquet", index=False)
    collect(copy)
    table = pd.read_csv(copy / "tables" / "pairs.csv", dtype=str, keep_default_na=False)
    old = old_table("pairs", archive)
    assert not table["reward_diff"].equals(old["reward_diff"])
