"""Code manifests: one small file per stage kind that names the code the kind runs and its hashes.

Why: each stage used to list its ~15 code files and folders as DVC dependencies, and DVC rewrites the
whole ``dvc.lock`` after every stage it runs; those entries were 40% of the lock (59 of 143 KB in a
12-iteration run), so every rewrite parsed and wrote them again, a cost that grows with the run. Now one
``code`` stage depends on all the code and writes ``data/code/<kind>.json`` (path -> md5 of the code of every
file of that kind's code, without comments, docstrings or help text: :mod:`tpgrpo.pipeline.rendering.code_hash`); each
iteration stage depends on its kind's manifest only. A code change re-runs the
``code`` stage, rewrites the manifests whose files changed, and DVC re-runs exactly the stages whose
manifest changed: the same stages as before, with one dependency each instead of ~15.

What a kind's code is comes from the imports of its stage modules (:mod:`tpgrpo.pipeline.rendering.code_graph`), not a
hand-kept list, and it is the code that computes the kind's artifacts and nothing else: what runs and records
stages (the command line, everything under ``tpgrpo/pipeline/``) is in no manifest, so editing it (or the
docs) re-runs only the cheap ``code`` stage, whose outputs come out byte-identical. A manifest also records
the versions of the libraries the stages run on. Under DVC a stage refuses to run when its manifest does not
match the files and versions that would run, or when the modules that run are not the project's recorded
code (:func:`check_stage_code`): an edit, an upgrade or another checkout is never recorded as code it ran.

Projects made before the manifests (code files as stage dependencies) or before code md5s (manifests of byte
md5s) are brought to this layout once by ``tpgrpo migrate`` (:mod:`tpgrpo.pipeline.migrate`).
"""

from __future__ import annotations

import json
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from pathlib import Path

from tpgrpo.pipeline.rendering.code_hash import BYTES, CODE, file_md5
from tpgrpo.pipeline.rendering.libraries import library_entries, library_versions, warm_library_caches
from tpgrpo.stage_params import (CONDITIONAL_PARAMS, ITERATION_STAGES, PATH_SWITCHES, RUN_STAGES, UNREAD_PARAMS,
                                 code_path, inputs)

CODE_DIR = "data/code"
REPO = Path(__file__).resolve().parents[3]  # the checkout this package runs from


def _kind_stages() -> dict[str, list[str]]:
    """Each manifest kind's stage modules, from the stages' records (tpgrpo.stage_params.ITERATION_STAGES, then
    RUN_STAGES): a record whose kind is another stage's adds its scripts to that kind's (the baseline's to the
    eval's)."""
    kinds: dict[str, list[str]] = {}
    for stage in (*ITERATION_STAGES, *RUN_STAGES):
        kinds.setdefault(stage.kind, []).extend(stage.code)
    return kinds


# The stage modules each kind of stage runs; its code is what they import (tpgrpo.pipeline.rendering.code_graph).
KIND_STAGES = _kind_stages()
# `tpgrpo stage NAME` -> the manifest it depends on
STAGE_KIND = {stage.name: stage.kind for stage in (*ITERATION_STAGES, *RUN_STAGES)}
# The code stage depends on all of the code, folders whole (a new module is seen; .dvcignore drops byte code).
ALL_CODE = ["stages", "tpgrpo"]
# The params dvc.yaml's rendering reads (tpgrpo.pipeline.rendering.dvcfile.render; a test checks the list): the stages,
# their deps and commands (the reward-model folders: reward_models, but its device, an execution knob that no
# stage records). Other params change values DVC reads itself, never the stages.
# A conditional section's switch (tree.enabled) too: it decides whether the rollout lists the section, so
# `dvc exp run -S tree.enabled=true` re-runs the code stage, which then refuses the stale dvc.yaml.
RENDER_PARAMS = ["train.iterations", "train.block_size", "model.path", "task", *inputs("reward_models"),
                 *dict.fromkeys(switch for table in (CONDITIONAL_PARAMS, UNREAD_PARAMS) for pairs in table.values()
                                for _, switch in pairs)]
