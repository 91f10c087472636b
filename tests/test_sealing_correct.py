"""Sealing records only what ran on one real sealed run of a tiny project.

The run (2 iterations, one block of 2, sealed) is made once per module; each test works on a copy. Its
params.yaml writes ``update.lr: 1e-4`` and ``update.clip_range: 1e-5``: YAML 1.2 floats that PyYAML (YAML 1.1)
reads as strings, while DVC records them in dvc.lock as ``0.0001`` and ``1e-05``.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import make_tiny_project

from tpgrpo.config import load_config
from tpgrpo.pipeline.long_runs.blocks import (Block, object_path, read_as_dvc, read_lock, read_seal, write_block_entry,
                                              write_lock, write_yaml)
from tpgrpo.pipeline.dvc_integration.dvclock import RWLOCK
from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml
from tpgrpo.pipeline.long_runs.sealing import seal_finished, stage_names, stale_stages, unseal_changed

BLOCK = Block(1, 2)


def _env() -> dict:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true", OMP_NUM_THREADS="1")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def _sh(root: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    # the project's own code first: a test that edits it must run it (a stage refuses code other than the
    # project's under DVC)
    env = dict(_env(), PYTHONPATH=str(root))
    done = subprocess.run(list(args), cwd=root, env=env, capture_output=True, text=True)
    if ok:
        assert done.returncode == 0, f"{args}: {done.stdout[-2000:]} {done.stderr[-2000:]}"
    return done


def _tpgrpo(root: Path, *args: str, ok: bool = True) -> subprocess.CompletedProcess:
    return _sh(root, sys.executable, "-m", "tpgrpo", *args, ok=ok)


def _ran(output: str) -> list[str]:
    return [line.split("'")[1] for line in output.splitlines() if line.startswith("Running stage")]


def _dvc_status(root: Path) -> dict:
    return json.loads(_sh(root, sys.executable, "-m", "dvc", "status", "--json").stdout or "{}")


def _edit_params(root: Path, old: str, new: str) -> None:
    """Edit params.yaml as text (a YAML dump would rewrite 1e-4 as 0.0001)."""
    text = (root / "params.yaml").read_text()
    assert text.count(old) == 1, old
    (root / "params.yaml").write_text(text.replace(old, new))


@pytest.fixture(scope="module")
def sealed_run(tmp_path_factory, tiny_model_dir) -> Path:
    root = make_tiny_project(tmp_path_factory.mktemp("sealed") / "project", tiny_model_dir)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"].update(iterations=2, block_size=2)
    raw["update"].update(lr=0.5, clip_range=0.25)  # placeholders, rewritten as YAML 1.2 text below
    text = yaml.safe_dump(raw, sort_keys=False).replace("lr: 0.5", "lr: 1e-4").replace("clip_range: 0.25",
                                                                                       "clip_range: 1e-5")
    (root / "params.yaml").write_text(text)
    out = _tpgrpo(root, "run").stdout
    assert "sealed iters-0001-0002" in out
    return root


@pytest.fixture
def run_copy(sealed_run, tmp_path) -> Path:
    root = tmp_path / "project"
    shutil.copytree(sealed_run, root, symlinks=True)
    return root


@pytest.mark.slow
def test_yaml_1_2_values_a_second_run_unseals_nothing_and_runs_nothing(run_copy):
    root = run_copy
    raw_pyyaml = yaml.safe_load((root / "params.yaml").read_text())
    assert raw_pyyaml["update"]["lr"] == "1e-4"  # the hazard: YAML 1.1 reads a string
    assert read_as_dvc(root / "params.yaml")["update"]["clip_range"] == 1e-5
    assert "clip_range: 1e-05" in BLOCK.lockfile(root).read_text()  # as DVC records it
    lock_before = (root / "dvc.lock").read_bytes()
    out = _tpgrpo(root, "run").stdout
    assert "unsealed" not in out and "sealed" not in out and _ran(out) == []
    assert (root / "dvc.lock").read_bytes() == lock_before and BLOCK.seal_path(root).is_file()
    assert _dvc_status(root) == {}


def _unseal_by_hand(root: Path) -> dict:
    """Bring the block's per-stage entries back (as a params change would) with dvc.yaml rendered open;
    returns dvc.lock as it is then (up to date: nothing was changed on disk)."""
    params = read_as_dvc(root / "params.yaml")
    other = json.loads(json.dumps(params))
    other["credit"]["adv_clip"] = 4.0
    cfg = load_config(root / "params.yaml")
    assert list(unseal_changed(root, cfg, other)) == [BLOCK]
    write_dvc_yaml(cfg, root)
    assert stale_stages(root, stage_names(cfg, BLOCK)) == {}  # (the summary's deps changed with the layout)
    return read_lock(root)


@pytest.mark.slow
def test_a_block_whose_stage_is_stale_by_dvcs_measure_is_not_sealed(run_copy):
    root = run_copy
    cfg = load_config(root / "params.yaml")
    lock = _unseal_by_hand(root)
    # An older run's record: credit-0001 ran with another adv_clip than params.yaml says today.
    older = json.loads(json.dumps(lock))
    older["stages"]["credit-0001"]["params"]["params.yaml"]["credit"]["adv_clip"] = 3.0
    write_lock(root, older)
    notes: list[str] = []
    assert seal_finished(root, cfg, note=notes.append) == []
    assert not BLOCK.seal_path(root).exists() and "iters-0001-0002" not in read_lock(root)["stages"]
    assert len(notes) == 1 and "credit-0001" in notes[0] and "credit modified" in notes[0], notes
    write_lock(root, lock)
    # A stage re-run by hand with other params: its output no longer is what the lock entry recorded.
    table = root / "data/iters/0002/credit.parquet"
    original = table.read_bytes()
    table.unlink()  # a new file, as a stage writes it (never in place)
    table.write_bytes(original + b"\0")
    assert seal_finished(root, cfg, note=notes.append) == [] and not BLOCK.seal_path(root).exists()
    assert "credit-0002" in notes[-1], notes
    table.unlink()
    table.write_bytes(original)
    assert seal_finished(root, cfg) == [BLOCK]  # up to date again: sealed
    assert _dvc_status(root) == {}


@pytest.mark.slow
def test_a_params_edit_between_status_and_commit_does_not_seal_the_block(run_copy, monkeypatch):
    import tpgrpo.pipeline.long_runs.sealing as sealing

    root = run_copy
    cfg = load_config(root / "params.yaml")
    _unseal_by_hand(root)
    real_dvc = sealing.dvc

    def edit_then_dvc(where, *args):  # the user saves params.yaml just as the block is committed
        if args[0] == "commit":
            _edit_params(root, "adv_clip: 5.0", "adv_clip: 4.0")
        real_dvc(where, *args)

    monkeypatch.setattr(sealing, "dvc", edit_then_dvc)
    notes: list[str] = []
    assert seal_finished(root, cfg, note=notes.append) == []  # before: sealed, recording adv_clip 4.0 as run
    assert not BLOCK.seal_path(root).exists() and BLOCK.name not in read_lock(root)["stages"]
    assert len(notes) == 1 and "credit.adv_clip" in notes[0] and "while it was being sealed" in notes[0], notes
    stale = _dvc_status(root)
    assert {"credit-0001", "credit-0002"} <= set(stale), stale
    monkeypatch.setattr(sealing, "dvc", real_dvc)
    out = _tpgrpo(root, "run").stdout
    assert {"credit-0001", "credit-0002"} <= set(_ran(out)) and "sealed iters-0001-0002" in out, out
    assert _dvc_status(root) == {}


@pytest.mark.slow
def test_lowering_the_iteration_count_into_a_sealed_block_re_runs_nothing(run_copy):
    root = run_copy
    _edit_params(root, "iterations: 2", "iterations: 1")
    refused = _tpgrpo(root, "dvc-yaml", ok=False)  # rendering alone would drop the lock entries: refused
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert "iters-0001-0002" in refused.stderr and "tpgrpo run" in refused.stderr
    out = _tpgrpo(root, "run").stdout
    assert "unsealed iters-0001-0002" in out
    assert set(_ran(out)) <= {"code", "summary"}, _ran(out)  # the summary reads train.iterations
    assert "rollout-0001" in yaml.safe_load((root / "dvc.yaml").read_text())["stages"]
    assert _dvc_status(root) == {}
    _edit_params(root, "iterations: 1", "iterations: 2")
    out = _tpgrpo(root, "run").stdout
    assert set(_ran(out)) <= {"code", "summary"} and "sealed iters-0001-0002" in out, out
    assert _dvc_status(root) == {}


@pytest.mark.slow
def test_a_params_edit_after_a_code_change_re_runs_only_the_stages_it_touches(run_copy):
    root = run_copy
    with open(root / "stages/eval.py", "a") as f:
        f.write("\n_code_change = 1  # code (a comment alone changes no manifest) only the eval stages import\n")
    out = _tpgrpo(root, "run").stdout
    # before: the sealed block re-ran whole (`tpgrpo block`: rollouts, probes, updates included)
    assert "unsealed iters-0001-0002 (code changed: data/code/eval.json)" in out, out
    ran = {name.rsplit("-", 1)[0] for name in _ran(out)}
    assert ran <= {"code", "eval", "baseline", "summary"} and {"eval-0001", "eval-0002"} <= set(_ran(out)), out
    assert BLOCK.name not in _ran(out) and "sealed iters-0001-0002" in out and BLOCK.seal_path(root).is_file()
    _edit_params(root, "num_steps: 4\n  guidance_scale", "num_steps: 3\n  guidance_scale")  # eval.num_steps
    out = _tpgrpo(root, "run").stdout
    assert "unsealed iters-0001-0002 (params changed: eval.num_steps)" in out, out
    ran = {name.rsplit("-", 1)[0] for name in _ran(out)}
    assert ran <= {"code", "eval", "baseline", "summary"}, _ran(out)
    assert {"eval-0001", "eval-0002"} <= set(_ran(out)) and _dvc_status(root) == {}


def _dropped_dirs(root: Path) -> tuple[dict, dict]:
    """The block's lock outs (path -> entry) before retention, and its per-stage entries."""
    outs = {o["path"]: o for o in read_as_dvc(BLOCK.lockfile(root))["stages"][BLOCK.name]["outs"]}
    return outs, read_seal(BLOCK.entries_path(root))


