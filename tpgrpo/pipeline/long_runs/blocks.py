"""Blocks of finished iterations, their seal files and ``dvc.lock``: the data, no DVC calls.

A sealed block of ``train.block_size`` iterations is ONE DVC stage (``iters-0001-0025``) instead of five
per iteration. Its seal file ``data/seals/0001-0025.yaml`` keeps what sealing replaced, so the block can
be unsealed exactly:

- ``outs``: the block's artifact paths DVC still tracks (all of them at sealing; fewer after
  ``tpgrpo retain``), in dvc.yaml order;
- beside it, ``0001-0025.stages``: the per-stage ``dvc.lock`` entries of its iterations at sealing time
  (read only to unseal: rendering dvc.yaml reads the small files alone);
- and the folder ``0001-0025/``: the block's own pipeline file (``dvc.yaml``, its one stage) and its own
  ``dvc.lock``, which DVC collects like any other pipeline file. DVC rewrites a lock file whole after every
  stage it runs, so the root ``dvc.lock`` holds only the open stages: its rewrite does not grow with the run.

Every file here is read as DVC reads it (YAML 1.2, DVC's parser) and written so that DVC reads back the same
values (:func:`write_yaml`). Pure file handling; :mod:`tpgrpo.pipeline.long_runs.sealing` does the DVC side.
"""

from __future__ import annotations

import re
from dataclasses import dataclass
from pathlib import Path

import yaml

SEALS = Path("data") / "seals"
# A plain scalar YAML 1.2 (DVC, ruamel) might read as a number, bool or null; PyYAML (YAML 1.1) writes such a
# string unquoted when 1.1 reads it as a string (an md5 like 123e4567...): quote it. Over-quoting is harmless.
_NOT_PLAIN = re.compile(r"^(?:[-+]?[0-9._]*[0-9][0-9._]*(?:[eE][-+]?[0-9]+)?|[-+]?\.?(?:inf|nan)|0[ox][0-9a-f_]+"
                        r"|true|false|yes|no|on|off|y|n|null|~|)$", re.IGNORECASE)


class _Dumper(getattr(yaml, "CSafeDumper", yaml.SafeDumper)):
    """PyYAML's dumper, quoting every string YAML 1.2 could read as something else, and writing an object
    shared by several entries (a block's params value restored into each of its stages) in full each time:
    an anchor in one stage's entry and aliases in others tie entries DVC rewrites one by one."""

    def ignore_aliases(self, data) -> bool:
        return True


def _represent_str(dumper, data: str):
    style = "'" if _NOT_PLAIN.match(data) else None
    return dumper.represent_scalar("tag:yaml.org,2002:str", data, style=style)


_Dumper.add_representer(str, _represent_str)


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

    def folder(self, root: Path) -> Path:
        """The folder of the block's pipeline file and lock file."""
        return root / SEALS / f"{self.first:04d}-{self.last:04d}"

    def dvcfile(self, root: Path) -> Path:
        return self.folder(root) / "dvc.yaml"

    def lockfile(self, root: Path) -> Path:
        return self.folder(root) / "dvc.lock"

    @property
    def address(self) -> str:
        """Its DVC address (``dvc commit``, ``dvc status`` targets), relative to the project root."""
        return f"{SEALS.as_posix()}/{self.first:04d}-{self.last:04d}/dvc.yaml:{self.name}"


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
    """A seal file (``first``, ``last``, ``outs``) or a block's ``.stages`` file; PipelineError (one line) when it
    is missing, damaged or not what sealing writes."""
    if not path.is_file():
        raise _error(f"{path}: missing (a sealed block's record); restore it from git, or delete the block's "
                     f"seal files ({path.with_suffix('')}.*) to re-run the block whole")
    data = read_as_dvc(path)
    shape_ok = isinstance(data, dict) and (path.suffix != ".yaml" or isinstance(data.get("outs"), list)) and \
        all(isinstance(v, dict) for v in (data.values() if path.suffix == ".stages" else []))
    if not shape_ok:
        raise _error(f"{path}: not a seal file (expected a mapping with first, last and a list of outs)"
                     if path.suffix == ".yaml" else f"{path}: not a block's stage entries (expected a mapping of "
                     "stage name -> dvc.lock entry)")
    return data


def _error(message: str):
    from tpgrpo.errors import PipelineError

    return PipelineError(message)


