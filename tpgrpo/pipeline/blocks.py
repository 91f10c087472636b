"""Blocks of finished iterations, their seal files and ``dvc.lock``: the data, no DVC calls.

A sealed block of ``train.block_size`` iterations is ONE DVC stage (``iters-0001-0025``) instead of five
per iteration. Its seal file ``data/seals/0001-0025.yaml`` keeps what sealing replaced, so the block can
be unsealed exactly:

- ``outs``: the block's artifact paths DVC still tracks (all of them at sealing; fewer after
  ``tpgrpo retain``), in dvc.yaml order;
- beside it, ``0001-0025.stages``: the per-stage ``dvc.lock`` entries of its iterations at sealing time
  (read only to unseal: rendering dvc.yaml reads the small files alone).

Pure file handling; :mod:`tpgrpo.pipeline.sealing` does the DVC side.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import yaml

SEALS = Path("data") / "seals"
_Loader = getattr(yaml, "CSafeLoader", yaml.SafeLoader)  # dvc.lock reaches megabytes at 1,000 iterations
_Dumper = getattr(yaml, "CSafeDumper", yaml.SafeDumper)


@dataclass(frozen=True, order=True)
class Block:
    """Iterations ``first..last`` (inclusive)."""

    first: int
    last: int

    @property
    def name(self) -> str:
        """Its DVC stage name."""
        return f"iters-{self.first:04d}-{self.last:04d}"

    @property
    def iterations(self) -> range:
        return range(self.first, self.last + 1)

    def seal_path(self, root: Path) -> Path:
        return root / SEALS / f"{self.first:04d}-{self.last:04d}.yaml"

    def entries_path(self, root: Path) -> Path:
        return root / SEALS / f"{self.first:04d}-{self.last:04d}.stages"


def full_blocks(block_size: int, iterations: int) -> list[Block]:
    """The complete blocks of ``block_size`` iterations inside 1..iterations (none when block_size is 0)."""
    if block_size <= 0:
        return []
    return [Block(s, s + block_size - 1) for s in range(1, iterations - block_size + 2, block_size)]


def block_of(path: Path) -> Block:
    """The block a seal file names (``0026-0050.yaml``)."""
    first, last = path.stem.split("-")
    return Block(int(first), int(last))


def seal_files(root: Path) -> dict[Block, Path]:
    """Every seal file on disk, by block."""
    folder = root / SEALS
    if not folder.is_dir():
        return {}
    return {block_of(p): p for p in sorted(folder.glob("[0-9]" * 4 + "-" + "[0-9]" * 4 + ".yaml"))}


def read_seal(path: Path) -> dict:
    return yaml.load(path.read_text(), Loader=_Loader)


def write_yaml(path: Path, data: dict) -> None:
    """Write through a temporary sibling and rename: a reader never sees half a file."""
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    tmp.write_text(yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120))
    tmp.replace(path)


def sealed_outs(root: Path, blocks: list[Block]) -> dict[Block, list[str]]:
    """The sealed blocks among ``blocks`` and the outs each still tracks (what dvc.yaml renders)."""
    files = seal_files(root)
    return {b: read_seal(files[b])["outs"] for b in blocks if b in files}


def read_lock(root: Path) -> dict:
    """``dvc.lock`` as a mapping (an empty one when there is none yet)."""
    path = root / "dvc.lock"
    lock = yaml.load(path.read_text(), Loader=_Loader) if path.is_file() else None
    return lock or {"schema": "2.0", "stages": {}}


def write_lock(root: Path, lock: dict) -> None:
    write_yaml(root / "dvc.lock", lock)


def param_values(raw: dict, keys: list[str]) -> dict:
    """The values of ``keys`` (``"model"`` = a section, ``"task.reward"`` = one key) the way dvc.lock
    records them."""
    values = {}
    for key in keys:
        section, _, name = key.partition(".")
        values[key] = raw[section][name] if name else raw[section]
    return values
