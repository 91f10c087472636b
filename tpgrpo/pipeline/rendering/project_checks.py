"""Checks of the project folder that DVC would otherwise fail on with a long traceback."""

from __future__ import annotations

from pathlib import Path

from tpgrpo.errors import PipelineError


def _no_scm_configured(dvc_dir: Path) -> bool:
    """Whether DVC's config (``.dvc/config`` or ``.dvc/config.local``) sets ``core.no_scm`` true."""
    from configobj import ConfigObj  # DVC's own config reader (a dependency of DVC)

    for name in ("config", "config.local"):
        path = dvc_dir / name
        if path.is_file():
            value = str(ConfigObj(str(path)).get("core", {}).get("no_scm", "false"))
            if value.strip().lower() in ("true", "1", "yes"):
                return True
    return False


def in_git_repository(folder: Path) -> bool:
    """Whether ``folder`` or one above it holds ``.git`` (a folder, or a worktree's or submodule's file), as
    DVC's search for the repository does."""
    return any((parent / ".git").exists() for parent in (folder, *folder.parents))


def require_scm(root: Path) -> None:
    """One :class:`PipelineError` line when ``root`` is a DVC project (``.dvc/``) that DVC cannot open for want
    of a git repository (a source archive: ``.dvc/config`` without ``.git``), saying what to do. Why: DVC
    raises ``SCMError ... is not a git repository`` from deep inside, a 100-line traceback."""
    root = Path(root).resolve()
    if not (root / ".dvc").is_dir() or in_git_repository(root) or _no_scm_configured(root / ".dvc"):
        return
    raise PipelineError(f"{root} is a DVC project outside a git repository (a source archive?), and DVC needs "
                        "one: run `git init && git add -A && git commit -m 'tpgrpo project'` there, then run this again")
