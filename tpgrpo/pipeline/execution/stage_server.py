"""A fork server for stage processes: the libraries are imported once, every stage still runs in a
process of its own.

Why: a stage process of the tiny CPU model spends about 2-4 s importing torch, diffusers, transformers and
peft (diffusers alone pulls in torch._dynamo and peft) before 0.1-40 s of work, and the default run starts
62 of them. ``tpgrpo run`` starts this server (``launch.stage_server``: Linux, CPU, one process per stage);
it imports those libraries once, then for each ``tpgrpo stage ...`` / ``tpgrpo block ...`` that DVC starts
it forks a child that runs the command with the caller's argv, working folder, environment and standard
streams. The process DVC started is a thin client: it passes its streams over a Unix socket, forwards
SIGINT/SIGTERM/SIGHUP to the child and exits with the child's status. The child is a process of its own
(own memory, own exit code), so a crash or a leak stays inside its stage, as before.

The client runs the command itself (the old path) whenever the server cannot take it: no server named in
the environment, the socket gone, the server died before forking, or a caller whose interpreter, code
folders or thread/seed/device environment differ from the server's (then the imports would differ).

The server runs the modules it imported when it started, so before each fork it checks that no file under
``tpgrpo/`` or ``stages/``, no installed distribution and no file of an editable or unpackaged library the
code imports changed since (:class:`CodeState`, :func:`watched_folders`); after a change
it refuses (the caller runs the stage in a fresh process, with the code on disk), stops listening, and exits
once its running stages end. It lives and dies with ``tpgrpo run``: it stays in the run's process group (a
group kill reaches it and its stages), it gets SIGTERM when the run's process dies (``PR_SET_PDEATHSIG``),
and each forked stage gets SIGKILL when the server dies, so no stage of a killed run writes on unseen.

The client (:func:`run_via_server`) is :mod:`tpgrpo.pipeline.execution.stage_client`: it must start in milliseconds and
imports only the standard library. The server's preload happens in :func:`serve`; a forked child runs the
command with :mod:`tpgrpo.pipeline.execution.stage_runner` (the stage commands and ``block``), never the whole CLI.
"""

from __future__ import annotations

import contextlib
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Iterator

from tpgrpo.pipeline.rendering.code_manifest import STAGE_KIND, warm_caches
from tpgrpo.pipeline.execution.processes import CodeState, die_with_parent
from tpgrpo.pipeline.execution.stage_children import caller_gone, end_children, reap, send, watch_exits
from tpgrpo.pipeline.execution.stage_client import COMMANDS, ENV_VAR, MAX_MESSAGE, fingerprint

# the stage runner first: it sets OMP_WAIT_POLICY, which the OpenMP runtime reads when torch loads it.
PRELOAD = ("tpgrpo.pipeline.execution.stage_runner", "torch", "numpy", "pandas", "pyarrow.parquet", "zarr", "safetensors.torch", "peft", "typer",
           "diffusers:SD3Transformer2DModel", "diffusers:FlowMatchEulerDiscreteScheduler",
           "diffusers.loaders:SD3LoraLoaderMixin", "transformers:CLIPTextModel",
           "transformers:PreTrainedTokenizerFast", "tpgrpo.models.tiny", "tpgrpo.tasks.rewards", "dvc.utils.serialize",
           # what every stage command imported after the fork (0.17 s a stage, measured): typer's argument
           # adapters (pydantic), DVC's YAML parser, pyarrow's dataset reader, the runner's status and lock modules
           "typer._adapters", "ruamel.yaml", "pyarrow.dataset", "tpgrpo.pipeline.status",
           "tpgrpo.pipeline.dvc_integration.params_read", "tpgrpo.pipeline.long_runs.blocks",
           "tpgrpo.pipeline.dvc_integration.dvclock", "tpgrpo.algo.tree_credit",
           *(f"stages.{s}" for s in STAGE_KIND))  # every `tpgrpo stage NAME`


# ---------------------------------------------------------------------------------------------- server


def preload(names=PRELOAD) -> list[str]:
    """Import ``module`` or ``module:attribute`` names; returns the ones that failed (optional backends)."""
    import importlib

    failed = []
    for name in names:
        module, _, attribute = name.partition(":")
        try:
            imported = importlib.import_module(module)
            if attribute:
                getattr(imported, attribute)  # diffusers/transformers resolve these lazily
        except Exception as exc:  # noqa: BLE001 - a backend the run does not use may be missing
            failed.append(f"{name} ({type(exc).__name__}: {exc})")
    return failed