def block_entry(root: Path, block: Block) -> dict | None:
    """The sealed block's own lock entry (what DVC recorded for its stage), None when there is none."""
    entry = ((read_as_dvc(block.lockfile(root)) or {}).get("stages") or {}).get(block.name)
    return entry if isinstance(entry, dict) else None


def write_block_entry(root: Path, block: Block, entry: dict | None) -> None:
    """Replace the block's lock entry (``None``: remove its lock file, DVC then sees a stage never run)."""
    if entry is None:
        block.lockfile(root).unlink(missing_ok=True)
    else:
        write_yaml(block.lockfile(root), {"schema": "2.0", "stages": {block.name: entry}})


def remove_block_files(root: Path, block: Block) -> None:
    """Delete what sealing wrote for ``block``, what DVC reads first: its pipeline file (DVC no longer sees the
    block's stage), its lock file and folder, then the seal file, then the stage entries.

    Why this order: a kill between two steps must never leave the block's pipeline file without its seal. The
    next render would then list the block's iterations in dvc.yaml too, and DVC, finding the outputs in two
    pipeline files, refuses every command. Killed with the folder gone, the seal and entries remain: the block
    is sealed without a lock entry, and the next run unseals it again, keeping the stage entries this
    unsealing already put into the root lock (:func:`tpgrpo.pipeline.long_runs.sealing.unseal_changed`). Killed after
    the seal went, only the entries file is left: :func:`sweep_unsealed` removes it."""
    import shutil

    block.dvcfile(root).unlink(missing_ok=True)
    shutil.rmtree(block.folder(root), ignore_errors=True)
    block.seal_path(root).unlink(missing_ok=True)
    block.entries_path(root).unlink(missing_ok=True)


def sweep_unsealed(root: Path) -> list[str]:
    """Remove what an interrupted unsealing left of blocks that are no longer sealed: a block folder
    (``data/seals/NNNN-MMMM/``, its pipeline and lock file) or stage entries file whose seal file is gone.
    Older versions removed the seal file first, so a kill could leave such a folder; once dvc.yaml renders the
    block's iterations as stages, DVC refuses every command ("output ... is specified in ..."). Sealing writes
    the seal file before the folder, so nothing live is taken. Returns the paths removed (relative)."""
    import shutil

    folder = root / SEALS
    if not folder.is_dir():
        return []
    sealed = {p.stem for p in folder.glob("*.yaml")}
    removed = []
    for path in sorted(folder.glob("[0-9]" * 4 + "-" + "[0-9]" * 4 + "*")):
        if path.stem in sealed or not (path.is_dir() or path.suffix == ".stages"):
            continue
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        removed.append(path.relative_to(root).as_posix())
    return removed


def write_yaml(path: Path, data: dict) -> None:
    """Write through a temporary sibling of a unique name and rename: a reader never sees half a file, and two
    writers never share a temporary file. Values read by :func:`read_as_dvc` come back the same through DVC's
    parser (strings it could misread are quoted)."""
    write_text_atomic(path, yaml.dump(data, Dumper=_Dumper, sort_keys=False, default_flow_style=False, width=120))


def write_text_atomic(path: Path, text: str) -> None:
    """``text`` to ``path`` through a uniquely named temporary sibling (its writer's PID in the name: a later
    run sweeps a killed writer's), renamed over it; mode 0o666 less the umask (0o644 usually), so that a
    shared project's other members can read dvc.yaml, dvc.lock and the seal files (DVC keeps the mode)."""
    from tpgrpo.io.atomic_text import atomic_write_text

    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(path, lambda handle: handle.write(text), keep_mode=False)


def sealed_outs(root: Path, blocks: list[Block]) -> dict[Block, list[str]]:
    """The sealed blocks among ``blocks`` and the outs each still tracks (what dvc.yaml renders)."""
    files = seal_files(root)
    return {b: read_seal(files[b])["outs"] for b in blocks if b in files}


def read_lock(root: Path) -> dict:
    """``dvc.lock`` as a mapping, as DVC reads it (an empty one when there is none yet). Read with PyYAML, DVC's
    ``1e-05`` would come back a string, and written back by :func:`write_yaml` a quoted one DVC no longer
    matches; about 1.6 times PyYAML's C loader (a second per MB)."""
    lock = read_as_dvc(root / "dvc.lock") or {"schema": "2.0", "stages": {}}
    if not isinstance(lock, dict) or not isinstance(lock.setdefault("stages", {}), dict):
        raise _error(f"{root / 'dvc.lock'}: not a DVC lock file (expected a mapping with a 'stages' mapping); "
                     "restore it from git")
    return lock


