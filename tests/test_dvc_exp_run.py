"""`dvc exp run -S ...` (the README's own command) runs what `tpgrpo run` renders, or refuses with one line.

The failure it guards against: dvc.yaml is rendered from params.yaml by `tpgrpo run`, and `dvc exp run -S credit.mode=
flow_grpo` changed params.yaml without re-rendering: it ran probes Flow-GRPO does not need, then failed on a
figure the summary no longer draws, and recorded no experiment. Now every credit mode renders the same
stages, and a param that changes the stages (train.iterations, eval.every, ...) is refused by the code stage.
"""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import yaml
from conftest import make_tiny_project
from test_dvc_pipeline import env, ran, tpgrpo_run

pytestmark = pytest.mark.slow


def _git(root, *args):
    subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)


def _dvc(root, *args) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=env(), capture_output=True, text=True)


def test_dvc_exp_run_for_each_credit_mode_gives_what_tpgrpo_run_gives(tmp_path, tiny_model_dir):
    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    raw = yaml.safe_load((root / "params.yaml").read_text())
    raw["train"]["iterations"] = 1
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))
    _git(root, "init", "-q")
    _git(root, "config", "user.email", "ci@example.com")
    _git(root, "config", "user.name", "ci")
    first = tpgrpo_run(root)
    assert first.returncode == 0, first.stdout[-3000:] + first.stderr[-3000:]
    _git(root, "add", "-A")
    _git(root, "commit", "-q", "-m", "finished run")
    d = root / "data" / "iters" / "0001"
    for mode in ("flow_grpo", "incremental", "tp_unconstrained", "tp"):
        done = _dvc(root, "exp", "run", "-S", f"credit.mode={mode}")
        assert done.returncode == 0, f"{mode}: " + done.stdout[-3000:] + done.stderr[-3000:]
        assert json.loads((d / "credit.json").read_text())["mode"] == mode
        passes = json.loads((d / "probe.json").read_text())["forward_passes"]
        assert (passes == 0) == (mode == "flow_grpo"), (mode, passes)  # Flow-GRPO's probe loads no model
        # `tpgrpo run` on the result renders the same dvc.yaml and finds nothing to run
        again = tpgrpo_run(root)
        assert again.returncode == 0 and ran(again.stdout) == set(), (mode, again.stdout[-2000:])
        status = _dvc(root, "status")
        assert status.returncode == 0 and "up to date" in status.stdout, status.stdout
    listed = _dvc(root, "exp", "list", "--name-only")
    assert listed.returncode == 0 and len(listed.stdout.split()) == 4, listed.stdout

    refused = _dvc(root, "exp", "run", "-S", "train.iterations=2")  # the stages themselves would change
    assert refused.returncode != 0
    assert "dvc.yaml was rendered from other params than params.yaml's" in refused.stdout + refused.stderr
    assert not (root / "data" / "iters" / "0002").exists()
    # switching the tree on changes what the rollout lists (the tree section): refused too, not run on the chain's
    # dvc.yaml (the code stage lists tree.enabled)
    refused = _dvc(root, "exp", "run", "-S", "tree.enabled=true", "-S", "tree.split_steps='0,1'")  # quoted: no sweep
    assert refused.returncode != 0
    assert "dvc.yaml was rendered from other params than params.yaml's" in refused.stdout + refused.stderr
