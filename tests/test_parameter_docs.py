"""Each params key is described once (tpgrpo/config.py); params.yaml's comments and docs/parameters.md are
generated from it and must be current, and every documented bound is one the loader enforces."""

from __future__ import annotations

import copy
import dataclasses
import re
from pathlib import Path

import pytest
import yaml

from tpgrpo.config import RANGE_TEXT, RANGES, ConfigError, config_from_dict, param_fields
from tpgrpo.config_docs import main, render_markdown, render_params

ROOT = Path(__file__).resolve().parents[1]
PARAMS = (ROOT / "params.yaml").read_text()
LR_LINE = re.search(r"^  lr: \S+", PARAMS, re.M).group(0)  # the value as written (no comment)
# A value just outside each checkable range.
OUTSIDE = {"> 0": 0, ">= 0": -1, "[0, 1]": 1.5}


def test_params_yaml_and_parameters_page_are_generated_from_the_config():
    assert PARAMS == render_params(PARAMS), "params.yaml's comments are stale: run python -m tpgrpo.config_docs"
    page = (ROOT / "docs" / "parameters.md").read_text()
    assert page == render_markdown(PARAMS), "docs/parameters.md is stale: run python -m tpgrpo.config_docs"
    for key in param_fields():
        assert f"| `{key}` |" in page


def test_every_key_has_a_meaning_and_every_number_a_checked_bound():
    for key, field in param_fields().items():
        meta = field.metadata
        assert meta["doc"], f"{key}: no meaning"
        if field.type in ("int", "float"):
            assert meta["bounds"] in RANGES, f"{key}: a number with no bounds"


@pytest.mark.parametrize("key", [k for k, f in param_fields().items()
                                 if f.metadata["bounds"] in RANGES or isinstance(f.metadata["bounds"], tuple)])
def test_documented_bounds_are_enforced(key):
    raw = yaml.safe_load(PARAMS)
    section, name = key.split(".")
    bounds = param_fields()[key].metadata["bounds"]
    raw[section][name] = "no-such-choice" if isinstance(bounds, tuple) else OUTSIDE[bounds]
    with pytest.raises(ConfigError) as info:
        config_from_dict(raw)
    expected = "expected one of" if isinstance(bounds, tuple) else RANGE_TEXT[bounds]
    assert f"{key} = " in str(info.value) and expected in str(info.value)


def test_regenerating_keeps_values_as_written_and_replaces_comments(tmp_path):
    edited = PARAMS.replace(LR_LINE, "  lr: 2.5e-3  # a hand-written comment\n    # and another line")
    assert edited != PARAMS
    params, docs = tmp_path / "params.yaml", tmp_path / "parameters.md"
    params.write_text(edited)
    assert main(["--params", str(params), "--docs", str(docs), "--check"]) == 1  # stale, and nothing written
    assert params.read_text() == edited and not docs.exists()
    assert main(["--params", str(params), "--docs", str(docs)]) == 0
    text = params.read_text()
    assert "hand-written" not in text and "  lr: 2.5e-3 " in text and "AdamW learning rate" in text
    want = copy.deepcopy(yaml.safe_load(PARAMS))
    want["update"]["lr"] = 2.5e-3
    assert yaml.safe_load(text) == want
    assert "| `update.lr` | `2.5e-3` |" in docs.read_text()
    assert main(["--params", str(params), "--docs", str(docs), "--check"]) == 0


def test_a_key_missing_from_the_config_or_the_file_is_named():
    with pytest.raises(ValueError, match="disagree on keys: update.lr"):
        render_params(PARAMS.replace(LR_LINE, "  #" + LR_LINE[2:]))
    with pytest.raises(ValueError, match="disagree on keys: update.lrr"):
        render_params(PARAMS.replace(LR_LINE, LR_LINE + "\n  lrr: 1"))
    assert dataclasses.is_dataclass(config_from_dict(yaml.safe_load(PARAMS)))
