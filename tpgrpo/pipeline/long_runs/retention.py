"""Retention: what ``tpgrpo retain`` drops of sealed blocks, and the cache objects it frees.

Tables and metrics are kept forever; trajectories and prompt embeddings only for the last
``retention.keep_trajectories`` finished iterations; adapters of every ``keep_adapter_every``-th iteration and
each block's last (the next block starts from it). The records change first (seal file, the block's pipeline
file and lock entry), then the files go, then the cache objects nothing references any more.
"""

from __future__ import annotations

import shutil
from pathlib import Path
from typing import Callable

from tpgrpo.config import Config
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.long_runs.blocks import (Block, block_entry, committed_oids, entry_oids, full_blocks, read_lock,
                                              read_seal, seal_files, unreferenced, write_block_entry, write_yaml)
from tpgrpo.pipeline.dvc_integration.dvclock import dvc_lock_held
from tpgrpo.stage_params import ITERATION_OUTPUTS

# {output name: its retention group} (tpgrpo.stage_params.ITERATION_STAGES); everything else (tables, metrics)
# is kept forever
DROPPABLE = {out.name: out.droppable for out in ITERATION_OUTPUTS.values() if out.droppable}


def dropped_outs(root: Path, block: Block, entries: dict | None = None) -> list[str]:
    """The outputs of a sealed block's stages (``entries``: its per-stage lock entries at sealing) that its
    seal no longer tracks: what ``tpgrpo retain`` deleted."""
    entries = read_seal(block.entries_path(root)) if entries is None else entries
    kept = set(read_seal(block.seal_path(root))["outs"])
    return [o["path"] for e in entries.values() for o in e.get("outs") or [] if o["path"] not in kept]


def remove_path(path: Path) -> None:
    """Delete a file or a folder (nothing when it is gone)."""
    if path.is_dir():
        shutil.rmtree(path)
    elif path.exists():
        path.unlink()


def kept_outs(cfg: Config, block: Block, outs: list[str], last_done: int) -> list[str]:
    """Which of a sealed block's ``outs`` the retention policy keeps (tables always; trajectories of the
    last ``keep_trajectories`` finished iterations; adapters of every m-th iteration and the block's last,
    which the next block starts from)."""
    keep_t, every = cfg.retention.keep_trajectories, cfg.retention.keep_adapter_every
    kept = []
    for path in outs:
        iteration, name = int(Path(path).parent.name), Path(path).name
        kind = DROPPABLE.get(name)
        if kind == "trajectories" and keep_t and iteration <= last_done - keep_t:
            continue
        if kind == "adapter" and every and iteration % every and iteration != block.last:
            continue
        kept.append(path)
    return kept


def last_finished(cfg: Config, lock: dict, sealed: list[Block]) -> int:
    """The highest iteration whose update has a lock entry or that a sealed block holds (0 if none)."""
    stages = lock.get("stages", {})
    done = [i for i in range(1, cfg.train.iterations + 1) if f"update-{i:04d}" in stages]
    return max([*done, *(b.last for b in sealed)], default=0)


def free_cache(root: Path, repo, lock: dict, gone: list[dict],
               committed: set | None = None) -> tuple[int, int] | None:
    """Remove the cache objects of the dropped outs ``gone`` (their dvc.lock out entries) that nothing else
    references: this dvc.lock (``lock``, already without them), the per-stage entries of every sealed block
    (but the outputs retention dropped from it), and every dvc.lock and block entries git holds in any commit
    or DVC experiment (:func:`tpgrpo.pipeline.long_runs.blocks.committed_oids`). Returns (objects, bytes) removed;
    None, removing nothing, where ``cache.dir`` is set (a cache other projects may share: this project cannot
    see their needs). ``committed``: :func:`~tpgrpo.pipeline.long_runs.blocks.committed_oids`, read now when None.
    Unlike ``dvc gc --workspace`` it leaves what experiments, other commits and other projects stored (an
    experiment's files that were never committed to git, e.g. a queued one's, are not seen)."""
    if not _own_cache(repo):
        return None
    cache = Path(repo.cache.local.path).parents[1]  # <cache>/files/md5 -> <cache>
    kept = entry_oids(lock.get("stages", {}).values()) | (committed_oids(root) if committed is None else committed)
    kept |= entry_oids([e for b in seal_files(root) if (e := block_entry(root, b))])
    for block in seal_files(root):
        if block.entries_path(root).is_file():
            entries = read_seal(block.entries_path(root))
            kept |= entry_oids(entries.values(), skip=set(dropped_outs(root, block, entries)))
    paths = unreferenced(cache, entry_oids([{"outs": gone}]), kept)
    size = sum(p.stat().st_size for p in paths)
    for path in paths:
        path.unlink()
    return len(paths), size


def _own_cache(repo) -> bool:
    """Whether this project's DVC cache is its own (no ``cache.dir``: one other projects may share)."""
    return repo is not None and not repo.config.get("cache", {}).get("dir")


def retain(root: Path, cfg: Config, gc: bool = True, note: Callable[[str], None] | None = None) -> list[str]:
    """Apply ``retention`` to the sealed blocks: drop the artifacts it does not keep from the workspace,
    the blocks' outs and their lock entries (so ``dvc status`` stays clean), then (``gc``) their cache
    objects nothing else references (:func:`free_cache`; ``note`` hears how many). Holds DVC's lock
    throughout (:func:`dvc_lock_held`). Returns the dropped paths."""
    from tpgrpo.pipeline.rendering.dvcfile import write_block_dvcfile

    with dvc_lock_held(root) as repo:
        # before anything changes: a git that cannot list the other commits' records stops retain here (one line)
        committed = committed_oids(root) if gc and _own_cache(repo) else set()
        lock, files = read_lock(root), seal_files(root)
        blocks = [b for b in full_blocks(cfg.train.block_size, cfg.train.iterations) if b in files]
        last_done = last_finished(cfg, lock, blocks)
        thinned: dict[Block, tuple[dict, dict]] = {}
        dropped: list[str] = []
        gone: list[dict] = []
        for block in blocks:
            entry = block_entry(root, block)
            if entry is None:
                raise PipelineError(f"{block.lockfile(root).relative_to(root)}: block {block.name} has no lock entry; "
                                    "run `tpgrpo run` first (it unseals or re-records the block)")
            seal = read_seal(files[block])
            keep = set(kept := kept_outs(cfg, block, seal["outs"], last_done))
            if kept == seal["outs"]:
                continue
            gone += [o for o in entry["outs"] if o["path"] not in keep]
            dropped += [p for p in seal["outs"] if p not in keep]
            thinned[block] = ({**seal, "outs": kept}, {**entry, "outs": [o for o in entry["outs"] if o["path"] in keep]})
        # records first (seal, pipeline file, then lock: a lock entry with an out its stage no longer lists is
        # harmless), then the files: an interruption leaves untracked files behind, never a dangling out
        for block, (seal, entry) in thinned.items():
            write_yaml(files[block], seal)
            write_block_dvcfile(cfg, root, block, seal["outs"])
            write_block_entry(root, block, entry)
        for path in dropped:
            remove_path(root / path)
        if dropped:
            freed = free_cache(root, repo, lock, gone, committed) if gc else None
            if note is not None and gc:
                note(f"freed {freed[0]} cache objects ({freed[1] / 1e6:.1f} MB)" if freed else
                     "cache.dir is set (a cache other projects may share): nothing removed from it")
    return dropped
