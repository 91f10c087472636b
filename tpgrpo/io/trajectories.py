"""The rollout's trajectory store, ``trajectories.zarr``: written atomically, read back checked.

Every array is stored one file per 64 trajectories with a crc32c per chunk (a flipped byte fails to decode, it
does not decode to finite nonsense); ``states`` keep each (trajectory, state) compressed and checksummed on its
own inside its file (a zarr shard), so the update reads only the states a micro-batch uses
(:mod:`tpgrpo.policy.states`), and a tree's ``node_states`` each node likewise. Reads check values against
:data:`tpgrpo.io.schemas.TRAJECTORY_ARRAYS`.
"""

from __future__ import annotations

import math
from pathlib import Path

from tpgrpo.io.artifacts import atomic_path, first_line, require
from tpgrpo.io.schemas import TRAJECTORY_ARRAYS, ArtifactError, check_array_values, check_trajectories, conform_arrays


# arrays stored as shards of single states: name -> leading index dims ((trajectory, state) or (node,))
SHARDED = {"states": 2, "node_states": 1}
# Chunk files named c.0.0.0.0.0 side by side in the array's folder, not c/0/0/0/0/0 (zarr's default, one folder
# per file): DVC hashes the large files of ONE folder in parallel threads and those of different folders one
# after another, so at the paper's 18 files of 160 MiB per array the default layout hashed on one core.
CHUNK_KEYS = {"name": "default", "separator": "."}


def _chunk_codecs() -> list:
    """Zarr's bytes-to-bytes codecs for the trajectory store: zstd (with its frame checksum of the content)
    then crc32c over the stored bytes. Zarr's default zstd has no checksum, so flipped bytes in a chunk
    decoded to finite nonsense (1e20); now they fail to decode. The decoded values are unchanged."""
    from zarr.codecs import Crc32cCodec, ZstdCodec

    return [ZstdCodec(level=0, checksum=True), Crc32cCodec()]


def write_zarr(path: Path, arrays: dict, attrs: dict, hash_for_dvc: bool = False, cache_for_dvc: bool = False) -> int:
    """Write the trajectory store atomically after checking it against its schema; each array gets its
    dimension names and meaning as attributes, each chunk a checksum (``_chunk_codecs``). ``hash_for_dvc``
    (``launch.hash_while_writing``): take each file's md5 while writing it and hand it to DVC's state
    database (``tpgrpo.io.dvc_prehash``), so that ``dvc repro`` does not read the store again to hash it;
    with ``cache_for_dvc`` (``launch.cache_while_writing``) also write each file into DVC's cache, so that
    ``dvc repro`` does not copy it there. Returns the number of md5s handed to DVC (0 without
    ``hash_for_dvc`` or outside a DVC project)."""
    import zarr

    from tpgrpo.io.dvc_prehash import HashingStore, dvc_cache_placer, hand_md5s_to_dvc

    check_trajectories(arrays, attrs, f"{path} (being written)")
    arrays = conform_arrays(arrays)
    docs = {spec.name: spec for spec in TRAJECTORY_ARRAYS}
    placer = dvc_cache_placer(path) if hash_for_dvc and cache_for_dvc else None
    with atomic_path(path) as tmp:
        store = HashingStore(tmp, placer) if hash_for_dvc else str(tmp)
        group = zarr.open_group(store, mode="w")
        for name, data in arrays.items():
            chunks = (min(64, data.shape[0]),) + data.shape[1:]
            # states: one file per 64 trajectories as the other arrays, each (trajectory, state) compressed
            # and checksummed on its own inside it (a shard), so the update reads only the states it uses;
            # a tree's node_states likewise, one file per 64 nodes, each node on its own inside it
            lead = SHARDED.get(name)
            layout = {"shards": chunks, "chunks": (1,) * lead + data.shape[lead:]} if lead else {"chunks": chunks}
            # every chunk stored, fill-valued ones too: a missing chunk file is then damage, not zeros
            arr = group.create_array(name, data=data, **layout, compressors=_chunk_codecs(),
                                     chunk_key_encoding=CHUNK_KEYS, config={"write_empty_chunks": True})
            arr.attrs.update({"dims": list(docs[name].dims), "meaning": docs[name].meaning})
        group.attrs.update(attrs)
    return hand_md5s_to_dvc(path, store.md5s(), placer) if hash_for_dvc else 0


