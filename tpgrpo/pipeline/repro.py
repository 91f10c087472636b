"""One ``dvc repro`` as ``tpgrpo run`` makes it, and the checks of what DVC recorded."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path
from typing import Callable

from tpgrpo.config import Config
from tpgrpo.pipeline.dvc_integration.dvc_atomic import COMMAND as DVC_COMMAND
from tpgrpo.errors import PipelineError

TRIES = 3  # repros of one rendering whose records disagree with what the stages read, before giving up


def repro_checked(root: Path, cfg: Config, upto: int, env: dict[str, str], note: Callable[[str], None],
                  refresh_code: bool = True) -> None:
    """``dvc repro`` of dvc.yaml rendered through ``upto``, again while DVC recorded params other than a stage
    read (:func:`tpgrpo.pipeline.dvc_integration.params_read.drop_disagreeing` drops those entries, so DVC re-runs
    them; each retry is one ``note`` line). ``refresh_code``: rewrite the code manifests that differ first (False
    where the caller just did). PipelineError (one line) when DVC fails, an output was not stored
    (:func:`tpgrpo.pipeline.status.check_outputs_cached`), or params.yaml kept changing for ``TRIES`` repros."""
    for _ in range(TRIES):
        redo = _repro(root, cfg, upto, env, note, refresh_code)
        if not redo:
            return
        note(f"re-running {', '.join(redo)}: params.yaml changed as DVC recorded it")
    raise PipelineError(f"params.yaml kept changing while stages ran ({TRIES} tries); run again once it is saved")


def sealed_through(root: Path, upto: int) -> list:
    """The sealed blocks a repro rendered through ``upto`` has upstream."""
    from tpgrpo.pipeline.long_runs.blocks import seal_files

    return [b for b in seal_files(root) if b.last <= upto]


def repro_args(root: Path, upto: int) -> list[str]:
    """``dvc repro``'s arguments: with every sealed block of this rendering unchanged since DVC last checked it
    (:mod:`tpgrpo.pipeline.long_runs.seal_cache`), only the stages of dvc.yaml, each against its own record, in the
    file's order (pipeline order); otherwise DVC's full check of every stage upstream, sealed blocks included.
    Why: the full check hashes every sealed output (6,000 at 1,000 iterations) on every repro."""
    sealed = sealed_through(root, upto)
    if not sealed:
        return ["repro"]
    from tpgrpo.pipeline.long_runs.seal_cache import unchanged

    return ["repro", "--single-item", "dvc.yaml"] if unchanged(root, sealed) else ["repro"]


def _repro(root: Path, cfg: Config, upto: int, env: dict[str, str], note: Callable[[str], None],
           refresh_code: bool = True) -> list[str]:
    """One repro and its checks; returns the dvc.lock entries dropped (DVC re-runs them). The params-read notes
    are checked after it whether it succeeded, failed or was interrupted (:func:`_check_notes`), and before it
    too: what a killed run's stages noted is checked, not cleared unseen."""
    from tpgrpo.pipeline.rendering.code_manifest import refresh_manifests
    from tpgrpo.pipeline.rendering.dvcfile import write_dvc_yaml
    from tpgrpo.pipeline.dvc_integration.params_read import drop_disagreeing
    from tpgrpo.pipeline.status import check_outputs_cached

    write_dvc_yaml(cfg, root, upto)
    if refresh_code:  # a library upgraded since the code stage ran: it re-runs (see library_versions)
        refresh_manifests(root, cfg)
    lock = root / "dvc.lock"
    _check_notes(root, note, "an earlier run, killed, ")  # then cleared: only this repro's stages are checked after it
    before = lock.stat().st_mtime_ns if lock.exists() else None
    args = repro_args(root, upto)
    full = "--single-item" not in args  # DVC checks every sealed block upstream and re-runs what changed
    sealed = sealed_through(root, upto)
    if sealed:  # a long run's: a short one loads none of this (tpgrpo.pipeline.long_run)
        from tpgrpo.pipeline.long_runs.seal_cache import digests, vouch
    stamps = digests(root, sealed) if full and sealed else {}  # the files as DVC will first see them
    try:
        # DVC through dvc_atomic: a run killed while DVC rewrites dvc.lock leaves the old file, not a part of it
        code = subprocess.run([*DVC_COMMAND, *args], cwd=root, env=env).returncode
        if code != 0:
            raise PipelineError(f"dvc repro failed with exit code {code}")
        # (no relinking: with cache.type copy a workspace file is never the cache's object)
        if lock.exists() and lock.stat().st_mtime_ns != before:  # something ran: was it all stored?
            check_outputs_cached(root, env, [] if full else ["dvc.yaml"])
    except BaseException:  # a stage failed, an output was not stored, Ctrl-C: what DVC recorded is checked now
        _check_notes(root, note, "")
        raise
    if full and sealed:  # vouch only for the blocks whose files did not move while DVC checked them
        vouch(root, sealed, stamps)
    return drop_disagreeing(root)


def _check_notes(root: Path, note: Callable[[str], None], who: str) -> None:
    """Drop each lock entry DVC wrote with params other than its stage noted it read
    (:func:`tpgrpo.pipeline.dvc_integration.params_read.drop_disagreeing`), outside a repro that returns normally:
    after one that failed or was interrupted (``who`` empty; a later stage's failure or a Ctrl-C must not leave an
    edit recorded as what an earlier stage ran with: `dvc status` then lists it), and before a repro (the notes a
    killed run left; ``who`` names it). A ``note`` line each. When DVC's lock is busy the notes stay on disk, for
    the next run to check."""
    from tpgrpo.pipeline.dvc_integration.params_read import drop_disagreeing

    try:
        dropped = drop_disagreeing(root)
    except PipelineError:
        return
    for entry in dropped:
        note(f"dropped the dvc.lock entry of {entry}: {who}DVC recorded params.yaml as changed after the stage read "
             "it; it runs again")
