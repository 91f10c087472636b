"""The stage server's children: who is running, waking on their exits, telling their callers.

``children`` maps each forked stage's pid to its caller's socket (None once the caller is gone); ``exits``
maps it to a pidfd, readable once the child has exited, which :func:`tpgrpo.pipeline.execution.stage_server.serve`
waits on beside its listener. Split from the server's module by concern: this is the bookkeeping of running
stages, the server's module the accepting and forking.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import socket


def send(conn: socket.socket, payload: dict) -> bool:
    """Reply to a caller; False when it has gone (it may leave at any time: that must not end the server)."""
    try:
        conn.send(json.dumps(payload).encode())
        return True
    except OSError:
        return False


def caller_gone(pid: int, children: dict[int, socket.socket | None]) -> None:
    """The caller of child ``pid`` died without forwarding a signal (SIGKILL): end the stage as the
    caller's own process would have ended, instead of letting it run on unseen."""
    print(f"caller of {pid} gone: terminating it", flush=True)
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, signal.SIGTERM)
    children[pid].close()
    children[pid] = None


def watch_exits(children: dict[int, socket.socket | None], exits: dict[int, int]) -> None:
    """Open a pidfd for each child not yet watched, so that its exit wakes the server's select at once
    instead of at the next tick (50 ms: about 25 ms a stage on average). Without pidfds (a kernel before
    5.3) the tick still reaps it."""
    for pid in children.keys() - exits.keys():
        try:
            exits[pid] = os.pidfd_open(pid)
        except (AttributeError, OSError):  # not on this kernel, or already reaped: the tick covers it
            return


def reap(children: dict[int, socket.socket | None], exits: dict[int, int]) -> None:
    """Collect every exited child: close its pidfd, tell its caller the exit code, close the caller's socket."""
    while children:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        if pid in exits:
            os.close(exits.pop(pid))
        conn = children.pop(pid, None)
        if conn is not None:
            send(conn, {"exit": os.waitstatus_to_exitcode(status)})  # fails if the caller is gone: nothing to tell
            conn.close()


def end_children(children: dict[int, socket.socket | None], exits: dict[int, int]) -> None:
    """SIGKILL every running child and reap it (the server is ending: nothing may write on unseen)."""
    for pid, conn in children.items():
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)
        with contextlib.suppress(ChildProcessError):
            os.waitpid(pid, 0)
        if conn is not None:
            conn.close()  # the caller reads EOF: "the stage server stopped before the stage finished"
    children.clear()
    for fd in exits.values():
        os.close(fd)
    exits.clear()