@pytest.mark.slow
def test_retain_frees_only_its_own_objects_and_a_retained_block_refuses_a_leaf_param(run_copy):
    root = run_copy
    cache = root / ".dvc" / "cache"
    outs, _ = _dropped_dirs(root)
    old, kept = outs["data/iters/0001/trajectories.zarr"], outs["data/iters/0002/trajectories.zarr"]
    listing = lambda o: {f["md5"] for f in json.loads(object_path(cache, o["md5"], False).read_text())}  # noqa: E731
    old_files, kept_files = listing(old), listing(kept)
    shared = old_files & kept_files
    assert shared  # zarr metadata: the same object in both stores (retention must keep it for iteration 2)
    foreign = object_path(cache, "0123456789abcdef0123456789abcdef", False)  # e.g. an experiment's output
    foreign.parent.mkdir(parents=True, exist_ok=True)
    foreign.write_text("not this workspace's")
    _edit_params(root, "keep_trajectories: 0", "keep_trajectories: 1")
    _edit_params(root, "keep_adapter_every: 0", "keep_adapter_every: 2")
    out = _tpgrpo(root, "retain").stdout
    assert "dropped 3 artifacts" in out and "freed" in out
    assert not object_path(cache, old["md5"], False).exists()
    assert old_files - kept_files and not any(object_path(cache, m, False).exists() for m in old_files - kept_files)
    assert all(object_path(cache, m, False).exists() for m in shared) and foreign.is_file()
    shutil.rmtree(root / "data/iters/0002/trajectories.zarr")  # what is kept still checks out of the cache
    _sh(root, sys.executable, "-m", "dvc", "checkout", "-q")
    assert set(_ran(_tpgrpo(root, "run").stdout)) <= {"code"}  # params.yaml changed (retention): the code stage
    assert _dvc_status(root) == {}

    lock_before = (root / "dvc.lock").read_bytes()
    _edit_params(root, "num_steps: 4\n  guidance_scale", "num_steps: 3\n  guidance_scale")  # eval.num_steps
    refused = _tpgrpo(root, "run", ok=False)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "eval.num_steps" in lines[0] and "iters-0001-0002" in lines[0] and "retain" in lines[0]
    assert _ran(refused.stdout) == [] and (root / "dvc.lock").read_bytes() == lock_before
    _edit_params(root, "num_steps: 3\n  guidance_scale", "num_steps: 4\n  guidance_scale")
    assert set(_ran(_tpgrpo(root, "run").stdout)) <= {"code"}
    assert _dvc_status(root) == {}