def write_lock(root: Path, lock: dict) -> None:
    write_yaml(root / "dvc.lock", lock)


def read_as_dvc(path: Path) -> dict:
    """A YAML file (dvc.lock, params.yaml) as DVC reads it: YAML 1.2 through DVC's own parser (ruamel). PyYAML
    is YAML 1.1: it reads DVC's ``1e-05`` and a params ``1e-4`` as strings, so values it reads never match
    DVC's. Empty when there is no file."""
    from dvc.utils.serialize import parse_yaml

    if not path.is_file():
        return {}
    try:
        data = parse_yaml(path.read_text(), str(path))
    except Exception as exc:  # DVC's YAMLFileCorruptedError, a decode error: one line, not 35 frames
        cause = str(getattr(exc, "__cause__", None) or exc).strip().splitlines()
        raise _error(f"{path}: not readable as YAML ({cause[-1] if cause else type(exc).__name__}); restore it "
                     "from git or a backup") from None
    return data if data is not None else {}


def param_values(raw: dict, keys: list[str]) -> dict:
    """The values of ``keys`` (``"model"`` = a section, ``"task.reward"`` = one key) the way dvc.lock
    records them."""
    values = {}
    for key in keys:
        section, _, name = key.partition(".")
        values[key] = raw[section][name] if name else raw[section]
    return values


def current_entries(entries: dict, block_entry: dict | None) -> dict:
    """A sealed block's per-stage dvc.lock ``entries`` (written at its sealing) brought up to its own lock entry
    ``block_entry``: every dep, out and param the block's entry also records is taken from it.

    Why: when a code change re-runs a sealed block (``tpgrpo block``), DVC rewrites the block's entry only.
    Restored as recorded at sealing, every re-run output would look changed to DVC, and a later params edit
    would re-run stages it does not touch. The block's entry is what DVC recorded after its last run, so each
    stage's deps, outs and params taken from it are what that stage last ran with and wrote. A path or param
    the block's entry lacks keeps its recorded value (DVC re-runs the stage if that is stale)."""
    if not block_entry:
        return entries
    files = {i["path"]: i for i in [*(block_entry.get("deps") or []), *(block_entry.get("outs") or [])]}
    params = (block_entry.get("params") or {}).get("params.yaml") or {}

    def value(key: str, recorded):
        section, _, name = key.partition(".")
        if key in params:
            return params[key]
        return params[section].get(name, recorded) if name and isinstance(params.get(section), dict) else recorded

    current = {}
    for stage, entry in entries.items():
        entry = dict(entry)
        for part in ("deps", "outs"):
            if entry.get(part):
                entry[part] = [dict(files.get(item["path"], item)) for item in entry[part]]
        if (entry.get("params") or {}).get("params.yaml"):
            own = entry["params"]["params.yaml"]
            entry["params"] = {**entry["params"], "params.yaml": {k: value(k, v) for k, v in own.items()}}
        current[stage] = entry
    return current


def disagreements(entries: dict, block_entry: dict | None) -> list[str]:
    """Where a sealed block's per-stage ``entries`` and its own lock entry ``block_entry`` disagree: ``stage:
    path`` for a dep or out of another md5, ``stage: key`` for a param of another value; every stage when
    there is no block entry. Empty when the block's entry records exactly what its stages ran with."""
    if not block_entry:
        return [f"{stage}: no block entry" for stage in entries]
    now, found = current_entries(entries, block_entry), []
    for stage, entry in entries.items():
        for part in ("deps", "outs"):
            found += [f"{stage}: {a['path']}" for a, b in zip(entry.get(part) or [], now[stage].get(part) or [])
                      if a.get("md5") != b.get("md5")]
        recorded = (entry.get("params") or {}).get("params.yaml") or {}
        for key, was in recorded.items():
            is_ = now[stage]["params"]["params.yaml"][key]
            if is_ != was and isinstance(is_, dict) and isinstance(was, dict):
                found += [f"{stage}: {key}.{k}" for k in sorted(set(was) | set(is_)) if was.get(k) != is_.get(k)]
            elif is_ != was:
                found.append(f"{stage}: {key}")
    return found


# --- DVC's cache objects (retention frees those of the outputs it dropped) ---

