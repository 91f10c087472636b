"""`tpgrpo run` renders dvc.yaml once per repro and hashes the code once per repro: no render of the whole run
before the first repro, no second refresh of the manifests right after the first."""

from __future__ import annotations

import subprocess
from types import SimpleNamespace

import pytest
import yaml
from typer.testing import CliRunner

from conftest import make_tiny_project, tiny_params


@pytest.mark.parametrize("iterations,block_size,repros", [(2, 0, [2]), (4, 2, [2, 4])])
def test_run_renders_and_refreshes_once_per_repro(tmp_path, tiny_model_dir, monkeypatch, iterations, block_size,
                                                  repros):
    from tpgrpo import cli
    from tpgrpo.pipeline import long_run, repro
    from tpgrpo.pipeline.rendering import code_manifest, dvcfile

    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    if subprocess.run(["git", "init", "-q", str(root)]).returncode != 0:
        pytest.skip("no git")
    params = tiny_params(train={"iterations": iterations, "block_size": block_size},
                         launch={"stage_server": False})
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    (root / "data" / "code").mkdir()  # a project whose code stage ran: the manifests are refreshed

    renders, refreshes, dvc_calls = [], [], []
    real_write, real_refresh = dvcfile.write_dvc_yaml, code_manifest.refresh_manifests
    monkeypatch.setattr(dvcfile, "write_dvc_yaml", lambda cfg, r, upto=None: renders.append(upto)
                        or real_write(cfg, r, upto))
    monkeypatch.setattr(code_manifest, "refresh_manifests", lambda r, cfg=None: refreshes.append(1)
                        or real_refresh(r, cfg))
    # DVC itself is not the subject: each repro "succeeds" without running a stage, nothing is sealed
    monkeypatch.setattr(repro, "subprocess", SimpleNamespace(run=lambda args, **kw: dvc_calls.append(args)
                                                              or subprocess.CompletedProcess(args, 0)))
    monkeypatch.setattr(long_run, "after_repro", lambda *args, **kw: None)

    result = CliRunner().invoke(cli.app, ["run", "--params", str(root / "params.yaml")])
    assert result.exit_code == 0, result.output
    assert [c[-1] for c in dvc_calls] == ["repro"] * len(repros)  # one repro per block end
    assert renders == repros  # one render each, through that repro's end; none of the whole run before
    assert len(refreshes) == len(repros)  # the run's own refresh, then one per later repro
    assert yaml.safe_load((root / "dvc.yaml").read_text())["stages"]  # what the last repro rendered stays