@pytest.mark.slow
def test_a_run_refused_for_a_retained_block_leaves_the_pipeline_files_as_they_were(run_copy):
    """Turning the tree on reaches the block `tpgrpo retain` thinned: the run refuses in one line before it
    renders anything, so once the edit is undone `dvc status` is clean with no run in between. (The bench's
    seed 202 sequence 0: the refused run had rendered dvc.yaml and the block's pipeline file for the tree,
    and `dvc status` then listed the block's tree keys as new params.)"""
    root = run_copy
    _edit_params(root, "keep_trajectories: 0", "keep_trajectories: 1")
    _edit_params(root, "keep_adapter_every: 0", "keep_adapter_every: 2")
    assert "dropped" in _tpgrpo(root, "retain").stdout
    assert set(_ran(_tpgrpo(root, "run").stdout)) <= {"code"}  # params.yaml changed (retention): the code stage
    pipeline = [root / "dvc.yaml", BLOCK.dvcfile(root)]
    before, params = [p.read_bytes() for p in pipeline], (root / "params.yaml").read_text()
    _edit_params(root, "enabled: false", "enabled: true")
    _edit_params(root, "split_steps: 0,3,6", "split_steps: 0,1")  # fits the tiny schedule (T = 4)
    refused = _tpgrpo(root, "run", ok=False)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "iters-0001-0002" in lines[0] and "retain" in lines[0]
    assert [p.read_bytes() for p in pipeline] == before
    (root / "params.yaml").write_text(params)  # the user undoes the edit
    assert _dvc_status(root) == {}
    assert _ran(_tpgrpo(root, "run").stdout) == []


