"""Helpers for the "up to date means correct" property: a real tiny project, its artifacts
reduced to digests of their decoded values, reference runs from scratch cached by params + code, and which
stages ran.

The property, after any user action followed by ``tpgrpo run``: (a) every artifact equals what a run from
scratch with the current params and code makes (both at 1 torch thread), (b) ``dvc status`` is clean,
(c) what ran is what the action affects. The actions live in ``up_to_date_actions.py``.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import yaml

REPO = Path(__file__).resolve().parents[1]
CODE = ("stages", "tpgrpo", "pyproject.toml")  # what a project copies of the code (the code stage's deps)
# The line the code edits append, stripped from the reference key: a statement, not a comment (the manifests
# hash code without comments, so a comment re-runs nothing); each edit appends one more, so the code changes.
MARK = "_up_to_date_harness_edit = 1  # up-to-date harness edit"
THREADS = "1"  # float results are byte-identical at equal thread counts only
# Metric fields that are wall-clock readings, never equal between two runs.
WALL_KEYS = ("wall", "seconds", "s_per_iter")
WALL_FILES = ("data/metrics/seconds_per_iter.json",)
# Bookkeeping, not artifacts: status note, seal files, ignore files.
SKIP = ("data/.last_stage.json", "data/seals/")
ARTIFACT_DIRS = ("data/iters", "data/metrics", "data/reports", "data/code")
STAGE_LOGS = ("rollout", "probe", "credit", "update", "eval")


def env(root: Path) -> dict[str, str]:
    """The environment of every command in project ``root``: 1 thread, no analytics, this interpreter's
    scripts first, and the project's own code first on the module path (the ``tpgrpo`` script DVC calls
    would otherwise import the checkout's editable install, not the code the manifests hash)."""
    e = dict(os.environ, PYTHONPATH=str(root.resolve()), DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true", OMP_NUM_THREADS=THREADS,
             MKL_NUM_THREADS=THREADS, OMP_WAIT_POLICY="PASSIVE")
    e["PATH"] = str(Path(sys.executable).parent) + os.pathsep + e.get("PATH", "")
    return e