class CheckedArray:
    """A trajectory array read lazily (``read_trajectories(lazy=...)``): ``shape``, ``dtype``, and slices
    ``arr[a:b]`` read on use. A chunk that fails its checksum or does not decode, or values the schema
    refuses (non-finite, out of range), raise one :class:`ArtifactError` line naming the array."""

    def __init__(self, arr, source: str, name: str):
        self._arr, self.source, self.name = arr, source, name
        self.chunk_rows = int((arr.shards or arr.chunks)[0])  # trajectories per chunk file
        self.shape, self.dtype = tuple(arr.shape), arr.dtype
        self._spec = next(spec for spec in TRAJECTORY_ARRAYS if spec.name == name)

    def __len__(self) -> int:
        return self.shape[0]

    def __getitem__(self, key):
        values = _read_array(self._arr, self.source, self.name, key)
        first = key.start if isinstance(key, slice) and key.start is not None else 0
        check_array_values(self._spec, values, self.source, row_offset=first if first >= 0 else 0)
        return values

    def oindex(self, selection: tuple):
        """``arr.oindex[selection]`` (an index array or slice per leading axis): reads only the chunks it
        touches, checksums verified as in ``__getitem__``; values unchecked (the caller knows the positions)."""
        return _read_array(self._arr, self.source, self.name, selection, orthogonal=True)


def _read_array(arr, source: str, name: str, key=slice(None), orthogonal: bool = False):
    """``arr[key]`` (``arr.oindex[key]`` if ``orthogonal``) as numpy; a reader failure (checksum, truncated
    chunk, ...) is one line naming the array's first chunk file that fails."""
    try:
        return arr.oindex[key] if orthogonal else arr[key]
    except Exception as exc:  # noqa: BLE001 - zarr raises ValueError / RuntimeError / OSError on damage
        raise ArtifactError(f"{source}: array '{name}' is damaged: chunk {_bad_chunk(arr)} fails its checksum "
                            f"or does not decode ({first_line(exc)})") from None


def _chunk_file(arr, index) -> str:
    """The file of chunk (or shard) ``index`` of ``arr`` under the store: ``states/c.3.0.0.0.0``, or
    ``states/c/3/0/0/0/0`` in a store written before ``CHUNK_KEYS``."""
    return f"{arr.path}/{arr.metadata.chunk_key_encoding.encode_chunk_key(index)}"


def _bad_chunk(arr) -> str:
    """The file (under the store) of the first chunk of ``arr`` that fails to read. The store's files split
    the trajectory axis only (``write_zarr``; a sharded array's files are its shards)."""
    rows = (arr.shards or arr.chunks)[0]
    for i in range(-(-arr.shape[0] // rows)):
        try:
            arr[i * rows:(i + 1) * rows]
        except Exception:  # noqa: BLE001
            return _chunk_file(arr, (i, *[0] * (arr.ndim - 1)))
    return _chunk_file(arr, ("?",))


def _check_chunks_stored(arr, source: str, name: str) -> None:
    """A checksummed array (``write_zarr``) stores every chunk; zarr reads a missing chunk file as its fill
    value, so count them. (Stores written before checksums skip fill-valued chunks: not counted.)"""
    from zarr.codecs import Crc32cCodec

    files = arr.shards or arr.chunks  # zarr counts a sharded array's chunks as its shards x chunks per shard
    stored = arr.nchunks_initialized // (math.prod(files) // math.prod(arr.chunks))
    expected = math.prod(-(-size // rows) for size, rows in zip(arr.shape, files))
    if any(isinstance(c, Crc32cCodec) for c in arr.compressors) and stored != expected:
        first = _chunk_file(arr, (0,) * arr.ndim)
        raise ArtifactError(f"{source}: array '{name}' has {stored} of its {expected} "
                            f"chunk files ({first} ...): the store is damaged")


def read_trajectories(path: Path, lazy: tuple[str, ...] = ()) -> tuple[dict, dict]:
    """The arrays of a ``trajectories.zarr`` as numpy (those named in ``lazy`` as :class:`CheckedArray`,
    read and checked when sliced) and its attributes, checked against the schema: one
    :class:`ArtifactError` line naming the store (and its iteration) and the array if not."""
    import zarr

    require(path, "trajectories.zarr: run the rollout stage first")
    try:  # any failure of the reader on a damaged store is reported as such, with the reader's reason
        group = zarr.open_group(str(path), mode="r")
        stored = dict(group.arrays())
        attrs = dict(group.attrs)
    except Exception as exc:  # noqa: BLE001
        raise ArtifactError(f"{path}: not a readable Zarr group ({first_line(exc)})") from None
    source = f"{path} (iteration {attrs['iteration']})" if "iteration" in attrs else str(path)
    for name, arr in stored.items():
        _check_chunks_stored(arr, source, name)
    arrays = {name: CheckedArray(arr, source, name) if name in lazy else _read_array(arr, source, name)
              for name, arr in stored.items()}
    check_trajectories(arrays, attrs, source, loaded=tuple(n for n in arrays if n not in lazy))
    return arrays, attrs
