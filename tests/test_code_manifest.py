"""Code manifests: every stage depends on its kind's manifest, which changes exactly when its code does."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from conftest import REPO, make_tiny_project, tiny_params

from tpgrpo.pipeline.rendering.code_manifest import (ALL_CODE, KIND_STAGES, MANIFEST_PARAMS, RENDER_PARAMS, STAGE_KIND,
                                                     check_code, kind_code, manifest_path,
                                                     write_manifests)
from tpgrpo.config import config_from_dict
from tpgrpo.pipeline.rendering.dvcfile import render

CODE_ROOTS = ("stages/", "tpgrpo/")


def _kind(name: str, cfg) -> str:
    return STAGE_KIND[name.split("-")[0]]


@pytest.mark.parametrize("mode", ["tp", "flow_grpo"])
def test_each_stage_depends_on_its_kinds_manifest_and_no_code_file(mode):
    cfg = config_from_dict(tiny_params(train={"iterations": 2}, credit={"mode": mode}))
    stages = render(cfg)["stages"]
    code = stages.pop("code")
    assert code["cmd"] == "tpgrpo stage code" and code["deps"] == ALL_CODE
    assert code["params"] == [*RENDER_PARAMS, *MANIFEST_PARAMS] == [*RENDER_PARAMS, "credit.mode"]
    assert code["outs"] == [{manifest_path(kind): {"cache": False}} for kind in KIND_STAGES]
    assert all(path.startswith(tuple(ALL_CODE)) for kind in KIND_STAGES for path in kind_code(REPO, kind))
    for name, stage in stages.items():
        assert not any(dep.startswith(CODE_ROOTS) for dep in stage["deps"]), name
        assert [d for d in stage["deps"] if d.startswith("data/code/")] == [manifest_path(_kind(name, cfg))], name


def _copy_code(root: Path) -> None:
    for folder in ("stages", "tpgrpo"):
        shutil.copytree(REPO / folder, root / folder, ignore=shutil.ignore_patterns("__pycache__"))


def _manifests(root: Path) -> dict[str, bytes]:
    write_manifests(root)
    return {kind: (root / manifest_path(kind)).read_bytes() for kind in KIND_STAGES}


def test_a_manifest_changes_exactly_when_a_file_of_its_kind_changes(tmp_path):
    _copy_code(tmp_path)
    before = _manifests(tmp_path)
    assert json.loads(before["update"])["files"]["tpgrpo/algo/loss.py"]  # folders are listed file by file
    assert any(f.startswith("tpgrpo/models/") for f in json.loads(before["rollout"])["files"])
    assert _manifests(tmp_path) == before  # deterministic

    (tmp_path / "tpgrpo" / "models" / "__pycache__").mkdir(exist_ok=True)  # byte code is not code
    (tmp_path / "tpgrpo" / "models" / "__pycache__" / "x.cpython-311.pyc").write_bytes(b"\0")
    assert _manifests(tmp_path) == before

    _append(tmp_path / "tpgrpo" / "algo" / "loss.py")
    after = _manifests(tmp_path)
    assert {k for k in KIND_STAGES if after[k] != before[k]} == {
        k for k in KIND_STAGES if "tpgrpo/algo/loss.py" in kind_code(tmp_path, k)}
    assert {k for k in KIND_STAGES if after[k] != before[k]} == {"update"}

    model_file = sorted((tmp_path / "tpgrpo" / "models").glob("*.py"))[0]
    model_file.write_text(model_file.read_text() + EDIT)
    changed = {k for k in KIND_STAGES if _manifests(tmp_path)[k] != after[k]}
    assert changed == set(KIND_STAGES) - {"credit"}  # credit reads a table: it loads no model


EDIT = "\nEDITED = 1\n"  # a change of code (a comment changes no manifest: tests/test_code_hash.py)


def _append(path: Path, text: str = EDIT) -> None:
    with open(path, "a") as f:
        f.write(text)


def _changed(root: Path, before: dict[str, bytes]) -> set[str]:
    return {kind for kind, text in _manifests(root).items() if text != before[kind]}


def test_a_manifest_records_the_libraries_its_code_imports_and_their_upgrades(tmp_path, monkeypatch):
    """The libraries come from the kind's imports, not a hand-kept list. The default detector and
    the OCR reward import cv2 (opencv-python), rapidocr brings onnxruntime, pyclipper and shapely, the text
    encoders tokenizers; credit reads a table and records none of them. A fake opencv upgrade changes the
    manifests of the kinds that import it, and a lazy ``import cv2`` inside a credit function adds it there."""
    import tpgrpo.pipeline.rendering.libraries as libs

    _copy_code(tmp_path)
    before = _manifests(tmp_path)
    libraries = {kind: json.loads(text)["libraries"] for kind, text in before.items()}
    assert {"opencv-python", "rapidocr-onnxruntime", "onnxruntime", "pyclipper", "shapely", "tokenizers",
            "torch"} <= set(libraries["rollout"]) and "tokenizers" in libraries["update"]
    assert "opencv-python" not in libraries["credit"] and {"torch", "pyarrow", "zarr"} <= set(libraries["credit"])
    assert all(list(found) == sorted(found) for found in libraries.values())

    real = libs.installed_version
    monkeypatch.setattr(libs, "installed_version", lambda dist: "99.0" if dist == "opencv-python" else real(dist))
    assert _changed(tmp_path, before) == {k for k in KIND_STAGES if "opencv-python" in libraries[k]} >= {
        "rollout", "probe", "eval"}
    monkeypatch.setattr(libs, "installed_version", real)
    _append(tmp_path / "tpgrpo" / "algo" / "credit.py", "\n\ndef _lazy():\n    import cv2  # noqa: F401\n")
    assert _changed(tmp_path, before) == {"credit"}
    assert "opencv-python" in json.loads(_manifests(tmp_path)["credit"])["libraries"]


def test_no_stage_closure_contains_orchestration():
    """The boundary, drawn in the package: stage code never imports the command line or tpgrpo/pipeline/
    (stage runner, stage server, manifests, dvc.yaml, sealing, status, launch, params notes)."""
    from tpgrpo.pipeline.rendering.code_graph import ORCHESTRATION, is_orchestration

    assert is_orchestration("tpgrpo/cli.py") and is_orchestration("tpgrpo/pipeline/status.py")
    wings = [p.relative_to(REPO).as_posix() for p in (REPO / "tpgrpo" / "pipeline").glob("*/*.py")]
    assert "tpgrpo/pipeline/execution/stage_runner.py" in wings and all(map(is_orchestration, wings)), wings
    assert not is_orchestration("tpgrpo/distributed.py") and not is_orchestration("stages/credit.py")
    for kind in KIND_STAGES:
        code = kind_code(REPO, kind)
        assert set(KIND_STAGES[kind]) <= set(code), kind
        assert not [f for f in code if is_orchestration(f)], f"{kind} imports orchestration ({ORCHESTRATION})"
    credit = kind_code(REPO, "credit")  # reads a Parquet table: no model, policy or reward code
    assert not [f for f in credit if f.startswith(("tpgrpo/models/", "tpgrpo/policy/", "tpgrpo/rewards/"))], credit
    assert {"tpgrpo/algo/credit.py", "tpgrpo/algo/advantages.py", "tpgrpo/io/artifacts.py", "tpgrpo/stage_common.py",
            "tpgrpo/config.py"} <= set(credit) and len(credit) <= 26, credit  # + the probe and credit tables' readers


def test_an_edit_to_the_cli_the_status_or_the_docs_changes_no_manifest(tmp_path):
    """What runs and reports stages is not what they compute: the code stage re-runs (its deps are all the
    code) and writes the same bytes, so DVC re-runs nothing after it."""
    _copy_code(tmp_path)
    shutil.copytree(REPO / "docs", tmp_path / "docs")
    before = _manifests(tmp_path)
    cli = tmp_path / "tpgrpo" / "cli.py"
    text = cli.read_text()
    assert '"""One screen: iterations done' in text
    cli.write_text(text.replace('"""One screen: iterations done', '"""One screen (edited help): iterations done'))
    for path in ("tpgrpo/pipeline/status.py", "tpgrpo/pipeline/execution/stage_runner.py",
                 "tpgrpo/pipeline/execution/stage_server.py", "tpgrpo/pipeline/execution/launch.py",
                 "tpgrpo/__main__.py", "docs/artifacts.md"):
        _append(tmp_path / path)
    assert _changed(tmp_path, before) == set()


