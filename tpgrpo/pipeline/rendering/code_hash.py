"""What a code manifest records of a Python file: its code, without what never changes a number.

A manifest's entry for a file used to be the md5 of its bytes, so a comment, a docstring or a param's help text
in ``tpgrpo/config.py`` (a file in every stage's code) re-ran the whole run. Now it is the md5 of the file's
syntax tree (``ast.dump``: no comments, no layout, no line numbers) with three things left out:

- **string statements**: a docstring, or any other bare string constant used as a statement. Such a
  statement has no effect; a docstring only sets ``__doc__``, and no stage code reads ``__doc__`` (the
  command line's help does, and it is orchestration, in no manifest; ``tests/test_code_hash.py`` checks
  that no stage closure mentions ``__doc__``).
- **help text of a params key**: the ``doc``, ``unit``, ``rule`` and ``note`` of each ``param(...)`` call in
  the module that defines :func:`tpgrpo.config.param` or imports it. They go into the field's metadata, which
  stage code reads only for ``bounds`` (the loader's check, kept); the docs generator that reads the rest is
  in no manifest. The default and the bounds stay: they change what a stage computes or accepts.
- **other stages' declarations**: in the module that defines ``IterationStage`` and ``RunStage``
  (``tpgrpo/stage_params.py``), each ``IterationStage(...)`` or ``RunStage(...)`` call of another kind's stage
  is reduced to its name. A stage computes with its own declaration (its params, hence its ``config_hash``,
  and its outputs); another stage's declaration reaches it only through what DVC records itself (that stage's
  outputs, which are its inputs; its paths in dvc.yaml). So an edit of eval's declaration changes eval's
  manifest only; an edit of the baseline's too (its ``manifest`` is the eval's). The rest of the module (the
  shared tables and functions) counts for every stage. A ``RunStage``'s help line (``help``: what
  ``tpgrpo stage NAME --help`` prints) counts for none, as a param's help text.

Anything else that changes the tree changes the hash, so a code change is never missed; a new Python version
may dump the same code differently, which re-runs stages (never the reverse). Files that do not parse are
hashed by their bytes (a stage would not import them anyway).
"""

from __future__ import annotations

import ast
import hashlib

CODE = "code"  # a manifest's "hashes": its file entries are code_md5s; absent (older manifests): bytes md5s
BYTES = "bytes"
HELP_ARGS = {1: "doc", 2: "unit", 4: "rule", 5: "note"}  # tpgrpo.config.param's help text: position -> name
DECLARATION = "IterationStage"  # the class whose calls declare the iteration stages
RUN_DECLARATION = "RunStage"  # the class whose calls declare the run-level stages
RUN_HELP = (1, "help")  # a RunStage's help line: its position and keyword

# raw md5 -> (the dump of everything but the declarations, {stage name: the dump of its declaration}); content-
# addressed, so never stale (a stage server's forked stages find it warm)
_PARTS: dict[str, tuple[str, dict[str, str]]] = {}


def file_md5(data: bytes, kind: str | None, hashes: str = CODE) -> str:
    """The md5 a manifest of ``kind`` records for a file with bytes ``data`` (hex, 32 characters): of the
    bytes (``hashes`` = :data:`BYTES`, the older manifests), or of its normalised code (:data:`CODE`)."""
    raw = hashlib.md5(data).hexdigest()
    if hashes == BYTES:
        return raw
    if raw not in _PARTS:
        _PARTS[raw] = _parts(data)
    common, declarations = _PARTS[raw]
    own = declarations.get(kind or "", "")
    return hashlib.md5(f"{common}\n{own}".encode()).hexdigest()


def _parts(data: bytes) -> tuple[str, dict[str, str]]:
    """(the normalised dump less other stages' declarations, {stage: its declaration's dump})."""
    try:
        tree = ast.parse(data)
    except (SyntaxError, ValueError):
        return "bytes " + hashlib.md5(data).hexdigest(), {}
    defined = {n.name for n in tree.body if isinstance(n, (ast.FunctionDef, ast.ClassDef))}
    imported = {a.asname or a.name for n in tree.body if isinstance(n, ast.ImportFrom) and n.module == "tpgrpo.config"
                for a in n.names}
    helps, declares = "param" in defined | imported, DECLARATION in defined or RUN_DECLARATION in defined
    calls = []
    for node in ast.walk(tree):  # in place (a NodeTransformer took 4x as long as the parse)
        for name in ("body", "orelse", "finalbody"):
            block = getattr(node, name, None)
            if isinstance(block, list) and any(map(_is_string_statement, block)):
                setattr(node, name, [s for s in block if not _is_string_statement(s)])
        if (helps or declares) and isinstance(node, ast.Call) and isinstance(node.func, ast.Name):
            calls.append(node)
    declarations: dict[str, str] = {}
    for call in calls:
        if helps and call.func.id == "param":
            call.args = [ast.Constant(None) if i in HELP_ARGS else a for i, a in enumerate(call.args)]
            call.keywords = [k for k in call.keywords if k.arg not in HELP_ARGS.values()]
        elif declares and call.func.id in (DECLARATION, RUN_DECLARATION) and (kind := _declared_kind(call)):
            stage = _declared_name(call)
            if call.func.id == RUN_DECLARATION:  # its help line: printed by the command line, never computed with
                call.args = [ast.Constant(None) if i == RUN_HELP[0] else a for i, a in enumerate(call.args)]
                call.keywords = [k for k in call.keywords if k.arg != RUN_HELP[1]]
            declarations[kind] = declarations.get(kind, "") + ast.dump(call)  # the eval's, then the baseline's
            call.args, call.keywords = [ast.Constant(stage)], []
    return ast.dump(tree), declarations


def _is_string_statement(node: ast.AST) -> bool:
    """A docstring, or another string constant as a statement: no effect (a docstring sets ``__doc__`` only)."""
    return isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str)


def _declared_name(node: ast.Call) -> str | None:
    """The stage an ``IterationStage(...)`` or ``RunStage(...)`` call declares: its first argument or ``name=``,
    if a string literal (else None: the call then counts for every stage)."""
    first = node.args[0] if node.args else next((k.value for k in node.keywords if k.arg == "name"), None)
    return first.value if isinstance(first, ast.Constant) and isinstance(first.value, str) else None


def _declared_kind(node: ast.Call) -> str | None:
    """The manifest kind a declaration counts for: a ``RunStage``'s ``manifest=`` (the baseline's is
    ``"eval"``) when given, else the stage's name; None (the call counts for every stage) where either is
    not a string literal."""
    given = next((k.value for k in node.keywords if k.arg == "manifest"), None)
    if given is None:
        return _declared_name(node)
    return given.value if isinstance(given, ast.Constant) and isinstance(given.value, str) and given.value else None
