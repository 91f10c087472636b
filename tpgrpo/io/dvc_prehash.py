"""Hashing while writing: the trajectory store hands DVC the md5 of each file it writes, so that ``dvc repro``
does not read the gigabytes again to hash them.

Why it is safe to hand DVC a hash: DVC keeps the md5s it computed in a state database keyed by path, inode,
mtime and size (``Repo.state``), and trusts an entry while those four still match the file on disk. It does not
check where an entry came from (``bench/studies/dvc_state_trust.py``): an entry that is not the md5 of the
file's final bytes would be recorded in ``dvc.lock`` and stored in the cache under the wrong name, silently.
So an entry is written only for a file that

- was written exactly once by :class:`HashingStore`, whose md5 is taken of the very buffer handed to the file
  (zarr's ``LocalStore`` writes it whole to a temporary file and renames it, so a written file is that buffer;
  the hash may finish after the write, which is sound because the buffer is the codecs' fresh output of a
  chunk or shard that zarr does not reuse: the tests would see a reused one as a wrong md5);
- was neither deleted nor rewritten since, by the store (counted) or by anything else: its size on disk equals
  the buffer's, and any later change of its bytes moves its mtime, which makes DVC's own lookup miss;

and the entries are written after the store's final rename, with the stat DVC will compare, and only once
the first file written has been read back and matched its md5 (an enforced check, one file's read). Files
without an entry (the small metadata files zarr writes more than once) are hashed by DVC as before.
``tests/test_dvc_prehash.py`` compares every entry with the md5 of the file's bytes and with what DVC records.

Caching while writing (``launch.cache_while_writing``): the hashing thread also writes each buffer into DVC's
local cache under the md5 it took (:class:`CachePlacer`), as DVC's commit would copy the file there, so that
``dvc repro`` finds the objects present and copies nothing. A cache object is content-addressed: one named by
the md5 of its own bytes is right whatever becomes of the workspace file. DVC trusts an object whose mode is
its cache mode (0o444) without hashing it, so an object is placed only through a temporary file renamed into
place, never over an existing one, and the first object placed is read back and must match its name (else
every object placed is removed and DVC copies, one warning line). The workspace file and the cache object
stay two files, as with DVC's copy: damage to one does not reach the other.
"""

from __future__ import annotations

import hashlib
import os
import sqlite3
import sys
import uuid
from concurrent.futures import Future, ThreadPoolExecutor
from pathlib import Path
from typing import Callable

from zarr.storage import LocalStore


def _md5(view) -> str:
    """md5 of a buffer (hashlib releases the GIL for large buffers: it runs beside zarr's encoding)."""
    return hashlib.md5(view, usedforsecurity=False).hexdigest()


def _file_md5(path: str) -> str:
    md5 = hashlib.md5(usedforsecurity=False)
    with open(path, "rb") as f:
        while block := f.read(1 << 22):
            md5.update(block)
    return md5.hexdigest()


def _remove_protected(path: str) -> None:
    """Delete a file this process wrote into the cache, read-only (0o444) or not; nothing if it is gone."""
    if os.path.lexists(path):
        os.chmod(path, 0o644)
        os.unlink(path)


class CachePlacer:
    """Writes buffers into DVC's local cache (``odb``: DVC's ``LocalHashFileDB``, ``repo.cache.local``) under
    their md5, protected as DVC protects its objects. Called from the hashing thread only, one buffer at a
    time; an object already there is left as it is. A failed write stops placing (DVC copies the rest)."""

    def __init__(self, odb) -> None:
        self._odb = odb
        self.placed: list[tuple[str, str]] = []  # (cache path, md5), in the order placed
        self.error: str = ""

    def __call__(self, view, digest: str) -> None:
        path = self._odb.oid_to_path(digest)
        if self.error or os.path.lexists(path):
            return
        tmp = f"{path}.{uuid.uuid4().hex}.tmp"
        try:
            self._odb.makedirs(os.path.dirname(path))
            with open(tmp, "wb") as f:
                f.write(view)
            self._odb.protect(tmp)  # 0o444: DVC then trusts the object without hashing it
            os.replace(tmp, path)
        except OSError as exc:
            self.error = f"{type(exc).__name__}: {exc}"
            _remove_protected(tmp)
            return
        self.placed.append((path, digest))

    def vouch(self) -> int:
        """The enforced check, after the last placement: the first object placed is read back and must be
        named by its md5; otherwise (or after a failed write) one warning line, and only objects that passed
        remain (none on a mismatch). Returns how many objects stay placed."""
        if self.placed and _file_md5(self.placed[0][0]) != self.placed[0][1]:
            self.error = f"{self.placed[0][0]} does not match its md5"
            self.discard()
        if self.error:
            print(f"warning: trajectory store: cache while writing stopped ({self.error}); DVC copies the rest",
                  file=sys.stderr)
        return len(self.placed)

    def discard(self) -> None:
        """Remove every object this placer put into the cache."""
        for path, _ in self.placed:
            _remove_protected(path)
        self.placed = []


def _md5_and_place(view, place: Callable | None) -> str:
    digest = _md5(view)
    if place is not None:
        place(view, digest)
    return digest


