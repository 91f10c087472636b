"""Local folders of reward models: resolve a params path, check the files a loader needs, one-line errors.

Nothing here downloads: every loader is called with ``local_files_only=True`` on a checked folder.
"""

from __future__ import annotations

from pathlib import Path

from tpgrpo.config import ConfigError
from tpgrpo.errors import RewardError


def resolve_path(key: str, value: str, root: Path | None, what: str) -> Path:
    """The path params key ``key`` names (relative paths start at ``root``); "" is an error naming the key."""
    if not value:
        raise ConfigError(f"params: {key} is not set: expected {what}")
    path = Path(value).expanduser()
    return path if path.is_absolute() or root is None else Path(root) / path


def check_folder(key: str, value: str, root: Path | None, what: str,
                 required: tuple[tuple[str, ...], ...]) -> Path:
    """Resolve ``value`` and check it is a folder holding, for each group of ``required``, one of its files.

    e.g. required = (("config.json",), ("preprocessor_config.json", "processor_config.json")).
    """
    path = resolve_path(key, value, root, what)
    if not path.is_dir():
        raise ConfigError(f"params: {key} = {value!r}: folder {path} not found (expected {what})")
    for group in required:
        if not any((path / name).is_file() for name in group):
            names = " or ".join(group)
            raise ConfigError(f"params: {key} = {value!r}: {path} has no {names} (expected {what})")
    return path


def check_file(key: str, value: str, root: Path | None, what: str) -> Path:
    """Resolve ``value`` and check it is a file."""
    path = resolve_path(key, value, root, what)
    if not path.is_file():
        raise ConfigError(f"params: {key} = {value!r}: file {path} not found (expected {what})")
    return path


def one_line(exc: BaseException, limit: int = 300) -> str:
    """An exception's message on one line (whitespace collapsed, at most ``limit`` characters)."""
    text = " ".join(str(exc).split()) or type(exc).__name__
    return text if len(text) <= limit else text[:limit - 3] + "..."


def load_error(reward: str, path: Path, exc: BaseException) -> RewardError:
    """A one-line error for a folder that passed the file checks but does not load."""
    return RewardError(f"reward {reward}: cannot load {path}: {one_line(exc)}")
