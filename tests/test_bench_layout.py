"""``bench/`` is a package run as ``python -m bench.NAME``: no bench file edits ``sys.path``."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]


def path_edits(path: Path) -> list[int]:
    """Lines of ``path`` that touch ``sys.path`` (``sys.path.insert``, ``sys.path[:0] = ...``, ``append``, ...) or
    call ``site.addsitedir``: any use of the attribute counts, reading it too, so no edit hides behind a name."""
    lines = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) and (
                (node.value.id == "sys" and node.attr == "path") or
                (node.value.id == "site" and node.attr == "addsitedir")):
            lines.append(node.lineno)
    return sorted(lines)


def test_the_check_sees_each_form(tmp_path):
    script = tmp_path / "s.py"
    script.write_text("import sys, site\nsys.path.insert(0, 'x')\nsys.path[:0] = ['y']\n"
                      "site.addsitedir('z')\np = sys.platform\n")
    assert path_edits(script) == [2, 3, 4]


def test_no_bench_file_edits_sys_path():
    files = [p for p in (REPO / "bench").rglob("*.py") if "__pycache__" not in p.parts]
    assert len(files) > 30
    bad = [f"{p.relative_to(REPO)}:{line}" for p in files for line in path_edits(p)]
    assert not bad, "bench files touching sys.path (run them as python -m bench.NAME): " + ", ".join(bad)
    assert (REPO / "bench" / "__init__.py").is_file() and (REPO / "bench" / "studies" / "__init__.py").is_file()


def test_a_study_runs_as_a_module_and_imports_its_sibling():
    """From the repository root (the usage lines' working directory) the scripts import as modules: a study
    its sibling (``prompt_kinds`` -> ``bench.studies.arm_pairs``), a bench ``bench.common``, with no path edit."""
    done = subprocess.run([sys.executable, "-c", "import bench.studies.power_plan, bench.studies.prompt_kinds, "
                           "bench.probe_cost, bench.tree_cost, bench.common; print('ok')"],
                          cwd=REPO, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]


def imported_roots(path: Path) -> set[str]:
    """Top-level module names ``path`` imports anywhere, inside functions too (lazy imports fail only when run)."""
    roots = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            roots.update(alias.name.split(".")[0] for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            roots.add(node.module.split(".")[0])
    return roots


def test_every_import_in_bench_resolves_from_the_repository_root():
    """A bench file that still imports a sibling by its bare name (``from bench_sd3 import ...``, left over from
    the ``sys.path`` days) fails only when that code path runs; here every import, lazy ones included, must
    resolve from the root as ``python -m bench.NAME`` sees it. Two kinds of file say where else they look:
    ``bench/paper_standin/`` runs inside stage processes with its own folder on PYTHONPATH (it is their
    ``sitecustomize``), and a script calling ``reexec_with_tests_helpers`` starts again with tests/ on it."""
    standin = REPO / "bench" / "paper_standin"
    looks_in = {"standin": {p.stem for p in standin.glob("*.py")},
                "tests": {p.stem for p in (REPO / "tests").glob("*.py")}}
    wanted: dict[str, list[str]] = {}
    for path in (p for p in (REPO / "bench").rglob("*.py") if "__pycache__" not in p.parts):
        also = (looks_in["standin"] if standin in path.parents else set()) | (
            looks_in["tests"] if "reexec_with_tests_helpers(" in path.read_text() else set())
        for root in imported_roots(path) - also:
            wanted.setdefault(root, []).append(str(path.relative_to(REPO)))
    probe = ("import importlib.util, sys\n"
             "print(' '.join(n for n in sys.argv[1:] if importlib.util.find_spec(n) is None))")
    done = subprocess.run([sys.executable, "-c", probe, *sorted(wanted)], cwd=REPO, capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0, done.stderr[-2000:]
    missing = {name: wanted[name] for name in done.stdout.split()}
    assert not missing, f"bench imports that do not resolve from the repository root (name: files): {missing}"