class HashingStore(LocalStore):
    """A zarr ``LocalStore`` that takes the md5 of every file it writes, beside the writing.

    Each buffer is hashed on a thread of its own while zarr goes on encoding the next chunks (hashlib
    releases the GIL), so on a machine with a spare core the hashing costs the writer no wall time. ``place``
    (a :class:`CachePlacer`) is then given each buffer and its md5 on the same thread.
    :meth:`md5s` waits for the hashes and returns ``{key: (md5 hex, bytes)}`` for each key written exactly
    once and never deleted; keys written more than once get no entry (two writes of one key could finish in
    either order)."""

    def __init__(self, root: Path | str, place: Callable | None = None) -> None:
        super().__init__(root)
        self._place = place  # e.g. a CachePlacer: also writes each hashed buffer into DVC's cache
        self._hashing = ThreadPoolExecutor(max_workers=1, thread_name_prefix="md5")
        self._pending: dict[str, tuple[Future, int]] = {}
        self._rewritten: set[str] = set()

    async def _set(self, key: str, value, exclusive: bool = False) -> None:
        await super()._set(key, value, exclusive=exclusive)
        if key in self._pending or key in self._rewritten:
            self._pending.pop(key, None)
            self._rewritten.add(key)
        else:
            view = value.as_buffer_like()  # kept alive by the future until it is hashed
            self._pending[key] = (self._hashing.submit(_md5_and_place, view, self._place), memoryview(view).nbytes)

    def _forget(self, prefix: str) -> None:
        under = prefix.rstrip("/") + "/" if prefix else ""  # "" (clear): every key
        for key in [k for k in self._pending if k == prefix or k.startswith(under)]:
            del self._pending[key]
            self._rewritten.add(key)

    async def delete(self, key: str) -> None:
        self._forget(key)
        await super().delete(key)

    async def delete_dir(self, prefix: str) -> None:
        self._forget(prefix)
        await super().delete_dir(prefix)

    async def clear(self) -> None:
        self._forget("")
        await super().clear()

    def md5s(self) -> dict[str, tuple[str, int]]:
        """Wait for the hashes; ``{key: (md5 hex, bytes)}`` of the keys written once and still there."""
        out = {key: (future.result(), size) for key, (future, size) in self._pending.items()}
        self._hashing.shutdown()
        return out


def _dvc_repo(path: Path):
    """The DVC project that holds ``path`` (its nearest folder with ``.dvc/``), opened; None outside one or
    where DVC cannot open it (then no ``dvc repro`` can use the md5s either).
    Not resolved: DVC keys its state on the path as it was given (from the working directory, as here).
    Refused (one line) on a DVC or dvc-data other than the one verified: the trust in state entries and cache
    modes above is that release's (:mod:`tpgrpo.io.dvc_versions`)."""
    for folder in Path(os.path.abspath(path)).parents:
        if (folder / ".dvc").is_dir():
            from tpgrpo.io.dvc_versions import require_verified

            require_verified()
            from dvc.exceptions import DvcException
            from dvc.repo import Repo

            try:
                return Repo(str(folder))
            except DvcException:  # e.g. `.dvc/` without the git repository it was made for: no repro to spare
                return None
    return None


def entries_for(folder: Path, written: dict[str, tuple[str, int]]) -> list[tuple[str, str]]:
    """``(absolute path, md5)`` of each file of ``folder`` (the store after its rename) that ``written`` vouches
    for: present as a regular file whose size on disk is the size that was hashed."""
    out = []
    for key, (digest, size) in written.items():  # in the order written
        path = os.path.join(os.path.abspath(folder), key)
        try:
            st = os.lstat(path)
        except FileNotFoundError:
            continue
        if os.path.isfile(path) and not os.path.islink(path) and st.st_size == size:
            out.append((path, digest))
    return out


def _first_file_matches(entries: list[tuple[str, str]]) -> bool:
    """The enforced check: the first file written is read back and hashed. A writer that reused or changed a
    buffer after handing it over would show there first (later writes overwrite earlier buffers); it costs
    one file's read (one shard: 1/18 of a paper-sized store), not the whole pass."""
    path, digest = entries[0]
    return _file_md5(path) == digest


def dvc_cache_placer(path: Path) -> CachePlacer | None:
    """A :class:`CachePlacer` for the local cache of the DVC project that holds ``path``; None outside one."""
    repo = _dvc_repo(Path(path))
    if repo is None:
        return None
    try:
        return CachePlacer(repo.cache.local)
    finally:
        repo.close()


def hand_md5s_to_dvc(folder: Path, written: dict[str, tuple[str, int]], placer: CachePlacer | None = None) -> int:
    """Write DVC state entries for the files of ``folder`` that ``written`` vouches for (``entries_for``),
    once the first of them has been read back and matched (``_first_file_matches``); returns how many.
    Nothing outside a DVC project; nothing, with one warning line, if the check fails (and then the objects
    ``placer`` put into DVC's cache are removed too: the buffers behind them are in doubt)."""
    entries = entries_for(folder, written)
    if placer is not None:
        placer.vouch()
    if entries and not _first_file_matches(entries):
        print(f"warning: {folder}: the md5 taken while writing {entries[0][0]} is not that of the file on disk; "
              "no md5 handed to DVC (it hashes the files)", file=sys.stderr)
        if placer is not None:
            placer.discard()
        return 0
    repo = _dvc_repo(Path(folder)) if entries else None
    if repo is None:
        return 0
    from dvc_data.hashfile.hash_info import HashInfo

    try:
        repo.state.save_many([(path, HashInfo("md5", digest), None) for path, digest in entries], repo.fs)
    except (OSError, sqlite3.Error) as exc:  # e.g. the database locked too long: DVC then hashes the files itself
        print(f"warning: {folder}: md5s not handed to DVC ({type(exc).__name__}: {exc}); DVC hashes the files",
              file=sys.stderr)
        return 0
    finally:
        repo.close()
    return len(entries)
