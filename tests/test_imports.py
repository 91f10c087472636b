"""The package's import graph has no cycle, and no two modules have names a reader confuses.

The graph is read from the source (no import runs): every ``import`` and ``from ... import`` statement of a
module under ``tpgrpo/`` or ``stages/``, at module level or inside a function (a function-level import is
how a cycle hides until the function runs), with ``from pkg import name`` resolved to the module
``pkg.name`` when there is one and to ``pkg`` otherwise. Importing ``a.b`` runs ``a/__init__.py`` first; that
implicit edge is left out, or every package whose ``__init__`` names one of its modules would be a cycle.
"""

from __future__ import annotations

import ast
from collections import Counter
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("tpgrpo", "stages")
# Library module names that may repeat inside tpgrpo/, and why a reader does not confuse them.
SHARED_NAMES = {
    "cli": "tpgrpo/cli.py is the command line; tpgrpo/comparison/cli.py its `compare` sub-app",
    "rewards": "tpgrpo/tasks/rewards.py is the reward registry; tpgrpo/rewards/ the model and remote rewards",
}


def module_name(path: Path) -> str:
    """``tpgrpo/algo/loss.py`` -> ``tpgrpo.algo.loss``; a package's ``__init__.py`` -> the package."""
    parts = list(path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def project_modules() -> dict[str, Path]:
    """Every module under tpgrpo/ and stages/, by dotted name."""
    return {module_name(p): p for package in PACKAGES for p in sorted((ROOT / package).rglob("*.py"))}


def _from_base(module: str, path: Path, node: ast.ImportFrom) -> str:
    """The absolute module of ``from <base> import ...`` (relative imports resolved against ``module``)."""
    if not node.level:
        return node.module or ""
    package = module.split(".") if path.name == "__init__.py" else module.split(".")[:-1]
    package = package[:len(package) - node.level + 1]
    return ".".join(package + ([node.module] if node.module else []))


def imports_of(module: str, path: Path, modules: dict[str, Path]) -> set[str]:
    """The project modules ``module`` imports anywhere in its file."""
    found: set[str] = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names if alias.name in modules)
        elif isinstance(node, ast.ImportFrom):
            base = _from_base(module, path, node)
            for alias in node.names:
                target = f"{base}.{alias.name}"
                found.add(target if target in modules else base)
        elif _imports_by_name(node):
            found.add(node.args[0].value)
    return (found & modules.keys()) - {module}


def _imports_by_name(node: ast.AST) -> bool:
    """``import_module("a.b")`` / ``importlib.import_module("a.b")`` with a literal name."""
    if not isinstance(node, ast.Call) or not node.args or not isinstance(node.args[0], ast.Constant):
        return False
    func = node.func
    name = func.attr if isinstance(func, ast.Attribute) else getattr(func, "id", "")
    return name == "import_module" and isinstance(node.args[0].value, str)


def import_graph() -> dict[str, set[str]]:
    """Module -> the project modules it imports."""
    modules = project_modules()
    return {name: imports_of(name, path, modules) for name, path in modules.items()}


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle ``[a, b, ..., a]`` of ``graph``, or None (iterative depth-first search, sorted: stable)."""
    state: dict[str, int] = {}  # 1 = on the current path, 2 = done
    for start in sorted(graph):
        if start in state:
            continue
        path, stack = [start], [iter(sorted(graph[start]))]
        state[start] = 1
        while stack:
            nxt = next(stack[-1], None)
            if nxt is None:
                state[path.pop()] = 2
                stack.pop()
            elif state.get(nxt) == 1:
                return path[path.index(nxt):] + [nxt]
            elif nxt not in state:
                state[nxt] = 1
                path.append(nxt)
                stack.append(iter(sorted(graph[nxt])))
    return None


def test_no_import_cycle():
    graph = import_graph()
    assert {"tpgrpo.algo.credit_table", "tpgrpo.config", "tpgrpo.io.schemas"} <= graph["stages.credit"]
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def layer_of(module: str) -> str:
    """The part of the package a module belongs to: its folder under tpgrpo/ (``tpgrpo.algo.loss`` ->
    ``tpgrpo.algo``), or the module itself at tpgrpo/'s top level (``tpgrpo.config``) or in stages/."""
    parts = module.split(".")
    return ".".join(parts[:2]) if len(parts) > 2 else module


def layer_graph(graph: dict[str, set[str]]) -> dict[str, set[str]]:
    """Folder (or top-level module) -> the folders and top-level modules it imports, itself left out."""
    layers: dict[str, set[str]] = {}
    for module, targets in graph.items():
        here = layer_of(module)
        layers.setdefault(here, set()).update(layer_of(t) for t in targets if layer_of(t) != here)
    for targets in list(layers.values()):
        for t in targets:
            layers.setdefault(t, set())
    return layers