# The params the manifests read: the keys that pick a stage kind's code path (tpgrpo.stage_params.PATH_SWITCHES;
# the probe's manifest says "path": "final_reward" under credit.mode flow_grpo). The code stage lists them too,
# so it re-runs (a second) when one changes, and rewrites a manifest only when the path changed.
MANIFEST_PARAMS = [key for key, _, _ in PATH_SWITCHES.values()]


def kind_code(root: Path, kind: str) -> list[str]:
    """The project files a stage of ``kind`` runs (relative to ``root``, sorted)."""
    from tpgrpo.pipeline.rendering.code_graph import closure

    return closure(root, KIND_STAGES[kind])


def warm_caches(code_root: Path) -> None:
    """Fill this process's caches that every stage's code check reads: the installed distributions' metadata
    (``packages_distributions`` and each one's requirements, about 0.3-0.4 s), the import scan of each
    stage kind's code under ``code_root`` (cached per file stamp) and its files' parsed code (cached by
    content). The stage server calls it once before forking, so that no forked stage redoes them (each did:
    most of a served stage's start-up). Safe there:
    the server stops serving once any installed distribution or code file changes, and the scan's cache is
    keyed by each file's mtime and size. Installed versions stay uncached (the check after a stage must see an
    upgrade made while it ran)."""
    warm_library_caches()
    with suppress(Exception):  # a warm-up only: any failure (not a project folder, a file mid-edit) leaves it cold
        for kind in KIND_STAGES:
            _hashes(code_root, kind_code(code_root, kind), kind)  # code md5s: cached by content, never stale


def unpinned_sources(root: Path) -> list[Path]:
    """The files and folders of the libraries every kind's manifest records by their md5 rather than their
    version alone (editable installs, shadowed or unpackaged modules): what a long-lived process that
    imported them must watch for edits (the stage server)."""
    from tpgrpo.pipeline.rendering.code_graph import external_modules

    modules = sorted({m for kind in KIND_STAGES for m in external_modules(root, kind_code(root, kind))})
    return sorted({path for _, roots in library_entries(modules).values() for path in roots})


def manifest_path(kind: str) -> str:
    """The manifest a stage of ``kind`` depends on, relative to the project root."""
    return f"{CODE_DIR}/{kind}.json"


def code_deps(kind: str) -> list[str]:
    """A stage's code dependencies: its kind's manifest."""
    return [manifest_path(kind)]


def manifest(root: Path, kind: str, cfg=None, hashes: str = CODE) -> dict:
    """``{"kind", "hashes", "files": {path: md5}, "libraries": {name: version}}`` for the kind's code (sorted
    paths), plus ``"path"`` where ``cfg`` (a Config or parsed params.yaml; None: ``root/params.yaml``) picks
    the kind's other code path (:func:`tpgrpo.stage_params.code_path`; absent on the default path, as before
    paths existed). ``hashes``: what a file's md5 is of (:mod:`tpgrpo.pipeline.rendering.code_hash`): its code without
    comments, docstrings and help text (``"code"``), or its bytes (``"bytes"``: the manifests written before,
    which have no ``"hashes"`` entry)."""
    from tpgrpo.pipeline.rendering.code_graph import external_modules

    code = kind_code(root, kind)
    found = {"kind": kind, "files": _hashes(root, code, kind, hashes),
             "libraries": library_versions(external_modules(root, code))}
    if hashes != BYTES:
        found["hashes"] = hashes
    path = code_path(kind, _params_of(root) if cfg is None else cfg)
    return found if path is None else {**found, "path": path}


def _params_of(root: Path) -> dict:
    """``root/params.yaml`` parsed (empty when missing or unreadable: the default paths)."""
    import yaml

    try:
        raw = yaml.safe_load((root / "params.yaml").read_text())
    except (OSError, yaml.YAMLError):
        return {}
    return raw if isinstance(raw, dict) else {}


