"""Where each iteration's artifacts live, writing them atomically (temp path, then rename), and reading
them back checked against their schemas (:mod:`tpgrpo.io.schemas`).

Iterations are numbered 1..N; policy 0 is the base model. Layout under the project root::

    data/iters/0003/trajectories.zarr   rollout: latents, log-probs, sigmas, seeds
    data/iters/0003/prompt_embeds.safetensors  rollout: the iteration's prompt embeddings (probe/update read them)
    data/iters/0003/rollout.json        rollout metrics (its seconds: rollout.timing.json, untracked: tpgrpo.io.stage_logs)
    data/iters/0003/probe.parquet       probe: one row per (trajectory, step)
    data/iters/0003/credit.parquet      credit: one row per (trajectory, window step)
    data/iters/0003/policy/             update: policy 3 (LoRA adapter + optimizer state), what iteration 4 samples from
    data/iters/0003/eval.json           eval metrics
    data/iters/summary_log.json         the summary stage's seconds (a log, like the stage JSONs)
    data/iters/eval_prompt_embeds/      eval_prompts: held-out prompt embeddings per eval chunk (eval, baseline)
    data/code/<kind>.json               the code stage: md5 of each file a kind of stage runs (its dependency)

What a stage reads is checked before it is computed on: trajectory chunks carry a crc32c (a flipped byte
fails to decode) and ``states`` are checked finite and in range (:mod:`tpgrpo.io.trajectories`), and a
folder a stage writes for later stages to load (the policy) carries ``sha256.json``, verified on load
(:func:`verify_file`). DVC's cache never shares an inode with the workspace (:data:`DVC_CACHE_TYPE`), so
damage in place is a changed output.
"""

from __future__ import annotations

import hashlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tpgrpo.errors import PipelineError
from tpgrpo.io.atomic import atomic_path, recover, swap_in  # noqa: F401 - re-exported: the writers' home
from tpgrpo.io.schemas import EMBEDDING_CHECKSUM, ArtifactError, TableSchema, check_embeddings, check_table
from tpgrpo.stage_params import EVAL_EMBEDS, EVAL_EMBEDS_LOG  # noqa: F401 - re-exported: declared with its stage

# The DVC cache's link types in every project this code creates (and the repo's .dvc/config): never hardlink
# or symlink. A linked output IS its cache object, so damage in place (root ignores DVC's read-only bits)
# damages the object named after the old md5 and DVC checks the damage out as "cached". A reflink is
# copy-on-write and a copy is a copy: damage is a changed output, and its stage re-runs (or is restored).
DVC_CACHE_TYPE = "reflink,copy"
MANIFEST_FILE = "sha256.json"  # in a folder a stage writes for later stages: {file name: sha256 of its bytes}


@dataclass(frozen=True)
class IterationPaths:
    """Paths of one iteration's artifacts: ``folder`` (``data/iters/NNNN``) and one attribute per output that
    :data:`tpgrpo.stage_params.ITERATION_STAGES` declares: ``trajectories``, ``prompt_embeds``,
    ``rollout_metrics``, ``probe``, ``probe_metrics``, ``credit``, ``credit_metrics``, ``policy``,
    ``update_metrics``, ``eval_table``, ``eval_metrics``."""

    root: Path
    iteration: int

    @property
    def folder(self) -> Path:
        return self.root / "data" / "iters" / f"{self.iteration:04d}"

    def __getattr__(self, attr: str) -> Path:
        from tpgrpo.stage_params import ITERATION_OUTPUTS

        if attr not in ITERATION_OUTPUTS:
            raise AttributeError(f"IterationPaths has no {attr!r} (outputs: {', '.join(ITERATION_OUTPUTS)})")
        return self.folder / ITERATION_OUTPUTS[attr].name

    def previous(self) -> "IterationPaths | None":
        return IterationPaths(self.root, self.iteration - 1) if self.iteration > 1 else None


def require(path: Path, what: str) -> Path:
    """Fail with one line if an input artifact is missing (e.g. a stage run out of order)."""
    if not path.exists():
        raise PipelineError(f"missing input {path} ({what})")
    return path


def write_json(path: Path, payload: dict[str, Any]) -> None:
    """Write ``payload`` as sorted, indented JSON, atomically."""
    with atomic_path(path) as tmp:
        tmp.write_text(json.dumps(payload, indent=2, sort_keys=True) + "\n")


