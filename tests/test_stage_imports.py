"""Nothing imports the stage modules (``stages/``) but the stage runner, and the eval's code holds nothing of the
comparison.

The rule. ``stages/*.py`` are thin shells that DVC's commands reach through ``tpgrpo stage NAME``; the code they
run lives in ``tpgrpo/``. So:

- ``tpgrpo/`` never imports ``stages``, except :func:`tpgrpo.pipeline.execution.stage_runner.stage_module`, the one door
  (``tpgrpo stage`` and the stage server's forked stages run a shell through it);
- ``bench/`` never does (a bench that runs a stage in-process calls ``bench.common.run_stage``, which goes
  through that door), nor do the tests' helper modules (``tests/*.py`` not named ``test_*``);
- a test may import a stage module to test that shell (run it, patch what it calls), but takes nothing else
  from it: ``from stages.X import Y`` only for ``Y = run``. A function a test wants comes from ``tpgrpo/``.

Imports are read from the source: ``import``/``from`` statements anywhere in a file, and ``import_module`` /
``__import__`` calls whose name is a literal or an f-string starting with ``stages``.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[1]
DOOR = "tpgrpo/pipeline/execution/stage_runner.py"


def _is_stages(name: str) -> bool:
    return name == "stages" or name.startswith("stages.")


def _dynamic_name(node: ast.Call) -> str | None:
    """The module name of an ``import_module(...)`` / ``__import__(...)`` call: a literal, or an f-string's
    leading text (``f"stages.{name}"`` -> ``"stages."``); None for anything else."""
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    if name not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value)
    return None


def stage_imports(path: Path) -> list[tuple[int, str, tuple[str, ...]]]:
    """``(line, module, names)`` of each import of ``stages`` in ``path`` (``names``: what a ``from`` import
    takes; empty for ``import stages.x`` and dynamic imports)."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, a.name, ()) for a in node.names if _is_stages(a.name)]
        elif isinstance(node, ast.ImportFrom) and not node.level and _is_stages(node.module or ""):
            found.append((node.lineno, node.module, tuple(a.name for a in node.names)))
        elif isinstance(node, ast.Call):
            name = _dynamic_name(node)
            if name is not None and _is_stages(name.rstrip(".") if name.endswith(".") else name):
                found.append((node.lineno, name, ()))
    return found


def _files(folder: str) -> list[Path]:
    return sorted(p for p in (REPO / folder).rglob("*.py") if "__pycache__" not in p.parts)


def _where(path: Path, hits) -> list[str]:
    return [f"{path.relative_to(REPO)}:{line} imports {module}" for line, module, _ in hits]


def test_the_scan_finds_every_form_of_import(tmp_path):
    """The checker itself: each way of importing a stage module is found, other modules are not."""
    path = tmp_path / "m.py"
    path.write_text("import stages.eval\nfrom stages.probe import score_states\nfrom stages import credit\n"
                    "import stagesque\nfrom tpgrpo.stage_common import stopwatch\n"
                    "def f(name):\n    import importlib\n    importlib.import_module(f'stages.{name}')\n"
                    "    __import__('stages.rollout', fromlist=['run'])\n    importlib.import_module('tpgrpo.cli')\n")
    assert [(line, module) for line, module, _ in stage_imports(path)] == [
        (1, "stages.eval"), (2, "stages.probe"), (3, "stages"), (8, "stages."), (9, "stages.rollout")]
    assert stage_imports(path)[1][2] == ("score_states",)


def test_the_library_imports_no_stage_module_but_through_the_runner():
    hits = {p: stage_imports(p) for p in _files("tpgrpo")}
    door = hits.pop(REPO / DOOR)
    assert [module for _, module, _ in door] == ["stages."], "the runner's door imports stages.<name> by name"
    bad = [w for p, h in hits.items() for w in _where(p, h)]
    assert not bad, "tpgrpo/ imports stage modules (run them through the stage runner): " + "; ".join(bad)


@pytest.mark.parametrize("folder", ["bench", "tests"])
def test_benches_and_test_helpers_import_no_stage_module(folder):
    files = [p for p in _files(folder) if folder == "bench" or not p.name.startswith("test_")]
    assert files, folder
    bad = [w for p in files for w in _where(p, stage_imports(p))]
    assert not bad, f"{folder}/ imports stage modules (use tpgrpo/, or bench.common.run_stage): " + "; ".join(bad)


def test_a_test_takes_only_run_from_a_stage_module():
    bad = [f"{p.relative_to(REPO)}:{line} takes {names} from {module}"
           for p in _files("tests") if p.name.startswith("test_")
           for line, module, names in stage_imports(p) if names and set(names) != {"run"}]
    assert not bad, "tests take library code from stage shells (import it from tpgrpo/): " + "; ".join(bad)


def test_the_eval_code_holds_nothing_of_the_comparison():
    """An edit to the comparison's statistics re-runs no eval: no file of ``tpgrpo/comparison/`` is in the eval
    (and baseline) stages' code."""
    from tpgrpo.pipeline.rendering.code_graph import closure
    from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES

    code = closure(REPO, KIND_STAGES["eval"])
    assert "tpgrpo/policy/evaluation.py" in code and "tpgrpo/io/eval_table.py" in code
    assert not [p for p in code if p.startswith("tpgrpo/comparison/")], code