def _hashes(root: Path, files: list[str], kind: str, hashes: str = CODE) -> dict[str, str]:
    return {f: file_md5((root / f).read_bytes(), kind, hashes) for f in files}


def manifest_text(root: Path, kind: str, cfg=None, hashes: str = CODE) -> str:
    return json.dumps(manifest(root, kind, cfg, hashes), indent=1, sort_keys=True) + "\n"


def _texts(root: Path, cfg=None) -> dict[str, str]:
    """Each kind's manifest text."""
    return {kind: manifest_text(root, kind, cfg) for kind in KIND_STAGES}


def write_manifests(root: Path, cfg=None) -> list[Path]:
    """Write every kind's manifest under ``root/data/code`` (all computed first, then each written to a
    temporary file and renamed); returns them. A manifest's bytes change exactly when the code of a file of
    its kind's changes (not a comment, a docstring or a param's help text:
    :mod:`tpgrpo.pipeline.rendering.code_hash`)."""
    texts = _texts(root, cfg)
    from tpgrpo.io.artifacts import atomic_path

    written = []
    for kind, text in texts.items():
        with atomic_path(root / manifest_path(kind)) as tmp:
            tmp.write_text(text)
        written.append(root / manifest_path(kind))
    return written


def refresh_manifests(root: Path, cfg=None) -> dict[Path, tuple[bytes, int] | None]:
    """Rewrite the manifests of a project that has them where they differ (a library upgraded since the code
    stage wrote them): DVC then sees the code stage's outputs changed and re-runs it and what they feed.
    Returns what each rewritten manifest was: ``(bytes, mtime_ns)``, or None where it did not exist."""
    if not (root / CODE_DIR).is_dir():
        return {}
    from tpgrpo.io.artifacts import atomic_path

    replaced = {}
    texts = _texts(root, cfg)
    for kind, text in texts.items():
        path = root / manifest_path(kind)
        if not path.is_file() or path.read_text() != text:
            replaced[path] = (path.read_bytes(), path.stat().st_mtime_ns) if path.is_file() else None
            with atomic_path(path) as tmp:
                tmp.write_text(text)
    return replaced


@contextmanager
def manifests_refreshed(root: Path, cfg=None) -> Iterator[None]:
    """:func:`refresh_manifests` for the body, undone if the body raises: ``tpgrpo run`` checks the sealed
    blocks against the refreshed manifests (a code edit shows only there), and a run refused on them (the
    edit would unseal a block ``tpgrpo retain`` thinned) must leave the project's files as they were. The old
    bytes and modification times go back (DVC's state database then still knows their md5s)."""
    import os

    from tpgrpo.io.artifacts import atomic_path

    replaced = refresh_manifests(root, cfg)
    try:
        yield
    except BaseException:
        for path, old in replaced.items():
            if old is None:
                path.unlink(missing_ok=True)
                continue
            with atomic_path(path) as tmp:
                tmp.write_bytes(old[0])
            os.utime(path, ns=(old[1], old[1]))
        raise


def check_code(root: Path, kind: str, cfg=None) -> None:
    """Refuse to run a stage whose recorded code is not what would run: DVC records the manifest as the
    stage's input, so a file edited (or a library upgraded) after the ``code`` stage wrote it would be
    recorded as code it did not run. No manifest (a stage run by hand in a fresh folder): nothing to check."""
    path = root / manifest_path(kind)
    if not path.is_file():
        return
    recorded = json.loads(path.read_text())
    now = manifest(root, kind, cfg)
    changed = sorted(f for f in set(recorded.get("files", {})) | set(now["files"])
                     if recorded.get("files", {}).get(f) != now["files"].get(f))
    was = recorded.get("libraries", {})
    changed += sorted(f"{name} {was.get(name)} -> {now['libraries'].get(name)}"
                      for name in set(was) | set(now["libraries"]) if was.get(name) != now["libraries"].get(name))
    if recorded.get("path") != now.get("path"):  # params.yaml changed the path after the code stage ran
        changed.append(f"code path {recorded.get('path') or 'default'} -> {now.get('path') or 'default'}")
    if changed:
        from tpgrpo.errors import PipelineError

        raise PipelineError(f"{manifest_path(kind)} does not match the code that would run ({', '.join(changed[:3])}"
                            f"{', ...' if len(changed) > 3 else ''}): run `tpgrpo run`, or "
                            "`tpgrpo stage code` then `dvc repro`")


