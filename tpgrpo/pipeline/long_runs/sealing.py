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
  run left it (:func:`tpgrpo.pipeline.long_runs.blocks.current_entries`), so a params edit after a code change re-runs
  only the stages the edit touches.
"""

from __future__ import annotations

import json
import subprocess
import sys
from functools import lru_cache
from pathlib import Path
from typing import Callable

from tpgrpo.config import Config
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.long_runs.block_logs import write_digest
from tpgrpo.pipeline.long_runs.blocks import (Block, block_entry, current_entries, disagreements, full_blocks,
                                              param_values, read_as_dvc, read_lock, read_seal, remove_block_files,
                                              seal_files, write_block_entry, write_lock, write_yaml)
from tpgrpo.pipeline.rendering.code_manifest import CODE_DIR
from tpgrpo.pipeline.rendering.dvcfile import (block_out_paths, block_stage, iteration_stages, stage_command,
                                              write_dvc_yaml)
# dvc_env is re-exported (benches)
from tpgrpo.pipeline.dvc_integration.dvc_atomic import dvc_env, run_dvc as dvc  # noqa: F401
from tpgrpo.pipeline.dvc_integration.dvclock import dvc_lock_held
from tpgrpo.pipeline.long_runs.seal_cache import vouch
from tpgrpo.pipeline.long_runs.retention import (DROPPABLE, dropped_outs, free_cache, kept_outs,  # noqa: F401
                                                 remove_path, retain)  # (re-exported: retention's home was this module)


def stage_names(cfg: Config, block: Block) -> list[str]:
    return [name for i in block.iterations for name in iteration_stages(cfg, i)]


def repro_ends(root: Path, cfg: Config, pending: set[Block] | frozenset = frozenset()) -> list[int]:
    """The iterations ``tpgrpo run`` renders dvc.yaml through, one ``dvc repro`` each: the end of every full
    block not yet sealed or to be unsealed (``pending``), then the run's last. DVC rewrites the whole dvc.lock
    after every stage it runs, so a run repro'd in one piece pays for every earlier stage's entry again at
    each stage (quadratic in the run's length); block by block, with each block sealed before the next, the
    lock stays about one block's stages long (bench/lock_growth.py)."""
    sealed = seal_files(root)
    ends = [b.last for b in full_blocks(cfg.train.block_size, cfg.train.iterations)
            if b not in sealed or b in pending]
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
    of the stages of dvc.yaml, not of their upstream, kept for ``names``): ``{stage: [what changed]}``, empty
    when every one's lock entry matches today's params.yaml (as DVC reads it) and its dep and out files.
    Why the whole file and not the names: DVC parses dvc.yaml and dvc.lock once per target, so 125 stage names
    took about a minute per sealed block; the file is one target."""
    if not names:
        return {}
    done = subprocess.run([sys.executable, "-m", "dvc", "status", "--json", "dvc.yaml"], cwd=root, env=dvc_env(),
                          capture_output=True, text=True)
    if done.returncode != 0:
        last = (done.stderr.strip() or done.stdout.strip() or "no output").splitlines()[-1]
        raise PipelineError(f"dvc status of {len(names)} stages failed (exit {done.returncode}): {last}")
    found = json.loads(done.stdout or "{}")
    return {name: found[name] for name in names if name in found}


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
    a successful ``dvc repro`` of dvc.yaml rendered through ``upto``. Each sealed block moves into its own
    pipeline file with its own lock (``data/seals/NNNN-MMMM/``); the root ``dvc.lock`` keeps the open stages
    only. Returns the blocks sealed."""
    new = up_to_date(root, cfg, sealable(cfg, read_lock(root)["stages"], seal_files(root), upto), note)
    if not new:
        return []
    with dvc_lock_held(root):  # no `tpgrpo retain` or DVC command edits the lock files meanwhile
        lock = read_lock(root)
        stages = lock["stages"]
        for block in new:  # records of the block first: an interruption leaves a seal with no entry (unsealed)
            names = stage_names(cfg, block)
            write_digest(root, block)  # an output of the block's stage: `dvc commit` records it
            write_yaml(block.entries_path(root), {n: stages[n] for n in names})
            write_yaml(block.seal_path(root), {"first": block.first, "last": block.last,
                                               "outs": block_out_paths(cfg, block)})
            write_block_entry(root, block, None)
            for n in names:
                del stages[n]
        write_lock(root, lock)
        write_dvc_yaml(cfg, root, upto)  # and the blocks' own pipeline files
    # the summary's deps list changed with the blocks (it ran just now, so it is up to date); before
    # the last block's repro dvc.yaml has no summary
    summary = ["summary"] if upto in (None, cfg.train.iterations) else []
    dvc(root, "commit", "--force", "--quiet", *[b.address for b in new], *summary)
    sealed = _undo_changed_while_sealing(root, cfg, new, upto, note)
    vouch(root, sealed)  # DVC just hashed their files: later runs trust them while their stats stay
    return sealed