def test_an_edit_to_the_credit_maths_changes_the_credit_manifest_only(tmp_path):
    """Credit re-runs; the stages after it re-run through its outputs (data deps), not through their code."""
    _copy_code(tmp_path)
    before = _manifests(tmp_path)
    _append(tmp_path / "tpgrpo" / "algo" / "credit.py")
    assert _changed(tmp_path, before) == {"credit"}
    after = _manifests(tmp_path)
    for path in ("tpgrpo/models/base.py", "tpgrpo/tasks/rewards.py", "tpgrpo/policy/lora.py"):  # not credit's
        _append(tmp_path / path)
    assert _changed(tmp_path, after) == set(KIND_STAGES) - {"credit"}


def test_an_edit_to_the_eval_stage_and_its_entry_point_changes_the_eval_manifest_only(tmp_path):
    """``tpgrpo/__main__.py`` starts every stage (the console script) but computes nothing."""
    _copy_code(tmp_path)
    before = _manifests(tmp_path)
    _append(tmp_path / "stages" / "eval.py")
    _append(tmp_path / "tpgrpo" / "__main__.py")
    assert _changed(tmp_path, before) == {"eval"}


def test_a_missing_code_path_is_a_one_line_error(tmp_path):
    _copy_code(tmp_path)
    (tmp_path / "stages" / "update.py").unlink()
    with pytest.raises(FileNotFoundError, match=r"code path stages/update\.py: not found under"):
        write_manifests(tmp_path)
    assert not (tmp_path / "data" / "code").exists()  # no manifest written: none goes stale beside the others


