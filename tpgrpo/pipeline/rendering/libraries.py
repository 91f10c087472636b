"""The libraries a code manifest records (:func:`library_versions`), and the files where a version does not say
what code runs.

A manifest records the distributions that provide the third-party modules its kind's code imports
(``code_graph.external_modules``: cv2 -> opencv-python, PIL -> pillow), and the installed requirements those
distributions declare themselves, one level down (rapidocr-onnxruntime -> onnxruntime, pyclipper, shapely;
zarr -> numcodecs; torch -> its CUDA libraries where installed). Deeper requirements are not recorded (a
chosen gap: they are mostly HTTP, command-line and typing helpers, huggingface-hub -> httpx -> h11, and
recording them would re-run every stage for each such upgrade). No file of the project changes when a library
is upgraded: `tpgrpo run` rewrites the manifests before each repro (DVC then re-runs the code stage, whose
outputs are not cached so its run cache cannot restore old ones, and the stages whose manifest changed), and
under DVC a stage refuses to run when its manifest does not match the files and versions
(``code_manifest.check_stage_code``).

A distribution is recorded by its version: enough for a wheel, whose files only an upgrade or a reinstall
replaces. Not enough for

- an **editable install** (``pip install -e ../diffusers``; PEP 610: the distribution's ``direct_url.json``
  says ``"dir_info": {"editable": true}``): its version stays while its checkout is edited;
- a **module that no distribution provides** but Python finds (a folder on ``PYTHONPATH``, or an editable
  install whose metadata names no module);
- a **module shadowed** by another copy outside its distributions' install folders (a patched ``diffusers``
  folder on ``PYTHONPATH`` in front of the installed one).

For these the manifest records the md5 of the files that would be imported (:func:`sources_md5`) after the
version, so an edit there re-runs the stages that import them, and the stage server watches those folders (it
stops serving stale imports). An in-place edit of an installed wheel's files in site-packages is not seen:
hashing every installed file on each check would cost seconds (torch alone has thousands of files).
"""

from __future__ import annotations

import hashlib
import json
import os
from functools import lru_cache
from pathlib import Path


def canonical(name: str) -> str:
    """A distribution's name as PEP 503 compares them (``PyYAML`` -> ``pyyaml``, ``huggingface_hub`` ->
    ``huggingface-hub``): the manifests' keys."""
    import re

    return re.sub(r"[-_.]+", "-", name).lower()


def installed_version(dist: str) -> str | None:
    """The installed version of distribution ``dist``, or None."""
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


@lru_cache(maxsize=1)
def _providers() -> dict[str, tuple[str, ...]]:
    """Top-level module -> the installed distributions that provide it (canonical names, sorted)."""
    from importlib.metadata import packages_distributions

    return {module: tuple(sorted({canonical(d) for d in dists})) for module, dists in packages_distributions().items()}


@lru_cache(maxsize=256)
def _requirements(dist: str) -> tuple[str, ...]:
    """The distributions ``dist`` requires on this machine (markers evaluated, no extras; canonical names)."""
    from importlib.metadata import PackageNotFoundError, requires

    from packaging.requirements import Requirement

    try:
        found = [Requirement(line) for line in requires(dist) or []]
    except PackageNotFoundError:
        return ()
    return tuple(sorted({canonical(r.name) for r in found if r.marker is None or r.marker.evaluate({"extra": ""})}))


@lru_cache(maxsize=1)
def _provided() -> dict[str, tuple[str, ...]]:
    """Distribution (canonical name) -> the top-level modules it provides (sorted)."""
    found: dict[str, set[str]] = {}
    for module, dists in _providers().items():
        for dist in dists:
            found.setdefault(dist, set()).add(module)
    return {dist: tuple(sorted(modules)) for dist, modules in found.items()}


def library_entries(modules: list[str]) -> dict[str, tuple[str, list[Path]]]:
    """``{name: (entry, files it covers)}`` behind :func:`library_versions`."""
    providers, provided = _providers(), _provided()
    direct = {d for m in modules for d in providers.get(m, ())}
    found = {m: unpackaged(m) for m in modules if m not in providers}
    for dist in sorted(direct | {r for d in direct for r in _requirements(d)}):
        version = installed_version(dist)
        if version is not None:  # a requirement this machine lacks (an optional one) runs nowhere
            imported = [m for m in provided.get(dist, ()) if m in modules]
            found[dist] = pinned(dist, version, imported, list(provided.get(dist, ())), providers)
    return dict(sorted(found.items()))


def library_versions(modules: list[str]) -> dict[str, str]:
    """``{distribution: version}`` (sorted) of the libraries code importing the top-level ``modules`` runs on:
    their distributions and those distributions' installed requirements (one level; see above). A module no
    installed distribution provides is recorded under its own name as ``"absent"`` (installing it changes the
    manifest), or ``"unpackaged <md5>"`` where Python finds it anyway (a folder on PYTHONPATH). Where the
    version does not pin the files (an editable install, a module shadowed by another copy) the md5 of the
    files imported follows it (:func:`pinned`)."""
    return {name: entry for name, (entry, _) in library_entries(modules).items()}


