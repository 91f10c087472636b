"""Which machine and which code a comparison run trained with, and whether two runs may be paired.

The same training seed gave held-out 0.43 on one CPU and 0.46 on another: CPUs with other vector units
(AVX-512, AMX, bf16) round the same float maths differently, and a few dozen policy steps amplify it to the size
of the differences a comparison decides. So every ``tpgrpo run`` attempt of a comparison run appends the
machine it ran on to the run folder's ``machine.json``; a run resumed on another machine has two records and
pairs with nothing. The machine is the CPU model, the CPU flags that change float results (vector width, fused
multiply-add, bf16 and AMX units), the torch version and the thread count: a change of any of them can change
the numbers, a change of anything else (host name, memory, load) cannot.

The code is the run's own record of it: the code manifests ``data/code/<kind>.json`` that every project keeps
(:mod:`tpgrpo.pipeline.rendering.code_manifest`: the md5 of every file that computes a stage kind's artifacts, and the
library versions). Two runs whose manifests of the kinds that compute numbers differ ran code that may compute
other numbers; an edit to the command line, the orchestration or the docs is in no manifest, so a commit
that only touches those pairs fine.
"""

from __future__ import annotations

import json
import os
import platform
import time
from pathlib import Path

from tpgrpo.pipeline.rendering.code_manifest import manifest_path

MACHINE_FILE = "machine.json"
# The stage kinds whose code computes a run's numbers (not eval_prompts / summary: they copy and collect).
NUMERIC_KINDS = ("rollout", "probe", "credit", "update", "eval")
# CPU flags that select another kernel in torch's CPU backend (oneDNN / ATen vectorised code): the flags that can
# change a float result. Others (virtualisation, security mitigations) cannot.
NUMERIC_FLAGS = ("avx", "avx2", "fma", "f16c", "avx512f", "avx512bw", "avx512vl", "avx512_vnni", "avx512_bf16",
                 "avx512_fp16", "amx_bf16", "amx_int8", "amx_tile", "avx_vnni", "neon", "asimd", "sve")
# What makes two runs' numbers comparable; a record's other keys (time) describe the attempt only.
IDENTITY_KEYS = ("cpu_model", "cpu_id", "numeric_flags", "machine", "torch", "threads")


def _cpuinfo(path: Path = Path("/proc/cpuinfo")) -> tuple[str, str, set[str]]:
    """(model name, "vendor family/model/stepping", flags) of the first CPU in ``path``. The numbers matter: a
    virtual machine may name its CPU only "AMD EPYC", for several generations."""
    fields: dict[str, str] = {}
    if path.is_file():
        for line in path.read_text(errors="replace").splitlines():
            key, _, value = line.partition(":")
            fields.setdefault(key.strip().lower(), value.strip())
    model = fields.get("model name") or fields.get("cpu model") or platform.processor() or platform.machine()
    cpu_id = "/".join(fields.get(k, "?") for k in ("vendor_id", "cpu family", "model", "stepping"))
    return model, cpu_id, set((fields.get("flags") or fields.get("features") or "").split())


def machine_record(threads: int, cpuinfo: Path = Path("/proc/cpuinfo")) -> dict:
    """This machine as a run's numbers depend on it (``IDENTITY_KEYS``), plus the time of the attempt."""
    import torch

    model, cpu_id, flags = _cpuinfo(cpuinfo)
    return {"cpu_model": model, "cpu_id": cpu_id, "numeric_flags": sorted(f for f in NUMERIC_FLAGS if f in flags),
            "machine": platform.machine(), "torch": torch.__version__, "threads": int(threads),
            "time": time.strftime("%Y-%m-%d %H:%M:%S")}


def identity(record: dict) -> tuple:
    """The part of a machine record two comparable runs share (JSON lists made hashable)."""
    return tuple(json.dumps(record.get(k), sort_keys=True) for k in IDENTITY_KEYS)


def read_machines(folder: Path) -> list[dict]:
    """The run folder's machine records, one per attempt ([] for a run made before they were recorded)."""
    from tpgrpo.comparison import store

    path = Path(folder) / MACHINE_FILE
    return store.read_json(path) if store.is_file(path) else []