@pytest.mark.slow
def test_a_code_change_reruns_the_stages_of_its_kind_only(tmp_path, tiny_model_dir):
    """Real DVC, the project's code first on PYTHONPATH (what its manifests hash is what runs): after a run,
    `tpgrpo run` after an edit to the CLI's help, `tpgrpo status`'s code and the docs re-runs the code stage
    only; a line of code added to tpgrpo/algo/loss.py (update's code) re-runs the code stage and the updates, and
    nothing of the rollout, probe, credit or baseline; one added to tpgrpo/reports/figures.py re-runs the
    summary only (besides the code stage)."""
    from test_dvc_pipeline import env, ran

    root = make_tiny_project(tmp_path / "project", tiny_model_dir)
    own = dict(env(), PYTHONPATH=str(root))

    def run(*command: str) -> subprocess.CompletedProcess:
        done = subprocess.run([sys.executable, "-m", *command], cwd=root, env=own, capture_output=True, text=True)
        assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
        return done

    run("tpgrpo", "run")
    lock = yaml.safe_load((root / "dvc.lock").read_text())
    assert "code" in lock["stages"]
    assert ran(run("dvc", "repro").stdout) == set()

    cli = root / "tpgrpo" / "cli.py"
    cli.write_text(cli.read_text().replace('"""One screen: iterations done', '"""One screen (edited): iterations done'))
    _append(root / "tpgrpo" / "pipeline" / "status.py")
    (root / "docs").mkdir()
    (root / "docs" / "notes.md").write_text("# notes\n")
    again = run("tpgrpo", "run")
    assert ran(again.stdout) == {"code"}, again.stdout[-3000:]

    _append(root / "tpgrpo" / "algo" / "loss.py")
    rerun = ran(run("dvc", "repro").stdout)
    assert {"code", "update-0001"} <= rerun, rerun
    assert not any(n.startswith(("rollout-0001", "probe-", "credit-", "baseline")) for n in rerun), rerun

    _append(root / "tpgrpo" / "reports" / "figures.py")
    assert ran(run("dvc", "repro").stdout) == {"code", "summary"}
    assert "up to date" in run("dvc", "status").stdout

    # a comment, a docstring and a param's help text in config.py (every stage's code): the code stage only
    config = root / "tpgrpo" / "config.py"
    text = config.read_text()
    assert text.count('"T, denoising steps per rollout"') == 1 and text.count('"""The model every model') == 1
    config.write_text(text.replace('"T, denoising steps per rollout"', '"T: the denoising steps of a rollout"')
                      .replace('"""The model every model', '"""The (edited) model every model') + "# a comment\n")
    assert ran(run("tpgrpo", "run").stdout) == {"code"}

    # a new field in eval's declaration: the evals and the baseline (eval's manifest), no rollout/probe/credit/update
    declarations = root / "tpgrpo" / "stage_params.py"
    text = declarations.read_text()
    eval_out = 'Output("eval.json", "eval_metrics", cached=False, read_by=(SUMMARY, DONE))'
    assert text.count(eval_out) == 1
    declarations.write_text(text.replace(eval_out, eval_out.replace("cached=False", 'cached=False, droppable=""')))
    rerun = ran(run("tpgrpo", "run").stdout)
    assert {"code", "eval-0001", "baseline"} <= rerun <= {"code", "summary", "baseline"} | {
        n for n in rerun if n.startswith("eval-")}, rerun

    _older_layouts_are_migrated(root, own, run)


