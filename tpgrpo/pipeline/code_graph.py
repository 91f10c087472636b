"""Which project files a stage runs, derived from the imports of its module (not kept by hand).

A hand-kept list of each stage's code drifted (``seeds.py``, ``distributed.py``, ``config.py`` and the package
``__init__`` were in no manifest), so the code manifests now take each kind's files from the import graph:
starting from its stage modules, every ``import`` / ``from ... import`` of a project module (at module level
or inside a function), every string constant that names a project module (the reward registry imports its
model rewards by name), and every package ``__init__`` on the way. The command line that runs a stage
(``tpgrpo/__main__.py``, ``tpgrpo/cli.py``, the stage server's client) is followed only through the functions
that run a stage: their other commands import most of the package. ``tests/test_code_manifest.py`` runs each
stage and checks that every project module it imported is covered.
"""

from __future__ import annotations

import ast
from functools import lru_cache
from pathlib import Path

PROJECT_PACKAGES = ("tpgrpo", "stages")
# Files on every stage's path, followed only through what runs a stage (module level + these functions).
RUNNER: dict[str, tuple[str, ...]] = {
    "tpgrpo/__main__.py": ("main",),
    "tpgrpo/cli.py": ("_run_stage",),
    "tpgrpo/pipeline/stage_server.py": ("run_via_server",),
}


def module_file(root: Path, module: str) -> str | None:
    """``tpgrpo.algo.loss`` -> ``tpgrpo/algo/loss.py`` (or the package's ``__init__.py``) if under ``root``."""
    if module.split(".")[0] not in PROJECT_PACKAGES:
        return None
    base = Path(*module.split("."))
    for candidate in (base.with_suffix(".py"), base / "__init__.py"):
        if (root / candidate).is_file():
            return candidate.as_posix()
    return None


def _packages(path: str) -> list[str]:
    """The ``__init__.py`` files Python runs before the module at ``path`` (a stages/ folder may have one)."""
    parts = Path(path).parts[:-1]
    return [Path(*parts[:n], "__init__.py").as_posix() for n in range(1, len(parts) + 1)]


def _imported_names(nodes) -> set[str]:
    """Dotted names a list of AST nodes may import: ``import a.b``, ``from a import b`` (a, and a.b in case b
    is a module), and string constants that look like dotted project module names."""
    names: set[str] = set()
    for tree in nodes:
        for node in ast.walk(tree):
            if isinstance(node, ast.Import):
                names.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                names.add(node.module)
                names.update(f"{node.module}.{alias.name}" for alias in node.names)
            elif isinstance(node, ast.Constant) and isinstance(node.value, str) and \
                    node.value.startswith(tuple(p + "." for p in PROJECT_PACKAGES)) and " " not in node.value:
                names.add(node.value)
    return names


def _roots_of(tree: ast.Module, functions: tuple[str, ...] | None) -> list:
    """The parts of a module to follow: all of it, or (a runner) its module level and the named functions."""
    if functions is None:
        return [tree]
    top = [n for n in tree.body if not isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef, ast.ClassDef))]
    # functions the module level calls run at import too (e.g. a command registered by a call)
    called = {c.func.id for n in top for c in ast.walk(n) if isinstance(c, ast.Call) and isinstance(c.func, ast.Name)}
    named = [n for n in tree.body if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))
             and (n.name in functions or n.name in called)]
    return top + named


@lru_cache(maxsize=256)
def _direct(root: Path, path: str, stamp: tuple) -> tuple[str, ...]:
    """The project files one file imports directly (cached per file content stamp)."""
    tree = ast.parse((root / path).read_text(), filename=path)
    names = _imported_names(_roots_of(tree, RUNNER.get(path)))
    files = {f for name in names if (f := module_file(root, name))}
    return tuple(sorted(files | {p for p in _packages(path) if (root / p).is_file()}))


def closure(root: Path, starts: list[str]) -> list[str]:
    """Every project file (relative paths, sorted) reachable from ``starts`` through imports, with the
    packages' ``__init__`` files and the runner files."""
    todo = [*starts, *RUNNER]
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        if not (root / path).is_file():
            raise FileNotFoundError(f"code path {path}: not found under {root} (a code file the stages run)")
        seen.add(path)
        stat = (root / path).stat()
        todo.extend(_direct(root, path, (stat.st_mtime_ns, stat.st_size)))
    return sorted(p for p in seen if (root / p).is_file())