def _undo_changed_while_sealing(root: Path, cfg: Config, blocks: list[Block], upto: int | None,
                                note: Callable[[str], None] | None) -> list[Block]:
    """``dvc commit`` records params.yaml and the files as they are when it runs, seconds after ``dvc status``
    found the stages up to date: a params edit in between would be recorded as what the block ran with. Any
    block whose new entry disagrees with its stages' own entries is unsealed again (its stages' entries back,
    named in one ``note`` line), so the next repro re-runs what changed. Returns the blocks that stay sealed."""
    with dvc_lock_held(root):
        bad = {b: d for b in blocks if (d := disagreements(read_seal(b.entries_path(root)), block_entry(root, b)))}
        if not bad:
            return blocks
        lock = read_lock(root)
        for block, found in bad.items():
            lock["stages"].update(read_seal(block.entries_path(root)))
            if note is not None:
                note(f"not sealed: {block.name}: {found[0]} changed while it was being sealed; the next `tpgrpo "
                     "run` re-runs what changed")
        write_lock(root, lock)  # the stages' entries back first, then the block's records go
        for block in bad:
            remove_block_files(root, block)
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


STRUCTURAL = ("train.block_size", "train.iterations")  # reasons that unseal at once (render needs it)


def unseal_reason(cfg: Config, block: Block, entry: dict | None, params: dict, root: Path | None = None) -> str | None:
    """Why the sealed ``block`` must be unsealed under ``cfg`` (``params``: params.yaml as DVC reads it;
    ``entry``: its lock entry), or None. A block wholly beyond the run stays sealed for when train.iterations
    is raised again; one the run now ends inside is unsealed, and its iterations come back as stages with their
    lock entries: nothing re-runs. With ``root``, a code manifest (``data/code/*.json``) the block recorded
    that differs from today's file also unseals it: DVC then re-runs only the stages of that kind's code."""
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
    if changed:
        return f"params changed: {', '.join(changed[:3])}{', ...' if len(changed) > 3 else ''}"
    code = changed_code(root, entry) if root is not None else []
    return f"code changed: {', '.join(code)}" if code else None


def changed_code(root: Path, entry: dict) -> list[str]:
    """The code manifests a block's lock ``entry`` records with an md5 other than today's file's."""
    return [str(d["path"]) for d in entry.get("deps") or [] if str(d.get("path", "")).startswith(CODE_DIR + "/")
            and (now := _md5_now(root / d["path"])) is not None and now != d.get("md5")]


def _md5_now(path: Path) -> str | None:
    """md5 of a small file (a code manifest), once per content stamp: every sealed block records the same
    seven manifests, and a run asks about each block several times."""
    try:
        st = path.stat()
    except OSError:
        return None
    return _md5_of(path, st.st_mtime_ns, st.st_size, st.st_ino)


@lru_cache(maxsize=64)
def _md5_of(path: Path, mtime_ns: int, size: int, ino: int) -> str:  # noqa: ARG001 - the stamp keys the cache
    import hashlib

    return hashlib.md5(path.read_bytes()).hexdigest()