def _older_layouts_are_migrated(root: Path, own: dict, run) -> None:
    """A run folder made before code md5s (manifests of byte md5s), then one made before the manifests (code
    files as stage dependencies): DVC sees it up to date; tpgrpo refuses it in one line until `tpgrpo migrate`,
    once, after which DVC still sees it up to date and `tpgrpo run` re-runs nothing."""
    from test_dvc_pipeline import ran

    for make_older in (_to_byte_manifests, _to_code_files):
        make_older(root)
        run("dvc", "commit", "--force")
        assert "up to date" in run("dvc", "status").stdout, make_older
        refused = subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=root, env=own, capture_output=True,
                                 text=True)
        assert refused.returncode != 0 and "run `tpgrpo migrate` once" in refused.stdout + refused.stderr
        assert run("tpgrpo", "migrate").stdout.strip(), make_older
        assert "up to date" in run("dvc", "status").stdout, make_older
        assert ran(run("tpgrpo", "run").stdout) == set(), make_older
        assert all(json.loads((root / manifest_path(k)).read_text())["hashes"] == "code" for k in KIND_STAGES)


def _to_byte_manifests(root: Path) -> None:
    """The manifests as written before code md5s (the caller records them with `dvc commit`)."""
    from tpgrpo.pipeline.rendering.code_hash import BYTES
    from tpgrpo.pipeline.rendering.code_manifest import manifest_text

    for kind in KIND_STAGES:
        (root / manifest_path(kind)).write_text(manifest_text(root, kind, None, BYTES))


def _to_code_files(root: Path) -> None:
    """A finished project as the layout before the manifests left it: no code stage, each stage listing its
    kind's code files (recorded with their byte md5s), the probe also ``credit.mode`` (its code path)."""
    import hashlib

    from tpgrpo.pipeline.long_runs.blocks import read_as_dvc, write_yaml

    def files(dep: str) -> list[str]:
        return kind_code(root, Path(dep).stem) if dep.startswith("data/code/") else [dep]

    def item(path: str) -> dict:
        data = (root / path).read_bytes()
        return {"path": path, "hash": "md5", "md5": hashlib.md5(data).hexdigest(), "size": len(data)}

    pipeline, lock = yaml.safe_load((root / "dvc.yaml").read_text()), read_as_dvc(root / "dvc.lock")
    mode = yaml.safe_load((root / "params.yaml").read_text())["credit"]["mode"]
    for stages in (pipeline["stages"], lock["stages"]):
        del stages["code"]
    for name, stage in pipeline["stages"].items():
        stage["deps"] = [f for dep in stage["deps"] for f in files(dep)]
        entry = lock["stages"][name]
        entry["deps"] = sorted([item(f) for d in entry["deps"] if d["path"].startswith("data/code/")
                                for f in files(d["path"])] + [d for d in entry["deps"]
                                                              if not d["path"].startswith("data/code/")],
                               key=lambda d: d["path"])
        if name.startswith("probe-"):
            stage["params"].append("credit.mode")
            entry["params"]["params.yaml"]["credit.mode"] = mode
    (root / "dvc.yaml").write_text(yaml.safe_dump(pipeline, sort_keys=False))
    write_yaml(root / "dvc.lock", lock)
    shutil.rmtree(root / "data" / "code")


