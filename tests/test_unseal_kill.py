"""Unsealing killed at every point (SIGKILL at each file-system change it makes): `dvc status` never fails,
and the next run's unsealing ends in the state an uninterrupted one leaves, with each stage's entry as the
block's own lock entry last recorded it. Fast: hand-made sealed blocks in a real DVC project (no stage runs);
the same through a real `tpgrpo run` is slow, at the end."""

from __future__ import annotations

import json
import os
import random
import shutil
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest
import yaml
from conftest import tiny_params

from tpgrpo.config import config_from_dict
from tpgrpo.pipeline.long_runs.blocks import (Block, param_values, read_as_dvc, read_lock, seal_files, sweep_unsealed,
                                              write_block_entry, write_lock, write_yaml)
from tpgrpo.pipeline.rendering.dvcfile import block_out_paths, block_stage, iteration_stages, write_dvc_yaml

TESTS = Path(__file__).resolve().parent
REPO = TESTS.parent
KILLER = TESTS / "kill_points.py"
WITHIN = ["tpgrpo.pipeline.long_runs.sealing:unseal_changed"]

# What `tpgrpo run` does around its unsealings, without the repros: prepare (sweeps leftovers, unseals what a
# structural change reaches), then per repro end before_repro (unseals what it reaches) and the repro's render.
PROGRAM = textwrap.dedent("""
    from pathlib import Path
    from tpgrpo.config import load_config
    from tpgrpo.pipeline import long_run
    from tpgrpo.pipeline.long_runs.blocks import read_as_dvc
    from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml

    root = Path.cwd()
    cfg, raw = load_config(root / "params.yaml"), read_as_dvc(root / "params.yaml")
    pending = long_run.prepare(root, cfg, raw, print)
    write_dvc_yaml(cfg, root)
    for upto in long_run.repro_ends(root, cfg, pending):
        long_run.before_repro(root, cfg, raw, upto, print)
        write_dvc_yaml(cfg, root, upto)
""")


def _env(root: Path) -> dict[str, str]:
    return dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true",
                PYTHONPATH=os.pathsep.join([str(root), str(REPO)]))


def _sealed_project(root: Path) -> Path:
    """4 iterations in two sealed blocks of 2, in a DVC project. Each block's own entry records newer outputs
    than its stage entries at sealing (as after `tpgrpo block` re-ran it for a code change): unsealing must
    restore the newer ones."""
    raw = tiny_params(train={"iterations": 4, "block_size": 2})
    root.mkdir(parents=True)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=root, env=_env(root), check=True)
    cfg = config_from_dict(raw)
    for block in (Block(1, 2), Block(3, 4)):
        entries = {}
        for i in block.iterations:
            for name, stage in iteration_stages(cfg, i).items():
                outs = [next(iter(o)) if isinstance(o, dict) else o for o in stage["outs"]]
                entries[name] = {"cmd": stage["cmd"], "outs": [{"path": p, "hash": "md5", "md5": f"{len(p):032x}"}
                                                               for p in outs]}
        write_yaml(block.entries_path(root), entries)
        write_yaml(block.seal_path(root), {"first": block.first, "last": block.last,
                                           "outs": block_out_paths(cfg, block)})
        params = param_values(raw, block_stage(cfg, block)["params"])
        write_block_entry(root, block, {"cmd": "x", "params": {"params.yaml": params},
                                        "outs": [{"path": p, "hash": "md5", "md5": f"{len(p) + 1:032x}"}
                                                 for p in block_out_paths(cfg, block)]})
    write_lock(root, {"schema": "2.0", "stages": {}})
    write_dvc_yaml(cfg, root)
    raw["credit"]["mode"] = "incremental"  # reaches both blocks' credit stages: each is unsealed as a repro nears
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    (root / "program.py").write_text(PROGRAM)
    return root


def _run(root: Path, at: int, count: Path | None = None) -> subprocess.CompletedProcess:
    args = [sys.executable, str(KILLER), "--at", str(at), *[a for w in WITHIN for a in ("--within", w)]]
    args += ["--count", str(count)] if count else []
    return subprocess.run([*args, "-m", "program"], cwd=root, env=_env(root), capture_output=True, text=True,
                          start_new_session=True)