def stale_seals(root: Path, cfg: Config, params: dict, upto: int | None = None) -> dict[Block, str]:
    """The sealed blocks to unseal now and why (:func:`unseal_reason`): a structural reason at once, any other
    only for blocks ending by ``upto`` (the block the next repro reaches: the root lock then holds about one
    block's stages, even when a change reaches the whole history)."""
    from tpgrpo.pipeline.long_runs.seal_cache import summary

    found = {}
    for block in seal_files(root):
        known = summary(root, block)  # the block's params and code md5s, without parsing its lock each time
        entry = None if known is None else {"params": {"params.yaml": known["params"]},
                                            "deps": [{"path": p, "md5": m} for p, m in known["deps"].items()]}
        why = unseal_reason(cfg, block, entry, params, root)
        if why and (upto is None or block.last <= upto or why.startswith(STRUCTURAL)):
            found[block] = why
    return found


def unseal_changed(root: Path, cfg: Config, raw_params: dict | None = None,
                   upto: int | None = None) -> dict[Block, str]:
    """Unseal the sealed blocks this config no longer matches (:func:`stale_seals`; ``raw_params``: params.yaml's
    values, read from the file as DVC reads it when None). Restores their per-stage lock entries into the root
    ``dvc.lock``, as the block's own entry last recorded them (:func:`current_entries`); returns ``{block:
    why}``. Refuses (PipelineError, one line, nothing written) when a block's records are missing or damaged, or
    when one was thinned by ``tpgrpo retain``: its restored stages would miss outputs and DVC would re-run them.
    Holds DVC's lock while it edits the lock files (:func:`dvc_lock_held`)."""
    if not seal_files(root):
        return {}
    params = read_as_dvc(root / "params.yaml") if raw_params is None else raw_params
    if not stale_seals(root, cfg, params, upto):
        return {}  # nothing to edit: no need for DVC's lock
    with dvc_lock_held(root):
        todo = stale_seals(root, cfg, params, upto)
        entries = check_records(root, todo)
        if todo:
            lock = read_lock(root)
            for block in todo:
                restored = entries[block]
                if block_entry(root, block) is None:  # an interrupted unsealing (remove_block_files) put these
                    # stages back already, as the block's lost entry recorded them: the entries at sealing may be older
                    restored = {name: lock["stages"].get(name, entry) for name, entry in restored.items()}
                lock["stages"].update(restored)
            write_lock(root, lock)  # the stages' entries first: an interruption leaves a seal to unseal again
            for block in todo:
                remove_block_files(root, block)
    return todo


def check_records(root: Path, blocks: dict[Block, str]) -> dict[Block, dict]:
    """Refuse (PipelineError, one line) when a block to be unsealed (``{block: why}``, :func:`stale_seals`) has
    a missing or damaged seal file or stage entries file (unsealing restores its stages from them, and without
    them the block's iterations would lose every lock entry: DVC would re-run them all), or was thinned by
    ``tpgrpo retain`` (:func:`_refuse_thinned`). Reads only: ``tpgrpo run`` calls it before it renders anything,
    so a refused run leaves dvc.yaml and the blocks' pipeline files as they were (else `dvc status` lists what
    the refused params would list, once the edit is undone). Returns each block's per-stage entries, brought up
    to its own lock entry (:func:`current_entries`)."""
    entries = {}
    for block, why in blocks.items():
        read_seal(block.seal_path(root))
        entries[block] = current_entries(read_seal(block.entries_path(root)), block_entry(root, block))
        _refuse_thinned(root, block, why, entries[block])
    return entries


def _refuse_thinned(root: Path, block: Block, why: str, entries: dict) -> None:
    gone = dropped_outs(root, block, entries)
    if gone:
        stem = block.seal_path(root).relative_to(root).with_suffix("")
        raise PipelineError(
            f"{stem}.yaml: block {block.name} would have to be unsealed ({why}), but `tpgrpo retain` dropped "
            f"{len(gone)} of its outputs (first: {gone[0]}), so DVC would re-run iterations {block.first}-"
            f"{block.last} from their rollouts; undo the change, or delete {stem}.yaml, {stem}.stages and "
            f"{stem}/ to re-run the block whole")


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
            remove_path(root / path)


