"""Archives of a comparison: the result files only, in two Parquet tables, and the same report from them as from
the run folders."""

from __future__ import annotations

import json

import pandas as pd
import pytest
from test_comparison import make_comparison

from tpgrpo.comparison import store
from tpgrpo.comparison.archive import MARKER, refuse_archive, write_archive
from tpgrpo.comparison.compact import held_files, result_files
from tpgrpo.comparison.claims import collect
from tpgrpo.errors import PipelineError


def comparison_with_artifacts(root):
    """make_comparison's runs plus what a real root also holds: code, a code record, commands, trajectories."""
    make_comparison(root)
    (root / "code" / "tpgrpo").mkdir(parents=True)
    (root / "code" / "tpgrpo" / "cli.py").write_text("# code\n")
    (root / "code" / "SNAPSHOT.json").write_text(json.dumps({"commit": "abc", "time": "then"}))
    (root / "commands.txt").write_text("python bench/compare_modes.py run --out cmp\n")
    zarr = root / "tp" / "seed0" / "data" / "iters" / "0001" / "trajectories.zarr"
    zarr.mkdir()
    (zarr / "chunk").write_bytes(b"\0" * 100_000)
    (root / "tp" / "seed0" / "data" / "iters" / "0001" / "credit.parquet").write_bytes(b"x")


def test_an_archive_keeps_the_result_files_only_and_reports_the_same(tmp_path):
    root, dest = tmp_path / "cmp", tmp_path / "docs" / "cmp"
    comparison_with_artifacts(root)
    record = write_archive(root, dest)
    on_disk = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    assert on_disk == {MARKER, "runs.parquet", "evals.parquet", "code/SNAPSHOT.json", "commands.txt"}
    kept = held_files(dest)
    assert kept == sorted(result_files(root))
    assert "tp/seed0/run.json" in kept and "tp/seed0/data/iters/baseline_eval.parquet" in kept
    assert "tp/seed0/data/iters/0004/eval.parquet" in kept and "tp/seed0/data/iters/0004/credit.json" in kept
    assert not any("trajectories" in k or "credit.parquet" in k or k.startswith("code/tpgrpo") for k in kept)
    for rel in kept:  # every file reads back as it was
        if rel.endswith(".parquet"):  # an empty table (an iteration not evaluated): its columns
            want, got = pd.read_parquet(root / rel), store.read_table(dest / rel)
            pd.testing.assert_frame_equal(got, want, check_dtype=len(want) > 0)
        else:
            assert store.read_text(dest / rel) == (root / rel).read_text(), rel
    assert record["runs"] == 6 and record["files"] == len(kept)
    assert json.loads((dest / MARKER).read_text())["source"] == str(root)
    runs = pd.read_parquet(dest / "runs.parquet")  # typed curves for pandas beside the files' texts
    assert runs.loc[(runs["variant"] == "tp") & (runs["seed"] == 0), "iteration"].tolist() == [0, 1, 2, 3, 4]
    assert runs["eval_reward"].notna().any() and json.loads(runs["credit.json"].dropna().iloc[0])

    original, archived = collect(root, n_boot=300), collect(dest, n_boot=300)
    for name in ("curves", "tp_rates", "pairs", "claims"):
        pd.testing.assert_frame_equal(original[name], archived[name])
    assert (dest / "tables" / "claims.csv").is_file() and not (dest / "results").exists()


def test_a_result_that_would_not_read_back_leaves_no_archive(tmp_path, monkeypatch):
    """The check before the archive replaces anything: a table that loses a row is refused in one line."""
    from tpgrpo.comparison import compact

    root, dest = tmp_path / "cmp", tmp_path / "arch"
    comparison_with_artifacts(root)
    real = compact.tables_of
    monkeypatch.setattr(compact, "tables_of", lambda r: (lambda t: (t[0], t[1].iloc[1:]))(real(r)))
    with pytest.raises(PipelineError, match="reads back unlike"):
        write_archive(root, dest)
    assert not dest.exists()


