"""Every metric key the stages write is defined in docs/metrics.md.

The eval prompts' encoding, one tiny iteration (rollout, probe, credit, update, eval), the baseline eval and the
summary run through the real CLI; every key of their JSON logs, of ``data/metrics/*.json`` and every column of
the summary's CSVs must appear in the page's tables as ``key`` (nested keys as ``parent.child``; a list is one
key), and every key the page lists must be one they wrote.
"""

from __future__ import annotations

import json
import re
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import REPO, make_tiny_project
from typer.testing import CliRunner

from tpgrpo.cli import app

STAGES = ("rollout", "probe", "credit", "update", "eval")
ROW = re.compile(r"^\| `([^`]+)` \|", re.MULTILINE)


def flat_keys(value, prefix: str = "") -> set[str]:
    """``{"a": {"b": 1}, "c": 2}`` -> ``{"a.b", "c"}`` (a mapping whose keys are data, e.g. reward weights
    by reward name, counts as its own key)."""
    if not isinstance(value, dict) or not value:
        return {prefix}
    keys = set()
    for key, item in value.items():
        keys |= flat_keys(item, f"{prefix}.{key}" if prefix else key)
    return keys


@pytest.fixture(scope="module")
def ran(tmp_path_factory, tiny_model_dir) -> Path:
    """A tiny project after one full iteration, the baseline and the summary (train.iterations = 1)."""
    root = make_tiny_project(tmp_path_factory.mktemp("metrics") / "project", tiny_model_dir)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["train"]["iterations"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    runner = CliRunner()
    for name, iteration in [("eval_prompts", None), *((s, 1) for s in STAGES), ("baseline", None),
                            ("summary", None)]:
        args = ["stage", name, "--params", str(root / "params.yaml")] + (["--iter", "1"] if iteration else [])
        result = runner.invoke(app, args)
        assert result.exit_code == 0, f"{name}: {result.output}"
    return root


def documented() -> dict[str, set[str]]:
    """The keys of each ``## `file` `` section of docs/metrics.md (a key row: ``| `key` | ...``)."""
    text = (REPO / "docs" / "metrics.md").read_text()
    sections = re.split(r"^## ", text, flags=re.MULTILINE)[1:]
    return {s.splitlines()[0].strip(): set(ROW.findall(s)) for s in sections}


def written(root: Path) -> dict[str, set[str]]:
    """The keys the run wrote, under the section names docs/metrics.md uses."""
    iters = root / "data" / "iters"
    keys = {f"`data/iters/NNNN/{s}.json`": flat_keys(json.loads((iters / "0001" / f"{s}.json").read_text()))
            for s in STAGES}
    keys["`data/iters/baseline_eval.json`"] = flat_keys(json.loads((iters / "baseline_eval.json").read_text()))
    keys["`data/iters/eval_prompts.json`"] = flat_keys(json.loads((iters / "eval_prompts.json").read_text()))
    sidecars = [*(iters / "0001").glob("*.timing.json"), *iters.glob("*.timing.json")]  # tpgrpo.io.stage_logs
    assert len(sidecars) == len(STAGES) + 2, sorted(p.name for p in sidecars)  # + baseline_eval, eval_prompts
    keys["`data/iters/NNNN/<stage>.timing.json`"] = set().union(*(flat_keys(json.loads(p.read_text()))
                                                                  for p in sidecars))
    metrics = root / "data" / "metrics"
    keys["`data/metrics/summary.json`"] = flat_keys(json.loads((metrics / "summary.json").read_text()))
    glance = set()
    for path in sorted(metrics.glob("*.json")):
        if path.name != "summary.json":
            glance |= {f"{path.stem}.{k}" for k in flat_keys(json.loads(path.read_text()))}
    keys["`data/metrics/<quantity>.json`"] = glance
    for name in ("history", "eval_curve", "train_curve"):
        keys[f"`data/metrics/{name}.csv`"] = set(pd.read_csv(metrics / f"{name}.csv").columns)
    keys["`data/iters/summary_log.json`"] = flat_keys(json.loads((iters / "summary_log.json").read_text()))
    return keys


def test_every_written_metric_key_is_documented(ran):
    docs, keys = documented(), written(ran)
    assert keys["`data/iters/NNNN/update.json`"] and keys["`data/metrics/history.csv`"], "the run wrote metrics"
    missing = {f: sorted(k - docs.get(f, set())) for f, k in keys.items() if k - docs.get(f, set())}
    assert not missing, f"undocumented metric keys (add them to docs/metrics.md): {missing}"


def test_the_page_documents_no_key_the_stages_no_longer_write(ran):
    """The reverse: a key dropped from a writer leaves the page too (every key here is one this run writes:
    other params write subsets, e.g. a flow_grpo probe.json or the eval.json of an unevaluated iteration)."""
    docs, keys = documented(), written(ran)
    assert set(docs) == set(keys), f"sections: {sorted(set(docs) ^ set(keys))}"
    stale = {f: sorted(docs[f] - k) for f, k in keys.items() if docs[f] - k}
    assert not stale, f"documented keys no stage wrote: {stale}"
