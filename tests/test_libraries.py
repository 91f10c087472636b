"""Libraries whose version does not pin their files (tpgrpo.pipeline.rendering.libraries): an editable install
(PEP 610), a module shadowed by another copy, a module no distribution provides. Each is recorded by the md5 of
the files that would be imported, so an edit there changes the manifests of the kinds that import it, a stage
refuses it under DVC, and the stage server stops serving its stale imports. Fake distributions in a temporary site
folder."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
from conftest import REPO

import tpgrpo.pipeline.rendering.libraries as libs
from tpgrpo.pipeline.rendering.code_manifest import check_code, manifest_path, unpinned_sources, write_manifests

CACHES = (libs._providers, libs._requirements, libs._provided, libs.editable_folders)


@pytest.fixture
def site(tmp_path, monkeypatch):
    """A site folder on sys.path (fresh metadata caches before and after) and a maker of fake distributions."""
    folder = tmp_path / "site"
    folder.mkdir()
    monkeypatch.syspath_prepend(str(folder))
    for cache in CACHES:
        cache.cache_clear()
    yield folder
    for cache in CACHES:
        cache.cache_clear()


def _distribution(site: Path, name: str, editable_from: Path | None = None) -> None:
    """``name`` 1.0 installed in ``site``: its module in ``site`` itself, or an editable install of
    ``editable_from`` (its module there, the folder on sys.path as a .pth file would put it)."""
    info = site / f"{name}-1.0.dist-info"
    info.mkdir()
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {name}\nVersion: 1.0\n")
    (info / "top_level.txt").write_text(f"{name}\n")
    (info / "RECORD").write_text("")
    home = editable_from or site
    (home / name).mkdir(parents=True)
    (home / name / "__init__.py").write_text("VALUE = 1\n")
    if editable_from is not None:
        (info / "direct_url.json").write_text(json.dumps({"url": editable_from.as_uri(),
                                                          "dir_info": {"editable": True}}))


def test_an_editable_install_is_recorded_by_its_sources(site, tmp_path, monkeypatch):
    checkout = tmp_path / "checkout"
    _distribution(site, "fakelib", editable_from=checkout)
    monkeypatch.syspath_prepend(str(checkout))
    _distribution(site, "plainlib")
    assert libs.editable_folders()["fakelib"] == checkout and "plainlib" not in libs.editable_folders()
    first = libs.library_versions(["fakelib", "plainlib"])
    assert first["plainlib"] == "1.0" and first["fakelib"].startswith("1.0 editable ")
    (checkout / "fakelib" / "extra.py").write_text("")  # a new module of it
    second = libs.library_versions(["fakelib"])["fakelib"]
    (checkout / "fakelib" / "__init__.py").write_text("VALUE = 2\n")  # an edit: the same version
    third = libs.library_versions(["fakelib"])["fakelib"]
    assert len({first["fakelib"], second, third}) == 3
    assert libs.library_versions(["plainlib"]) == {"plainlib": "1.0"}  # a wheel: its version alone


def test_a_shadowed_or_unpackaged_module_is_recorded_by_its_files(site, tmp_path, monkeypatch):
    _distribution(site, "plainlib")
    elsewhere = tmp_path / "pythonpath"
    (elsewhere / "plainlib").mkdir(parents=True)
    (elsewhere / "plainlib" / "__init__.py").write_text("VALUE = 'patched'\n")
    (elsewhere / "loose.py").write_text("X = 1\n")
    assert libs.library_versions(["plainlib", "loose", "nowhere_to_be_found"]) == {
        "plainlib": "1.0", "loose": "absent", "nowhere_to_be_found": "absent"}
    monkeypatch.syspath_prepend(str(elsewhere))  # in front of the installed copy
    found = libs.library_versions(["plainlib", "loose", "nowhere_to_be_found"])
    assert found["plainlib"].startswith("1.0 shadowed ") and found["loose"].startswith("unpackaged ")
    assert found["nowhere_to_be_found"] == "absent"
    (elsewhere / "loose.py").write_text("X = 2\n")
    assert libs.library_versions(["loose"])["loose"] != found["loose"]


def test_the_installed_libraries_here_are_recorded_by_their_versions():
    """No false alarm on this machine's own install: every library the stages import is a wheel here, so the
    manifests record versions alone (an md5 entry would re-run every stage of a run made before)."""
    from tpgrpo.pipeline.rendering.code_graph import external_modules
    from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES, kind_code

    modules = sorted({m for kind in KIND_STAGES for m in external_modules(REPO, kind_code(REPO, kind))})
    entries = libs.library_versions(modules)
    assert "torch" in entries and not [e for e in entries.values() if " " in e], entries


def test_an_edit_to_an_editable_library_is_refused_under_dvc_and_stops_the_server(site, tmp_path, monkeypatch):
    """A credit stage that imports an editable library: its manifest records the library's sources; an edit
    there makes check_code refuse in one line naming it, and the stage server's watch covers the folder."""
    from tpgrpo.errors import PipelineError
    from tpgrpo.pipeline.execution.processes import CodeState
    from tpgrpo.pipeline.execution.stage_server import watched_folders

    checkout = tmp_path / "checkout"
    _distribution(site, "fakelib", editable_from=checkout)
    monkeypatch.syspath_prepend(str(checkout))
    project = tmp_path / "project"
    for folder in ("stages", "tpgrpo"):
        shutil.copytree(REPO / folder, project / folder, ignore=shutil.ignore_patterns("__pycache__"))
    with open(project / "tpgrpo" / "algo" / "credit.py", "a") as f:
        f.write("\n\ndef _lazy():\n    import fakelib  # noqa: F401\n")
    write_manifests(project)
    recorded = json.loads((project / manifest_path("credit")).read_text())["libraries"]
    assert recorded["fakelib"].startswith("1.0 editable ")
    assert "fakelib" not in json.loads((project / manifest_path("update")).read_text())["libraries"]
    check_code(project, "credit")
    assert unpinned_sources(project) == [checkout / "fakelib"]
    watched = watched_folders({"tpgrpo": [str(project / "tpgrpo")], "stages": [str(project / "stages")]})
    assert str(checkout / "fakelib") in watched
    state = CodeState(watched)

    (checkout / "fakelib" / "__init__.py").write_text("VALUE = 2\n")
    with pytest.raises(PipelineError, match=r"credit\.json does not match .*\(fakelib 1\.0 editable \w+ -> 1\.0 "
                                            r"editable \w+\)") as refused:
        check_code(project, "credit")
    assert "\n" not in str(refused.value)
    assert state.changed() == str(checkout / "fakelib" / "__init__.py")