def test_an_archive_in_the_older_per_file_layout_converts_with_its_record(tmp_path):
    """The older archives were the root's result files copied as they were: converted, their record stays."""
    import shutil

    root, old, dest = tmp_path / "cmp", tmp_path / "old", tmp_path / "new"
    comparison_with_artifacts(root)
    shutil.copytree(root, old, ignore=shutil.ignore_patterns("trajectories.zarr", "credit.parquet", "tpgrpo"))
    (old / MARKER).write_text(json.dumps({"source": "runs/cmp", "time": "then", "runs": 6, "files": 9, "bytes": 1}))
    record = write_archive(old, dest)
    assert record["source"] == "runs/cmp" and record["compacted"]["from"] == str(old)
    pd.testing.assert_frame_equal(collect(old, n_boot=200)["pairs"], collect(dest, n_boot=200)["pairs"])


def test_an_archive_is_not_trained_nor_archived_again_and_lands_outside_its_root(tmp_path):
    root, dest = tmp_path / "cmp", tmp_path / "arch"
    comparison_with_artifacts(root)
    with pytest.raises(PipelineError, match="inside the comparison root"):
        write_archive(root, root / "archive")
    with pytest.raises(PipelineError, match="no run folders"):
        write_archive(tmp_path / "empty", dest)
    assert not dest.exists()
    write_archive(root, dest)
    with pytest.raises(PipelineError, match="already a compact archive"):
        write_archive(dest, tmp_path / "again")
    refuse_archive(root)  # a real root: no error
    with pytest.raises(PipelineError, match="results only, nothing can be trained"):
        refuse_archive(dest)


def test_an_archive_keeps_the_stages_seconds_from_their_timing_sidecars(tmp_path):
    """A stage's seconds are in ``<stage>.timing.json`` beside its log, not in the log: the
    archive copies the sidecars, so the equal-wall seconds survive a fresh clone of an archived run; a log
    of an older run (its own wall_seconds) still reads."""
    from tpgrpo.comparison.runs import train_seconds

    root, dest = tmp_path / "cmp", tmp_path / "docs" / "cmp"
    make_comparison(root)
    run = root / "tp" / "seed0"
    before = train_seconds(run, 4)
    for log in sorted((run / "data" / "iters").glob("000[1-2]/*.json")):  # iterations 1-2: the new layout
        values = json.loads(log.read_text())
        (log.parent / f"{log.stem}.timing.json").write_text(json.dumps({"wall_seconds": values.pop("wall_seconds")}))
        log.write_text(json.dumps(values))
    assert train_seconds(run, 4) == before
    write_archive(root, dest)
    assert store.is_file(dest / "tp" / "seed0" / "data" / "iters" / "0001" / "rollout.timing.json")
    assert train_seconds(dest / "tp" / "seed0", 4) == before


def test_the_results_pages_are_an_index_and_one_page_per_archive(tmp_path):
    """``tpgrpo compare page``: the index links each archive's own page (its folder's README.md) and names its
    base model; each page holds that archive's section, links back, and its figures resolve from there."""
    from tpgrpo.comparison.page import write_page

    roots = []
    for name in ("a", "b"):
        comparison_with_artifacts(tmp_path / f"src-{name}")
        write_archive(tmp_path / f"src-{name}", tmp_path / "results" / name)
        roots.append(tmp_path / "results" / name)
    index = write_page(roots, tmp_path / "results" / "README.md", n_boot=200)
    text = index.read_text()
    assert "[a](a/README.md)" in text and "[b](b/README.md)" in text and "## How the numbers are made" in text
    assert "### Paired differences" not in text  # the sections live on the archives' pages
    for root in roots:
        page = (root / "README.md").read_text()
        assert page.startswith("[All results](../README.md)") and f"## `{root}`" in page
        assert "### Paired differences" in page and "Base model: `" in page
        figures = [line[line.index("](") + 2:-1] for line in page.splitlines() if line.startswith("![")]
        assert figures and all((root / f).is_file() for f in figures), figures
