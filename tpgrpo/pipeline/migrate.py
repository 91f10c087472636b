"""``tpgrpo migrate``: bring a project made by an older version of tpgrpo to this version's layout, once.

Three older layouts exist, each a way DVC's records were kept before:
- **sealed blocks recorded in the root lock**: before blocks had their own pipeline files, a sealed block's stage
  stood in the root ``dvc.yaml`` and its entry in the root ``dvc.lock``;
- **code files as dependencies**: before the code manifests, every stage listed its code files (and the probe
  ``credit.mode``, which picks its code path) as DVC dependencies;
- **manifests of byte md5s**: before code md5s, a manifest recorded the md5 of each file's bytes, so a comment
  changed it.

The commands that render or run (``tpgrpo run``, ``tpgrpo dvc-yaml``, ``tpgrpo retain``, and the code stage that
``dvc repro`` runs first) refuse such a project in one line (:func:`refuse_older_layout`) instead of carrying a
branch for each layout. :func:`migrate` rewrites the records in place and changes no artifact: a stage whose
recorded code is today's keeps its record with today's dependencies (DVC re-runs nothing); a stage whose code
changed since it ran loses its record (it re-runs, as it would have anyway), and migrate says which.
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

from tpgrpo.config import Config
from tpgrpo.pipeline.long_runs.blocks import (Block, read_as_dvc, read_lock, seal_files, sealed_outs,
                                              write_block_entry, write_lock, write_yaml)
from tpgrpo.pipeline.rendering.code_hash import BYTES
from tpgrpo.pipeline.rendering.code_manifest import KIND_STAGES, code_stage, manifest_path, manifest_text

CODE_FOLDERS = ("stages/", "tpgrpo/")  # an older layout's code dependencies lay under these


def uses_code_files(entries: dict) -> bool:
    """Whether stage entries (``{name: dvc.lock entry}``) come from the layout before the manifests: a stage
    other than the code stage lists a file under ``stages/`` or ``tpgrpo/`` as a dependency."""
    return any(entry.get("cmd") != code_stage()["cmd"] and any(
        str(dep.get("path", "")).startswith(CODE_FOLDERS) for dep in entry.get("deps") or [])
        for entry in entries.values() if isinstance(entry, dict))


def unmigrated_blocks(root: Path, lock: dict | None = None) -> list[Block]:
    """Sealed blocks whose entry is still in the root dvc.lock (sealed before blocks had their own files)."""
    files = seal_files(root)
    if not files or all(b.lockfile(root).is_file() for b in files):
        return []
    stages = (read_lock(root) if lock is None else lock)["stages"]
    return [b for b in files if b.name in stages and not b.lockfile(root).is_file()]


def _byte_manifests(root: Path) -> list[str]:
    """The kinds whose manifest records byte md5s (no ``"hashes"`` entry)."""
    kinds = []
    for kind in KIND_STAGES:
        path = root / manifest_path(kind)
        try:
            if path.is_file() and "hashes" not in json.loads(path.read_text()):
                kinds.append(kind)
        except ValueError:
            continue  # a damaged manifest: the code stage rewrites it
    return kinds


def _records(root: Path) -> list[tuple[Path, dict, dict]]:
    """Every file that keeps DVC records of stages: ``(path, its data, its {stage name: entry})``: the root
    lock, each sealed block's lock and its per-stage entries (what unsealing restores)."""
    found = []
    if (root / "dvc.lock").is_file():
        lock = read_lock(root)
        found.append((root / "dvc.lock", lock, lock["stages"]))
    for block in seal_files(root):
        if block.lockfile(root).is_file():
            data = read_as_dvc(block.lockfile(root))
            found.append((block.lockfile(root), data, data.setdefault("stages", {})))
        if block.entries_path(root).is_file():
            data = read_as_dvc(block.entries_path(root))
            found.append((block.entries_path(root), data, data))
    return found


def _root_lock_uses_code_files(root: Path) -> bool:
    """:func:`uses_code_files` on the root lock, parsed only when its text names a code file: every run and
    every code stage asks, and parsing a lock costs a second a MB. The root lock suffices: an older project
    always has stages there (the baseline, the held-out prompts' embeddings), listing their code files too."""
    path = root / "dvc.lock"
    if not path.is_file():
        return False
    text = path.read_text()
    return any(f"path: {folder}" in text for folder in CODE_FOLDERS) and uses_code_files(read_lock(root)["stages"])


def older_layouts(root: Path) -> list[str]:
    """What makes ``root`` a project of an older layout, a few words each (empty: today's layout)."""
    found = []
    if unmigrated_blocks(root):
        found.append("sealed blocks recorded in the root dvc.lock")
    if _root_lock_uses_code_files(root):
        found.append("code files as stage dependencies")
    kinds = _byte_manifests(root)
    if kinds:
        found.append(f"{manifest_path(kinds[0])}{' and others' if len(kinds) > 1 else ''} with byte md5s")
    return found


def refuse_older_layout(root: Path) -> None:
    """PipelineError (one line) when ``root`` was made by an older version (:func:`older_layouts`)."""
    found = older_layouts(root)
    if found:
        from tpgrpo.errors import PipelineError

        raise PipelineError(f"{root / 'dvc.lock'}: made by an older version of tpgrpo ({'; '.join(found)}): run "
                            "`tpgrpo migrate` once (it keeps the record of every stage whose code is unchanged)")