def first_line(exc: BaseException) -> str:
    """The first line of an exception's message (its type when empty): for one-line errors."""
    text = str(exc).strip()
    return text.splitlines()[0] if text else type(exc).__name__


def read_json(path: Path, what: str) -> dict[str, Any]:
    try:
        return json.loads(require(path, what).read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ArtifactError(f"{path}: not readable JSON ({first_line(exc)})") from None


def sha256_file(path: Path) -> str:
    """Hex sha256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def write_manifest(folder: Path) -> Path:
    """Write ``folder/sha256.json`` atomically: the sha256 of every file directly in ``folder`` (a sub-folder
    carries its own), of the bytes as written, so a later stage verifies what it loads (:func:`verify_file`).
    Sorted keys: identical files give an identical manifest."""
    folder = Path(folder)
    sums = {f.name: sha256_file(f) for f in sorted(folder.iterdir())
            if f.is_file() and f.name != MANIFEST_FILE and not f.name.startswith(".")}
    write_json(folder / MANIFEST_FILE, {"sha256": sums})
    return folder / MANIFEST_FILE


def verify_file(path: Path) -> Path:
    """Check ``path`` against the sha256 its folder's ``sha256.json`` records: one :class:`ArtifactError`
    line naming the file when it differs (damaged, truncated, replaced) or is not listed. A folder without a
    manifest (written before manifests existed) is not checked."""
    path = Path(path)
    manifest = path.parent / MANIFEST_FILE
    if not manifest.is_file():
        return path
    sums = read_json(manifest, "checksum manifest").get("sha256")
    if not isinstance(sums, dict) or path.name not in sums:
        raise ArtifactError(f"{manifest}: lists no sha256 for {path.name} (the folder was changed after it "
                            "was written)")
    if not path.is_file():
        raise ArtifactError(f"{path}: missing (its folder's {MANIFEST_FILE} lists it)")
    if sha256_file(path) != sums[path.name]:
        raise ArtifactError(f"{path}: damaged: its sha256 differs from the one recorded in {MANIFEST_FILE} "
                            f"when it was written ({path.stat().st_size} bytes now)")
    return path


def write_table(path: Path, frame, schema: TableSchema, metadata: dict[str, str], **structure) -> None:
    """Write a pandas DataFrame that follows ``schema`` (checked, exactly its columns) to Parquet atomically,
    with ``metadata`` in the Parquet schema. ``structure``: ``trajectories`` / ``steps`` / ``expect`` as in
    :func:`tpgrpo.io.schemas.check_table`.

    Nothing time-dependent goes in, so two runs with the same params give byte-identical files.
    """
    write_parquet(path, check_table(frame, schema, f"{path} (being written)", exact=True, **structure), metadata)


def write_parquet(path: Path, frame, metadata: dict[str, str]) -> None:
    """Write a DataFrame to Parquet atomically, with ``metadata`` (as ``tpgrpo.<key>``) in the schema.
    Tables with a schema go through :func:`write_table`."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    table = pa.Table.from_pandas(frame, preserve_index=False)
    meta = dict(table.schema.metadata or {})
    meta.update({f"tpgrpo.{k}".encode(): str(v).encode() for k, v in metadata.items()})
    with atomic_path(path) as tmp:
        pq.write_table(table.replace_schema_metadata(meta), tmp)


def read_table(path: Path, schema: TableSchema, what: str, **structure):
    """Read a Parquet table and check it against ``schema`` (see :func:`tpgrpo.io.schemas.check_table`):
    a missing, unreadable or non-conforming file is one :class:`ArtifactError` line naming it."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    try:
        table = pq.read_table(require(path, what))
    except (pa.ArrowException, OSError, ValueError) as exc:
        reason = first_line(exc).replace(f"Could not open Parquet input source '{path}': ", "")
        raise ArtifactError(f"{path}: not a readable Parquet file ({reason})") from None
    return check_table(table.to_pandas(), schema, str(path), **structure)


_SAFETENSORS_DTYPES = {"float64": "F64", "float32": "F32", "float16": "F16", "bfloat16": "BF16", "int64": "I64",
                       "int32": "I32", "int16": "I16", "int8": "I8", "uint8": "U8", "bool": "BOOL",
                       "float8_e4m3fn": "F8_E4M3", "float8_e5m2": "F8_E5M2"}


def save_safetensors(tensors: dict, path: Path, metadata: dict[str, str] | None = None) -> None:
    """Write ``tensors`` in the safetensors format, byte-identical for identical inputs in any process.

    ``safetensors.torch.save_file`` serialises its header from a Rust hash map, whose order (of the
    metadata, and so the bytes) changes from process to process; DVC would then see a changed output.
    Here the header is JSON with sorted keys: 8-byte little-endian header length, the header (padded with
    spaces to a multiple of 8), then each tensor's raw little-endian bytes, larger item sizes first, then
    by name (so every tensor's offset is a multiple of its item size), with no holes.
    """
    import struct
    import sys

    import torch

    if sys.byteorder != "little":  # the format stores little-endian bytes; raw tensor memory is native
        raise NotImplementedError("save_safetensors writes native bytes: a little-endian machine is needed")
    cpu = {name: t.detach().cpu().contiguous() for name, t in tensors.items()}
    header: dict[str, Any] = {"__metadata__": dict(metadata)} if metadata else {}
    chunks, offset = [], 0
    for name in sorted(cpu, key=lambda n: (-cpu[n].element_size(), n)):
        t = cpu[name]
        dtype = _SAFETENSORS_DTYPES.get(str(t.dtype).removeprefix("torch."))
        if dtype is None:
            raise ValueError(f"tensor {name!r}: dtype {t.dtype} has no safetensors code here")
        data = t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""
        header[name] = {"dtype": dtype, "shape": list(t.shape), "data_offsets": [offset, offset + len(data)]}
        chunks.append(data)
        offset += len(data)
    text = json.dumps(header, sort_keys=True, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)
    with open(path, "wb") as f:
        f.write(struct.pack("<Q", len(text)) + text)
        for data in chunks:
            f.write(data)


def canonicalize_safetensors(path: Path) -> None:
    """Rewrite a safetensors file (e.g. one a library wrote) with :func:`save_safetensors`: same tensors and
    metadata, deterministic bytes."""
    from safetensors import safe_open

    with safe_open(str(path), framework="pt", device="cpu") as f:
        metadata = f.metadata()
        tensors = {name: f.get_tensor(name) for name in f.keys()}
    save_safetensors(tensors, path, metadata)


def _tensors_sha256(tensors: dict) -> str:
    """sha256 over the tensors' names and raw bytes, in name order (what ``read_embeddings`` checks)."""
    import torch

    digest = hashlib.sha256()
    for name in sorted(tensors):
        t = tensors[name].detach().cpu().contiguous()
        digest.update(name.encode() + b"\0" + (t.reshape(-1).view(torch.uint8).numpy().tobytes() if t.numel() else b""))
    return digest.hexdigest()


def write_embeddings(path: Path, tensors: dict, metadata: dict[str, str]) -> None:
    """Write prompt embeddings (``{field: tensor (P, ...)}``) and their metadata, checked, atomically, with
    the tensors' sha256 in the metadata (``EMBEDDING_CHECKSUM``)."""
    check_embeddings({k: tuple(t.shape) for k, t in tensors.items()}, metadata, f"{path} (being written)")
    with atomic_path(path) as tmp:
        save_safetensors(tensors, tmp, {**metadata, EMBEDDING_CHECKSUM: _tensors_sha256(tensors)})


def read_embeddings(path: Path, key: dict[str, str]) -> dict | None:
    """The tensors of a prompt-embeddings file (on the CPU) when its metadata equals ``key``, else None.
    A file that is unreadable, does not follow the schema or whose tensors differ from their recorded sha256
    is one :class:`ArtifactError` line."""
    from safetensors import safe_open

    try:  # any failure of the reader on a damaged file is reported as such
        with safe_open(str(path), framework="pt", device="cpu") as f:
            metadata = f.metadata() or {}
            check_embeddings({k: tuple(f.get_slice(k).get_shape()) for k in f.keys()}, metadata, str(path))
            stored = metadata.pop(EMBEDDING_CHECKSUM, None)  # (absent in files written before checksums)
            if metadata != key:
                return None
            tensors = {name: f.get_tensor(name) for name in f.keys()}
        if stored is not None and _tensors_sha256(tensors) != stored:
            raise ArtifactError(f"{path}: damaged: its tensors' sha256 differs from the one recorded when it "
                                "was written")
        return tensors
    except ArtifactError:
        raise
    except Exception as exc:  # noqa: BLE001
        raise ArtifactError(f"{path}: not a readable safetensors file ({first_line(exc)})") from None
