"""``params.yaml``'s comments and ``docs/parameters.md``, generated from the typed config's field metadata.

Each key's meaning, unit, bounds and note are written once, in :mod:`tpgrpo.config` (:func:`~tpgrpo.config.param`).
This module rewrites every comment of ``params.yaml`` from them, keeping each value's text exactly as
written (it refuses to write a file whose parsed values would differ), and renders the parameter reference.

    python -m tpgrpo.config_docs            # regenerate params.yaml's comments and docs/parameters.md
    python -m tpgrpo.config_docs --check    # exit 1 if either is not what the config says (CI, tests)
"""

from __future__ import annotations

import argparse
import dataclasses
import re
import sys
import textwrap
from pathlib import Path
from typing import get_type_hints

import yaml

from tpgrpo.config import RANGES, Config, param_fields

HEADER = """\
# tpgrpo parameters: the one place values live. Every key is required; an unknown key is an error.
# Defaults run the embedded tiny model on a laptop CPU. Where they differ from the paper's GPU recipe
# (SD3.5-M, 512 px, G = 24, 32 GPUs, thousands of steps) the comment says so and why.
# The comments are generated from tpgrpo/config.py (python -m tpgrpo.config_docs); edit them there."""
COMMENT_COLUMN = 24  # where a key's comment starts (as params.yaml was written by hand)
WIDTH = 118
SECTION = re.compile(r"^([A-Za-z_]\w*):(.*)$")
KEY = re.compile(r"^  ([A-Za-z_]\w*):(.*)$")


def bounds_text(bounds, sep: str = " | ") -> str:
    """A field's declared bounds in words (choices joined by ``sep``)."""
    if isinstance(bounds, tuple):
        return sep.join(bounds)
    if bounds == "reward":
        from tpgrpo.tasks.rewards import REWARD_NAMES  # the registry: the names a spec may use

        return f"a reward name or a mapping name -> weight; names: {' '.join(REWARD_NAMES)}"
    if bounds == "completion":
        from tpgrpo.algo.probe_modes import EXPECTED

        return EXPECTED
    return bounds if bounds in RANGES else ""


def describe(field: dataclasses.Field, with_unit: bool = True, sep: str = " | ") -> str:
    """One key's comment: meaning [unit]; bounds; rule. Note."""
    meta = field.metadata
    text = meta["doc"] + (f" [{meta['unit']}]" if with_unit and meta["unit"] else "")
    for part in (bounds_text(meta["bounds"], sep), meta["rule"]):
        text += f"; {part}" if part else ""
    return text + (f". {meta['note']}" if meta["note"] else "")


def section_doc(name: str) -> str:
    """A section's docstring as one line."""
    return " ".join(get_type_hints(Config)[name].__doc__.split())


def _commented(code: str, comment: str) -> list[str]:
    """``code`` with ``comment`` at the comment column, wrapped onto comment-only lines below it."""
    start = max(COMMENT_COLUMN, len(code) + 2)
    lines = textwrap.wrap(comment, WIDTH - start - 2, break_on_hyphens=False) or [""]
    first = f"{code.ljust(start)}# {lines[0]}"
    return [first] + [f"{' ' * COMMENT_COLUMN}# {line}" for line in
                      textwrap.wrap(" ".join(lines[1:]), WIDTH - COMMENT_COLUMN - 2, break_on_hyphens=False)]


def value_texts(text: str) -> dict[str, list[str]]:
    """``"section.key"`` -> the value as written (its text after ``key:`` and any deeper-indented lines of
    a block value), comments dropped."""
    values: dict[str, list[str]] = {}
    section = key = None
    for line in text.splitlines():
        stripped = line.strip()
        if not stripped or stripped.startswith("#"):
            continue
        if (m := SECTION.match(line)):
            section, key = m.group(1), None
        elif (m := KEY.match(line)) and section:
            key = f"{section}.{m.group(1)}"
            values[key] = [re.sub(r"\s+#.*$", "", m.group(2)).strip()]
        elif key and line.startswith("    "):  # a block value of the key above
            values[key].append(re.sub(r"\s+#.*$", "", line).rstrip())
        else:
            raise ValueError(f"params.yaml: cannot place line {line!r} (expected `section:` or `  key: value`)")
    return values


