"""What ``tpgrpo run`` knows of each sealed block without parsing its records: a machine-local cache.

Why: at 1,000 iterations there are 40 sealed blocks, each a lock entry of some 250 outputs. Parsing them all
(and having DVC hash all 6,000 outputs through the summary's dependencies) on every ``tpgrpo run`` made a
resume cost grow with the run. This cache keeps, per sealed block, in ``.dvc/tmp/tpgrpo_seals/`` (never in
git: its file times are this machine's):

- ``lock``: the (mtime, size, inode) of the block's ``dvc.lock`` when the rest was recorded: any write to the lock
  (DVC re-ran the block, retention thinned it) makes the entry stale, and it is rebuilt from the lock;
- ``params`` and ``deps``: the block entry's recorded params and dependency md5s (what unsealing compares);
- ``files``: a digest of the (path, size, mtime, inode) of every file of the block's deps and outs, taken when
  DVC last vouched for them (a ``dvc repro`` that checked the block, or the ``dvc commit`` that sealed it).

A block whose files still have that digest is what DVC found: ``tpgrpo run`` then needs DVC to check only the
open stages (:func:`tpgrpo.pipeline.repro.repro_args`). Any change of a file's size, time or inode (a delete,
an in-place write, a restore, ``touch``), a missing cache entry (a fresh clone) or an unreadable one sends the
repro through DVC's full check of every sealed block, exactly as before. The trust is DVC's own: its state
database also takes a file whose (inode, mtime, size) is unchanged to have its recorded md5.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path

from tpgrpo.pipeline.long_runs.blocks import Block, block_entry, seal_files, write_text_atomic

CACHE = Path(".dvc") / "tmp" / "tpgrpo_seals"


def _stamp(path: Path) -> list[int] | None:
    try:
        st = path.stat()
    except OSError:
        return None
    return [st.st_mtime_ns, st.st_size, st.st_ino]


def files_digest(root: Path, paths: list[str]) -> str:
    """md5 over (path, size, mtime, inode) of every file under ``paths`` (files or folders), sorted; a missing
    path counts as such."""
    rows = []
    for rel in sorted(set(paths)):
        top = root / rel
        if top.is_dir():
            for folder, dirs, files in os.walk(top):
                dirs.sort()
                rows += [(os.path.join(folder, f), _stamp(Path(folder, f))) for f in sorted(files)]
        else:
            rows.append((str(top), _stamp(top)))
    return hashlib.md5(json.dumps(rows).encode()).hexdigest()


def _entry_paths(entry: dict) -> list[str]:
    return [str(i["path"]) for i in [*(entry.get("deps") or []), *(entry.get("outs") or [])] if "path" in i]


def _cache_file(root: Path, block: Block) -> Path:
    return root / CACHE / f"{block.first:04d}-{block.last:04d}.json"


def _read(root: Path, block: Block) -> dict | None:
    """The cached record, if it was made from the block's lock file as it is now."""
    try:
        data = json.loads(_cache_file(root, block).read_text())
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) and data.get("lock") == _stamp(block.lockfile(root)) else None


def summary(root: Path, block: Block) -> dict | None:
    """``{"params", "deps", "paths"}`` of the block's lock entry (None when it has none), from the cache when it
    matches the lock file, else parsed from the lock (and cached, without a files digest)."""
    cached = _read(root, block)
    if cached is not None:
        return cached["summary"]
    entry = block_entry(root, block)
    if entry is None:
        return None
    found = {"params": (entry.get("params") or {}).get("params.yaml") or {},
             "deps": {str(d["path"]): d.get("md5") for d in entry.get("deps") or [] if "path" in d},
             "paths": _entry_paths(entry)}
    _write(root, block, {"lock": _stamp(block.lockfile(root)), "summary": found, "files": None})
    return found


def _write(root: Path, block: Block, data: dict) -> None:
    if not (root / ".dvc").is_dir():
        return  # not a DVC project (yet): creating .dvc/tmp here would make `tpgrpo run` skip `dvc init`
    try:
        write_text_atomic(_cache_file(root, block), json.dumps(data))
    except OSError:
        pass  # a cache: without it the next run checks through DVC


def digests(root: Path, blocks: list[Block]) -> dict[Block, str | None]:
    """Each block's files digest now (None: no lock entry): take it before a ``dvc repro`` and pass it to
    :func:`vouch` after, so that only files DVC saw as they are now are vouched for."""
    found = {block: summary(root, block) for block in blocks}
    return {block: None if f is None else files_digest(root, f["paths"]) for block, f in found.items()}


def vouch(root: Path, blocks: list[Block] | None = None, before: dict[Block, str | None] | None = None) -> None:
    """Record the files digest of sealed ``blocks`` (all when None) as DVC just found them (call right after a
    ``dvc repro`` that checked them, or a ``dvc commit`` that recorded them). With ``before`` (:func:`digests`
    taken before a long repro) a block whose files' stamps moved meanwhile is not vouched for: DVC may have
    checked a file before it was written again (a stage re-run by hand during the repro), or re-ran the block;
    the next run checks it through DVC once more."""
    for block in seal_files(root) if blocks is None else blocks:
        found = summary(root, block)
        if found is None:
            continue
        now = files_digest(root, found["paths"])
        if before is not None and before.get(block) != now:
            continue
        _write(root, block, {"lock": _stamp(block.lockfile(root)), "summary": found, "files": now})


def unchanged(root: Path, blocks: list[Block]) -> bool:
    """Whether every one of ``blocks`` has a cached files digest that its files still match."""
    for block in blocks:
        cached = _read(root, block)
        if cached is None or cached.get("files") is None or \
                cached["files"] != files_digest(root, cached["summary"]["paths"]):
            return False
    return True
