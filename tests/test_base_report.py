"""The base-model report on a tiny untrained model: its tables are consistent with their definitions."""

from __future__ import annotations

import json

from PIL import Image

from tpgrpo.reports.base_report import write_base_report
from tpgrpo.config import load_config


def test_base_report_writes_tables_and_grid(tiny_project):
    root = tiny_project
    cfg = load_config(root / "params.yaml")
    out = root / "data" / "reports"
    payload = write_base_report(cfg, root, out)
    assert json.loads((out / "base_report.json").read_text()) == payload
    ode = {(r["task"], r["reward"], r["steps"]) for r in payload["ode"]}
    assert ode == {(t, r, s) for t, rs in (("compositional", ("geneval", "geneval_soft")), ("text", ("ocr",)))
                   for r in rs for s in (10, 40)}
    for row in payload["ode"]:
        # strict (every clause right / exact text) implies reward 1, so accuracy <= mean reward
        assert 0 <= row["strict_accuracy"] <= row["mean_reward"] + 1e-12 <= 1 + 1e-12
    for row in payload["increments"]:
        assert 0 <= row["zero_increment_fraction"] <= 1 and 0 <= row["turning_point_rate"] <= 1
        assert row["trajectories"] == 8 * cfg.rollout.group_size
    table = (out / "base_report.md").read_text()
    assert "| compositional | geneval | 40 |" in table
    grid = Image.open(out / "base_grid.png")
    assert grid.size[0] > 8 * 32 * 4  # 8 columns of 4x-upscaled 32 px images (+ padding)
    row = payload["eval"]  # eval's settings: what the baseline stage samples
    assert row["n"] == cfg.eval.num_prompts * cfg.eval.samples_per_prompt or row["n"] == 2 * row["prompts"]
    assert row["num_steps"] == cfg.eval.num_steps and row["guidance_scale"] == cfg.eval.guidance_scale
    assert 0 <= row["strict_accuracy"] <= row["reward_mean"] + 1e-12
    assert "At eval's settings" in table
    clauses = row["clauses"]  # every image counted once per kind, and once in "all"
    assert sum(v["n"] for k, v in clauses.items() if k != "all") == clauses["all"]["n"] == row["n"]
    assert abs(clauses["all"]["strict"] - row["strict_accuracy"]) < 1e-12
    assert "| all | " in table and "on the asked side" in table


def test_the_report_covers_the_tasks_the_base_was_pretrained_on(tmp_path):
    from tpgrpo.reports.base_report import pretrained_tasks

    assert pretrained_tasks(tmp_path) == ("compositional", "text")  # no pretrain.json: every task
    (tmp_path / "pretrain.json").write_text(json.dumps({"hparams": {"tasks": ["compositional"]}}))
    assert pretrained_tasks(tmp_path) == ("compositional",)
