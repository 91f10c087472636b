"""The DVC and dvc-data versions tpgrpo's patches of their internals were verified on, and the gate.

Why: :mod:`tpgrpo.pipeline.dvc_integration.dvc_atomic` replaces ``_dump_data`` and copies
``dvc.rwlock._edit_rwlock``, :mod:`tpgrpo.pipeline.dvc_integration.lock_blocks` replaces ``Lockfile.dump_stages``,
and :mod:`tpgrpo.io.dvc_prehash` writes dvc-data's state database and cache objects. Each rests on how those
functions work in one release; an upgraded DVC that still has the attributes would run the old copies silently.
So each patch calls :func:`require_verified` first and refuses another release in one line.

To move to a new DVC: read the diff of every function in :data:`SOURCES` between the releases, port the
copies and the assumptions in the three modules, then update :data:`VERIFIED`, :data:`SOURCES` (the hashes
``tests/test_dvc_versions.py`` prints when they differ) and the pins in pyproject.toml and constraints.txt.
"""

from __future__ import annotations

import hashlib
import importlib
import importlib.metadata
import inspect

from tpgrpo.errors import PipelineError

VERIFIED = {"dvc": "3.67.1", "dvc-data": "3.18.3"}

# sha256 (first 16 hex digits) of ``inspect.getsource`` of each function the patches replace, copy, wrap or
# rely on, as released in VERIFIED ("module:qualified name").
SOURCES = {
    # dvc_atomic: _dump_data is wrapped in every serializer module; the dumpers call it by its module name
    "dvc.utils.serialize._common:_dump_data": "e5c82405acfc8ccb",
    "dvc.utils.serialize._common:_modify_data": "5d8432d4d3002a03",
    "dvc.utils.serialize._yaml:dump_yaml": "5a3b25f72ee0bdee",
    # dvc_atomic: _edit_rwlock is replaced by a copy; rwlock() calls it, make_lock guards it
    "dvc.rwlock:_edit_rwlock": "cf3a97fb9efaa672",
    "dvc.rwlock:rwlock": "e8e87c10cc6499ad",
    "dvc.rwlock:make_lock": "15c4aa7c460c02be",
    # lock_blocks: dump_stages is replaced (and kept as the fallback); its entries and YAML are DVC's own
    "dvc.dvcfile:Lockfile.dump_stages": "be78a3c7bd285d86",
    "dvc.stage.serialize:to_lockfile": "78f9e179200f27ef",
    "dvc.utils.serialize._yaml:_dump": "bd1de1511309b6cb",
    "dvc.utils.serialize._yaml:parse_yaml": "aa41661d0e60f099",
    # dvc_prehash: state entries are trusted while path, inode, mtime and size match; a cache object whose
    # mode is the cache mode is trusted without hashing
    "dvc_data.hashfile.state:State.save_many": "bd4981cb3930dc7e",
    "dvc_data.hashfile.state:State.get": "6b5f62e3ff6e2f67",
    "dvc_data.hashfile.state:State._get": "79b38d3fd0e72652",
    "dvc_data.hashfile.state:_checksum": "39c7ebf790e1da89",
    "dvc_data.hashfile.db.local:LocalHashFileDB.oid_to_path": "28f08fae5a1b2ba5",
    "dvc_data.hashfile.db.local:LocalHashFileDB.makedirs": "7e1fa6bbb29591d0",
    "dvc_data.hashfile.db.local:LocalHashFileDB.protect": "5529326423d021bc",
    "dvc_data.hashfile.db.local:LocalHashFileDB.check": "ec2a12485b3a1001",
}


class DvcVersionError(PipelineError):
    """The installed DVC or dvc-data is not the release tpgrpo's patches were verified on."""


def installed_versions() -> dict[str, str]:
    """``{distribution: version}`` of DVC and dvc-data as installed ("missing" for one that is not)."""
    out = {}
    for name in VERIFIED:
        try:
            out[name] = importlib.metadata.version(name)
        except importlib.metadata.PackageNotFoundError:
            out[name] = "missing"
    return out


def refusal(installed: dict[str, str]) -> str | None:
    """The one-line refusal for ``installed`` versions other than :data:`VERIFIED`; None when they match."""
    if installed == VERIFIED:
        return None
    pair = lambda v: f"dvc {v['dvc']} / dvc-data {v['dvc-data']}"  # noqa: E731
    pins = " ".join(f"{name}=={version}" for name, version in VERIFIED.items())
    return (f"tpgrpo's DVC patches were verified on {pair(VERIFIED)}; installed {pair(installed)}: pin them "
            f"(pip install {pins}, or pip install -c constraints.txt -e '.[test]')")


def require_verified() -> None:
    """Raise :class:`DvcVersionError` (one line, both versions named) unless DVC and dvc-data are the releases
    the patches were verified on. Reads two installed METADATA files: microseconds."""
    message = refusal(installed_versions())
    if message is not None:
        raise DvcVersionError(message)


def source_digest(dotted: str) -> str:
    """sha256 (16 hex digits) of ``inspect.getsource`` of ``"module:qualified.name"``, as installed."""
    module, _, qualname = dotted.partition(":")
    obj = importlib.import_module(module)
    for part in qualname.split("."):
        obj = getattr(obj, part)
    obj = inspect.unwrap(obj)  # a contextmanager's generator function, not the wrapper
    return hashlib.sha256(inspect.getsource(obj).encode()).hexdigest()[:16]
