"""Seal finished blocks, unseal changed ones, run a sealed block, apply retention.

Why: DVC checks every dependency of every stage on each ``status`` / ``repro``; at five stages of ~20 deps
per iteration that is ~100,000 checks at 1,000 iterations (minutes per command). A sealed block lists the
union of its stages' outside deps once, so the work grows with the number of blocks, not of stages.

The guarantees stay those of per-stage DVC:
- a block is sealed only when DVC itself finds every one of its stages up to date (``dvc status`` of them:
  each lock entry's params equal today's params.yaml as DVC reads it, each dep and out its file), right
  after a successful ``dvc repro``; the block's lock entry is then written by ``dvc commit`` from the files
  on disk. A block with a stale stage (params edited while it ran, a stage re-run by hand) stays open, and
  the next repro re-runs what is stale;
- before rendering, a sealed block whose recorded params differ from ``params.yaml`` (compared as DVC reads
  both: YAML 1.2), that has no lock entry (an interrupted sealing), or that no longer fits the run (another
  ``train.block_size``, ``train.iterations`` lowered into it) is unsealed: its per-stage lock entries come
  back, so DVC re-runs exactly the stages the change touches (``credit.mode`` -> credit onward; nothing
  for a lowered iteration count);
- a block ``tpgrpo retain`` thinned is never unsealed (its stages would miss outputs and DVC would re-run
  its rollouts): the change is refused with one line;
- a code change re-runs a whole sealed block (``tpgrpo block``), stage by stage, one process per stage;
  DVC then rewrites the block's lock entry only, and unsealing it later restores each stage's entry as that
  run left it (:func:`tpgrpo.pipeline.blocks.current_entries`), so a params edit after a code change re-runs
  only the stages the edit touches.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from contextlib import contextmanager
from pathlib import Path
from typing import Callable

from tpgrpo.config import Config
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.block_logs import write_digest
from tpgrpo.pipeline.blocks import (Block, committed_oids, current_entries, disagreements, entry_oids, full_blocks,
                                    param_values, read_as_dvc, read_lock, read_seal, seal_files, unreferenced,
                                    write_lock, write_yaml)
from tpgrpo.pipeline.dvcfile import block_out_paths, block_stage, iteration_stages, stage_command, write_dvc_yaml

DROPPABLE = {"trajectories.zarr": "trajectories", "prompt_embeds.safetensors": "trajectories",
             "policy": "adapter"}  # everything else (tables, metrics) is kept forever


def dvc_env() -> dict[str, str]:
    """Stage commands call ``tpgrpo``: this interpreter's scripts folder comes first on PATH."""
    env = dict(os.environ, DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")
    env["PATH"] = str(Path(sys.executable).parent) + os.pathsep + env.get("PATH", "")
    return env


def dvc(root: Path, *args: str) -> None:
    """Run one DVC command in ``root``; a failure is one line naming it."""
    done = subprocess.run([sys.executable, "-m", "dvc", *args], cwd=root, env=dvc_env(),
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise PipelineError(f"dvc {' '.join(args)} failed (exit {done.returncode}): {last}")


def stage_names(cfg: Config, block: Block) -> list[str]:
    return [name for i in block.iterations for name in iteration_stages(cfg, i)]


def repro_ends(root: Path, cfg: Config) -> list[int]:
    """The iterations ``tpgrpo run`` renders dvc.yaml through, one ``dvc repro`` each: the end of every full
    block not yet sealed, then the run's last. DVC rewrites the whole dvc.lock after every stage it runs,
    so a run repro'd in one piece pays for every earlier stage's entry again at each stage (quadratic in
    the run's length); block by block, with each block sealed before the next, the lock stays about one
    block's stages long (bench/lock_growth.py)."""
    sealed = seal_files(root)
    ends = [b.last for b in full_blocks(cfg.train.block_size, cfg.train.iterations) if b not in sealed]
    return [e for e in ends if e < cfg.train.iterations] + [cfg.train.iterations]


def sealable(cfg: Config, lock_stages: dict, sealed, upto: int | None = None) -> list[Block]:
    """The full blocks, not yet sealed and ending by ``upto``, whose stages all have a lock entry. Only
    those were just reproduced: a later block's entries may be stale (restored by unsealing, not yet
    re-run), and sealing it would commit its old outputs as up to date."""
    last = cfg.train.iterations if upto is None else upto
    return [b for b in full_blocks(cfg.train.block_size, cfg.train.iterations)
            if b not in sealed and b.last <= last and all(n in lock_stages for n in stage_names(cfg, b))]


def stale_stages(root: Path, names: list[str]) -> dict[str, list]:
    """DVC's own verdict on the stages ``names`` of dvc.yaml as rendered now, each alone (``dvc status --json``
    of them, not of their upstream): ``{stage: [what changed]}``, empty when every one's lock entry matches
    today's params.yaml (as DVC reads it) and its dep and out files."""
    if not names:
        return {}
    done = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", *names], cwd=root, env=dvc_env(),
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise PipelineError(f"dvc status of {len(names)} stages failed (exit {done.returncode}): {last}")
    return json.loads(done.stdout or "{}")


def _what(changes: list) -> str:
    """``dvc status --json``'s list for one stage, as a few words: ``credit.adv_clip modified, ...``."""
    parts: list[str] = []
    for change in changes:
        for files in (change.values() if isinstance(change, dict) else [change]):
            for path, state in (files.items() if isinstance(files, dict) else [(files, "")]):
                parts += ([f"{k} {v}" for k, v in state.items()] if isinstance(state, dict)
                          else [f"{path} {state}".strip()])
    return ", ".join(parts[:3]) + (", ..." if len(parts) > 3 else "")


def up_to_date(root: Path, cfg: Config, blocks: list[Block], note: Callable[[str], None] | None = None) -> list[Block]:
    """The blocks among ``blocks`` whose every stage DVC finds up to date. Sealing any other would record
    today's params.yaml and files as what its stages ran with; each is named in one ``note`` line and stays
    open, so the next ``dvc repro`` re-runs its stale stages."""
    stale = stale_stages(root, [n for b in blocks for n in stage_names(cfg, b)])
    fresh = []
    for block in blocks:
        bad = [n for n in stage_names(cfg, block) if n in stale]
        if not bad:
            fresh.append(block)
        elif note is not None:
            note(f"not sealed: {block.name}: {bad[0]}" + (f" and {len(bad) - 1} more stages" if len(bad) > 1 else "")
                 + f" not up to date ({_what(stale[bad[0]])}); the next `tpgrpo run` re-runs them")
    return fresh


def seal_finished(root: Path, cfg: Config, upto: int | None = None,
                  note: Callable[[str], None] | None = None) -> list[Block]:
    """Seal every complete, not yet sealed block (ending by ``upto``) whose stages all have a ``dvc.lock``
    entry that DVC finds up to date (:func:`up_to_date`; ``note`` hears of each one that is not). Call after
    a successful ``dvc repro`` of dvc.yaml rendered through ``upto``. Returns the blocks sealed."""
    lock, sealed = read_lock(root), seal_files(root)
    stages = lock.setdefault("stages", {})
    new = up_to_date(root, cfg, sealable(cfg, stages, sealed, upto), note)
    for block in new:
        names = stage_names(cfg, block)
        write_digest(root, block)  # an output of the block's stage: `dvc commit` records it
        write_yaml(block.entries_path(root), {n: stages[n] for n in names})
        write_yaml(block.seal_path(root), {"first": block.first, "last": block.last,
                                           "outs": block_out_paths(cfg, block)})
        for n in names:
            del stages[n]
    if new:
        write_lock(root, lock)
        write_dvc_yaml(cfg, root, upto)
        # the summary's deps list changed with the blocks (it ran just now, so it is up to date); before
        # the last block's repro dvc.yaml has no summary
        summary = ["summary"] if upto in (None, cfg.train.iterations) else []
        dvc(root, "commit", "--force", "--quiet", *[b.name for b in new], *summary)
        new = _undo_changed_while_sealing(root, cfg, new, upto, note)
    return new


def _undo_changed_while_sealing(root: Path, cfg: Config, blocks: list[Block], upto: int | None,
                                note: Callable[[str], None] | None) -> list[Block]:
    """``dvc commit`` records params.yaml and the files as they are when it runs, seconds after ``dvc status``
    found the stages up to date: a params edit in between would be recorded as what the block ran with. Any
    block whose new entry disagrees with its stages' own entries is unsealed again (its stages' entries back,
    named in one ``note`` line), so the next repro re-runs what changed. Returns the blocks that stay sealed."""
    lock = read_lock(root)
    stages = lock["stages"]
    bad = {b: d for b in blocks if (d := disagreements(read_seal(b.entries_path(root)), stages.get(b.name)))}
    for block, found in bad.items():
        stages.pop(block.name, None)
        stages.update(read_seal(block.entries_path(root)))
        block.seal_path(root).unlink()
        block.entries_path(root).unlink()
        if note is not None:
            note(f"not sealed: {block.name}: {found[0]} changed while it was being sealed; the next `tpgrpo run` "
                 "re-runs what changed")
    if bad:
        write_lock(root, lock)
        write_dvc_yaml(cfg, root, upto)
    return [b for b in blocks if b not in bad]


def changed_keys(recorded: dict, now: dict) -> list[str]:
    """The param keys whose values differ (``eval.num_steps`` inside a section), sorted."""
    out = []
    for key in sorted(set(recorded) | set(now)):
        a, b = recorded.get(key), now.get(key)
        if a != b and isinstance(a, dict) and isinstance(b, dict):
            out += [f"{key}.{k}" for k in sorted(set(a) | set(b)) if a.get(k) != b.get(k)]
        elif a != b:
            out.append(key)
    return out


def unseal_reason(cfg: Config, block: Block, entry: dict | None, params: dict) -> str | None:
    """Why the sealed ``block`` must be unsealed under ``cfg`` (``params``: params.yaml as DVC reads it;
    ``entry``: its dvc.lock entry), or None. A block wholly beyond the run stays sealed for when
    train.iterations is raised again; one the run now ends inside is unsealed, and its iterations come
    back as stages with their lock entries: nothing re-runs."""
    size, n = cfg.train.block_size, cfg.train.iterations
    if block.first > n:
        return None
    if size <= 0 or (block.first - 1) % size or block.last - block.first + 1 != size:
        return f"train.block_size is {size}"
    if block.last > n:
        return f"train.iterations = {n} ends inside it"
    if entry is None:
        return "it has no dvc.lock entry"
    recorded = (entry.get("params") or {}).get("params.yaml") or {}
    changed = changed_keys(recorded, param_values(params, block_stage(cfg, block)["params"]))
    return f"params changed: {', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}" if changed else None


def dropped_outs(root: Path, block: Block, entries: dict | None = None) -> list[str]:
    """The outputs of a sealed block's stages (``entries``: its per-stage lock entries at sealing) that its
    seal no longer tracks: what ``tpgrpo retain`` deleted."""
    entries = read_seal(block.entries_path(root)) if entries is None else entries
    kept = set(read_seal(block.seal_path(root))["outs"])
    return [o["path"] for e in entries.values() for o in e.get("outs") or [] if o["path"] not in kept]


def unseal_changed(root: Path, cfg: Config, raw_params: dict | None = None) -> list[Block]:
    """Unseal the sealed blocks this config no longer matches (:func:`unseal_reason`; ``raw_params``:
    params.yaml's values, read from the file as DVC reads it when None). Restores their per-stage lock
    entries, as the block's own entry last recorded them (:func:`current_entries`); returns the blocks
    unsealed. Refuses (PipelineError, one line, nothing changed) when one of them was thinned by ``tpgrpo
    retain``: its restored stages would miss outputs and DVC would re-run them."""
    files = seal_files(root)
    if not files:
        return []
    params = read_as_dvc(root / "params.yaml") if raw_params is None else raw_params
    lock = read_lock(root)
    stages = lock.setdefault("stages", {})
    todo = {b: why for b in files if (why := unseal_reason(cfg, b, stages.get(b.name), params))}
    entries = {b: current_entries(read_seal(b.entries_path(root)), stages.get(b.name)) for b in todo}
    for block, why in todo.items():
        gone = dropped_outs(root, block, entries[block])
        if gone:
            stem = block.seal_path(root).relative_to(root).with_suffix("")
            raise PipelineError(
                f"{stem}.yaml: block {block.name} would have to be unsealed ({why}), but `tpgrpo retain` dropped "
                f"{len(gone)} of its outputs (first: {gone[0]}), so DVC would re-run iterations {block.first}-"
                f"{block.last} from their rollouts; undo the change, or delete {stem}.yaml and {stem}.stages "
                "to re-run the block whole")
    for block in todo:
        stages.pop(block.name, None)
        stages.update(entries[block])
    if todo:
        write_lock(root, lock)
        for block in todo:
            block.seal_path(root).unlink()
            block.entries_path(root).unlink()
    return list(todo)


def run_block(root: Path, cfg: Config, block: Block) -> None:
    """What a sealed block's DVC stage runs: each iteration's stages in order, one process each (as
    dvc.yaml would), then drops the artifacts the block's seal no longer tracks (retention)."""
    for i in block.iterations:
        for name in iteration_stages(cfg, i):
            stage = name.rsplit("-", 1)[0]
            done = subprocess.run(stage_command(cfg, stage, i), shell=True, cwd=root, env=dvc_env())
            if done.returncode != 0:
                raise PipelineError(f"block {block.name}: stage {name} failed with exit code {done.returncode}")
    write_digest(root, block)
    seal = block.seal_path(root)
    kept = set(read_seal(seal)["outs"]) if seal.is_file() else None
    for path in block_out_paths(cfg, block):
        if kept is not None and path not in kept:
            _remove(root / path)


def _remove(path: Path) -> None:
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


@contextmanager
def dvc_lock_held(root: Path):
    """Hold DVC's repository lock (``.dvc/tmp/lock``) while dvc.lock is edited outside DVC; yields DVC's
    Repo (None where ``root`` has no DVC yet). Refuses with one line while a DVC command holds that lock, or
    while ``.dvc/tmp/rwlock`` names a live process (``dvc repro`` releases the repository lock while a stage
    runs; the rwlock names it)."""
    if not (root / ".dvc").is_dir():
        yield None
        return
    from dvc.lock import LockError
    from dvc.repo import Repo

    from tpgrpo.pipeline.dvclock import RWLOCK, lock_pids, pid_state

    repo = Repo(str(root))
    try:
        try:
            repo.lock.lock()
        except LockError:
            raise PipelineError(".dvc/tmp/lock: a DVC command is running in this project (it holds DVC's lock); "
                                "retry when it has finished") from None
        try:
            try:
                rw = json.loads((root / RWLOCK).read_text()) if (root / RWLOCK).is_file() else {}
            except ValueError:
                raise PipelineError(f"{RWLOCK}: not readable as DVC's lock (expected JSON)") from None
            live = [pid for pid in lock_pids(rw) if pid_state(pid) not in (None, "Z")]
            if live:
                raise PipelineError(f"{RWLOCK}: DVC process {', '.join(map(str, live))} is running a stage in this "
                                    "project; retry when it has finished")
            yield repo
        finally:
            repo.lock.unlock()
    finally:
        repo.close()


def free_cache(root: Path, repo, lock: dict, gone: list[dict]) -> tuple[int, int] | None:
    """Remove the cache objects of the dropped outs ``gone`` (their dvc.lock out entries) that nothing else
    references: this dvc.lock (``lock``, already without them), the per-stage entries of every sealed block
    (but the outputs retention dropped from it), and every dvc.lock and block entries git holds in any commit
    or DVC experiment (:func:`tpgrpo.pipeline.blocks.committed_oids`). Returns (objects, bytes) removed;
    None, removing nothing, where ``cache.dir`` is set (a cache other projects may share: this project cannot
    see their needs).
    Unlike ``dvc gc --workspace`` it leaves what experiments, other commits and other projects stored (an
    experiment's files that were never committed to git, e.g. a queued one's, are not seen)."""
    if repo is None or repo.config.get("cache", {}).get("dir"):
        return None
    cache = Path(repo.cache.local.path).parents[1]  # <cache>/files/md5 -> <cache>
    kept = entry_oids(lock.get("stages", {}).values()) | committed_oids(root)
    for block in seal_files(root):
        if block.entries_path(root).is_file():
            entries = read_seal(block.entries_path(root))
            kept |= entry_oids(entries.values(), skip=set(dropped_outs(root, block, entries)))
    paths = unreferenced(cache, entry_oids([{"outs": gone}]), kept)
    size = sum(p.stat().st_size for p in paths)
    for path in paths:
        path.unlink()
    return len(paths), size


def retain(root: Path, cfg: Config, gc: bool = True, note: Callable[[str], None] | None = None) -> list[str]:
    """Apply ``retention`` to the sealed blocks: drop the artifacts it does not keep from the workspace,
    the blocks' outs and their lock entries (so ``dvc status`` stays clean), then (``gc``) their cache
    objects nothing else references (:func:`free_cache`; ``note`` hears how many). Holds DVC's lock
    throughout (:func:`dvc_lock_held`). Returns the dropped paths."""
    with dvc_lock_held(root) as repo:
        lock, files = read_lock(root), seal_files(root)
        stages = lock.setdefault("stages", {})
        blocks = [b for b in full_blocks(cfg.train.block_size, cfg.train.iterations) if b in files]
        last_done = last_finished(cfg, lock, blocks)
        dropped: list[str] = []
        gone: list[dict] = []
        for block in blocks:
            if block.name not in stages:
                raise PipelineError(f"{files[block]}: block {block.name} has no dvc.lock entry; run `tpgrpo run` "
                                    "first (it unseals or re-records the block)")
            seal = read_seal(files[block])
            kept = kept_outs(cfg, block, seal["outs"], last_done)
            if kept == seal["outs"]:
                continue
            keep = set(kept)
            gone += [o for o in stages[block.name]["outs"] if o["path"] not in keep]
            stages[block.name]["outs"] = [o for o in stages[block.name]["outs"] if o["path"] in keep]
            dropped += [p for p in seal["outs"] if p not in keep]
            seal["outs"] = kept
            write_yaml(files[block], seal)
        if dropped:  # records first: an interruption leaves untracked files behind, never a dangling out
            write_lock(root, lock)
            write_dvc_yaml(cfg, root)
            for path in dropped:
                _remove(root / path)
            freed = free_cache(root, repo, lock, gone) if gc else None
            if note is not None and gc:
                note(f"freed {freed[0]} cache objects ({freed[1] / 1e6:.1f} MB)" if freed else
                     "cache.dir is set (a cache other projects may share): nothing removed from it")
    return dropped