def object_path(cache: Path, oid: str, legacy: bool) -> Path:
    """Where DVC keeps the object ``oid`` (an md5, ``.dir`` for a directory's listing): ``files/md5/ab/cd..``
    for entries with ``hash: md5`` (DVC 3), ``ab/cd..`` for older ones."""
    return cache / ("." if legacy else "files/md5") / oid[:2] / oid[2:]


def entry_oids(entries, skip: set[str] = frozenset()) -> set[tuple[bool, str]]:
    """``(legacy layout?, md5)`` of every dep and out of these dvc.lock entries, but those at paths ``skip``."""
    found = set()
    for entry in entries:
        for item in [*(entry.get("deps") or []), *(entry.get("outs") or [])]:
            if item.get("md5") and item.get("path") not in skip:
                found.add((item.get("hash") != "md5", item["md5"]))
    return found


def dir_files(cache: Path, legacy: bool, oid: str) -> set[tuple[bool, str]]:
    """The file objects a directory object lists (none when it is missing or not a directory)."""
    path = object_path(cache, oid, legacy)
    if not oid.endswith(".dir") or not path.is_file():
        return set()
    import json

    return {(legacy, f["md5"]) for f in json.loads(path.read_text())}


def unreferenced(cache: Path, dropped: set[tuple[bool, str]], kept: set[tuple[bool, str]]) -> list[Path]:
    """The cache objects of ``dropped`` (a directory: its listing and its files) that nothing in ``kept``
    references; a kept directory references its files (zarr metadata, for one, is the same in every store)."""
    kept_all = set(kept).union(*(dir_files(cache, legacy, oid) for legacy, oid in kept))
    paths = []
    for legacy, oid in sorted(dropped - kept):
        inner = sorted(dir_files(cache, legacy, oid) - kept_all)
        paths += [object_path(cache, o, lg) for lg, o in inner] + [object_path(cache, oid, legacy)]
    return [p for p in dict.fromkeys(paths) if p.is_file()]


def committed_oids(root: Path) -> set[tuple[bool, str]]:
    """Every cache object that a ``dvc.lock`` or a sealed block's ``.stages`` file records in any commit git
    can reach from a ref of ``root``'s repository (branches, tags, DVC experiments under ``refs/exps``): what
    ``git checkout`` + ``dvc checkout`` or ``dvc exp apply`` would need. Empty where ``root`` is in no git
    repository. PipelineError (one line) where it is one but git cannot say (no ``git`` binary, or git fails:
    "dubious ownership" of a shared folder): read as "no commits", the objects other commits need would be
    freed."""
    import subprocess

    if not in_git(root):
        return set()

    def git(*args: str) -> str:
        why = "nothing was deleted: `tpgrpo retain` frees cache objects only when git can list those other commits need"
        try:
            done = subprocess.run(["git", *args], cwd=root, capture_output=True, text=True)
        except OSError as exc:  # no git binary (FileNotFoundError), not executable
            raise _error(f"git: cannot run it ({exc.strerror}) in {root}, a git repository; {why} (install git, "
                         "or run `tpgrpo retain --no-gc`)") from None
        if done.returncode != 0:
            lines = [ln.strip() for ln in done.stderr.splitlines() if ln.strip()] or ["no output"]
            first = next((ln for ln in lines if ln.startswith(("fatal:", "error:"))), lines[-1])
            raise _error(f"git {args[0]} failed in {root} (exit {done.returncode}: {first}); {why}")
        return done.stdout

    commits = git("rev-list", "--all").split()
    blobs = set()
    for commit in commits:
        for line in git("ls-tree", "-r", commit, "--", "dvc.lock", str(SEALS)).splitlines():
            meta, _, path = line.partition("\t")
            if path.endswith("dvc.lock") or path.endswith(".stages"):
                blobs.add((meta.split()[2], path.endswith("dvc.lock")))
    from dvc.utils.serialize import parse_yaml

    found: set[tuple[bool, str]] = set()
    for blob, is_lock in sorted(blobs):
        data = parse_yaml(git("cat-file", "blob", blob), blob) or {}
        found |= entry_oids((data.get("stages") or {}).values() if is_lock else data.values())
    return found


def in_git(root: Path) -> bool:
    """Whether git would find a repository for ``root``: ``$GIT_DIR`` set, or a ``.git`` (folder or file) in
    ``root`` or a folder above it."""
    import os

    if os.environ.get("GIT_DIR"):
        return True
    here = Path(root).resolve()
    return any((folder / ".git").exists() for folder in (here, *here.parents))
