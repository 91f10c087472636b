"""The client side of the stage server (:mod:`tpgrpo.pipeline.stage_server`): what ``tpgrpo stage ...`` runs
first when ``tpgrpo run`` started a server.

Why a module of its own: the process DVC starts for a stage imports this before anything else, so it must
start in milliseconds (the standard library only), and it must not import the server, the CLI or the stage
runner (the server imports them to fork stages). The server imports the names it shares with its callers
(the socket variable, what it serves, the fingerprint both compare) from here.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys

ENV_VAR = "TPGRPO_STAGE_SERVER"  # the socket's path, set by `tpgrpo run` for `dvc repro`
COMMANDS = ("stage", "block")  # what the server runs; anything else runs in the caller
# Environment read at import time (threads, hash seed, devices, library switches): the caller's must equal
# the server's, or its imports would not be the ones the server made.
ENV_PREFIXES = ("PYTHON", "OMP_", "MKL_", "OPENBLAS", "TORCH", "PYTORCH", "CUDA", "HF_", "DIFFUSERS",
                "TRANSFORMERS", "TOKENIZERS", "ACCELERATE", "WORLD_SIZE", "RANK", "LOCAL_RANK", "MASTER_")
MAX_MESSAGE = 1 << 20


def fingerprint(env: dict[str, str]) -> dict:
    """What must match between caller and server: interpreter, where ``tpgrpo`` and ``stages`` come from,
    and the import-time environment."""
    from importlib.util import find_spec

    def where(name: str) -> list[str]:
        spec = find_spec(name)
        return sorted(os.path.realpath(p) for p in (spec.submodule_search_locations or [])) if spec else []

    return {"executable": os.path.realpath(sys.executable), "tpgrpo": where("tpgrpo"), "stages": where("stages"),
            "env": {k: v for k, v in sorted(env.items()) if k.startswith(ENV_PREFIXES)}}


# ---------------------------------------------------------------------------------------------- client


def run_via_server(argv: list[str]) -> int | None:
    """Run ``argv`` (``[prog, command, ...]``) in a child of the server named by $TPGRPO_STAGE_SERVER and
    return its exit code; ``None`` when the server cannot take it (the caller then runs it itself)."""
    path = os.environ.get(ENV_VAR)
    if not path or not sys.platform.startswith("linux") or argv[1:2] not in ([c] for c in COMMANDS):
        return None
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "fingerprint": fingerprint(os.environ)}
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        sock.connect(path)
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(sock.recv(MAX_MESSAGE) or b"{}")  # waits while the server is still importing
    except (OSError, ValueError):
        return None
    if "pid" not in reply:
        return None  # refused (reply["refused"] says why; the server's log has it too)
    return _wait_for_child(sock, int(reply["pid"]))


def _wait_for_child(sock: socket.socket, pid: int) -> int:
    def forward(signum, _frame):
        try:
            os.kill(pid, signum)
        except ProcessLookupError:
            pass

    for signum in (signal.SIGINT, signal.SIGTERM, signal.SIGHUP):
        signal.signal(signum, forward)
    data = sock.recv(MAX_MESSAGE)  # PEP 475: a forwarded signal does not interrupt the wait
    if not data:
        forward(signal.SIGTERM, None)
        sys.stderr.write("error: the stage server stopped before the stage finished\n")
        return 1
    code = int(json.loads(data)["exit"])
    if code < 0:  # killed by a signal: die of the same one, as the stage process itself would have
        signal.signal(-code, signal.SIG_DFL)
        os.kill(os.getpid(), -code)
    return code
