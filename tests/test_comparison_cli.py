"""`tpgrpo compare` through typer's CliRunner: the sub-app is reachable from the main CLI, errors are one
line, an archive is reported and never trained, and bench/compare_modes.py is only an alias."""

from __future__ import annotations

import subprocess
import sys

from conftest import REPO, make_tiny_project
from test_comparison_archive import comparison_with_artifacts
from typer.testing import CliRunner

from tpgrpo.cli import app
from tpgrpo.comparison.archive import MARKER, write_archive


def compare(*args: str):
    """``tpgrpo compare ARGS`` in this process."""
    return CliRunner().invoke(app, ["compare", *args])


def test_compare_lists_its_six_commands_and_the_main_help_lists_compare():
    res = compare("--help")
    assert res.exit_code == 0
    for name in ("run", "equal-wall", "status", "report", "archive", "load-cost"):
        assert name in res.stdout
    top = CliRunner().invoke(app, ["--help"])
    assert top.exit_code == 0 and "compare" in top.stdout


def test_bad_override_is_one_line_and_writes_nothing(tmp_path, tiny_model_dir):
    base = make_tiny_project(tmp_path / "base", tiny_model_dir)
    out = tmp_path / "out"
    res = compare("run", "--base", str(base), "--out", str(out), "--set", "sampling.noise_levle=0.5")
    assert res.exit_code == 2 and not out.exists()
    assert res.stderr.strip().count("\n") == 0 and "sampling.noise_levle" in res.stderr


def test_archive_then_status_report_and_a_refused_run(tmp_path):
    root, dest = tmp_path / "cmp", tmp_path / "arch"
    comparison_with_artifacts(root)
    res = compare("archive", "--results", str(root), "--to", str(dest))
    assert res.exit_code == 0 and f"{dest}: " in res.stdout and (dest / MARKER).is_file()
    before = sorted(dest.rglob("*"))
    res = compare("run", "--base", str(REPO), "--out", str(dest), "--modes", "tp", "--seeds", "0")
    assert res.exit_code == 2 and res.stderr.strip().count("\n") == 0 and MARKER in res.stderr
    assert sorted(dest.rglob("*")) == before, "a refused run writes nothing"
    status = compare("status", "--out", str(dest))
    assert "tp/seed0: archived (4/4 iterations)" in status.stdout
    assert "flow_grpo/seed0: archived (8/8 iterations)" in status.stdout
    report = tmp_path / "report.md"
    res = compare("report", "--results", str(dest), "--out", str(report), "--n-boot", "200")
    assert res.exit_code == 0, res.stdout + res.stderr
    text = report.read_text()
    assert "`tpgrpo compare archive`" in text and "python bench/compare_modes.py run --out cmp" in text


def test_status_of_an_empty_folder_is_a_one_line_error(tmp_path):
    res = compare("status", "--out", str(tmp_path))
    assert res.exit_code == 2 and "no run folders" in res.stderr and res.stderr.strip().count("\n") == 0


def test_bench_compare_modes_is_an_alias(tmp_path):
    code = [line for line in (REPO / "bench" / "compare_modes.py").read_text().splitlines()
            if line.strip() and not line.startswith(('"""', "if __name__"))]
    assert code == ["    from tpgrpo.comparison.cli import app; app()  # noqa: E702"]
    res = subprocess.run([sys.executable, str(REPO / "bench" / "compare_modes.py"), "status", "--out",
                          str(tmp_path)], capture_output=True, text=True)
    assert res.returncode == 2 and "no run folders" in res.stderr
