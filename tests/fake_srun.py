"""A stand-in for SLURM's ``srun`` inside an allocation, for tests: simulated nodes on localhost.

Installed as ``srun`` first on PATH (:func:`install`). ``srun [--option=value ...] COMMAND ARGS...`` starts
COMMAND once per node (``--nodes``, else ``SLURM_NNODES``), all at once, each with ``SLURM_NODEID``,
``SLURM_PROCID``, ``SLURM_LOCALID`` and ``SLURMD_NODENAME`` set as srun sets them for one task per node,
and waits for all; with ``--kill-on-bad-exit=1`` a failed task stops the others (SIGTERM), as srun does.
It exits with the first non-zero exit status, else 0. Each call appends its options and command, as one JSON
line, to ``$FAKE_SRUN_LOG`` (when set), so a test can see how it was called.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path


def install(folder: Path) -> Path:
    """Write an executable ``srun`` (this file, run by this interpreter) into ``folder``; returns the folder."""
    folder.mkdir(parents=True, exist_ok=True)
    srun = folder / "srun"
    srun.write_text(f"#!{sys.executable}\n" + Path(__file__).read_text())
    srun.chmod(0o755)
    return folder


def _split(argv: list[str]) -> tuple[dict[str, str], list[str]]:
    """``--key=value`` options before the command, and the command."""
    options, i = {}, 0
    while i < len(argv) and argv[i].startswith("-"):
        key, _, value = argv[i].lstrip("-").partition("=")
        options[key] = value
        i += 1
    return options, argv[i:]


def main(argv: list[str]) -> int:
    options, command = _split(argv)
    nodes = int(options.get("nodes") or os.environ["SLURM_NNODES"])
    if os.environ.get("FAKE_SRUN_LOG"):
        with open(os.environ["FAKE_SRUN_LOG"], "a") as log:
            log.write(json.dumps({"options": options, "command": command}) + "\n")
    tasks = [subprocess.Popen(command, env={**os.environ, "SLURM_NODEID": str(n), "SLURM_PROCID": str(n),
                                            "SLURM_LOCALID": "0", "SLURMD_NODENAME": f"node{n}"})
             for n in range(nodes)]
    first_failure = 0
    while any(t.poll() is None for t in tasks):
        failed = [t.returncode for t in tasks if t.returncode not in (None, 0)]
        if failed and options.get("kill-on-bad-exit") == "1":
            first_failure = first_failure or failed[0]
            for t in tasks:
                if t.poll() is None:
                    t.terminate()
        time.sleep(0.1)
    codes = [t.returncode for t in tasks]
    return first_failure or next((c for c in codes if c != 0), 0)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