def check_stage_code(root: Path, stage: str, cfg=None) -> None:
    """:func:`check_code` and :func:`check_running_code` for ``tpgrpo stage NAME`` when DVC runs it
    (``DVC_STAGE`` set): a stage run by hand is recorded by nothing, and the next ``dvc repro`` re-runs the
    code stage before it anyway."""
    import os

    if os.environ.get("DVC_STAGE") and stage in STAGE_KIND and (root / manifest_path(STAGE_KIND[stage])).is_file():
        check_code(root, STAGE_KIND[stage], cfg)
        check_running_code(root, STAGE_KIND[stage])


def running_root() -> Path:
    """The folder the running ``tpgrpo`` and ``stages`` packages were imported from; a one-line error when they
    come from two folders (no project holds its code that way)."""
    import importlib

    where = {name: Path(importlib.import_module(name).__file__).resolve().parents[1] for name in ("tpgrpo", "stages")}
    if where["tpgrpo"] != where["stages"]:
        from tpgrpo.errors import PipelineError

        raise PipelineError(f"tpgrpo is imported from {where['tpgrpo']} and stages from {where['stages']}: run "
                            "both from the project's folder (PYTHONPATH=<project>)")
    return where["tpgrpo"]


def check_running_code(root: Path, kind: str) -> None:
    """Refuse to run a stage when the modules that run are not the code its manifest records.

    The manifests hash the project folder's copy of the code (``root/tpgrpo``, ``root/stages``: what the code
    stage depends on, so what DVC sees change). The modules that run come from wherever Python finds
    ``tpgrpo``: the project itself (``PYTHONPATH=<project>``, ``python -m tpgrpo`` from it, or an install of
    it), or another checkout (an editable install pointing elsewhere, a copied project, the temporary copy
    ``dvc exp run --temp`` runs in, with the installed package). The rule compares contents, not folders:
    the running checkout's files of this kind must be byte for byte the ones recorded. So a project that
    holds a copy of the code it runs (the tests' projects, a comparison run's snapshot) runs; a different
    ``seeds.py`` is refused with one line instead of being recorded as code it did not run. A project with
    no code of its own is not one DVC can run (the code stage depends on its ``stages`` and ``tpgrpo``)."""
    running = running_root()
    if running == root.resolve():
        return
    whole = json.loads((root / manifest_path(kind)).read_text())
    recorded = whole.get("files", {})
    try:
        files = _hashes(running, kind_code(running, kind), kind)
    except FileNotFoundError:
        files = {}
    differ = sorted(f for f in set(recorded) | set(files) if recorded.get(f) != files.get(f))
    if differ:
        from tpgrpo.errors import PipelineError

        raise PipelineError(
            f"the code that runs is not the code {manifest_path(kind)} records: tpgrpo is imported from {running}, "
            f"whose {', '.join(differ[:3])}{', ...' if len(differ) > 3 else ''} "
            f"{'differs' if len(differ) == 1 else 'differ'} from {root}'s copy; put the project's code first "
            f"(PYTHONPATH={root}); `dvc exp run --temp` runs a copy of the project with the installed package: "
            "run `PYTHONPATH=. dvc exp run --temp`")


def code_stage() -> dict:
    """The dvc.yaml stage that writes the manifests from all the code, and checks that dvc.yaml is what
    params.yaml renders (so it lists the params the rendering reads: it re-runs, in a second, when one
    changes)."""
    return {"cmd": "tpgrpo stage code", "deps": ALL_CODE, "params": [*RENDER_PARAMS, *MANIFEST_PARAMS],
            "outs": [{manifest_path(kind): {"cache": False}} for kind in KIND_STAGES]}