def sh(root: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """Run a command in ``root`` in its own process group (a timeout kills the whole group)."""
    proc = subprocess.Popen(list(args), cwd=root, env=env(root), stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                            text=True, start_new_session=True)
    try:
        out, err = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        out, err = proc.communicate()
        err += f"\n[harness] timed out after {timeout} s"
    return subprocess.CompletedProcess(args, proc.returncode, out, err)


def tpgrpo(root: Path, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    return sh(root, sys.executable, "-m", "tpgrpo", *args, timeout=timeout)


def dvc_status(root: Path) -> str:
    """``dvc status --json`` ("{}" when clean), or the failure's text."""
    done = sh(root, sys.executable, "-m", "dvc", "status", "--json")
    return done.stdout.strip() if done.returncode == 0 else f"rc {done.returncode}: {done.stderr.strip()[-500:]}"


# ---------------------------------------------------------------- params (read as DVC reads: YAML 1.2)

def read_params(root: Path) -> dict:
    """params.yaml as DVC parses it (YAML 1.2: ``1e-4`` is a float here, a string for PyYAML)."""
    from ruamel.yaml import YAML

    return YAML(typ="safe", pure=True).load((root / "params.yaml").read_text())


def write_params(root: Path, raw: dict) -> None:
    """Write params.yaml the way a user's editor would: in place of the old file."""
    (root / "params.yaml").write_text(yaml.safe_dump(raw, sort_keys=False))


def get_param(raw: dict, key: str):
    section, name = key.split(".")
    return raw[section][name]


def set_param(raw: dict, key: str, value) -> dict:
    section, name = key.split(".")
    raw[section][name] = value
    return raw


# ---------------------------------------------------------------- projects

def export_code(dest: Path, source: str = "worktree") -> Path:
    """The code a project copies: this checkout's working tree, or ``head`` (the last commit only: other
    engineers' uncommitted edits stay out)."""
    if source == "worktree":
        return REPO
    dest.mkdir(parents=True, exist_ok=True)
    archive = subprocess.run(["git", "archive", "HEAD", *[c for c in CODE if (REPO / c).exists()]], cwd=REPO,
                             capture_output=True, check=True).stdout
    subprocess.run(["tar", "x", "-C", str(dest)], input=archive, check=True)
    return dest


def copy_code(src: Path, root: Path) -> None:
    for name in CODE:
        if (src / name).is_dir():
            shutil.copytree(src / name, root / name, ignore=shutil.ignore_patterns("__pycache__"),
                            dirs_exist_ok=True)
        elif (src / name).is_file():
            shutil.copy2(src / name, root / name)


def make_project(root: Path, model_dir: Path, code_src: Path, raw: dict) -> Path:
    """A git-initialised project: prompts, the tiny model, the code and ``raw`` as params.yaml."""
    (root / "data").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "prompts", root / "data" / "prompts")
    shutil.copytree(model_dir, root / "data" / "base")
    copy_code(code_src, root)
    write_params(root, raw)
    for args in (("init", "-q"), ("-c", "user.name=t", "-c", "user.email=t@t", "commit", "-q", "--allow-empty",
                                  "-m", "init")):
        subprocess.run(["git", *args], cwd=root, check=True, capture_output=True)
    return root


def processes_in(root: Path) -> list[tuple[int, str]]:
    """Live processes whose working directory is inside ``root`` (pid, command line)."""
    found, prefix = [], str(root.resolve())
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit() or int(entry.name) == os.getpid():
            continue
        try:
            cwd = os.readlink(entry / "cwd")
            state = (entry / "stat").read_text().rsplit(")", 1)[1].split()[0]
            cmd = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace").strip()
        except OSError:
            continue
        if state != "Z" and (cwd == prefix or cwd.startswith(prefix + "/")):
            found.append((int(entry.name), cmd))
    return found


def end_processes(root: Path) -> None:
    """End, by pid, what this harness's runs left running in ``root`` (a stage server, a forked stage)."""
    for pid, _ in processes_in(root):
        try:
            os.kill(pid, signal.SIGKILL)
        except OSError:
            pass


# ---------------------------------------------------------------- artifacts as digests of decoded values

def _drop_wall(value):
    if isinstance(value, dict):
        return {k: _drop_wall(v) for k, v in value.items() if not any(w in k for w in WALL_KEYS)}
    if isinstance(value, list):
        return [_drop_wall(v) for v in value]
    return value


def _tensor_bytes(tensor) -> bytes:
    import torch

    t = tensor.detach().cpu().contiguous()
    if t.dtype == torch.bfloat16:
        t = t.view(torch.int16)
    return f"{t.dtype}{tuple(t.shape)}".encode() + t.numpy().tobytes()


def _parquet(path: Path, h) -> None:
    import pyarrow.parquet as pq

    table = pq.read_table(path)
    meta = {k.decode(): v.decode() for k, v in (table.schema.metadata or {}).items()
            if k.startswith(b"tpgrpo.")}
    h.update(json.dumps(meta, sort_keys=True).encode())
    df = table.to_pandas()
    for col in df.columns:
        values = df[col].to_numpy()
        data = values.tobytes() if values.dtype.kind in "biuf" else "\x00".join(map(repr, values)).encode()
        h.update(f"{col}:{values.dtype}:".encode() + data)


def _zarr(path: Path, h) -> None:
    import zarr

    group = zarr.open_group(str(path), mode="r")
    h.update(json.dumps(dict(group.attrs), sort_keys=True, default=str).encode())
    for name, array in sorted(group.arrays()):
        values = array[...]
        h.update(f"{name}:{values.dtype}:{values.shape}:".encode() + values.tobytes())
        h.update(json.dumps(dict(array.attrs), sort_keys=True, default=str).encode())


def _safetensors(path: Path, h) -> None:
    from safetensors import safe_open

    with safe_open(str(path), "pt") as f:
        h.update(json.dumps(f.metadata() or {}, sort_keys=True).encode())
        for key in sorted(f.keys()):
            h.update(key.encode() + _tensor_bytes(f.get_tensor(key)))


def _torch_obj(obj, h) -> None:
    import torch

    if isinstance(obj, torch.Tensor):
        h.update(_tensor_bytes(obj))
    elif isinstance(obj, dict):
        for k in sorted(obj, key=repr):
            h.update(repr(k).encode())
            _torch_obj(obj[k], h)
    elif isinstance(obj, (list, tuple)):
        for v in obj:
            _torch_obj(v, h)
    else:
        h.update(repr(obj).encode())


def _csv(path: Path, h) -> None:
    import pandas as pd

    df = pd.read_csv(path)
    df = df[[c for c in df.columns if not any(w in c for w in WALL_KEYS)]]
    h.update(df.to_csv(index=False).encode())


def _png(path: Path, h) -> None:
    from PIL import Image

    with Image.open(path) as im:
        h.update(f"{im.mode}{im.size}".encode() + im.tobytes())


def _md5_now(path: Path) -> str | None:
    """The md5 of the file at ``path`` now, or None if there is none."""
    return hashlib.md5(path.read_bytes()).hexdigest() if path.is_file() else None


def _log_digest(path: Path, h) -> None:
    """A sealed block's log digest holds md5s of stage logs (wall-clock fields and all): never equal between
    two runs. What must hold: its names, and each table's md5 matching the table it names now (a JSON
    log's md5 may trail a hand re-run that changed only its wall-clock fields; the logs are compared
    on their own)."""
    folder = next(p for p in path.parents if p.name == "iters")  # its names are relative to data/iters
    for name, md5 in sorted(json.loads(path.read_text()).items()):
        actual = _md5_now(folder / name)
        fresh = md5 == actual or (name.endswith(".json") and (md5 is None) == (actual is None))
        h.update(f"{name}:{md5 is None}:{'matches' if fresh else 'STALE'};".encode())


def _manifest_digest(path: Path, h) -> None:
    """A code manifest (data/code/KIND.json) lists md5s of code files, and the harness's code edits append
    lines with random tokens that one reference (keyed without them) cannot match. What must hold: the
    manifest names the same files, libraries and path, and each md5 is that of the project's file now (a
    stale manifest reads STALE)."""
    from tpgrpo.pipeline.rendering.code_hash import BYTES, file_md5

    root = path.parents[2]
    recorded = json.loads(path.read_text())
    how = recorded.get("hashes", BYTES)  # what a file's md5 is of: its bytes, or its code without comments
    now = {name: file_md5((root / name).read_bytes(), recorded.get("kind"), how) if (root / name).is_file()
           else None for name in recorded.get("files", {})}
    files = {name: "matches" if now[name] == md5 else "STALE" for name, md5 in recorded.get("files", {}).items()}
    libraries = {name: _library_now(root, name, entry) for name, entry in recorded.get("libraries", {}).items()}
    h.update(json.dumps({**recorded, "files": files, "libraries": libraries}, sort_keys=True).encode())


def _library_now(root: Path, name: str, entry: str) -> str:
    """A manifest's library entry as the reference records it: ``"3.1.0 shadowed <md5>"`` reads ``"3.1.0"`` when
    the md5 is that of the harness's shadowing copy now (a folder of the library's name in the project root,
    which the from-scratch reference does not have: up_to_date_actions.edit_dependency), ``"3.1.0 STALE"``
    otherwise; a plain version stays as it is."""
    from tpgrpo.pipeline.rendering.libraries import sources_md5

    version, _, rest = entry.partition(" ")
    if not rest:
        return entry
    copy = root / name.replace("-", "_")
    return version if copy.is_dir() and sources_md5([copy]) == rest.rpartition(" ")[2] else f"{version} STALE"


def digest(path: Path) -> str:
    """A digest of what ``path`` holds, decoded (tables' values, Zarr arrays' values, tensors, JSON
    without wall-clock fields, pixels); raw bytes for anything else. A read error is part of the answer."""
    h = hashlib.sha256()
    try:
        if path.suffix == ".zarr":
            _zarr(path, h)
        elif path.suffix == ".parquet":
            _parquet(path, h)
        elif path.suffix == ".safetensors":
            _safetensors(path, h)
        elif path.suffix == ".pt":
            import torch

            _torch_obj(torch.load(path, map_location="cpu", weights_only=False), h)
        elif path.name.endswith((".logs.json", "block_logs.json")):
            _log_digest(path, h)
        elif path.parent.name == "code" and path.parent.parent.name == "data":
            _manifest_digest(path, h)
        elif path.suffix == ".json":
            h.update(json.dumps(_drop_wall(json.loads(path.read_text())), sort_keys=True).encode())
        elif path.suffix == ".csv":
            _csv(path, h)
        elif path.suffix == ".png":
            _png(path, h)
        else:
            h.update(path.read_bytes())
    except Exception as exc:  # noqa: BLE001 - damage shows up as an unreadable artifact
        return f"unreadable: {type(exc).__name__}: {str(exc)[:120]}"
    return h.hexdigest()[:16]


def artifact_paths(root: Path) -> list[str]:
    """Every artifact under ``root`` (a Zarr store counts as one), relative, sorted."""
    found = []
    for top in ARTIFACT_DIRS:
        base = root / top
        if not base.is_dir():
            continue
        for dirpath, dirnames, files in os.walk(base):
            here = Path(dirpath)
            for d in [d for d in dirnames if d.endswith(".zarr")]:
                found.append((here / d).relative_to(root).as_posix())
                dirnames.remove(d)
            found += [(here / f).relative_to(root).as_posix() for f in files if not f.startswith(".")]
    return sorted(p for p in found if not p.startswith(SKIP) and p not in WALL_FILES)


def digests(root: Path) -> dict[str, str]:
    return {p: digest(root / p) for p in artifact_paths(root)}


def iteration_of(path: str) -> int | None:
    parts = path.split("/")
    return int(parts[2]) if len(parts) > 2 and parts[1] == "iters" and parts[2].isdigit() else None


DROPPABLE = ("trajectories.zarr", "prompt_embeds.safetensors", "policy/")  # what retention may drop


def compare(project: dict[str, str], reference: dict[str, str]) -> list[str]:
    """What differs between a project's digests and a from-scratch reference's: changed artifacts, and
    missing ones other than those retention drops. Files beyond ``train.iterations`` (kept for a later
    raise) and files DVC no longer lists (another mode's leftovers) are not compared."""
    problems = []
    for path, want in reference.items():
        have = project.get(path)
        if have is None:
            if not any(d in path for d in DROPPABLE):
                problems.append(f"{path}: missing")
        elif have != want:
            problems.append(f"{path}: {have} != reference {want}")
    return problems


# ---------------------------------------------------------------- reference runs from scratch

def code_key(root: Path) -> str:
    """A hash of the project's code with the harness's appended comments removed (a comment changes
    no result, so one reference serves every commented variant)."""
    h = hashlib.sha256()
    for name in CODE:
        base = root / name
        files = [base] if base.is_file() else sorted(p for p in base.rglob("*") if p.is_file()
                                                     and "__pycache__" not in p.parts and p.suffix != ".pyc")
        for f in files:
            text = b"\n".join(line for line in f.read_bytes().split(b"\n") if not line.startswith(MARK.encode()))
            h.update(f.relative_to(root).as_posix().encode() + hashlib.sha256(text).digest())
    return h.hexdigest()


def params_key(raw: dict) -> str:
    """A hash of the params that can change a result (retention changes none: no stage reads it; nor does an
    execution knob, beyond float round-off: tpgrpo.stage_params.EXECUTION_KNOBS)."""
    from tpgrpo.stage_params import EXECUTION_KNOBS

    kept = {k: dict(v) if isinstance(v, dict) else v for k, v in raw.items() if k != "retention"}
    for knob in EXECUTION_KNOBS:
        section, _, name = knob.partition(".")
        if isinstance(kept.get(section), dict):
            kept[section].pop(name, None)
    return hashlib.sha256(json.dumps(kept, sort_keys=True, default=repr).encode()).hexdigest()


class References:
    """Reference runs from scratch, one per (params, code), kept as digests in ``folder``."""

    def __init__(self, folder: Path, model_dir: Path):
        self.folder, self.model_dir = folder, model_dir
        folder.mkdir(parents=True, exist_ok=True)
        self.computed = 0

    def key(self, root: Path) -> str:
        return hashlib.sha256((params_key(read_params(root)) + code_key(root)).encode()).hexdigest()[:20]

    def store(self, key: str, values: dict[str, str]) -> None:
        (self.folder / f"{key}.json").write_text(json.dumps(values, indent=0, sort_keys=True))

    def get(self, root: Path) -> dict[str, str]:
        """The reference for ``root``'s current params and code: a fresh project, ``tpgrpo run``."""
        key = self.key(root)
        path = self.folder / f"{key}.json"
        if path.is_file():
            return json.loads(path.read_text())
        work = self.folder / f"work-{key}"
        shutil.rmtree(work, ignore_errors=True)
        make_project(work, self.model_dir, root, read_params(root))
        started = time.time()
        done = tpgrpo(work, "run")
        if done.returncode != 0:
            end_processes(work)
            raise RuntimeError(f"reference run failed ({key}): {done.stderr.strip()[-800:]}")
        values = digests(work)
        end_processes(work)
        shutil.rmtree(work, ignore_errors=True)
        self.store(key, values)
        self.computed += 1
        print(f"[reference {key}: {time.time() - started:.0f} s]", file=sys.stderr, flush=True)
        return values


# ---------------------------------------------------------------- which stages ran

def stage_marks(root: Path) -> dict[str, tuple]:
    """Per stage, (mtime, content hash) of the log it writes when it runs: data/iters/NNNN/<stage>.json, the
    baseline's JSON, the summary, a manifest; under "" the time the marks were taken. The hash covers the
    log's untracked timing sidecar too (``<stage>.timing.json``; the summary's ``summary_log.json``): the log
    DVC tracks is the same bytes on every run of the same inputs, its wall seconds are not."""
    logs = {"baseline": root / "data/iters/baseline_eval.json", "summary": root / "data/metrics/summary.json",
            "code": root / "data/code/rollout.json", "eval_prompts": root / "data/iters/eval_prompts.json"}
    for folder in sorted((root / "data/iters").glob("[0-9]" * 4)):
        for name in STAGE_LOGS:
            logs[f"{name}-{folder.name}"] = folder / f"{name}.json"
    side = {"summary": root / "data/iters/summary_log.json"}
    marks: dict[str, tuple] = {"": (time.time_ns(),)}
    for name, path in logs.items():
        try:
            h = hashlib.md5(path.read_bytes())
            mark = path.stat().st_mtime_ns
        except OSError:
            continue
        extra = side.get(name, path.with_name(path.stem + ".timing.json"))
        if extra.is_file():
            h.update(extra.read_bytes())
        marks[name] = (mark, h.hexdigest())
    return marks


def ran_between(before: dict[str, tuple], after: dict[str, tuple]) -> tuple[set[str], set[str]]:
    """(stages whose log is new or holds other bytes, stages whose log was rewritten during the run). A
    real run rewrites its log's wall-clock fields (in its sidecar), so other bytes mean it ran; the logs are cached DVC
    outputs, and a checkout or a restore from the run cache rewrites a log with the same bytes (not a
    run), so a rewrite alone only shows that a stage *may* have run."""
    since = before[""][0] - 50_000_000  # file times lag the clock by a tick
    changed, rewritten = set(), set()
    for name, mark in after.items():
        old = before.get(name)
        if not name:
            continue
        if old is None or old[1] != mark[1]:
            changed.add(name)
        elif old[0] != mark[0] and mark[0] >= since:
            rewritten.add(name)
    return changed, rewritten


def sealed_blocks(root: Path) -> list[tuple[int, int]]:
    return [tuple(int(x) for x in p.stem.split("-")) for p in sorted((root / "data/seals").glob("*-*.yaml"))]


def one_line_error(done: subprocess.CompletedProcess) -> bool:
    """A refusal as the issue asks for it: non-zero, and stderr is one line starting with ``error:``."""
    lines = [line for line in done.stderr.splitlines() if line.strip()]
    return done.returncode != 0 and len(lines) == 1 and lines[0].startswith("error:")


def damage(path: Path, how: str, rng) -> str:
    """Damage a file in place (same inode: what a faulty disk or a stray write does): ``truncate`` to
    half, or ``flip`` 16 bytes in the middle. Returns a description."""
    os.chmod(path, 0o644)  # DVC marks cached files read-only; in-place writers ignore that as root does
    size = path.stat().st_size
    with open(path, "r+b") as f:
        if how == "truncate":
            f.truncate(size // 2)
            return f"truncated {size} -> {size // 2} bytes"
        offset = max(0, size // 2 - 8 + rng.randrange(-4, 5))
        f.seek(offset)
        chunk = f.read(16)
        f.seek(offset)
        f.write(bytes(b ^ 0xFF for b in chunk))
    return f"flipped {len(chunk)} bytes at {offset} of {size}"

