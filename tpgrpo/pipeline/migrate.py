"""Projects sealed before blocks had their own pipeline files: their block entries move out of the root lock.

Such a project keeps each sealed block's stage in the root ``dvc.yaml`` and its entry in the root ``dvc.lock``.
Moving the entry into the block's own lock file, beside its own pipeline file, gives DVC the same stage with
the same record (nothing re-runs) and leaves the root lock with the open stages only.
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.config import Config
from tpgrpo.pipeline.long_runs.blocks import Block, read_lock, seal_files, write_block_entry, write_lock
from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml
from tpgrpo.pipeline.dvc_integration.dvclock import dvc_lock_held


def _unmigrated(root: Path, lock: dict | None = None) -> list[Block]:
    """Sealed blocks whose entry is still in the root dvc.lock (sealed before blocks had their own files)."""
    files = seal_files(root)
    if not files or all(b.lockfile(root).is_file() for b in files):
        return []
    stages = (read_lock(root) if lock is None else lock)["stages"]
    return [b for b in files if b.name in stages and not b.lockfile(root).is_file()]


def migrate_if_needed(root: Path, cfg: Config) -> list[Block]:
    """:func:`migrate_sealed_entries` under DVC's lock, when a sealed block still has its entry in the root lock
    (rendering dvc.yaml without it would leave the block's own pipeline file with no record: DVC would re-run
    it)."""
    if not _unmigrated(root):
        return []
    with dvc_lock_held(root):
        return migrate_sealed_entries(root, cfg)


def migrate_sealed_entries(root: Path, cfg: Config) -> list[Block]:
    """Projects sealed before blocks had their own pipeline files keep each block's stage in the root
    dvc.yaml and its entry in the root dvc.lock: move each such entry into the block's own lock, beside its
    pipeline file, and re-render dvc.yaml without it (DVC sees the same stage with the same record: nothing
    re-runs). Call with DVC's lock held. Returns the blocks moved."""
    lock = read_lock(root)
    moved = _unmigrated(root, lock)
    for block in moved:
        write_block_entry(root, block, lock["stages"].pop(block.name))
    if moved:
        write_lock(root, lock)
        write_dvc_yaml(cfg, root)
    return moved