def append_machine(folder: Path, record: dict) -> None:
    """Add one attempt's record to ``folder/machine.json`` (rewritten through a temporary file)."""
    path = Path(folder) / MACHINE_FILE
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps([*read_machines(folder), record], indent=2, sort_keys=True) + "\n")
    os.replace(tmp, path)


def describe(record: dict) -> str:
    return (f"{record.get('cpu_model', '?')} ({record.get('cpu_id', '?')}) [{' '.join(record.get('numeric_flags', []))}], torch "
            f"{record.get('torch', '?')}, {record.get('threads', '?')} thread(s)")


def run_machine(folder: Path) -> tuple[tuple | None, str]:
    """(identity, "") of a run trained on one machine throughout; (None, why) for a run with no record or
    with attempts on different machines."""
    records = read_machines(folder)
    if not records:
        return None, f"{folder}: no {MACHINE_FILE} (trained before machines were recorded)"
    ids = {identity(r) for r in records}
    if len(ids) > 1:
        kinds = sorted({describe(r) for r in records})
        return None, f"{folder}: resumed on another machine ({'; '.join(kinds)})"
    return identity(records[0]), ""


def code_record(folder: Path) -> dict | None:
    """``{kind: {"files": {path: md5}, "libraries": {...}, "hashes": what a md5 is of}}`` of the run's numeric
    kinds, None without manifests. ``hashes`` is "bytes" for manifests older than the code hash (they lack it)."""
    from tpgrpo.comparison import store

    out = {}
    for kind in NUMERIC_KINDS:
        path = Path(folder) / manifest_path(kind)
        if not store.is_file(path):
            return None
        record = store.read_json(path)
        out[kind] = {"files": record.get("files", {}), "libraries": record.get("libraries", {}),
                     "hashes": record.get("hashes", "bytes")}
    return out


def code_difference(a: dict, b: dict) -> list[str]:
    """The files and libraries two code records disagree on (sorted, deduplicated across kinds)."""
    differ = set()
    for kind in NUMERIC_KINDS:
        for part in ("files", "libraries"):
            x, y = a[kind][part], b[kind][part]
            differ |= {k for k in set(x) | set(y) if x.get(k) != y.get(k)}
    return sorted(differ)


def mismatch(folders: list[Path]) -> tuple[str, str]:
    """Whether the runs in ``folders`` may be compared on numbers: ``("", "")`` if they may; ``("unknown",
    why)`` where a run has no machine or code record (trained before they were kept); ``("differ", why)`` where
    a run was resumed on another machine or two runs differ in machine or in code that computes numbers."""
    machines: dict[tuple, Path] = {}
    for folder in folders:
        ident, why = run_machine(folder)
        if ident is None:
            return ("unknown" if not read_machines(folder) else "differ"), why
        machines.setdefault(ident, folder)
    if len(machines) > 1:
        (_, a), (_, b) = list(machines.items())[:2]
        return "differ", (f"{a} and {b} trained on different machines ({describe(read_machines(a)[0])} vs "
                          f"{describe(read_machines(b)[0])})")
    codes = [(folder, code_record(folder)) for folder in folders]
    missing = [f for f, c in codes if c is None]
    if missing:
        return "unknown", f"{missing[0]}: no code manifests (data/code/*.json)"
    formats = sorted({(code[kind]["hashes"], str(folder)) for folder, code in codes for kind in NUMERIC_KINDS})
    if formats[0][0] != formats[-1][0]:  # md5s of bytes and of stripped code never agree: no evidence either way
        (x, a), (y, b) = formats[0], formats[-1]
        return "unknown", f"{a} and {b} hashed their code differently ({x} vs {y}): the files cannot be compared"
    for folder, code in codes[1:]:
        differ = code_difference(codes[0][1], code)
        if differ:
            return "differ", (f"{codes[0][0]} and {folder} ran different code that computes numbers "
                              f"({', '.join(differ[:4])}{', ...' if len(differ) > 4 else ''})")
    return "", ""