def migrate(root: Path, cfg: Config) -> list[str]:
    """Rewrite ``root``'s records to this version's layout (DVC's lock held); re-render dvc.yaml and the blocks'
    pipeline files, and record the code stage (``dvc commit``). Returns a line per change (empty: nothing to
    do)."""
    from tpgrpo.pipeline.dvc_integration.dvclock import dvc_lock_held
    from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml

    if not older_layouts(root):
        return []
    with dvc_lock_held(root):
        moved = migrate_sealed_entries(root)
        notes = [f"moved the records of {', '.join(b.name for b in moved)} into the blocks' own lock files"] \
            if moved else []
        notes += _to_code_md5s(root, cfg)
        notes += _to_manifests(root, cfg)
        write_dvc_yaml(cfg, root)
    if (root / ".dvc").is_dir():
        from dvc.repo import Repo

        Repo(str(root)).commit("code", force=True)  # the code stage: what it would write is on disk now
    return notes


def migrate_sealed_entries(root: Path) -> list[Block]:
    """Move each sealed block's entry from the root dvc.lock into the block's own lock, beside its pipeline
    file (DVC sees the same stage with the same record). Call with DVC's lock held. Returns the blocks moved."""
    lock = read_lock(root)
    moved = unmigrated_blocks(root, lock)
    for block in moved:
        write_block_entry(root, block, lock["stages"].pop(block.name))
    if moved:
        write_lock(root, lock)
    return moved


def _md5(data: bytes) -> str:
    return hashlib.md5(data).hexdigest()


def _rewrite_records(root: Path, rewrite) -> list[str]:
    """Apply ``rewrite(name, entry) -> entry | None`` to every record (None: the record goes, the stage
    re-runs); write back the files that changed. Returns the names whose record went."""
    dropped = []
    for path, data, entries in _records(root):
        before = json.dumps(data, sort_keys=True, default=str)
        for name in list(entries):
            new = rewrite(name, entries[name]) if isinstance(entries[name], dict) else entries[name]
            if new is None:
                dropped.append(name)
                del entries[name]
            else:
                entries[name] = new
        if json.dumps(data, sort_keys=True, default=str) != before:
            write_yaml(path, data)
    return dropped


def _to_code_md5s(root: Path, cfg: Config) -> list[str]:
    """Rewrite manifests of byte md5s with code md5s; where the code is what the old manifest recorded, the
    records that name the old manifest's md5 get the new one (nothing re-runs)."""
    from tpgrpo.io.artifacts import atomic_path

    swaps, changed = {}, []
    for kind in _byte_manifests(root):
        path = root / manifest_path(kind)
        old, new = path.read_bytes(), manifest_text(root, kind, cfg).encode()
        if manifest_text(root, kind, cfg, BYTES).encode() == old:
            swaps[manifest_path(kind)] = (_md5(old), _md5(new), len(new))
        else:
            changed.append(kind)
        with atomic_path(path) as tmp:
            tmp.write_bytes(new)

    def swap(_name: str, entry: dict) -> dict:
        for item in [*(entry.get("deps") or []), *(entry.get("outs") or [])]:
            old_md5, new_md5, size = swaps.get(item.get("path"), (None, None, None))
            if old_md5 is not None and item.get("md5") == old_md5:
                item.update(md5=new_md5, size=size)
        return entry

    _rewrite_records(root, swap)
    notes = [f"rewrote {len(swaps) + len(changed)} code manifests with code md5s"] if swaps or changed else []
    if changed:
        notes.append(f"the code of {', '.join(changed)} changed since its manifest was written: those stages re-run")
    return notes


def _rendered(cfg: Config, root: Path) -> dict[str, dict]:
    """Today's dvc.yaml entry of every stage a record may name: the rendered stages, each sealed block's stage
    and the stages inside it."""
    from tpgrpo.pipeline.rendering.dvcfile import block_stage, iteration_stages, render

    stages = dict(render(cfg, root)["stages"])
    for block, outs in sealed_outs(root, list(seal_files(root))).items():
        stages[block.name] = block_stage(cfg, block, outs)
        for i in block.iterations:
            stages.update(iteration_stages(cfg, i))
    return stages


def _to_manifests(root: Path, cfg: Config) -> list[str]:
    """Replace the code files in every record by the manifests of its stage's code kinds, with the manifests'
    md5s, where every recorded code file is unchanged; drop the record of a stage whose code changed since it
    ran. The params a record lists beyond today's stage (the probe's ``credit.mode``) go."""
    from tpgrpo.pipeline.rendering.code_manifest import write_manifests

    if not any(uses_code_files(entries) for _, _, entries in _records(root)):
        return []
    written = {p.relative_to(root).as_posix(): p.read_bytes() for p in write_manifests(root, cfg)}
    stages = _rendered(cfg, root)

    def convert(name: str, entry: dict) -> dict | None:
        deps = entry.get("deps") or []
        code = [d for d in deps if str(d.get("path", "")).startswith(CODE_FOLDERS)]
        if not code or name not in stages:
            return entry
        if any(not (root / d["path"]).is_file() or _md5((root / d["path"]).read_bytes()) != d.get("md5")
               for d in code):
            return None
        kept = [d for d in deps if d not in code]
        kept += [{"path": p, "hash": "md5", "md5": _md5(written[p]), "size": len(written[p])}
                 for p in stages[name]["deps"] if p in written]
        keys = {p for p in stages[name].get("params") or [] if isinstance(p, str)}
        params = {f: {k: v for k, v in values.items() if k in keys} for f, values in (entry.get("params") or {}).items()}
        return {**entry, "deps": sorted(kept, key=lambda d: d["path"]), **({"params": params} if params else {})}

    dropped = _rewrite_records(root, convert)
    notes = ["the stages now depend on code manifests (data/code/) instead of their code files"]
    if dropped:
        notes.append(f"code changed since {', '.join(dropped[:3])}{' and others' if len(dropped) > 3 else ''} ran: "
                     "they re-run")
    return notes
