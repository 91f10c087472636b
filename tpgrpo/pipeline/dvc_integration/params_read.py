"""What each stage read from params.yaml, checked against what DVC recorded for it.

A stage checks at its end that params.yaml still holds what it read at its start
(:func:`tpgrpo.pipeline.status.check_params_unchanged`), but DVC reads params.yaml for dvc.lock only after
the stage has exited and its outputs are hashed. An edit in that window, or between two stages of a sealed
block's re-run (``tpgrpo block``: DVC records the block once, after its last stage), would be recorded as what
the stage ran with. So each stage DVC runs also notes what it read (under ``.dvc/tmp``, no artifact), and
after each ``dvc repro`` ``tpgrpo run`` compares every note with the lock entry DVC wrote (the stage's own, or
its sealed block's): an entry that disagrees is dropped, and DVC runs that stage (or block) again.
"""

from __future__ import annotations

import json
import os
import re
import shutil
from pathlib import Path

from tpgrpo.pipeline.long_runs.blocks import Block, block_entry, read_lock, seal_files, write_block_entry, write_lock
from tpgrpo.pipeline.dvc_integration.dvclock import dvc_lock_held
from tpgrpo.pipeline.status import flat_params

NOTES = Path(".dvc") / "tmp" / "tpgrpo_params_read"
_BLOCK = re.compile(r"iters-(\d{4})-(\d{4})")


def note_params_read(root: Path, stage: str, read: dict) -> None:
    """Note ``read`` (``{dotted key: value}``, as :func:`tpgrpo.pipeline.status.stage_params` gives it) for
    the dvc.yaml stage ``stage`` (``eval-0003``), when DVC runs it (``DVC_STAGE`` set); a temp file, renamed."""
    if not os.environ.get("DVC_STAGE") or not (root / ".dvc").is_dir():
        return
    folder = root / NOTES
    folder.mkdir(parents=True, exist_ok=True)
    tmp = folder / f".{stage}.{os.getpid()}.tmp"
    tmp.write_text(json.dumps(read, sort_keys=True, default=str))
    tmp.replace(folder / f"{stage}.json")


def clear_notes(root: Path) -> None:
    """Forget every note (before a ``dvc repro``: only what that repro's stages read is checked after it)."""
    shutil.rmtree(root / NOTES, ignore_errors=True)


def entry_name(stages: dict, stage: str) -> str | None:
    """The dvc.lock entry that records ``stage``: its own, or that of the sealed block holding its iteration."""
    if stage in stages:
        return stage
    iteration = stage.rsplit("-", 1)[-1]
    if not iteration.isdigit():
        return None
    blocks = [n for n in stages if (m := _BLOCK.fullmatch(n)) and int(m[1]) <= int(iteration) <= int(m[2])]
    return blocks[0] if blocks else None


def _entries(root: Path) -> tuple[dict, dict[str, Block]]:
    """Every lock entry a note may name: the root dvc.lock's stages and each sealed block's own entry
    (``{name: entry}``), and the blocks by name (their entries live in their own lock files)."""
    stages = dict(read_lock(root).get("stages", {}))
    blocks = {}
    for block in seal_files(root):
        entry = block_entry(root, block)
        if entry is not None:
            stages[block.name], blocks[block.name] = entry, block
    return stages, blocks


def drop_disagreeing(root: Path) -> list[str]:
    """Drop each lock entry whose params differ from what a stage it records noted it read (DVC then
    re-runs that stage or block); clears the notes. Returns ``entry (stage: key)`` for each entry dropped.
    Edits the lock files with DVC's lock held."""
    folder = root / NOTES
    notes = sorted(folder.glob("*.json")) if folder.is_dir() else []
    if not notes:
        return []
    with dvc_lock_held(root):
        stages, blocks = _entries(root)
        dropped: dict[str, str] = {}
        for note in notes:
            name = entry_name(stages, note.stem)
            if name is None or name in dropped:
                continue
            recorded = flat_params((stages[name].get("params") or {}).get("params.yaml") or {})
            recorded = json.loads(json.dumps(recorded, default=str))  # compared as the note stored them
            changed = [k for k, v in sorted(json.loads(note.read_text()).items())
                       if k in recorded and recorded[k] != v]
            if changed:
                dropped[name] = f"{note.stem}: {changed[0]}"
        root_drops = [n for n in dropped if n not in blocks]
        if root_drops:
            lock = read_lock(root)
            for name in root_drops:
                lock["stages"].pop(name, None)
            write_lock(root, lock)
        for name in dropped:
            if name in blocks:
                write_block_entry(root, blocks[name], None)
        clear_notes(root)
    return [f"{name} ({why})" for name, why in dropped.items()]
