"""DVC's per-stage write of ``dvc.lock`` without parsing and re-emitting the whole file.

Why: after each stage ``dvc repro`` calls ``Lockfile.dump_stages`` (DVC 3.67.1), which parses ``dvc.lock`` with
ruamel's round-trip loader and emits the whole file again, both in pure Python: 0.6 s for 12 iterations of
entries, 1.2-1.6 s at a block's last stage (``bench/lock_growth.py``), five or six times an iteration. Yet a
lock file DVC wrote is a fixed header and one block of text per stage, and a stage's write changes its own
block only. Here the file's text is cut at its stage keys; each stage written gets its block emitted by DVC's
own dumper at the same nesting (so ruamel wraps long lines at the same columns), and every other block keeps
its bytes. Any file of another shape (hand-edited, a dataset section, a complex key, an anchor or alias) goes to
DVC's own code.
tests/test_lock_blocks.py compares the bytes with DVC's own write over random sequences of stage entries.
"""

from __future__ import annotations

import io
import os
import re
from typing import Callable

HEADER = "schema: '2.0'\nstages:\n"
# An anchor (``&id001``) where a value or item starts. A block holding an alias (``*id001``) may refer to an
# anchor in another block (PyYAML writes them for objects shared between stages), so a file with an anchor is
# not cut; without one no alias can be valid. False alarms (``x: &y`` inside a string) only cost DVC's write.
ANCHOR = re.compile(r"(?:: |- |\? )&\S")
KEY_INDENT = "  "  # a stage's key line: two spaces, then the key (block style, as DVC's dumper writes it)


def split_blocks(text: str, parse: Callable[[str], object]) -> dict[str, str] | None:
    """``{stage name: its block of text}`` in the file's order, for a lock file's ``text`` made of ``HEADER``
    and stage blocks only; None for any other shape (then DVC's own code writes it). ``parse``: DVC's YAML
    parser, which reads the stage names off their key lines (one writer may quote a name another leaves
    plain: PyYAML's ``'yes':`` is ruamel's ``yes:``)."""
    if not text.startswith(HEADER) or not text.endswith("\n") or ANCHOR.search(text):
        return None
    blocks: list[list[str]] = []
    for line in text[len(HEADER):].splitlines(keepends=True):
        if line.startswith(KEY_INDENT) and not line.startswith(KEY_INDENT + " "):
            if not line.rstrip("\n").endswith(":") or line.startswith(KEY_INDENT + "?"):
                return None  # a value on the key's line, or a complex key
            blocks.append([line])
        elif not blocks or not line.startswith(KEY_INDENT + " "):
            return None  # text before the first key, or a line back at the top level
        else:
            blocks[-1].append(line)
    try:  # every key line as "key: 0" in one document
        names = parse("".join(lines[0][len(KEY_INDENT):].rstrip("\n") + " 0\n" for lines in blocks)) or {}
    except Exception:  # noqa: BLE001 - DVC's parser raises its own errors (a duplicate key among them)
        return None
    if len(names) != len(blocks) or not all(isinstance(name, str) for name in names):
        return None
    return {name: "".join(lines) for name, lines in zip(names, blocks)}


def emit_block(name: str, entry: dict, dump: Callable) -> str | None:
    """One stage's block as ``dump`` (DVC's YAML dumper) writes it inside the whole file: emitted under a
    ``stages`` key, so that every line has its final column (ruamel wraps long lines at column 80). None when
    the dumper wrote anything but that key first: then DVC's own code writes the file (no crash mid-repro)."""
    stream = io.StringIO()
    dump({"stages": {name: entry}}, stream)
    text = stream.getvalue()
    return text[len("stages:\n"):] if text.startswith("stages:\n") else None


def updated_text(text: str, entries: dict[str, dict], dump: Callable,
                 parse: Callable) -> tuple[str, bool] | None:
    """The lock file's new text with ``entries`` (``{stage name: lock entry}``) written as DVC's
    ``data["stages"].update(entries)`` would (a known stage keeps its place, a new one goes last), and
    whether any block changed; None when ``text`` is not of the shape :func:`split_blocks` reads."""
    blocks = split_blocks(text, parse)
    if blocks is None:
        return None
    changed = False
    for name, entry in entries.items():
        block = emit_block(name, entry, dump)
        if block is None:
            return None
        changed |= blocks.get(name) != block
        blocks[name] = block
    return HEADER + "".join(blocks.values()), changed


def write_stream(stream, text: str) -> None:
    """The write of the whole new text (a function of its own: tests/test_dvc_atomic.py kills DVC inside it)."""
    stream.write(text)


def install(write_text: Callable[[str, Callable], None]) -> None:
    """Replace ``dvc.dvcfile.Lockfile.dump_stages`` in this process by one that writes through
    :func:`updated_text` and ``write_text(path, write)`` (the atomic writer), falling back to DVC's own
    method for a missing file, another file system or another shape. Refused (one line) on a DVC other than
    the one verified (:mod:`tpgrpo.io.dvc_versions`)."""
    from tpgrpo.io.dvc_versions import require_verified

    require_verified()
    from dvc import dvcfile
    from dvc.stage import serialize
    from dvc.utils.serialize import _yaml

    original = dvcfile.Lockfile.dump_stages
    if getattr(original, "__module__", "") == __name__:
        return  # installed already

    def dump_stages(self, stages, **kwargs):
        from dvc.fs import LocalFileSystem

        if not stages or not isinstance(self.repo.fs, LocalFileSystem) or not os.path.isfile(self.path):
            return original(self, stages, **kwargs)
        with open(self.path, encoding="utf-8") as fd:
            text = fd.read()
        entries = {}
        for stage in stages:
            entries.update(serialize.to_lockfile(stage, **kwargs))
        # looked up now: DVC's dumper (or a test's wrapper of it) and its safe parser
        new = updated_text(text, entries, _yaml._dump, lambda doc: _yaml.parse_yaml(doc, self.path))
        if new is None:
            return original(self, stages, **kwargs)
        if new[1]:
            dvcfile.logger.info("Updating lock file '%s'", self.relpath)
        write_text(self.path, lambda fd: write_stream(fd, new[0]))
        if new[1]:
            self.repo.scm_context.track_file(self.relpath)

    dvcfile.Lockfile.dump_stages = dump_stages