def drawn_layers(text: str) -> list[set[str]]:
    """The rows of the drawing between ``<!-- layers: top to bottom -->`` and ``<!-- end layers -->``: each
    row's names (before its description, comma-separated) as layer names (``__init__`` -> ``tpgrpo``)."""
    block = text.split("<!-- layers: top to bottom -->")[1].split("<!-- end layers -->")[0]
    rows = [line for line in block.splitlines() if line.strip() and not line.startswith("```")]
    names = [line.split("  ")[0].split(", ") for line in rows]
    return [{"tpgrpo" if n == "__init__" else f"tpgrpo.{n}" for n in row} for row in names]


def test_no_arrow_runs_back_up_between_folders():
    """Between tpgrpo/'s folders and top-level modules every arrow runs down the drawing in
    docs/development.md (which lists each of them once): none within a row, none back up, so no cycle."""
    layers = {k: v for k, v in layer_graph(import_graph()).items() if k.split(".")[0] == "tpgrpo"}
    assert "tpgrpo.algo" in layers["tpgrpo.rollout_shape"] and "tpgrpo.policy" in layers["tpgrpo.rollout_shape"]
    rows = drawn_layers((ROOT / "docs" / "development.md").read_text())
    row_of = {name: i for i, row in enumerate(rows) for name in row}
    assert sorted(row_of) == sorted(layers) and sum(map(len, rows)) == len(row_of), "the drawing's names"
    upward = [f"{a} -> {b}" for a, targets in layers.items() for b in targets if row_of[b] <= row_of[a]]
    assert not upward, "arrows that do not run down the drawing: " + ", ".join(sorted(upward))


def test_the_drawing_check_finds_an_arrow_back_up():
    rows = drawn_layers("<!-- layers: top to bottom -->\n```text\npolicy, io   a\nalgo   b\n```\n<!-- end layers -->")
    assert rows == [{"tpgrpo.policy", "tpgrpo.io"}, {"tpgrpo.algo"}]
    assert find_cycle(layer_graph({"tpgrpo.algo.x": {"tpgrpo.io.y"}, "tpgrpo.io.y": {"tpgrpo.algo.z"},
                                   "tpgrpo.algo.z": set()})) is not None


def test_find_cycle_names_a_function_level_cycle(tmp_path):
    """The checker itself: a cycle through a function-level ``from pkg import module`` is found and named."""
    graph = {"p.a": {"p.b"}, "p.b": {"p.c"}, "p.c": {"p.a"}, "p.d": {"p.a"}}
    assert find_cycle(graph) == ["p.a", "p.b", "p.c", "p.a"]
    assert find_cycle({"p.a": {"p.b"}, "p.b": set()}) is None
    (tmp_path / "a.py").write_text("def f():\n    from tpgrpo.algo import loss\n    from tpgrpo.io import nothing\n"
                                   "    import importlib\n    importlib.import_module('tpgrpo.cli').run_app()\n")
    modules = {"tpgrpo.algo.loss": Path(), "tpgrpo.io": Path(), "tpgrpo.cli": Path(), "x.a": tmp_path / "a.py"}
    assert imports_of("x.a", tmp_path / "a.py", modules) == {"tpgrpo.algo.loss", "tpgrpo.io", "tpgrpo.cli"}


def test_the_cli_and_the_stage_server_do_not_import_each_other():
    """Both run stages through tpgrpo.pipeline.execution.stage_runner; the server's child once imported the CLI by name
    while the CLI imported the server (a cycle the graph now sees through ``import_module``)."""
    graph = import_graph()
    runner, server = "tpgrpo.pipeline.execution.stage_runner", "tpgrpo.pipeline.execution.stage_server"
    assert runner in graph["tpgrpo.cli"] & graph[server]
    assert "tpgrpo.cli" not in graph[server]
    assert server in graph["tpgrpo.cli"]
    assert not {"tpgrpo.cli", server} & graph[runner]


def test_module_names_are_not_confusable():
    """A bench script never shares a library or stage module's name (``bench/probe_modes.py`` beside
    ``tpgrpo/probe_modes.py`` was read as one); inside tpgrpo/ a name repeats only where SHARED_NAMES says."""
    library = list((ROOT / "tpgrpo").rglob("*.py"))
    # a module's name, or a subpackage's (tpgrpo/rewards/ is a name too)
    names = Counter(p.parent.name if p.name == "__init__.py" else p.stem for p in library
                    if p.parent != ROOT / "tpgrpo" or p.name != "__init__.py")
    repeated = {name for name, n in names.items() if n > 1}
    assert SHARED_NAMES.keys() <= repeated, "SHARED_NAMES lists only names that do repeat"
    assert repeated <= SHARED_NAMES.keys(), f"tpgrpo/ names used twice: {sorted(repeated - SHARED_NAMES.keys())}"
    stages = {p.stem for p in (ROOT / "stages").glob("*.py")}
    bench = {p.stem for p in (ROOT / "bench").rglob("*.py")  # bench/studies/ and helper folders too
             if p.name != "__init__.py"}  # a package marker, not a script
    assert bench, "bench/ has scripts"
    clash = bench & (set(names) | stages)
    assert not clash, f"bench/ scripts named like library or stage modules: {sorted(clash)}"
