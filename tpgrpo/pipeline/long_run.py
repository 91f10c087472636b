"""The long-run machinery behind one small interface: what ``tpgrpo run`` asks of sealing (each finished block
of ``train.block_size`` iterations sealed into one DVC stage), unsealing what a change reaches, the seal cache,
and vouching for sealed files.

``tpgrpo run`` is :func:`prepare`, then for each ``upto`` of :func:`repro_ends`: :func:`before_repro`, one
``dvc repro`` of dvc.yaml rendered through ``upto`` (:mod:`tpgrpo.pipeline.repro`), :func:`after_repro`. A short
run (``train.block_size`` 0 and nothing sealed on disk: :func:`active` is False) is one render and one repro:
each call returns at once and none of the machinery (:mod:`tpgrpo.pipeline.long_runs.sealing`, ``seal_cache``,
``retention``) is imported. docs/long-runs.md says why it exists.
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable

from tpgrpo.config import Config


def active(root: Path, cfg: Config) -> bool:
    """Whether this run has blocks to seal, or sealed blocks on disk (left by a larger block size too)."""
    from tpgrpo.pipeline.long_runs.blocks import seal_files

    return cfg.train.block_size > 0 or bool(seal_files(root))


def prepare(root: Path, cfg: Config, raw: dict, note: Callable[[str], None]) -> set:
    """Before the first render: unseal the sealed blocks that a structural change reaches (block size, run
    length; a ``note`` line each) and find those that other changes reach, to unseal as the repros get to them;
    refuse (PipelineError, one line, nothing written) a block whose records cannot be unsealed. Returns the
    blocks pending. ``raw``: params.yaml as DVC reads it. First removes what an interrupted unsealing left
    (:func:`tpgrpo.pipeline.long_runs.blocks.sweep_unsealed`, a ``note`` line each)."""
    sweep(root, note)
    if not active(root, cfg):
        return set()
    from tpgrpo.pipeline.long_runs.sealing import check_records, stale_seals, unseal_changed

    _note_unsealed(unseal_changed(root, cfg, raw, upto=0), note)
    stale = stale_seals(root, cfg, raw)
    check_records(root, stale)
    return set(stale)


def sweep(root: Path, note: Callable[[str], None] | None = None) -> None:
    """Remove what an interrupted unsealing left (a block's pipeline file without its seal would list its
    outputs twice once rendered); a ``note`` line each. Before any render."""
    from tpgrpo.pipeline.long_runs.blocks import sweep_unsealed

    for path in sweep_unsealed(root):
        if note is not None:
            note(f"removed {path} (left by an interrupted unsealing)")


def _note_unsealed(unsealed: dict, note: Callable[[str], None]) -> None:
    for block, why in unsealed.items():
        note(f"unsealed {block.name} ({why})")


def repro_ends(root: Path, cfg: Config, pending: set) -> list[int]:
    """The iterations to render dvc.yaml through, one repro each: the end of every block to seal, then the run's
    last (:func:`tpgrpo.pipeline.long_runs.sealing.repro_ends`); a short run's last alone."""
    if not active(root, cfg):
        return [cfg.train.iterations]
    from tpgrpo.pipeline.long_runs.sealing import repro_ends as ends

    return ends(root, cfg, pending)


def before_repro(root: Path, cfg: Config, raw: dict, upto: int, note: Callable[[str], None]) -> None:
    """Unseal the sealed blocks through ``upto`` that this config no longer matches (a ``note`` line each)."""
    if active(root, cfg):
        from tpgrpo.pipeline.long_runs.sealing import unseal_changed

        _note_unsealed(unseal_changed(root, cfg, raw, upto=upto), note)


def after_repro(root: Path, cfg: Config, upto: int, note: Callable[[str], None]) -> None:
    """Seal every block finished through ``upto`` (one DVC stage per block from now on; a ``note`` line)."""
    if not active(root, cfg):
        return
    from tpgrpo.pipeline.long_runs.sealing import seal_finished

    sealed = seal_finished(root, cfg, upto, note=note)
    if sealed:
        note(f"sealed {', '.join(b.name for b in sealed)} (one DVC stage per block from now on)")