def _dvc_status(root: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", "status", "--json"], cwd=root, env=_env(root),
                          capture_output=True, text=True)


def _state(root: Path) -> dict:
    """What unsealing decides: the root lock's stages, the files under data/seals, dvc.yaml."""
    seals = sorted(p.relative_to(root).as_posix() for p in (root / "data" / "seals").rglob("*")) \
        if (root / "data" / "seals").is_dir() else []
    return {"lock": read_lock(root)["stages"], "seals": seals, "dvc.yaml": (root / "dvc.yaml").read_text()}


@pytest.fixture(scope="module")
def template(tmp_path_factory) -> Path:
    return _sealed_project(tmp_path_factory.mktemp("unseal") / "project")


# `dvc status`, then `dvc dag` (it builds the whole graph as `dvc repro` does, and refuses an output that two
# pipeline files list: `dvc status` does not check that), in one process: the first failure's exit code.
WEDGED = "from dvc.cli import main; import sys; sys.exit(main(['status']) or main(['dag']))"


def _dvc_wedged(root: Path) -> str | None:
    """None when DVC works in ``root`` (:data:`WEDGED`), else the failure."""
    done = subprocess.run([sys.executable, "-c", WEDGED], cwd=root, env=_env(root), capture_output=True, text=True)
    return None if done.returncode == 0 else f"rc {done.returncode}: {done.stderr.strip()[-600:]}"


def _kill_points(template: Path, tmp_path: Path, pick) -> None:
    """Unseal on a copy of ``template`` uninterrupted (the control), then on fresh copies SIGKILLed at each
    point ``pick(points)`` chooses; after each kill DVC works, and the next run ends in the control's state."""
    control = tmp_path / "control"
    shutil.copytree(template, control, symlinks=True)
    done = _run(control, 0, count=tmp_path / "count")
    assert done.returncode == 0, done.stderr
    points = int((tmp_path / "count").read_text())
    want = _state(control)
    assert not seal_files(control) and want["seals"] == []  # both blocks unsealed
    assert {e["outs"][0]["md5"] for e in want["lock"].values()} == {
        f"{len(e['outs'][0]['path']) + 1:032x}" for e in want["lock"].values()}  # the blocks' newer records
    assert points >= 10, points  # two unsealings: lock writes, pipeline files, lock files, folders, seals
    for at in pick(points):
        root = tmp_path / f"at{at}"
        shutil.copytree(template, root, symlinks=True)
        killed = _run(root, at)
        assert killed.returncode == -9, (at, killed.stderr[-800:])
        assert _dvc_wedged(root) is None, at  # before any repair: a user's own DVC commands
        again = _run(root, 0)
        assert again.returncode == 0, (at, again.stderr[-800:])
        assert _dvc_wedged(root) is None, at
        assert _state(root) == want, at
        shutil.rmtree(root)


def test_unsealing_killed_at_random_points_leaves_dvc_working_and_ends_as_if_never_killed(template, tmp_path):
    _kill_points(template, tmp_path, lambda points: sorted(random.Random(63).sample(range(1, points + 1), 3)))


@pytest.mark.slow
def test_unsealing_killed_at_every_point_leaves_dvc_working_and_ends_as_if_never_killed(template, tmp_path):
    _kill_points(template, tmp_path, lambda points: range(1, points + 1))


def test_a_leftover_block_folder_without_its_seal_is_swept_before_rendering(template, tmp_path):
    """What older versions left when killed between deleting the seal file and the folder: with the block's
    iterations rendered as stages too, DVC refused every command. The next run removes it first."""
    root = tmp_path / "project"
    shutil.copytree(template, root, symlinks=True)
    Block(1, 2).seal_path(root).unlink()  # the old order's first step, then the kill
    Block(1, 2).entries_path(root).unlink()
    lock = read_lock(root)
    entries = json.loads(json.dumps(read_as_dvc(Block(1, 2).lockfile(root))))
    lock["stages"].update({n: {"cmd": n} for n in ("rollout-0001", "probe-0001")})
    write_lock(root, lock)
    cfg = config_from_dict(read_as_dvc(root / "params.yaml"))
    write_dvc_yaml(cfg, root)  # what a render without the sweep makes of it
    broken = _dvc_wedged(root)
    assert broken and "is specified in" in broken  # the failure the sweep prevents
    assert entries  # (the block's own entry was still there: only the seal was gone)
    assert sweep_unsealed(root) == ["data/seals/0001-0002"]
    assert _dvc_wedged(root) is None
    assert sweep_unsealed(root) == []
    assert Block(3, 4).dvcfile(root).is_file() and Block(3, 4).entries_path(root).is_file()  # still sealed


