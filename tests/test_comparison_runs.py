"""The mode comparison's run folders: params checks, code snapshots, resume and the CLI end to end (slow)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pandas as pd
import pytest
import yaml
from conftest import REPO, make_tiny_project

from tpgrpo.comparison import runs as cmp
from tpgrpo.comparison.results import paired_difference
from tpgrpo.comparison.variants import main_variants
from tpgrpo.errors import PipelineError


def test_a_folder_of_another_comparison_is_refused(tmp_path, tiny_model_dir):
    base = make_tiny_project(tmp_path / "base", tiny_model_dir)
    params = yaml.safe_load((base / "params.yaml").read_text())
    code = cmp.snapshot_code(tmp_path / "out", REPO)
    spec = cmp.RunSpec(cmp.Variant("tp", "tp", {}), 0, tmp_path / "out" / "tp" / "seed0")
    cmp.prepare_run(spec, base, params, code, budget=2)
    assert (spec.folder / "data/base").is_dir() and (spec.folder / "tpgrpo/cli.py").is_file()
    assert json.loads((code / "SNAPSHOT.json").read_text())["commit"]
    cmp.prepare_run(spec, base, params, code, budget=3)  # a larger budget: train.iterations rises
    assert yaml.safe_load((spec.folder / "params.yaml").read_text())["train"]["iterations"] == 3
    (code / "tpgrpo" / "cli.py").unlink()  # a new snapshot writes new files (new inodes)
    (code / "tpgrpo" / "cli.py").write_text("# refreshed\n")
    cmp.prepare_run(spec, base, params, code, budget=3)
    assert (spec.folder / "tpgrpo/cli.py").read_text() != "# refreshed\n"  # without refresh: the old code
    cmp.prepare_run(spec, base, params, code, budget=3, refresh_code=True)
    assert (spec.folder / "tpgrpo/cli.py").read_text() == "# refreshed\n"
    other = cmp.RunSpec(cmp.Variant("tp", "tp", {"update.lr": 0.5}), 0, spec.folder)
    with pytest.raises(PipelineError, match="update.lr is 0.01 there"):
        cmp.check_run(other, params, 2)


def test_a_folder_made_before_a_bookkeeping_key_keeps_its_params_and_a_done_run_its_code(tmp_path, tiny_model_dir,
                                                                                        monkeypatch):
    base = make_tiny_project(tmp_path / "base", tiny_model_dir)
    params = yaml.safe_load((base / "params.yaml").read_text())
    code = cmp.snapshot_code(tmp_path / "out", REPO)
    spec = cmp.RunSpec(cmp.Variant("tp", "tp", {}), 0, tmp_path / "out" / "tp" / "seed0")
    cmp.prepare_run(spec, base, params, code, budget=2)
    old = yaml.safe_load((spec.folder / "params.yaml").read_text())
    del old["launch"]["stage_server"], old["train"]["block_size"]  # as older code wrote it
    (spec.folder / "params.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    cmp.prepare_run(spec, base, params, code, budget=2)  # no "a different comparison" error
    kept = yaml.safe_load((spec.folder / "params.yaml").read_text())
    assert "stage_server" not in kept["launch"] and "block_size" not in kept["train"]  # its code may not know them
    with pytest.raises(PipelineError, match="sampling.noise_level is 0.7 there"):  # a key that changes results
        cmp.check_run(cmp.RunSpec(cmp.Variant("tp", "tp", {"sampling.noise_level": 0.4}), 0, spec.folder), params, 2)
    monkeypatch.setattr(cmp, "run_state", lambda folder: ("done", 2, 2))  # as test_run_state_done_only_... builds
    (code / "tpgrpo" / "cli.py").unlink()
    (code / "tpgrpo" / "cli.py").write_text("# refreshed\n")
    cmp.prepare_run(spec, base, params, code, budget=2, refresh_code=True)
    assert (spec.folder / "tpgrpo/cli.py").read_text() != "# refreshed\n"  # a finished run keeps its code


def test_a_chain_folder_made_under_another_default_tree_shape_continues_and_keeps_it(tmp_path, tiny_model_dir):
    """For a default that becomes a tree: a main arm pins chains, and a chain folder made when
    the (inert) default shape was another keeps its own; a tree folder's shape still counts."""
    base = make_tiny_project(tmp_path / "base", tiny_model_dir)
    params = yaml.safe_load((base / "params.yaml").read_text())
    params["tree"].update({"enabled": True, "split_steps": "0,1", "children": "3,1"})  # as the new default
    code = cmp.snapshot_code(tmp_path / "out", REPO)
    [chain] = main_variants(["tp"], [0])
    spec = cmp.RunSpec(chain, 0, tmp_path / "out" / "tp" / "seed0")
    cmp.prepare_run(spec, base, params, code, budget=2)
    old = yaml.safe_load((spec.folder / "params.yaml").read_text())
    assert old["tree"]["enabled"] is False
    old["tree"].update({"split_steps": "0,3,6", "children": 1})  # as the old default wrote it
    (spec.folder / "params.yaml").write_text(yaml.safe_dump(old, sort_keys=False))
    cmp.prepare_run(spec, base, params, code, budget=3)  # no "a different comparison" error
    kept = yaml.safe_load((spec.folder / "params.yaml").read_text())
    assert kept["tree"] == old["tree"] and kept["train"]["iterations"] == 3
    tree = cmp.RunSpec(cmp.Variant("tree-tp", "tp", {"tree.enabled": True}), 0, tmp_path / "out" / "tree" / "seed0")
    cmp.prepare_run(tree, base, params, code, budget=2)
    made = yaml.safe_load((tree.folder / "params.yaml").read_text())
    made["tree"]["children"] = 1  # a tree's shape is what it computes
    (tree.folder / "params.yaml").write_text(yaml.safe_dump(made, sort_keys=False))
    with pytest.raises(PipelineError, match="tree.children is 1 there"):
        cmp.check_run(tree, params, 2)