def serve(path: str, parent: int, names=PRELOAD, model: dict | None = None, tick: float = 0.05) -> None:
    """Listen on ``path`` (bound before the imports, so early callers wait instead of falling back), import
    ``names``, load ``model`` (:func:`tpgrpo.models.resident.spec`; None = none), then fork one child per request until
    ``parent`` exits, SIGTERM comes, or the code changed (then it stops listening and waits for its running
    children). ``tick``: seconds between checks that ``parent`` is alive (requests and exits wake it at once)."""
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path + ".tmp")
    listener.listen(64)
    os.rename(path + ".tmp", path)  # the name appears only once connect() can succeed: running() waits for it
    start_env = dict(os.environ)
    # noted before the imports: an edit made while they run counts as a change
    where = fingerprint({})  # the folders the stages' code is imported from
    code = CodeState(watched_folders(where))
    failed = preload(names)
    from tpgrpo.models import load_backend, resident

    held = resident.hold_for_stages(load_backend, model)
    warm_caches(Path(where["tpgrpo"][0]).parent if where["tpgrpo"] else Path.cwd())  # once, not in each stage
    # what the imports set (OMP_WAIT_POLICY, torch's cache folders): a fresh stage process would set it too
    set_by_imports = {k: v for k, v in os.environ.items() if start_env.get(k) != v}
    print(f"stage server {os.getpid()}: ready; threads {len(os.listdir('/proc/self/task'))}; not imported: "
          f"{failed or 'none'}; model held: {held}; CUDA initialised: {cuda_initialised()}", flush=True)
    own = fingerprint(start_env)
    children: dict[int, socket.socket | None] = {}
    exits: dict[int, int] = {}  # pid -> a pidfd, readable once that child has exited
    try:
        while os.getppid() == parent and (listener is not None or children):
            callers = {conn: pid for pid, conn in children.items() if conn is not None}
            # a child's exit wakes the loop at once (its pidfd); the timeout only notices the parent's death
            waits = [*([listener] if listener else []), *callers, *exits.values()]
            ready, _, _ = select.select(waits, [], [], tick)
            for sock in ready:
                if isinstance(sock, int):
                    continue  # a pidfd: reap() below takes every exited child
                if sock is not listener:  # a caller sends nothing after its request: readable means gone
                    caller_gone(callers[sock], children)
                elif not _accept(listener, own, code, set_by_imports, children):
                    listener = _stop_listening(listener, path)  # callers now find no socket: they run it
                else:
                    watch_exits(children, exits)
            reap(children, exits)
    finally:
        end_children(children, exits)  # the run is gone (or ends): its stages go with it, as their processes would
        if listener is not None:
            _stop_listening(listener, path)
        with contextlib.suppress(OSError):
            os.rmdir(os.path.dirname(path))  # running()'s folder, if the parent could not remove it


def watched_folders(where: dict[str, list[str]]) -> list[str]:
    """What the server's imports came from beyond the installed distributions' versions: the folders of the
    stages' code (``where``: :func:`fingerprint`'s ``tpgrpo`` and ``stages``) and of the libraries the code
    manifests record by their files (editable installs, modules on PYTHONPATH: an edit there changes no
    distribution's entry; :func:`tpgrpo.pipeline.rendering.code_manifest.unpinned_sources`), a module file by its
    folder."""
    from tpgrpo.pipeline.rendering.code_manifest import unpinned_sources

    folders = [folder for name in ("tpgrpo", "stages") for folder in where[name]]
    with contextlib.suppress(Exception):  # not a project folder (no stages to scan): its own folders only
        folders += [str(p if p.is_dir() else p.parent) for p in unpinned_sources(Path(where["tpgrpo"][0]).parent)]
    return sorted(set(folders))


def _stop_listening(listener: socket.socket, path: str) -> None:
    listener.close()
    with contextlib.suppress(FileNotFoundError):
        os.unlink(path)


def _receive(conn: socket.socket) -> tuple[dict, list[int]] | None:
    """A request and the descriptors it sent; None (a line printed, both closed) when it is not one."""
    fds: list[int] = []
    try:
        message, fds, _, _ = socket.recv_fds(conn, MAX_MESSAGE, 3)
        request = json.loads(message)
        if not isinstance(request, dict):
            raise ValueError(f"expected a JSON object, got {type(request).__name__}")
    except (OSError, ValueError) as exc:
        print(f"bad request: {exc}", flush=True)
        for fd in fds:  # the descriptors it sent came with it: without this each bad request leaked them
            os.close(fd)
        conn.close()
        return None
    return request, fds


