"""A project folder DVC cannot open is one line, not DVC's traceback (tpgrpo.pipeline.rendering.project_checks).

A source archive of the project (``git archive``, a "download ZIP") holds ``.dvc/config`` but no ``.git``; DVC
then raises ``SCMError: ... is not a git repository`` from deep inside ``tpgrpo run`` and ``tpgrpo dvc-yaml``.
"""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import yaml

from conftest import tiny_params
from tpgrpo.pipeline.rendering.project_checks import in_git_repository, require_scm

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture
def archive(tmp_path) -> Path:
    """A project as a source archive gives it: params.yaml and DVC's committed config, no git repository."""
    if in_git_repository(tmp_path):
        pytest.skip(f"{tmp_path} lies inside a git repository")
    (tmp_path / ".dvc").mkdir()
    (tmp_path / ".dvc" / "config").write_text((ROOT / ".dvc" / "config").read_text())
    (tmp_path / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    return tmp_path


@pytest.mark.parametrize("command", ["run", "dvc-yaml"])
def test_project_without_git_is_one_line(archive, command):
    done = subprocess.run([sys.executable, "-m", "tpgrpo", command], cwd=archive, capture_output=True, text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [
        f"error: {archive} is a DVC project outside a git repository (a source archive?), and DVC needs one: "
        "run `git init && git add -A && git commit -m 'tpgrpo project'` there, then run this again"]
    assert not (archive / "dvc.yaml").exists()


def test_git_or_no_scm_lets_dvc_open_it(archive):
    with pytest.raises(Exception, match="outside a git repository"):
        require_scm(archive)
    (archive / ".dvc" / "config.local").write_text("[core]\n    no_scm = true\n")  # DVC's no-SCM mode
    require_scm(archive)
    (archive / ".dvc" / "config.local").unlink()
    (archive / "sub").mkdir()
    (archive / ".git").mkdir()  # found from a folder below too, as DVC searches
    require_scm(archive / "sub")
    require_scm(archive)