@pytest.mark.slow
def test_a_run_refused_for_a_code_edit_leaves_the_code_manifests_as_they_were(run_copy):
    """A code edit reaches the block `tpgrpo retain` thinned: the run refuses in one line, and the code
    manifests it refreshed to find that out are put back, bytes and times (the harness's seed 1700 sequence 1:
    the refused run had rewritten data/code/*.json). Once the edit is undone nothing is out of date."""
    root = run_copy
    _edit_params(root, "keep_trajectories: 0", "keep_trajectories: 1")
    _edit_params(root, "keep_adapter_every: 0", "keep_adapter_every: 2")
    assert "dropped" in _tpgrpo(root, "retain").stdout
    assert set(_ran(_tpgrpo(root, "run").stdout)) <= {"code"}
    manifests = sorted((root / "data/code").glob("*.json"))
    files = [*manifests, root / "dvc.yaml", BLOCK.dvcfile(root)]
    before = [(p.read_bytes(), p.stat().st_mtime_ns) for p in files]
    code = root / "tpgrpo/algo/credit.py"
    source = code.read_text()
    code.write_text(source + "\n_an_edit = 1  # code: a comment alone changes no manifest\n")
    refused = _tpgrpo(root, "run", ok=False)
    lines = refused.stderr.strip().splitlines()
    assert refused.returncode == 2 and len(lines) == 1, refused.stderr
    assert "code changed" in lines[0] and "iters-0001-0002" in lines[0] and "retain" in lines[0]
    assert [(p.read_bytes(), p.stat().st_mtime_ns) for p in files] == before
    code.write_text(source)  # the user undoes the edit
    assert _dvc_status(root) == {}
    assert _ran(_tpgrpo(root, "run").stdout) == []


# --- retain and DVC's lock: a hand-sealed project (fast) ---

