"""Sealed blocks' records under damage and concurrency: refused with one line, nothing written (fast: files
sealed by hand, no training)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from test_sealing import _four_iterations_sealed

from tpgrpo.config import config_from_dict
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.long_runs.blocks import Block, read_lock, write_lock
from tpgrpo.pipeline.long_runs.sealing import unseal_changed


def _files(root: Path) -> dict[str, bytes]:
    """Every file of the project but params.yaml, by path (what a refusal must leave as it was)."""
    return {str(p.relative_to(root)): p.read_bytes() for p in sorted(root.rglob("*"))
            if p.is_file() and p.name != "params.yaml" and ".dvc/tmp" not in str(p)}


def _edited(root: Path) -> dict:
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["credit"]["adv_clip"] = 4.0
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    return raw


def _tpgrpo(root: Path, *args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return subprocess.run([sys.executable, "-m", "tpgrpo", *args], cwd=root, env=env, capture_output=True, text=True)


def test_a_missing_stage_entries_file_refuses_a_params_change_before_anything_is_written(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    write_lock(root, lock)
    Block(1, 2).entries_path(root).unlink()  # lost: e.g. not committed to git with the rest
    raw = _edited(root)
    before = _files(root)
    with pytest.raises(PipelineError) as err:
        unseal_changed(root, config_from_dict(raw), raw)
    assert "\n" not in str(err.value) and "0001-0002.stages: missing" in str(err.value)
    assert _files(root) == before  # before: dvc.lock rewritten, the seal unlinked, then a traceback
    done = _tpgrpo(root, "run")  # the CLI: one line, exit 2, and still nothing written
    assert done.returncode == 2 and done.stderr.strip().splitlines() == [f"error: {err.value}"], done.stderr
    assert "Running stage" not in done.stdout
    assert {k: v for k, v in _files(root).items() if k.startswith("data/seals") or k.endswith("dvc.lock")} == \
        {k: v for k, v in before.items() if k.startswith("data/seals") or k.endswith("dvc.lock")}


@pytest.mark.parametrize("damaged", ["data/seals/0001-0002.yaml", "data/seals/0001-0002.stages", "dvc.lock",
                                     "data/seals/0001-0002/dvc.lock"])
def test_a_damaged_record_is_one_line_naming_it(tmp_path, damaged):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    lock["stages"]["credit-0005"] = {"cmd": "x"}  # the root lock exists too
    write_lock(root, lock)
    (root / damaged).write_text("stages: {credit-0001: [unclosed\n  - : :\n")
    raw = _edited(root)
    for args in (["run"], ["dvc-yaml"], ["retain"], ["status"]):
        done = _tpgrpo(root, *args)
        lines = done.stderr.strip().splitlines()
        assert "Traceback" not in done.stderr, (args, done.stderr[-3000:])
        if args == ["run"] or done.returncode:  # the others may not need the damaged file: then they work
            assert done.returncode == 2 and len(lines) == 1 and damaged in lines[0], (args, done.stderr[-3000:])
    with pytest.raises(PipelineError, match=damaged.replace(".", r"\.")):
        unseal_changed(root, config_from_dict(raw), raw)


def test_unsealing_waits_for_no_one_it_refuses_while_dvc_holds_its_lock(tmp_path):
    root, cfg, lock = _four_iterations_sealed(tmp_path)
    write_lock(root, lock)
    subprocess.run([sys.executable, "-m", "dvc", "init", "-q", "--no-scm"], cwd=root, check=True)
    raw = _edited(root)
    holder = subprocess.Popen([sys.executable, "-c", "from dvc.repo import Repo\nr = Repo('.')\nr.lock.lock()\n"
                               "print('ready', flush=True)\nimport time\ntime.sleep(60)"], cwd=root,
                              stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "ready"
        before = _files(root)
        with pytest.raises(PipelineError, match="a DVC command is running"):
            unseal_changed(root, config_from_dict(raw), raw)
        assert _files(root) == before
    finally:
        holder.send_signal(signal.SIGTERM)
        holder.wait()
    assert list(unseal_changed(root, config_from_dict(raw), raw)) == [Block(1, 2), Block(3, 4)]
    assert "credit-0001" in read_lock(root)["stages"]
    assert not list(root.rglob("*.tmp"))  # unique temporary names, each renamed or removed
