"""The two test layers are wired as the README says: `make test` is the fast layer (no slow test), `make
test-all` is every test, CI runs `make test-all`, and what the Makefile runs is installed by the project."""

from __future__ import annotations

import re
import shlex
import tomllib

from conftest import REPO


def make_target(name: str) -> str:
    """The recipe of Makefile target ``name`` with its variables expanded, as one string."""
    text = (REPO / "Makefile").read_text()
    variables = dict(re.findall(r"^([A-Z_]+) :?= (.*)$", text, flags=re.M))
    recipe = re.search(rf"^{re.escape(name)}: [^\n]*\n((?:\t[^\n]*\n)+)", text, flags=re.M)
    assert recipe, f"Makefile has no target {name}"
    return re.sub(r"\$\((\w+)\)", lambda m: variables.get(m.group(1), m.group(0)), recipe.group(1))


def pytest_args(recipe: str) -> list[str]:
    """The arguments after ``python -m pytest`` in a recipe."""
    words = shlex.split(recipe)
    return words[words.index("pytest") + 1:]


def test_make_test_leaves_out_the_slow_tests_and_make_test_all_runs_them():
    fast, every = (pytest_args(make_target(name)) for name in ("test", "test-all"))
    assert fast[fast.index("-m") + 1] == "not slow"
    assert "-m" not in every and "-k" not in every and not any(a.startswith("tests/") for a in every)


def test_ci_runs_every_test_and_the_readme_names_both_layers():
    ci = (REPO / ".ci" / "run").read_text()
    assert re.search(r"^make test-all$", ci, flags=re.M)
    readme = (REPO / "README.md").read_text()
    assert "make test " in readme and "make test-all" in readme


def test_the_workers_the_makefile_asks_for_are_a_declared_dependency():
    extras = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]["optional-dependencies"]["test"]
    assert "-n" in pytest_args(make_target("test"))
    assert any(req.startswith("pytest-xdist") for req in extras)
