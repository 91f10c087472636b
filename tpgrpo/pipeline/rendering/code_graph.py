"""Which project files a stage runs, derived from the imports of its module (not kept by hand).

A hand-kept list of each stage's code drifted (``seeds.py``, ``distributed.py``, ``config.py`` and the package
``__init__`` were in no manifest), so the code manifests now take each kind's files from the import graph:
starting from its stage modules, every ``import`` / ``from ... import`` of a project module (at module level
or inside a function), every string constant that names a project module (the reward registry imports its
model rewards by name, the model registry its backends), and every package ``__init__`` on the way.

What runs a stage is not followed: the command line, the stage server and client, the stage runner and its
checks and notes (all of :data:`ORCHESTRATION`). They decide when and how a stage runs, not what it computes,
and they import most of the package: with them in every closure, editing the help text of ``tpgrpo status``
re-ran every stage. Stage code never imports orchestration (``tests/test_code_manifest.py`` checks every
closure), so a stage's closure is the code that computes its artifacts. ``tests/test_code_coverage.py`` runs
each stage and checks that every other project module it imported is covered.
"""

from __future__ import annotations

import ast
import sys
from functools import lru_cache
from pathlib import Path

PROJECT_PACKAGES = ("tpgrpo", "stages")
# What runs stages and records runs, not what a stage computes: the command line and everything under
# tpgrpo/pipeline/ (stage runner, stage server, manifests, dvc.yaml, sealing, status, launch, ...). No stage
# closure contains one of these files (a test checks it); code a stage needs at run time lives elsewhere.
ORCHESTRATION = ("tpgrpo/__main__.py", "tpgrpo/cli.py", "tpgrpo/pipeline/")


def is_orchestration(path: str) -> bool:
    """Whether ``path`` (relative, POSIX) is orchestration code (:data:`ORCHESTRATION`)."""
    return path.startswith(ORCHESTRATION)


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


@lru_cache(maxsize=256)
def _scan(root: Path, path: str, stamp: tuple) -> tuple[tuple[str, ...], tuple[str, ...]]:
    """The project files one file imports directly, and the top-level modules outside the project and the
    standard library it imports (both sorted; cached per file content stamp)."""
    names = _imported_names([ast.parse((root / path).read_text(), filename=path)])
    files = {f for name in names if (f := module_file(root, name))}
    external = {top for name in names if (top := name.split(".")[0]) not in PROJECT_PACKAGES
                and top not in sys.stdlib_module_names}
    return tuple(sorted(files | {p for p in _packages(path) if (root / p).is_file()})), tuple(sorted(external))


def _stamp(root: Path, path: str) -> tuple:
    stat = (root / path).stat()
    return stat.st_mtime_ns, stat.st_size


def closure(root: Path, starts: list[str]) -> list[str]:
    """Every project file (relative paths, sorted) reachable from ``starts`` through imports, with the
    packages' ``__init__`` files."""
    todo = list(starts)
    seen: set[str] = set()
    while todo:
        path = todo.pop()
        if path in seen:
            continue
        if not (root / path).is_file():
            raise FileNotFoundError(f"code path {path}: not found under {root} (a code file the stages run)")
        seen.add(path)
        todo.extend(_scan(root, path, _stamp(root, path))[0])
    return sorted(p for p in seen if (root / p).is_file())


def external_modules(root: Path, files: list[str]) -> list[str]:
    """The third-party top-level modules (``cv2``, ``PIL``, ``torch``) that ``files`` (a closure) import, at
    module level or inside a function (the OCR reward imports ``rapidocr_onnxruntime`` when it first runs);
    sorted. These are the libraries a stage runs on (:func:`tpgrpo.pipeline.rendering.libraries.library_versions`)."""
    return sorted({m for path in files for m in _scan(root, path, _stamp(root, path))[1]})
