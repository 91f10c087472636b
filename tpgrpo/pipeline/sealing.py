"""Seal finished blocks, unseal changed ones, run a sealed block, apply retention.

Why: DVC checks every dependency of every stage on each ``status`` / ``repro``; at five stages of ~20 deps
per iteration that is ~100,000 checks at 1,000 iterations (minutes per command). A sealed block lists the
union of its stages' outside deps once, so the work grows with the number of blocks, not of stages.

The guarantees stay those of per-stage DVC:
- sealing happens only right after a successful ``dvc repro`` (every stage up to date), and the block's
  lock entry is written by ``dvc commit`` from the files on disk;
- before rendering, a sealed block whose recorded params differ from ``params.yaml`` (or that has no lock
  entry, e.g. after an interrupted sealing) is unsealed: its per-stage lock entries come back, so DVC
  re-runs exactly the stages the change touches (``credit.mode`` -> credit onward);
- a code change re-runs a whole sealed block (``tpgrpo block``), stage by stage, one process per stage.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from tpgrpo.config import Config
from tpgrpo.pipeline.dvcfile import block_out_paths, block_stage, iteration_stages, stage_command, write_dvc_yaml
from tpgrpo.errors import PipelineError
from tpgrpo.pipeline.block_logs import write_digest
from tpgrpo.pipeline.blocks import (Block, full_blocks, param_values, read_lock, read_seal, seal_files, write_lock,
                          write_yaml)

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


def seal_finished(root: Path, cfg: Config, upto: int | None = None) -> list[Block]:
    """Seal every complete, not yet sealed block whose stages all have a ``dvc.lock`` entry. Call only
    after a successful ``dvc repro`` of dvc.yaml rendered through ``upto`` (then every entry is up to
    date). Returns the blocks sealed."""
    lock, sealed = read_lock(root), seal_files(root)
    stages = lock.setdefault("stages", {})
    new = sealable(cfg, stages, sealed, upto)
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
    return new


def unseal_changed(root: Path, cfg: Config, raw_params: dict) -> list[Block]:
    """Unseal the sealed blocks this config no longer matches: recorded params differ, no lock entry,
    or a block size that changed. Restores their per-stage lock entries; returns the blocks unsealed."""
    lock = read_lock(root)
    stages = lock.setdefault("stages", {})
    blocks = set(full_blocks(cfg.train.block_size, cfg.train.iterations))
    unsealed = []
    for block, path in seal_files(root).items():
        if block.last > cfg.train.iterations:
            continue  # beyond a lowered train.iterations: not rendered, kept for when it is raised again
        entry = stages.get(block.name)
        if block in blocks and entry is not None:
            keys = block_stage(cfg, block)["params"]
            if entry.get("params", {}).get("params.yaml") == param_values(raw_params, keys):
                continue
        stages.pop(block.name, None)
        stages.update(read_seal(block.entries_path(root)))
        unsealed.append(block)
    if unsealed:
        write_lock(root, lock)
        for block in unsealed:
            block.seal_path(root).unlink()
            block.entries_path(root).unlink()
    return unsealed


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


def retain(root: Path, cfg: Config, gc: bool = True) -> list[str]:
    """Apply ``retention`` to the sealed blocks: drop the artifacts it does not keep from the workspace,
    the blocks' outs and their lock entries (so ``dvc status`` stays clean), then ``dvc gc --workspace``
    frees their cache copies. Returns the dropped paths."""
    lock, files = read_lock(root), seal_files(root)
    stages = lock.setdefault("stages", {})
    blocks = [b for b in full_blocks(cfg.train.block_size, cfg.train.iterations) if b in files]
    last_done = last_finished(cfg, lock, blocks)
    dropped: list[str] = []
    for block in blocks:
        if block.name not in stages:
            raise PipelineError(f"{files[block]}: block {block.name} has no dvc.lock entry; run `tpgrpo run` "
                                "first (it unseals or re-records the block)")
        seal = read_seal(files[block])
        kept = kept_outs(cfg, block, seal["outs"], last_done)
        if kept == seal["outs"]:
            continue
        keep = set(kept)
        stages[block.name]["outs"] = [o for o in stages[block.name]["outs"] if o["path"] in keep]
        dropped += [p for p in seal["outs"] if p not in keep]
        seal["outs"] = kept
        write_yaml(files[block], seal)
    if dropped:  # records first: an interruption leaves untracked files behind, never a dangling out
        write_lock(root, lock)
        write_dvc_yaml(cfg, root)
        for path in dropped:
            _remove(root / path)
        if gc:
            dvc(root, "gc", "--workspace", "--force", "--quiet")
    return dropped