@lru_cache(maxsize=1)
def editable_folders() -> dict[str, Path]:
    """``{distribution (canonical name): its project folder}`` of the installed distributions that are editable
    installs (PEP 610 ``direct_url.json`` with ``dir_info.editable`` true and a ``file:`` URL)."""
    from importlib.metadata import distributions
    from urllib.parse import unquote, urlparse

    found = {}
    for dist in distributions():
        try:
            record = json.loads(dist.read_text("direct_url.json") or "{}")
        except (OSError, ValueError):
            continue
        url = urlparse(str(record.get("url", ""))) if isinstance(record, dict) else None
        if url and url.scheme == "file" and (record.get("dir_info") or {}).get("editable") is True:
            found.setdefault(canonical(dist.metadata["Name"] or ""), Path(unquote(url.path)))
    return found


def module_roots(module: str) -> list[Path]:
    """The files or folders top-level ``module`` is imported from (a package's folders, a module's file); []
    where Python does not find it, or finds it built in or frozen."""
    import importlib.util

    try:
        spec = importlib.util.find_spec(module)
    except (ImportError, ValueError):
        return []
    if spec is None:
        return []
    if spec.submodule_search_locations:
        return [Path(p) for p in spec.submodule_search_locations]
    return [Path(spec.origin)] if spec.origin and os.path.isfile(spec.origin) else []


def sources_md5(roots: list[Path]) -> str:
    """md5 over every file under ``roots`` (relative name and bytes; byte code and hidden folders left out)."""
    digest = hashlib.md5()
    for root in sorted(set(roots)):
        for path in _files(root):
            digest.update(f"{path.relative_to(root.parent).as_posix()}\0".encode())
            digest.update(hashlib.md5(path.read_bytes()).digest())
    return digest.hexdigest()


def _files(root: Path) -> list[Path]:
    if root.is_file():
        return [root]
    found = []
    for folder, dirs, names in os.walk(root):
        dirs[:] = sorted(d for d in dirs if d != "__pycache__" and not d.startswith("."))
        found += [Path(folder, n) for n in sorted(names) if not n.endswith((".pyc", ".pyo"))]
    return found


def _inside(path: Path, folder: Path) -> bool:
    return path.resolve().is_relative_to(folder.resolve())


def editable_roots(dist: str, modules: list[str]) -> list[Path] | None:
    """What an editable ``dist`` imports from: the roots of ``modules`` (the ones it provides) inside its
    project folder, else the whole folder; None where ``dist`` is not an editable install."""
    folder = editable_folders().get(dist)
    if folder is None:
        return None
    return [r for m in modules for r in module_roots(m) if _inside(r, folder)] or [folder]


def shadowing_roots(module: str, dists: tuple[str, ...]) -> list[Path]:
    """Where ``module`` is imported from when that is inside none of its providers' (``dists``) install
    folders (another copy earlier on ``sys.path``), else []. Namespace packages (several folders) are not
    judged."""
    from importlib.metadata import PackageNotFoundError, distribution

    roots = module_roots(module)
    if len(roots) != 1:
        return []
    for dist in dists:
        try:
            if _inside(roots[0], Path(str(distribution(dist).locate_file("")))):
                return []
        except PackageNotFoundError:
            continue
    return roots


def pinned(dist: str, version: str, imported: list[str], provided: list[str],
           providers: dict[str, tuple[str, ...]]) -> tuple[str, list[Path]]:
    """What a manifest records for ``dist`` and the files that entry covers: its version alone (``[]``), or
    with the md5 of the sources the version does not pin: ``"0.42.1 editable <md5>"`` (an editable install:
    the roots of the modules it ``provided``), ``"0.42.1 shadowed <md5>"`` (a module of it that the code
    ``imported`` comes from outside every install folder of its ``providers``)."""
    roots = editable_roots(dist, provided)
    if roots is not None:
        return f"{version} editable {sources_md5(roots)}", roots
    shadowed = [r for m in imported for r in shadowing_roots(m, providers.get(m, ()))]
    return (f"{version} shadowed {sources_md5(shadowed)}", shadowed) if shadowed else (version, [])


def unpackaged(module: str) -> tuple[str, list[Path]]:
    """What a manifest records for a top-level ``module`` that no installed distribution provides, and the
    files that covers: ``"absent"`` where Python does not find it, else ``"unpackaged <md5 of its files>"``."""
    roots = module_roots(module)
    return (f"unpackaged {sources_md5(roots)}", roots) if roots else ("absent", [])


def warm_library_caches() -> None:
    """Fill the caches of the installed distributions' metadata (the stage server does, before forking)."""
    for dists in _providers().values():
        for dist in dists:
            _requirements(dist)
    _provided()
    editable_folders()