def render_params(text: str) -> str:
    """``params.yaml`` with every comment generated from the config and every value's text as written."""
    values, fields = value_texts(text), param_fields()
    missing = sorted(set(fields) - set(values)) + sorted(set(values) - set(fields))
    if missing:
        raise ValueError(f"params.yaml and tpgrpo/config.py disagree on keys: {', '.join(missing)}")
    out = [HEADER]
    for section in (f.name for f in dataclasses.fields(Config)):
        out += ["", *_commented(f"{section}:", section_doc(section))]
        for key in (k for k in fields if k.startswith(section + ".")):
            first, *block = values[key]
            out += _commented(f"  {key.split('.')[1]}: {first}".rstrip(), describe(fields[key])) + block
    rendered = "\n".join(out) + "\n"
    if yaml.safe_load(rendered) != yaml.safe_load(text):
        raise ValueError("params.yaml: the regenerated file would change a value; left as it is")
    return rendered


def render_markdown(params_text: str) -> str:
    """``docs/parameters.md``: every key's value (from ``params.yaml``), unit, bounds and meaning."""
    values, fields = value_texts(params_text), param_fields()
    out = ["# Parameters", "",
           "Every key of `params.yaml`, its value there, unit, bounds and meaning. Generated from the field "
           "metadata of `tpgrpo/config.py` (the one place each key is described; the loader checks the same "
           "bounds, and `params.yaml`'s comments come from it too) by `python -m tpgrpo.config_docs`; "
           "`tests/test_parameter_docs.py` fails when this page or those comments are stale. A cross-key rule "
           "is checked when the config loads; an unknown or missing key is an error naming it.", ""]
    for section in (f.name for f in dataclasses.fields(Config)):
        out += [f"## `{section}`", "", section_doc(section), "",
                "| key | value | unit | bounds | meaning |", "|---|---|---|---|---|"]
        for key in (k for k in fields if k.startswith(section + ".")):
            meta = fields[key].metadata
            value = " ".join(v.strip() for v in values[key])
            bounds = "; ".join(p for p in (bounds_text(meta["bounds"], ", "), meta["rule"]) if p)
            meaning = meta["doc"] + (f". {meta['note']}" if meta["note"] else "")
            cells = [f"`{key}`", f"`{value}`", meta["unit"], bounds, meaning]
            out.append("| " + " | ".join(c.replace("|", "\\|") for c in cells) + " |")
        out.append("")
    return "\n".join(out)


def main(argv: list[str] | None = None) -> int:
    """Regenerate (or with ``--check`` compare) params.yaml's comments and docs/parameters.md."""
    parser = argparse.ArgumentParser(prog="python -m tpgrpo.config_docs", description=__doc__.splitlines()[0])
    parser.add_argument("--params", type=Path, default=Path("params.yaml"))
    parser.add_argument("--docs", type=Path, default=Path("docs/parameters.md"))
    parser.add_argument("--check", action="store_true", help="exit 1 if a file is not what it would be")
    args = parser.parse_args(argv)
    text = args.params.read_text()
    stale = []
    for path, wanted in ((args.params, render_params(text)), (args.docs, render_markdown(text))):
        if path.is_file() and path.read_text() == wanted:
            continue
        stale.append(str(path))
        if not args.check:
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(wanted)
    verb = "stale (run python -m tpgrpo.config_docs)" if args.check else "written"
    print(f"{verb}: {', '.join(stale)}" if stale else "up to date", file=sys.stderr if stale and args.check else sys.stdout)
    return 1 if stale and args.check else 0


if __name__ == "__main__":
    sys.exit(main())
