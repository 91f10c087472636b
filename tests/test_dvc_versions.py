"""tpgrpo's patches of DVC's internals run only on the DVC they were verified on (tpgrpo.io.dvc_versions).

- The source of every DVC and dvc-data function the patches replace, copy, wrap or rely on is pinned by hash:
  a DVC whose functions changed fails here, even under the same version string.
- Another installed version (faked by a dist-info folder ahead on PYTHONPATH) is refused in one line that names
  both versions, with exit code 2, by the DVC wrapper that `tpgrpo run` calls, by `tpgrpo run` itself, and by
  each patch called in-process.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from tpgrpo.io import dvc_versions
from tpgrpo.io.dvc_versions import SOURCES, VERIFIED, DvcVersionError

ROOT = Path(__file__).resolve().parents[1]


def test_verified_versions_are_the_pinned_ones():
    pins = dict(line.split("==") for line in (ROOT / "constraints.txt").read_text().splitlines()
                if "==" in line and not line.startswith("#"))
    assert {name: pins[name] for name in VERIFIED} == VERIFIED
    assert f'"dvc=={VERIFIED["dvc"]}"' in (ROOT / "pyproject.toml").read_text()
    assert dvc_versions.installed_versions() == VERIFIED


def test_sources_of_the_patched_dvc_functions_are_the_verified_ones():
    # a fresh interpreter: in this one a test may have installed the patches over the originals
    code = ("import json; from tpgrpo.io.dvc_versions import SOURCES, source_digest; "
            "print(json.dumps({name: source_digest(name) for name in SOURCES}))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    found = json.loads(done.stdout)
    changed = {name: digest for name, digest in found.items() if digest != SOURCES[name]}
    assert not changed, (f"DVC's source changed in {sorted(changed)}: read the diff, port tpgrpo's copies, then "
                         f"set these hashes in tpgrpo/io/dvc_versions.py: {changed}")


def test_source_digest_sees_a_change(monkeypatch):
    import inspect

    name = "dvc.rwlock:_edit_rwlock"
    before = dvc_versions.source_digest(name)
    monkeypatch.setattr(inspect, "getsource", lambda obj: "changed")
    assert dvc_versions.source_digest(name) != before


def fake_version(folder: Path, dist: str, version: str) -> dict[str, str]:
    """An environment whose ``importlib.metadata.version(dist)`` is ``version``: a dist-info folder in
    ``folder``, ahead of site-packages on PYTHONPATH (the modules still import from site-packages)."""
    info = folder / f"{dist.replace('-', '_')}-{version}.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: {version}\n")
    path = os.pathsep.join(p for p in (str(folder), os.environ.get("PYTHONPATH", "")) if p)
    return dict(os.environ, PYTHONPATH=path, DVC_NO_ANALYTICS="1")


def refusal_line(installed: str) -> str:
    return (f"error: tpgrpo's DVC patches were verified on dvc {VERIFIED['dvc']} / dvc-data {VERIFIED['dvc-data']}; "
            f"installed {installed}: pin them (pip install dvc=={VERIFIED['dvc']} dvc-data=={VERIFIED['dvc-data']}, "
            "or pip install -c constraints.txt -e '.[test]')")


@pytest.mark.parametrize("dist,version", [("dvc", "3.68.0"), ("dvc-data", "3.19.0")])
def test_dvc_wrapper_refuses_another_version_in_one_line(tmp_path, dist, version):
    env = fake_version(tmp_path / "site", dist, version)
    done = subprocess.run([sys.executable, "-m", "tpgrpo.pipeline.dvc_integration.dvc_atomic", "status"], cwd=tmp_path,
                          env=env, capture_output=True, text=True)
    installed = dict(VERIFIED, **{dist: version})
    assert done.returncode == 2
    assert done.stderr.splitlines() == [refusal_line(f"dvc {installed['dvc']} / dvc-data {installed['dvc-data']}")]


def test_tpgrpo_run_refuses_another_version_in_one_line(tmp_path):
    env = fake_version(tmp_path / "site", "dvc", "3.68.0")
    (tmp_path / "params.yaml").write_text("{}\n")
    done = subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=tmp_path, env=env, capture_output=True,
                          text=True)
    assert done.returncode == 2
    assert done.stderr.splitlines() == [refusal_line(f"dvc 3.68.0 / dvc-data {VERIFIED['dvc-data']}")]
    assert not (tmp_path / ".dvc").exists()  # refused before anything was written


def test_each_patch_refuses_in_process(monkeypatch, tmp_path):
    from dvc import dvcfile

    from tpgrpo.io import dvc_prehash
    from tpgrpo.pipeline.dvc_integration import dvc_atomic, lock_blocks

    monkeypatch.setattr(dvc_versions, "installed_versions", lambda: dict(VERIFIED, dvc="4.0.0"))
    before = dvcfile.Lockfile.dump_stages
    for patch in (dvc_atomic.install, lambda: lock_blocks.install(dvc_atomic.atomic_write_text)):
        with pytest.raises(DvcVersionError, match=r"installed dvc 4\.0\.0 / dvc-data"):
            patch()
    assert dvcfile.Lockfile.dump_stages is before  # nothing patched
    (tmp_path / ".dvc").mkdir()
    with pytest.raises(DvcVersionError, match="verified on dvc"):
        dvc_prehash.dvc_cache_placer(tmp_path / "data" / "trajectories.zarr")
    assert dvc_versions.refusal(VERIFIED) is None


def test_install_doc_shows_the_refusal_as_printed():
    line = "error: " + dvc_versions.refusal(dict(VERIFIED, dvc="3.68.0"))
    assert line in (ROOT / "docs" / "install.md").read_text()
