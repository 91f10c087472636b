"""docs/default-run.md's table of the default run's params says what params.yaml sets: a change to one without
the other fails here."""

from __future__ import annotations

import re

import yaml

from conftest import REPO

ROW = re.compile(r"^\| `([a-z_]+\.[a-z_]+)` \| `([^`]*)` \|", flags=re.M)


def documented_params(text: str) -> dict[str, str]:
    """``{section.key: value}`` from the rows of the doc's tables whose first two cells are backticked."""
    return dict(ROW.findall(text))


def same_value(doc: str, actual) -> bool:
    """The doc's value as YAML equals params.yaml's (1.0e-3 and 0.001 are the same number)."""
    return yaml.safe_load(doc) == actual


def test_the_default_run_doc_names_params_yaml_values():
    params = yaml.safe_load((REPO / "params.yaml").read_text())
    documented = documented_params((REPO / "docs" / "default-run.md").read_text())
    assert {"sampling.guidance_scale", "update.objective", "train.iterations"} <= documented.keys()
    wrong = [f"{key}: doc {value!r}, params.yaml {params[key.split('.')[0]][key.split('.')[1]]!r}"
             for key, value in documented.items()
             if not same_value(value, params[key.split(".")[0]][key.split(".")[1]])]
    assert not wrong, "docs/default-run.md disagrees with params.yaml: " + "; ".join(wrong)


def test_the_check_reads_rows_and_compares_numbers():
    rows = documented_params("| key | value |\n|---|---|\n| `update.lr` | `1.0e-3` | why |\n| `a` | `b` | c |\n")
    assert rows == {"update.lr": "1.0e-3"}
    assert same_value("1.0e-3", 0.001) and not same_value("3.0e-4", 0.001) and same_value("false", False)
