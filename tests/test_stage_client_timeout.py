"""A stage server that never replies must not hang the repro: the caller gives up after
$TPGRPO_STAGE_SERVER_TIMEOUT seconds with one line, runs its stage itself, and removes the socket so that the
run's later stages do not wait too; a server that wakes later forks nothing for a caller that has left."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from tpgrpo.pipeline.execution import stage_client
from tpgrpo.pipeline.execution.stage_client import ENV_VAR, TIMEOUT_ENV, fingerprint, run_via_server


def _listener(path: str) -> socket.socket:
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    listener.bind(path)
    listener.listen(4)
    return listener


@pytest.mark.parametrize("accepts", [False, True], ids=["never-accepts", "accepts-never-replies"])
def test_a_server_that_never_replies_is_given_up_after_the_timeout_in_one_line(tmp_path, monkeypatch, capfd,
                                                                               accepts):
    path = str(tmp_path / "server.sock")
    listener = _listener(path)
    held = []
    if accepts:  # reads the request, then hangs (a deadlocked server)
        threading.Thread(target=lambda: held.append(listener.accept()[0]), daemon=True).start()
    monkeypatch.setenv(ENV_VAR, path)
    monkeypatch.setenv(TIMEOUT_ENV, "0.5")
    try:
        started = time.monotonic()
        assert run_via_server(["tpgrpo", "stage", "credit", "--iter", "1"]) is None  # runs it itself
        waited = time.monotonic() - started
        assert 0.4 < waited < 5, waited
        err = capfd.readouterr().err.strip().splitlines()
        assert len(err) == 1 and "sent no reply in 0.5 s" in err[0] and TIMEOUT_ENV in err[0], err
        assert not os.path.exists(path)  # the socket is gone: the next stage does not wait
        started = time.monotonic()
        assert run_via_server(["tpgrpo", "stage", "credit", "--iter", "2"]) is None
        assert time.monotonic() - started < 0.4
        assert capfd.readouterr().err == ""
    finally:
        listener.close()
        for conn in held:
            conn.close()


@pytest.mark.parametrize("value", ["soon", "0", "-3", "inf", "nan"])
def test_a_bad_timeout_is_one_line_naming_the_variable_and_the_stage_fails(tmp_path, monkeypatch, capfd, value):
    monkeypatch.setenv(ENV_VAR, str(tmp_path / "server.sock"))
    monkeypatch.setenv(TIMEOUT_ENV, value)
    assert run_via_server(["tpgrpo", "stage", "credit"]) == 2
    err = capfd.readouterr().err.strip().splitlines()
    assert err == [f"error: {TIMEOUT_ENV}={value!r}: expected a positive number of seconds"]


def test_the_default_wait_covers_a_server_still_loading(monkeypatch):
    monkeypatch.delenv(TIMEOUT_ENV, raising=False)
    assert stage_client.reply_timeout() == stage_client.TIMEOUT_S >= 60
    monkeypatch.setenv(TIMEOUT_ENV, " 12.5 ")
    assert stage_client.reply_timeout() == 12.5


def test_a_server_that_wakes_after_its_caller_left_forks_nothing(tmp_path):
    """The caller timed out and runs the stage itself; the server, reaching its request later, must not
    start the same stage a second time (it would write the same outputs beside the caller's run)."""
    from tpgrpo.pipeline.execution import stage_server

    class Unchanged:
        def changed(self) -> str:
            return ""

    path = str(tmp_path / "server.sock")
    listener = _listener(path)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    client.connect(path)
    own = fingerprint(dict(os.environ))
    request = {"argv": ["tpgrpo", "stage", "credit"], "fingerprint": own}
    r, w = os.pipe()
    try:
        socket.send_fds(client, [json.dumps(request).encode()], [r, w, r])
        client.close()  # it gave up waiting
        children: dict = {}
        assert stage_server._accept(listener, own, Unchanged(), {}, children) is True  # goes on serving
        assert children == {}  # nothing forked
    finally:
        for fd in (r, w):
            os.close(fd)
        listener.close()


def test_a_stage_command_under_a_hung_server_runs_in_its_own_process(tmp_path):
    """End to end through the `tpgrpo` entry point: the command finishes (here: its own one-line refusal of an
    iteration with no inputs), after one warning line, instead of waiting forever. (Its stream descriptors stay
    in the never-accepted request until the server's socket closes, as when `tpgrpo run` ends its server: so
    the exit is awaited, then the socket closed, then the streams read.)"""
    path = str(tmp_path / "server.sock")
    listener = _listener(path)
    env = dict(os.environ, **{ENV_VAR: path, TIMEOUT_ENV: "1"})
    proc = subprocess.Popen([sys.executable, "-m", "tpgrpo", "stage", "credit", "--iter", "1"], cwd=tmp_path,
                            env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        code = proc.wait(timeout=600)
    finally:
        listener.close()
        proc.kill()
    lines = proc.communicate()[1].strip().splitlines()
    assert "sent no reply in 1 s" in lines[0], lines
    assert code != 0 and len(lines) == 2, lines  # the stage's own one-line error follows
