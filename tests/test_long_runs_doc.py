"""docs/long-runs.md says what retention does to the DVC cache as tpgrpo.pipeline.long_runs.sealing.free_cache does it:
it removes the dropped outputs' unreferenced cache objects itself and never runs `dvc gc --workspace` (which
would also delete what experiments and other commits stored). Fast: the page and `tpgrpo retain --help`."""

from __future__ import annotations

import re

from conftest import REPO
from typer.testing import CliRunner

from tpgrpo.cli import app


def retention_paragraph() -> str:
    text = (REPO / "docs" / "long-runs.md").read_text()
    found = re.search(r"^\*\*Retention\*\*.*?(?=\n\n)", text, re.MULTILINE | re.DOTALL)
    assert found, "docs/long-runs.md: no **Retention** paragraph"
    return " ".join(found.group(0).split())


def test_retention_is_not_documented_as_dvc_gc():
    paragraph = retention_paragraph()
    assert not re.search(r"then `dvc gc", paragraph), paragraph  # the old text: "then `dvc gc --workspace` frees"
    assert "cache objects that nothing else references" in paragraph


def test_the_option_the_page_names_exists():
    assert "`--no-gc`" in retention_paragraph()
    help_text = CliRunner().invoke(app, ["retain", "--help"], terminal_width=200).output
    assert "--no-gc" in help_text