def test_a_stray_stage_entries_file_is_swept_and_a_sealed_block_kept(tmp_path):
    seals = tmp_path / "data" / "seals"
    (seals / "0001-0002").mkdir(parents=True)
    (seals / "0001-0002.yaml").write_text("first: 1\n")
    (seals / "0001-0002.stages").write_text("{}\n")
    (seals / "0003-0004.stages").write_text("{}\n")
    (seals / ".0005-0006.yaml.x.tmp").write_text("")
    assert sweep_unsealed(tmp_path) == ["data/seals/0003-0004.stages"]
    assert sorted(p.name for p in seals.iterdir()) == [".0005-0006.yaml.x.tmp", "0001-0002", "0001-0002.stages",
                                                       "0001-0002.yaml"]


@pytest.mark.slow
def test_a_real_run_killed_while_unsealing_leaves_dvc_working_and_the_next_run_finishes_clean(
        tiny_project, tmp_path):
    """A trained project of 4 iterations, blocks of 2, both sealed; a leaf param edited reaches both blocks;
    `tpgrpo run` SIGKILLed at seeded random points of its unsealings: `dvc status` works right after, the
    next `tpgrpo run` finishes and `dvc status` is clean."""
    root = tiny_project
    env = _env(root)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"].update(iterations=4, block_size=2)
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    subprocess.run(["git", "init", "-q"], cwd=root, check=True)
    first = subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=root, env=env, capture_output=True, text=True)
    assert first.returncode == 0, first.stderr[-2000:]
    assert len(seal_files(root)) == 2
    template = tmp_path / "template"
    shutil.copytree(root, template, symlinks=True)
    rng = random.Random(63)
    for value in (3, 2):
        project = tmp_path / f"eval{value}"
        shutil.copytree(template, project, symlinks=True)
        raw["eval"]["num_steps"] = value
        (project / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
        count = tmp_path / "count"
        at = rng.randint(1, 8)
        args = [sys.executable, str(KILLER), "--at", str(at), "--within", WITHIN[0], "--count", str(count),
                "-m", "tpgrpo", "run"]
        killed = subprocess.run(args, cwd=project, env=_env(project), capture_output=True, text=True,
                                start_new_session=True)
        assert killed.returncode == -9, (at, killed.stderr[-1500:])
        status = _dvc_status(project)
        assert status.returncode == 0, (at, status.stderr[-800:])
        done = subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=project, env=_env(project),
                              capture_output=True, text=True)
        assert done.returncode == 0, (at, done.stderr[-2000:])
        clean = _dvc_status(project)
        assert clean.returncode == 0 and json.loads(clean.stdout or "{}") == {}, (at, clean.stdout[-800:])


def test_a_block_whose_folder_went_keeps_the_stage_entries_its_unsealing_already_restored(template, tmp_path):
    """Killed after the block's folder (and its own lock entry) went, before its seal: the root lock already
    holds each stage as the block's entry recorded it; unsealing again must not put back the older entries
    written at sealing (DVC would re-run every stage a code change had re-run since)."""
    root = tmp_path / "project"
    shutil.copytree(template, root, symlinks=True)
    from tpgrpo.pipeline.long_runs.sealing import unseal_changed

    raw = read_as_dvc(root / "params.yaml")
    cfg = config_from_dict(raw)
    block = Block(1, 2)
    newer = unseal_changed(root, cfg, raw, upto=2) and read_lock(root)["stages"]
    assert newer and not block.seal_path(root).exists()
    shutil.copytree(template / "data" / "seals", root / "data" / "seals", dirs_exist_ok=True)
    shutil.rmtree(block.folder(root))  # the state such a kill leaves: seal and entries, no folder, root entries
    assert unseal_changed(root, cfg, raw, upto=2) == {block: "it has no dvc.lock entry"}
    assert read_lock(root)["stages"] == newer
