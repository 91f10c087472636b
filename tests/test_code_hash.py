"""What re-runs nothing: a comment, a docstring or a param's help text changes no code manifest; a code change
changes the manifests of the kinds that run it (tpgrpo.pipeline.rendering.code_hash). Manifests of byte md5s,
written before: tests/test_migrate.py."""

from __future__ import annotations

import ast
import json
from pathlib import Path

from conftest import REPO
from test_code_manifest import _changed, _copy_code, _manifests

from tpgrpo.pipeline.rendering import code_hash
from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES, kind_code


def _replace(path: Path, old: str, new: str) -> None:
    text = path.read_text()
    assert text.count(old) == 1, old
    path.write_text(text.replace(old, new))


def test_a_comment_a_docstring_or_help_text_in_config_changes_no_manifest(tmp_path):
    """config.py is in every stage's code: each of these edits used to re-run the whole run."""
    _copy_code(tmp_path)
    config = tmp_path / "tpgrpo" / "config.py"
    before = _manifests(tmp_path)
    assert all("tpgrpo/config.py" in json.loads(text)["files"] for text in before.values())
    with open(config, "a") as f:
        f.write("# a comment\n")
    _replace(config, '"""The model every model stage loads', '"""The model (edited docstring) every model stage loads')
    _replace(config, '"T, denoising steps per rollout", "steps"', '"T: the denoising steps of one rollout", "samples"')
    _replace(config, 'note="Paper: 10 for training, 40 for eval")', 'note="The paper: 10 to train, 40 to eval")')
    _replace(config, 'param(8, "G, samples per prompt"', 'param(8, "G, the samples of one prompt"')
    _replace(config, 'rule=">= 2 (GRPO needs a group)"', 'rule=">= 2 (a group of one has no spread)"')
    _replace(tmp_path / "tpgrpo" / "algo" / "loss.py", '"""Policy-update losses', '"""Edited. Policy-update losses')
    assert _changed(tmp_path, before) == set()

    _replace(config, 'param(10, "T: the denoising steps', 'param(11, "T: the denoising steps')  # a default: code
    assert _changed(tmp_path, before) == set(KIND_STAGES)
    _replace(config, 'param(11, "T: the denoising steps', 'param(10, "T: the denoising steps')
    _replace(config, 'bounds=("tiny", "sd3", "flux")', 'bounds=("tiny", "sd3")')  # bounds: what a stage accepts
    assert _changed(tmp_path, before) == set(KIND_STAGES)


def test_a_code_edit_is_seen_however_small():
    """What is left out has no effect; everything else counts (a mutation of the normaliser that dropped more
    would fail here)."""
    base = b'"""Doc."""\nimport x\n\ndef f(a):\n    """Doc."""\n    return a + 1\n'
    same = [b'"""Other doc."""\nimport x\n\n\ndef f(a):  # why\n    return a + 1\n',
            b'import x\ndef f(a):\n    "a string statement"\n    return (a +\n            1)\n']
    differ = [b'"""Doc."""\nimport x\n\ndef f(a):\n    return a + 2\n',
              b'"""Doc."""\nimport y\n\ndef f(a):\n    return a + 1\n',
              b'"""Doc."""\nimport x\n\ndef f(a):\n    x = "a string value"\n    return a + 1\n',
              b'"""Doc."""\nimport x\n\ndef f(a):\n    return f"{a}" + 1\n',
              b'"""Doc."""\nimport x\n\ndef f(b):\n    return b + 1\n',
              b'"""Doc."""\nimport x\n\ndef f(a):\n    print(a)\n    return a + 1\n']
    md5 = code_hash.file_md5(base, "update")
    assert [code_hash.file_md5(text, "update") for text in same] == [md5, md5]
    assert len({md5, *(code_hash.file_md5(text, "update") for text in differ)}) == len(differ) + 1
    # help text is left out only of tpgrpo.config.param: another function's text argument is code
    other = b'def param(*a, **k):\n    return a\nX = param(1, "text")\n'
    assert code_hash.file_md5(other, None) == code_hash.file_md5(other.replace(b'"text"', b'"other"'), None)
    elsewhere = b'from lib import param\nX = param(1, "text")\n'
    assert code_hash.file_md5(elsewhere, None) != code_hash.file_md5(elsewhere.replace(b'"text"', b'"t"'), None)
    broken = b"def f(:\n"  # does not parse: its bytes
    assert code_hash.file_md5(broken, None) != code_hash.file_md5(broken + b"# x\n", None)


def test_no_stage_reads_what_the_hash_leaves_out():
    """Why leaving docstrings and help text out is sound: no file of a stage's code reads ``__doc__``, and the
    parts of a param's metadata it reads (``bounds``; ``knob``, from which the execution knobs derive) are kept
    by the hash: none of it is help text (the docs generator reads that, in no closure)."""
    read = set()
    for kind in KIND_STAGES:
        files = kind_code(REPO, kind)
        assert "tpgrpo/config_docs.py" not in files, kind
        for path in files:
            tree = ast.parse((REPO / path).read_text())
            for node in ast.walk(tree):
                assert not (isinstance(node, ast.Attribute) and node.attr == "__doc__"), path
                assert not (isinstance(node, ast.Name) and node.id in ("__doc__", "getdoc")), path
                if isinstance(node, ast.Subscript) and isinstance(node.value, ast.Attribute) and \
                        node.value.attr == "metadata" and isinstance(node.slice, ast.Constant):
                    read.add(node.slice.value)
                if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "get" \
                        and isinstance(node.func.value, ast.Attribute) and node.func.value.attr == "metadata":
                    read.add(getattr(node.args[0], "value", None) if node.args else None)
    assert "bounds" in read and read <= {"bounds", "knob"} and not read & set(code_hash.HELP_ARGS.values())
    assert set(code_hash.HELP_ARGS.values()) == {"doc", "unit", "rule", "note"}
    import inspect

    from tpgrpo.config import param

    assert list(inspect.signature(param).parameters)[:6] == ["default", "doc", "unit", "bounds", "rule", "note"]