# ---- end to end -----------------------------------------------------------------------------------------------

def cli(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")
    res = subprocess.run([sys.executable, str(REPO / "bench" / "compare_modes.py"), *args], capture_output=True,
                         text=True, env=env)
    assert res.returncode == 0, res.stdout + res.stderr
    return res


def stages_ran(log: Path, since: int) -> set[str]:
    """Stages the log says ran after byte ``since`` (a byte offset: progress bars write multi-byte characters,
    so a character offset would skip lines, more of them the more often a bar redraws)."""
    text = log.read_bytes()[since:].decode()
    return {line.split("'")[1] for line in text.splitlines() if line.startswith("Running stage")}


@pytest.mark.slow
def test_comparison_end_to_end_with_resume_and_report(tmp_path, tiny_model_dir):
    from PIL import Image

    base = make_tiny_project(tmp_path / "base", tiny_model_dir)
    out = tmp_path / "cmp"
    run = ["run", "--base", str(base), "--out", str(out), "--modes", "flow_grpo,tp", "--seeds", "0,1",
           "--iterations", "2", "--set", "task.eval_reward=jpeg_compressibility", "--jobs", "2", "--threads", "1"]
    cli(*run)
    folders = {f"{v}/seed{s}": out / v / f"seed{s}" for v in ("flow_grpo", "tp") for s in (0, 1)}
    assert all(cmp.run_state(f)[0] == "done" for f in folders.values())

    # resume: iteration 2 of one run loses its eval; only that run runs again, and only eval-0002: its logs
    # come back the same bytes (seconds are in untracked sidecars), so the summary is up to date
    victim = folders["tp/seed1"]
    (victim / "data/iters/0002/eval.parquet").unlink()
    (victim / "data/iters/0002/eval.json").unlink()
    sizes = {k: (f / "run.log").stat().st_size for k, f in folders.items()}
    cli(*run)
    assert {k for k, f in folders.items() if (f / "run.log").stat().st_size != sizes[k]} == {"tp/seed1"}
    assert stages_ran(victim / "run.log", sizes["tp/seed1"]) == {"eval-0002"}
    assert cmp.run_state(victim)[0] == "done"  # its eval.json is newer than summary.json: DVC says so

    cli("equal-wall", "--out", str(out), "--jobs", "2", "--threads", "1")
    [wall] = json.loads((out / "equal_wall.json").read_text())  # one record per target
    assert wall["iterations"] >= 2 and wall["ratio"] > 0

    md = tmp_path / "docs" / "replication.md"
    cli("report", "--results", str(out), "--out", str(md), "--n-boot", "500")
    curves = pd.read_csv(out / "results" / "curves.csv")
    flow_iters = wall["iterations"]
    assert len(curves) == 2 * 3 + 2 * (flow_iters + 1)  # tp: 0..2 per seed; flow_grpo 0..its iterations
    assert curves["eval_reward"].notna().all() and (curves["cum_seconds"].diff().dropna() != 0).any()
    pairs = pd.read_csv(out / "results" / "pairs.csv").set_index(["a", "b", "kind"])
    row = pairs.loc[("tp", "flow_grpo", "iteration")]
    assert float(row["iteration_a"]) == float(row["iteration_b"]) == 2 and row["seeds"] == "0,1"
    assert row["reward_lo"] <= row["reward_diff"] <= row["reward_hi"]
    side = [(folders[f"tp/seed{s}"], 2) for s in (0, 1)]
    self_diff = paired_difference(side, side, n_boot=200)
    assert (self_diff["reward_diff"], self_diff["reward_lo"], self_diff["reward_hi"]) == (0.0, 0.0, 0.0)
    for name in ("reward_vs_iteration", "reward_vs_wall", "paired_differences", "tp_rate_per_step"):
        with Image.open(md.parent / "replication" / f"cmp-{name}.png") as image:
            assert image.format == "PNG"
    assert "TP-GRPO beats Flow-GRPO at equal wall-clock time" in md.read_text()


def test_a_run_finds_its_code_snapshot_from_a_relative_comparison_root(tmp_path, monkeypatch):
    from tpgrpo.comparison.runs import run_env

    (tmp_path / "out" / "tp" / "seed0").mkdir(parents=True)
    monkeypatch.chdir(tmp_path)
    # the run's processes start inside the run folder: a relative PYTHONPATH would point nowhere from there
    assert run_env(Path("out/tp/seed0"), 1)["PYTHONPATH"] == str(tmp_path / "out" / "tp" / "seed0")
