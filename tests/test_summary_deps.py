"""The summary of a sealed run re-runs whenever a block does.

It depended on each sealed block's last credit table only, so a re-run of a block that changed only logged
numbers (approx KL, grad norm, wall seconds) left summary.json, the curves and `dvc metrics show` stale. Now
each block writes a digest of the logs and tables the summary reads, and the summary depends on it.
"""

from __future__ import annotations

import subprocess
import sys

import pandas as pd
import pytest
from conftest import make_tiny_project
from test_dvc_pipeline import env, ran, sealed_run

from tpgrpo.config import config_from_dict
from tpgrpo.pipeline.long_runs.block_logs import digest_path, write_digest
from tpgrpo.pipeline.long_runs.blocks import Block
from tpgrpo.pipeline.rendering.dvcfile import summary_stage


def test_a_sealed_blocks_summary_dependency_is_its_log_digest(tmp_path):
    from conftest import tiny_params

    cfg = config_from_dict(tiny_params(train={"iterations": 4, "block_size": 2}))
    deps = summary_stage(cfg, [3, 4], [Block(1, 2)])["deps"]
    assert digest_path(Block(1, 2)) in deps and "data/iters/0002/credit.parquet" not in deps
    d = tmp_path / "data" / "iters" / "0001"
    d.mkdir(parents=True)
    (d / "update.json").write_text('{"approx_kl_after": 1e-6}')
    first = write_digest(tmp_path, Block(1, 2)).read_bytes()
    (d / "update.json").write_text('{"approx_kl_after": 2e-6}')  # a logged number only
    assert write_digest(tmp_path, Block(1, 2)).read_bytes() != first


@pytest.mark.slow
def test_rerunning_a_sealed_block_changes_no_log_so_the_summary_stays_up_to_date(tmp_path, tiny_model_dir):
    """A forced re-run of a sealed block writes its logs and tables byte for byte again (seconds and
    process counts are in untracked sidecars), so its digest is the same and nothing after it runs; a log
    whose number changed still changes the digest (the test above)."""
    root = sealed_run(make_tiny_project(tmp_path / "project", tiny_model_dir), iterations=2, block_size=2)
    digest = (root / digest_path(Block(1, 2))).read_bytes()
    sidecar = root / "data" / "iters" / "0001" / "update.timing.json"
    seconds = sidecar.read_bytes()
    block = "data/seals/0001-0002/dvc.yaml:iters-0001-0002"  # a sealed block's stage is in its own pipeline file
    again = subprocess.run([sys.executable, "-m", "dvc", "repro", "--force", "--single-item", block],
                           cwd=root, env=env(), capture_output=True, text=True)
    assert again.returncode == 0, again.stdout[-3000:] + again.stderr[-3000:]
    assert sidecar.read_bytes() != seconds  # the block did run again (its stages wrote new seconds)
    assert (root / digest_path(Block(1, 2))).read_bytes() == digest
    after = subprocess.run([sys.executable, "-m", "dvc", "repro"], cwd=root, env=env(), capture_output=True,
                           text=True)
    assert ran(after.stdout) == set(), after.stdout
    history = pd.read_csv(root / "data" / "metrics" / "history.csv").set_index("iteration")
    assert (history.loc[[1, 2], "update_wall_seconds"] > 0).all()  # read from the sidecars when it ran
    status = subprocess.run([sys.executable, "-m", "dvc", "status"], cwd=root, env=env(), capture_output=True,
                            text=True)
    assert "up to date" in status.stdout, status.stdout
