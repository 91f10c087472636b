"""The client side of the stage server (:mod:`tpgrpo.pipeline.execution.stage_server`): what ``tpgrpo stage ...`` runs
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
# Seconds a caller waits for the server's first reply (a fork's pid, or a refusal) before it gives up on the
# server and runs its stage itself. A ready server replies in milliseconds; the wait covers one that is still
# importing and loading the resident model when the first stage comes (a real-size model on a slow disk).
TIMEOUT_ENV = "TPGRPO_STAGE_SERVER_TIMEOUT"
TIMEOUT_S = 300.0


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
    timeout = reply_timeout()
    if isinstance(timeout, str):
        sys.stderr.write(f"error: {timeout}\n")
        return 2
    request = {"argv": argv, "cwd": os.getcwd(), "env": dict(os.environ), "fingerprint": fingerprint(os.environ)}
    try:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    except OSError:
        return None
    sock.settimeout(timeout)  # the connect, the request and the first reply: a hung server must not hang DVC
    try:
        sock.connect(path)
        socket.send_fds(sock, [json.dumps(request).encode()], [0, 1, 2])
        reply = json.loads(sock.recv(MAX_MESSAGE) or b"{}")  # waits while the server is still importing
    except TimeoutError:
        sock.close()  # the server, should it wake, sees its caller gone and forks nothing
        _give_up(path, timeout)
        return None
    except (OSError, ValueError):
        sock.close()
        return None
    if "pid" not in reply:
        sock.close()
        return None  # refused (reply["refused"] says why; the server's log has it too)
    sock.settimeout(None)  # the stage itself may take hours
    return _wait_for_child(sock, int(reply["pid"]))


def reply_timeout() -> float | str:
    """Seconds to wait for the server's first reply (:data:`TIMEOUT_ENV`, else :data:`TIMEOUT_S`), or what is
    wrong with the variable's value (one line)."""
    value = os.environ.get(TIMEOUT_ENV, "").strip()
    if not value:
        return TIMEOUT_S
    try:
        seconds = float(value)
    except ValueError:
        seconds = -1.0
    if not 0 < seconds < float("inf"):
        return f"{TIMEOUT_ENV}={value!r}: expected a positive number of seconds"
    return seconds


def _give_up(path: str, timeout: float) -> None:
    """After a server sent no reply in ``timeout`` seconds: remove its socket, so this run's later stages
    find none and start in their own process at once instead of each waiting as long, and say so in one
    line (stderr: DVC shows it with the stage's output)."""
    try:
        os.unlink(path)
    except OSError:
        pass
    sys.stderr.write(f"warning: the stage server ({path}) sent no reply in {timeout:g} s (hung, or still "
                     f"loading; the log: .dvc/tmp/stage_server.log; {TIMEOUT_ENV} sets the wait): this stage and "
                     "the rest of this run's run in their own processes\n")
    sys.stderr.flush()


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
