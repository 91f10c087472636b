"""Process lifetimes: a killed run leaves no stage running on through the stage server,
a caller that leaves early does not end the server, and a writer never deletes another live writer's
temporary file."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from test_stage_server import TPGRPO, base_env, log_lines, make_project

from tpgrpo.pipeline.execution.stage_server import ENV_VAR, MAX_MESSAGE, fingerprint, running

pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stage server is Linux-only")

# Stands in for `tpgrpo run`: starts the server, prints its socket, waits to be killed.
FAKE_RUN = ("import sys, time; from pathlib import Path; from tpgrpo.pipeline.execution.stage_server import running\n"
            "with running(Path(sys.argv[1])) as env:\n"
            "    print(env['TPGRPO_STAGE_SERVER'], flush=True)\n"
            "    time.sleep(600)\n")


def _state(pid: int) -> str:
    """The process's state letter (R, S, Z, ...) or "gone"."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


def _ended(pid: int, within: float = 120.0) -> bool:
    """Whether ``pid`` exits (gone or a zombie): waits for that event, polling its state; ``within`` only
    bounds a process that never ends (a loaded machine slows the exit, it does not change it)."""
    deadline = time.monotonic() + within
    while _state(pid) not in ("gone", "Z"):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


def _wait_for_note(root: Path, pid: int, state: str, within: float = 300.0) -> bool:
    """Wait until process ``pid`` notes ``state`` in data/.last_stage.json (the stage runner writes it once the
    stage's checks passed and its work starts), or ``pid`` ends first (False)."""
    note, deadline = root / "data" / ".last_stage.json", time.monotonic() + within
    while time.monotonic() < deadline and _state(pid) not in ("gone", "Z"):
        try:
            last = json.loads(note.read_text())
        except (OSError, ValueError):
            last = {}
        if last.get("pid") == pid and last.get("state") == state:
            return True
        time.sleep(0.02)
    return False


def _request(path: str, root: Path, env: dict, *args: str) -> socket.socket:
    """Send ``tpgrpo stage ARGS`` to the server as its caller would (streams: /dev/null); returns the socket."""
    request = {"argv": [TPGRPO, "stage", *args], "cwd": str(root), "env": env, "fingerprint": fingerprint(env)}
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    sock.connect(path)
    with open(os.devnull, "r+b") as null:
        socket.send_fds(sock, [json.dumps(request).encode()], [null.fileno()] * 3)
    return sock


@pytest.mark.parametrize("kill", ["process group", "run process only"])
def test_a_killed_run_leaves_no_stage_running_and_no_artifact_written(tmp_path, tiny_model_dir, kill):
    """SIGKILL the run (its process group, or only its process) while the server runs a rollout for it. The
    caller here is this test, which never ends the stage itself: the server and the stage must die with the
    run, and no rollout artifact may appear afterwards."""
    root = make_project(tmp_path / "project", tiny_model_dir)
    params = yaml.safe_load((root / "params.yaml").read_text())
    params["rollout"]["prompts_per_iter"] = 12  # a rollout of a few seconds, so that the kill lands inside it
    (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
    env = base_env()
    run = subprocess.Popen([sys.executable, "-c", FAKE_RUN, str(root)], env=env, stdout=subprocess.PIPE,
                           text=True, start_new_session=True)  # a group of its own, as a shell gives a job
    try:
        path = run.stdout.readline().strip()
        caller = _request(path, root, {**env, ENV_VAR: path}, "rollout", "--iter", "1", "--params", "params.yaml")
        stage = int(json.loads(caller.recv(MAX_MESSAGE))["pid"])  # waits while the server imports
        server = int(next(line for line in log_lines(root) if line.startswith("stage server")).split()[2][:-1])
        # the kill lands inside the rollout: once it noted that it runs (not after a fixed sleep, which a
        # loaded machine can outlast before the stage even starts its work)
        assert _wait_for_note(root, stage, "running"), f"the rollout {stage} ended before it started its work"
        assert _state(server) not in ("gone", "Z")
        os.killpg(run.pid, signal.SIGKILL) if kill == "process group" else run.kill()
        run.wait()
        assert _ended(stage), f"the forked rollout {stage} runs on after the run was killed"
        assert _ended(server), f"the stage server {server} runs on after the run was killed"
        # both have ended, and nothing else writes here: what is on disk now is what the killed run left
        folder = root / "data" / "iters" / "0001"
        assert not (folder / "rollout.json").exists() and not (folder / "trajectories.zarr").exists()
        assert json.loads((root / "data" / ".last_stage.json").read_text())["state"] != "done"
        caller.close()
    finally:
        if run.poll() is None:
            os.killpg(run.pid, signal.SIGKILL)
            run.wait()


def test_a_caller_that_leaves_before_the_reply_does_not_end_the_server(tmp_path, tiny_model_dir):
    root = make_project(tmp_path / "project", tiny_model_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        with running(root) as extra:
            env = {**base_env(), **extra}
            # sent while the server still imports, gone before it can answer: its reply meets a closed socket
            _request(extra[ENV_VAR], root, env, "credit", "--iter", "99").close()
            done = subprocess.run([TPGRPO, "stage", "credit", "--iter", "99"], cwd=root, env=env,
                                  capture_output=True, text=True)
            assert done.returncode == 2 and done.stderr.startswith("error: --iter 99:"), done.stderr
            lines = log_lines(root)
    forked = [line for line in lines if line.startswith("forked")]
    # the first caller's request is refused when the server sees it gone before forking (the usual case: it left
    # while the server imported), else its stage is forked and terminated at the failed reply
    refused = any("its caller left before the reply" in line for line in lines)
    assert len(forked) == (1 if refused else 2), lines  # the second caller was served: the server outlived the first
    if not refused:
        first = int(forked[0].split()[1][:-1])
        assert f"caller of {first} gone: terminating it" in lines
    assert not any("Traceback" in line for line in lines), lines


def test_a_writer_keeps_the_temporary_of_a_live_writer_and_removes_a_dead_ones(tmp_path):
    from tpgrpo.io.artifacts import atomic_path

    target = tmp_path / "out.json"
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = [tmp_path / f".out.json.tmp-{dead.pid}-0000abcd", tmp_path / ".out.json.tmp-0000abcd"]  # old name
    for path in stale:
        path.write_text("left by a killed run")
    # another process that is writing the same artifact right now, slowly
    writer = subprocess.Popen([sys.executable, "-c", (
        "import sys, time; from pathlib import Path; from tpgrpo.io.artifacts import atomic_path\n"
        "with atomic_path(Path(sys.argv[1])) as tmp:\n"
        "    tmp.write_text('theirs'); print('writing', flush=True); time.sleep(1.5)\n"), str(target)],
        stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    assert writer.stdout.readline() == "writing\n"
    with atomic_path(target) as tmp:
        tmp.write_text("ours")
    assert target.read_text() == "ours" and not any(p.exists() for p in stale)
    out, err = writer.communicate(timeout=30)
    assert writer.returncode == 0, err  # its temporary was still there to rename
    assert target.read_text() == "theirs"
    assert not [p.name for p in tmp_path.iterdir() if ".tmp-" in p.name]