def test_the_code_stage_lists_every_param_the_rendering_reads():
    """The code stage checks dvc.yaml against params.yaml; it runs only when one of its params changes, so a
    param outside RENDER_PARAMS must never change the rendering (each numeric or string leaf, altered)."""
    import copy

    from tpgrpo.config import ConfigError

    base = tiny_params(train={"iterations": 3, "block_size": 0}, tree={"split_steps": "0,1"})  # valid if enabled
    rendered = render(config_from_dict(base))
    for section, values in base.items():
        for key, value in values.items():
            name = f"{section}.{key}"
            if any(name == p or name.startswith(p + ".") for p in RENDER_PARAMS) or isinstance(value, dict):
                continue
            raw = copy.deepcopy(base)  # a bool flipped (tree.enabled changes the rollout's params list)
            raw[section][key] = (not value) if isinstance(value, bool) else (value + 1) if isinstance(
                value, (int, float)) else ("flow_grpo" if name == "credit.mode" else value)
            try:
                cfg = config_from_dict(raw)
            except ConfigError:
                continue  # out of bounds: no config to render
            assert render(cfg) == rendered, name


def test_warmed_caches_serve_a_forked_stage_and_still_see_an_upgrade_or_an_edit(tmp_path, monkeypatch):
    """The stage server fills the caches every stage's code check reads once, so that a forked stage
    reads no distribution's metadata and parses none of its code for them (it did: 0.2-0.4 s a stage). Once
    warmed, the libraries and each kind's code come back the same with the metadata scan and the parser
    broken; a version change still shows (versions stay uncached: the check after a stage must see an upgrade
    made while it ran), and so does an edited file (the scan is cached per file stamp)."""
    import importlib.metadata

    import tpgrpo.pipeline.rendering.code_manifest as cm
    import tpgrpo.pipeline.rendering.libraries as libs

    from tpgrpo.pipeline.rendering import code_graph, code_hash

    _copy_code(tmp_path)
    modules = ["torch", "pyarrow", "zarr", "cv2"]
    want, code = cm.library_versions(modules), {kind: cm.kind_code(tmp_path, kind) for kind in KIND_STAGES}
    hashes = {kind: cm._hashes(tmp_path, code[kind], kind) for kind in KIND_STAGES}
    for cache in (libs._providers, libs._requirements, libs._provided, libs.editable_folders, code_graph._scan):
        cache.cache_clear()
    monkeypatch.setattr(code_hash, "_PARTS", {})
    cm.warm_caches(tmp_path)  # alone: what follows may read nothing else

    def scanned(*_args, **_kwargs):
        raise AssertionError("read the distributions' metadata or parsed a code file again")

    for owner, name in ((importlib.metadata, "packages_distributions"), (importlib.metadata, "requires"),
                        (importlib.metadata, "distributions"), (code_graph, "_imported_names"),
                        (code_hash, "_parts")):
        monkeypatch.setattr(owner, name, scanned)
    assert cm.library_versions(modules) == want and {"torch", "pyarrow", "zarr", "opencv-python"} <= set(want)
    assert {kind: cm.kind_code(tmp_path, kind) for kind in KIND_STAGES} == code
    assert {kind: cm._hashes(tmp_path, code[kind], kind) for kind in KIND_STAGES} == hashes
    real = libs.installed_version
    monkeypatch.setattr(libs, "installed_version", lambda dist: "99.0" if dist == "zarr" else real(dist))
    assert cm.library_versions(modules)["zarr"] == "99.0"
    _append(tmp_path / "tpgrpo" / "algo" / "credit.py", "\n")
    with pytest.raises(AssertionError, match="parsed a code file again"):
        cm.kind_code(tmp_path, "credit")