def _hand_sealed(root: Path) -> Path:
    """A DVC project of 2 iterations in one block sealed by hand (fake hashes), retention set to drop."""
    from conftest import tiny_params

    raw = tiny_params()
    raw["train"].update(iterations=2, block_size=2)
    raw["retention"] = {"keep_trajectories": 1, "keep_adapter_every": 2}
    root.mkdir(parents=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    _sh(root, sys.executable, "-m", "dvc", "init", "-q", "--no-scm")
    from tpgrpo.pipeline.rendering.dvcfile import block_out_paths

    cfg = load_config(root / "params.yaml")
    outs = block_out_paths(cfg, BLOCK)
    write_yaml(BLOCK.entries_path(root), {"update-0002": {"cmd": "x", "outs": []}})
    write_yaml(BLOCK.seal_path(root), {"first": 1, "last": 2, "outs": outs})
    write_lock(root, {"schema": "2.0", "stages": {}})
    write_block_entry(root, BLOCK, {"cmd": "x", "outs": [{"path": p} for p in outs]})
    for path in outs:
        (root / path).parent.mkdir(parents=True, exist_ok=True)
        (root / path).write_text("x")
    return root


def _holder(root: Path, code: str) -> subprocess.Popen:
    """A live process that runs ``code`` then prints ready and sleeps."""
    proc = subprocess.Popen([sys.executable, "-c", code + "\nprint('ready', flush=True)\nimport time\n"
                             "time.sleep(120)"], cwd=root, env=_env(), stdout=subprocess.PIPE, text=True)
    assert proc.stdout.readline().strip() == "ready"
    return proc


def test_retain_refuses_while_a_dvc_process_holds_the_lock(tmp_path):
    root = _hand_sealed(tmp_path / "p")
    lock_before = (root / "dvc.lock").read_bytes()
    held = _holder(root, "from dvc.repo import Repo\nr = Repo('.')\nr.lock.lock()")
    try:
        refused = _tpgrpo(root, "retain", ok=False)
    finally:
        held.send_signal(signal.SIGTERM)
        held.wait()
    assert refused.returncode == 2 and refused.stderr.strip().splitlines() == [
        "error: .dvc/tmp/lock: a DVC command is running in this project (it holds DVC's lock); "
        "retry when it has finished"]
    assert (root / "dvc.lock").read_bytes() == lock_before and (root / "data/iters/0001/policy").exists()

    stage = _holder(root, "pass")  # a stage `dvc repro` runs: the repository lock is free, the rwlock names it
    (root / RWLOCK).write_text(json.dumps({"write": {str(root / "data/iters/0002/policy"):
                                                     {"pid": stage.pid, "cmd": "dvc repro"}}, "read": {}}))
    try:
        refused = _tpgrpo(root, "retain", ok=False)
    finally:
        stage.send_signal(signal.SIGTERM)
        stage.wait()
    assert refused.returncode == 2 and len(refused.stderr.strip().splitlines()) == 1
    assert str(stage.pid) in refused.stderr and str(RWLOCK) in refused.stderr
    assert (root / "dvc.lock").read_bytes() == lock_before
    time.sleep(0.1)
    assert "dropped 3 artifacts" in _tpgrpo(root, "retain").stdout  # the stage is gone: retain goes ahead
    assert not (root / "data/iters/0001/policy").exists()


BLOCK_STAGE = f"{BLOCK.address}"


@pytest.mark.slow
def test_a_resume_checks_sealed_blocks_by_their_files_and_a_damaged_one_still_re_runs(run_copy):
    """A no-op `tpgrpo run` has DVC check only the open stages while every sealed block's files are as DVC last
    found them (tpgrpo.pipeline.long_runs.seal_cache); any change to them sends the repro through DVC's full check."""
    root = run_copy
    out = _tpgrpo(root, "run").stdout  # the first run after the copy: inode changed, so DVC checks everything
    assert _ran(out) == [] and f"'{BLOCK_STAGE}' didn't change" in out, out
    out = _tpgrpo(root, "run").stdout  # vouched: the block is not even looked at
    assert _ran(out) == [] and BLOCK_STAGE not in out and "'summary' didn't change" in out, out
    stamp = time.time() - 3600
    os.utime(root / "data/iters/0001/probe.parquet", (stamp, stamp))  # a touch: checked again, nothing runs
    out = _tpgrpo(root, "run").stdout
    assert _ran(out) == [] and f"'{BLOCK_STAGE}' didn't change" in out, out
    table = root / "data/iters/0002/credit.parquet"
    original = table.read_bytes()
    table.write_bytes(original[:-8] + b"\0" * 8)  # damaged in place, same size
    out = _tpgrpo(root, "run").stdout
    redone = lambda: BLOCK_STAGE in _ran(out) or f"'{BLOCK_STAGE}' is cached - skipping run" in out  # noqa: E731
    assert redone() and table.read_bytes() == original, out  # re-run whole (or restored from DVC's run cache)
    assert _dvc_status(root) == {}
    table.unlink()
    out = _tpgrpo(root, "run").stdout
    assert redone() and table.read_bytes() == original and _dvc_status(root) == {}, out