def _refusal_now(conn: socket.socket, request: dict, own: dict, fds: list[int], code: CodeState) -> tuple[str, str]:
    """``(what changed for good, why the request is refused)``; empty strings where it is served."""
    changed = code.changed()
    if changed:
        return changed, f"code changed since the server started ({changed}): its imports are stale"
    if cuda_initialised():  # for good: stop serving, as after a code change
        return "CUDA", "CUDA was initialised in the server: a stage forked now could not use the GPU"
    if select.select([conn], [], [], 0)[0]:  # it sends nothing after its request: readable means it left
        return "", "its caller left before the reply (it stopped waiting and runs the stage itself)"
    return "", _refusal(request, own, fds) or ""


def _accept(listener: socket.socket, own: dict, code: CodeState, set_by_imports: dict[str, str],
            children: dict[int, socket.socket | None]) -> bool:
    """Take one request: refuse it, or fork its child. Returns False once the code changed (stop serving)."""
    conn, _ = listener.accept()
    received = _receive(conn)
    if received is None:
        return True
    request, fds = received
    changed, reason = _refusal_now(conn, request, own, fds, code)
    if reason:
        print(f"refused {request.get('argv')}: {reason}", flush=True)
        send(conn, {"refused": reason})
        for fd in fds:
            os.close(fd)
        conn.close()
        return not changed
    sys.stdout.flush()
    sys.stderr.flush()
    server = os.getpid()
    # Signals wait until the child has a stage's handlers: one landing in the fork hooks (zarr's) ran the
    # server's handler in the child and printed a traceback.
    mask = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT, signal.SIGTERM, signal.SIGHUP})
    pid = os.fork()
    if pid == 0:
        for signum in (signal.SIGTERM, signal.SIGHUP):
            signal.signal(signum, signal.SIG_DFL)
        signal.signal(signal.SIGINT, signal.default_int_handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
        die_with_parent(signal.SIGKILL)  # the server gone (the run killed): so is this stage, at once
        if os.getppid() != server:
            os._exit(1)  # it died before prctl
        listener.close()
        conn.close()  # only the server answers the caller: its EOF then means the server is gone
        for other in children.values():
            if other is not None:
                other.close()
        os._exit(_run_child(request, fds, set_by_imports))
    signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    for fd in fds:
        os.close(fd)
    print(f"forked {pid}: {' '.join(request['argv'][1:])}", flush=True)
    children[pid] = conn
    if not send(conn, {"pid": pid}):
        caller_gone(pid, children)  # it left before the reply: nobody would wait for or signal its stage
    return True


def _refusal(request: dict, own: dict, fds: list[int]) -> str:
    if len(fds) != 3:
        return f"expected 3 file descriptors (stdin, stdout, stderr), got {len(fds)}"
    argv = request.get("argv") or []
    if argv[1:2] not in ([c] for c in COMMANDS):
        return f"command {argv[1:2]}: the server runs only {', '.join(COMMANDS)}"
    theirs = request.get("fingerprint", {})
    for key in ("executable", "tpgrpo", "stages"):
        if theirs.get(key) != own[key]:
            return f"{key} differs: {theirs.get(key)} (server: {own[key]})"
    env, mine = theirs.get("env", {}), own["env"]
    diff = sorted(k for k in set(env) | set(mine) if env.get(k) != mine.get(k))
    return f"environment differs in {', '.join(diff)}" if diff else ""


def _run_child(request: dict, fds: list[int], set_by_imports: dict[str, str]) -> int:
    """In the forked child: become the caller (streams, folder, environment, argv) and run the command."""
    for target, fd in zip((0, 1, 2), fds):
        os.dup2(fd, target)
        os.close(fd)
    os.chdir(request["cwd"])
    os.environ.clear()
    os.environ.update(request["env"])
    for key, value in set_by_imports.items():
        os.environ.setdefault(key, value)
    sys.argv = list(request["argv"])
    signal.signal(signal.SIGINT, signal.default_int_handler)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    code = 1
    try:
        _fresh_global_generators()
        from tpgrpo.pipeline.execution.stage_runner import run_stage_command  # PRELOAD imported it

        run_stage_command(sys.argv[1:], prog_name="tpgrpo")
        code = 0
    except SystemExit as exc:
        code = exc.code if isinstance(exc.code, int) else (0 if exc.code is None else 1)
        if isinstance(exc.code, str):
            sys.stderr.write(exc.code + "\n")
    except BaseException:  # noqa: BLE001 - as an uncaught exception would end a stage process
        traceback.print_exc()
    finally:
        import logging

        logging.shutdown()  # what interpreter exit would do; os._exit skips it
        sys.stdout.flush()
        sys.stderr.flush()
    return code


def _fresh_global_generators() -> None:
    """A fresh process seeds torch's, numpy's and Python's global generators from OS entropy; a forked child
    would share the server's states with its siblings, so it draws new seeds the same way. (No stage may
    rely on these generators: every draw that matters uses a generator seeded from train.seed.)"""
    import random

    import numpy as np
    import torch

    torch.seed()
    np.random.seed()
    random.seed()


def wanted(cfg) -> bool:
    """Whether ``tpgrpo run`` starts the server: ``launch.stage_server``, one process per stage (no
    accelerate), Linux (fork after importing torch is not safe on macOS), and the CPU for the model and the
    reward models, unless ``launch.resident_model`` asks for the held weights on a GPU too (opt-in: a GPU
    stage's start-up is small next to its work, its load is not; the server never initialises CUDA and
    checks that before each fork, :func:`cuda_initialised`)."""
    from tpgrpo.pipeline.execution.launch import single

    on_cpu = cfg.model.device == "cpu" and cfg.reward_models.device == "cpu"
    return (cfg.launch.stage_server and single(cfg.launch) and (on_cpu or cfg.launch.resident_model)
            and sys.platform.startswith("linux"))


NVIDIA_DEVICES = "/dev/nvidia"  # what a process holds open once it initialised the CUDA driver (nvidiactl, nvidia0)


def cuda_initialised() -> bool:
    """Whether this process has initialised CUDA: torch's own lazy init, or the driver under any library (one
    ``torch.cuda.is_available()`` at some import runs cudaGetDeviceCount, which torch does not count), seen as
    an open ``/dev/nvidia*`` file. A process forked after that cannot use the GPU, so the server then stops
    forking and every stage runs in its caller (a false alarm only costs the held weights)."""
    torch = sys.modules.get("torch")
    if torch is not None and torch.cuda.is_initialized():
        return True
    for fd in os.listdir("/proc/self/fd"):
        with contextlib.suppress(OSError):  # the listing's own descriptor is gone by now
            if os.readlink(f"/proc/self/fd/{fd}").startswith(NVIDIA_DEVICES):
                return True
    return False


@contextlib.contextmanager
def running(root: Path, enabled: bool = True, model: dict | None = None) -> Iterator[dict[str, str]]:
    """Start the server for a ``dvc repro`` in ``root``; yields the environment entries that point the
    stage commands at it (none when not ``enabled``). ``model``: what it loads for the stages
    (:func:`tpgrpo.models.resident.spec`). Its log is ``.dvc/tmp/stage_server.log``."""
    if not enabled:
        yield {}
        return
    folder = tempfile.mkdtemp(prefix="tpgrpo-")  # a short path: Unix socket paths are limited to ~100 bytes
    path = os.path.join(folder, "server.sock")
    log_path = root / ".dvc" / "tmp" / "stage_server.log"
    log_path.parent.mkdir(parents=True, exist_ok=True)
    with open(log_path, "w") as log:
        # -c, then drop '' from sys.path: the server finds tpgrpo and stages where the `tpgrpo` command does
        code = "import sys; sys.path.remove(''); from tpgrpo.pipeline.execution.stage_server import main; main()"
        # in the run's process group (a group kill of the run reaches the server and its stages); it ignores
        # SIGINT: a Ctrl-C is for the stages, which get it from the terminal and from their callers
        server = subprocess.Popen([sys.executable, "-c", code, path, str(os.getpid()), json.dumps(model)],
                                  cwd=root, stdin=subprocess.DEVNULL, stdout=log, stderr=subprocess.STDOUT)
    try:
        _wait_for_socket(server, path)
        yield {ENV_VAR: path}
    finally:
        server.terminate()
        try:
            server.wait(timeout=10)
        except subprocess.TimeoutExpired:
            server.kill()
            server.wait()
        shutil.rmtree(folder, ignore_errors=True)


def _wait_for_socket(server: subprocess.Popen, path: str, timeout: float = 60.0) -> None:
    """Wait until the server has bound ``path`` (it does so before its slow imports): a caller that came
    earlier would find no socket and run its stage itself. Gives up quietly if the server died or is slow."""
    deadline = time.monotonic() + timeout
    while not os.path.exists(path) and server.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)


def main() -> None:
    """``python -m tpgrpo.pipeline.execution.stage_server SOCKET PARENT_PID [MODEL_JSON]``."""
    path, parent = sys.argv[1], int(sys.argv[2])
    model = json.loads(sys.argv[3]) if len(sys.argv) > 3 else None
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_signal)  # running() ending, or the run's process gone:
    die_with_parent(signal.SIGTERM)                 # either way serve()'s cleanup ends its stages
    if os.getppid() != parent:
        return  # the run died before prctl
    serve(path, parent, model=model)


def _exit_on_signal(signum, _frame):
    raise SystemExit(128 + signum)


if __name__ == "__main__":
    main()
