"""The stage server: stage commands forked from it write the same bytes as stage processes of their own,
pass exit codes, errors and signals through, and fall back to running themselves when it cannot take them."""

from __future__ import annotations

import hashlib
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import yaml
from conftest import REPO, tiny_params

from tpgrpo.pipeline.execution.stage_server import ENV_VAR, running

TPGRPO = str(Path(sys.executable).parent / "tpgrpo")  # the console script, as DVC calls it
pytestmark = pytest.mark.skipif(not sys.platform.startswith("linux"), reason="the stage server is Linux-only")


def digest(folder: Path) -> str:
    """md5 over every file under ``folder`` (relative names and bytes, sorted)."""
    h = hashlib.md5()
    for path in sorted(p for p in folder.rglob("*") if p.is_file()):
        h.update(str(path.relative_to(folder)).encode())
        h.update(path.read_bytes())
    return h.hexdigest()


def make_project(root: Path, model_dir: Path) -> Path:
    """Params, prompts and model only: the stage commands find the code where the `tpgrpo` command does."""
    import shutil

    (root / "data").mkdir(parents=True)
    shutil.copytree(REPO / "data" / "prompts", root / "data" / "prompts")
    shutil.copytree(model_dir, root / "data" / "base")
    (root / "params.yaml").write_text(yaml.safe_dump(tiny_params(), sort_keys=False))
    return root


def base_env() -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if k != ENV_VAR}
    return dict(env, OMP_NUM_THREADS="1", DVC_NO_ANALYTICS="1", DVC_STUDIO_OFFLINE="true")


def stage(root: Path, env: dict, *args: str, check: bool = True) -> subprocess.CompletedProcess:
    done = subprocess.run([TPGRPO, "stage", *args], cwd=root, env=env, capture_output=True, text=True)
    if check:
        assert done.returncode == 0, done.stderr
    return done


def log_lines(root: Path) -> list[str]:
    return (root / ".dvc" / "tmp" / "stage_server.log").read_text().splitlines()


@pytest.fixture(scope="module")
def served(tmp_path_factory, tiny_model_dir):
    """A project with a server running for it (the test process is its parent), and the server's env."""
    root = make_project(tmp_path_factory.mktemp("served") / "project", tiny_model_dir)
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")  # the server inherits our environment; the callers use base_env()
        model = {"kind": "tiny", "path": str(root / "data" / "base"), "device": "cpu", "dtype": "fp32", "resolution": 0}
        with running(root, model=model) as extra:  # launch.resident_model on
            yield root, {**base_env(), **extra}


def test_served_stages_write_the_bytes_of_stage_processes_of_their_own(served, tmp_path, tiny_model_dir):
    root, env = served
    plain = make_project(tmp_path / "plain", tiny_model_dir)
    for args in (["rollout", "--iter", "1"], ["probe", "--iter", "1"], ["credit", "--iter", "1"],
                 ["update", "--iter", "1"]):
        stage(root, env, *args)
        stage(plain, base_env(), *args)
    ready = next(line for line in log_lines(root) if "ready" in line)
    # the stages forked with it, from a server that never initialised CUDA
    assert ready.endswith(f"model held: tiny {root / 'data' / 'base'} (fp32); CUDA initialised: False")
    forked = [line for line in log_lines(root) if line.startswith("forked")]
    assert [line.split(": ", 1)[1] for line in forked][:4] == [
        "stage rollout --iter 1", "stage probe --iter 1", "stage credit --iter 1", "stage update --iter 1"]
    for name in ("trajectories.zarr", "prompt_embeds.safetensors", "probe.parquet", "credit.parquet", "policy"):
        a, b = root / "data" / "iters" / "0001" / name, plain / "data" / "iters" / "0001" / name
        assert (digest(a) if a.is_dir() else a.read_bytes()) == (digest(b) if b.is_dir() else b.read_bytes()), name


def test_a_served_error_is_the_same_one_line_and_exit_code(served):
    root, env = served
    served_run = stage(root, env, "credit", "--iter", "99", check=False)
    plain_run = stage(root, base_env(), "credit", "--iter", "99", check=False)
    assert served_run.returncode == plain_run.returncode == 2
    assert served_run.stderr == plain_run.stderr
    assert served_run.stderr.startswith("error: --iter 99:") and served_run.stderr.count("\n") == 1
    assert log_lines(root)[-1].endswith("stage credit --iter 99")


def test_the_server_keeps_no_descriptor_of_a_finished_stage(served):
    """Each forked stage gets a pidfd that wakes the server when it exits; reaping it closes that pidfd and
    the caller's socket, so a long run's server holds as many descriptors after a stage as before it."""
    root, env = served
    stage(root, env, "credit", "--iter", "99", check=False)  # one stage first: lazy descriptors open once
    server = int(next(line for line in log_lines(root) if "ready" in line).split()[2].rstrip(":"))
    before = len(os.listdir(f"/proc/{server}/fd"))
    for _ in range(3):
        stage(root, env, "credit", "--iter", "99", check=False)
    assert len(os.listdir(f"/proc/{server}/fd")) == before


def test_a_childs_exit_wakes_the_servers_select_and_its_reaping_closes_the_pidfd():
    """The server waits on a pidfd per child (instead of finding exits at its 50 ms tick): readable once
    the child has exited; reap then collects the child and closes its pidfd."""
    import select

    from tpgrpo.pipeline.execution.stage_children import reap, watch_exits

    pid = os.fork()
    if pid == 0:
        os._exit(3)
    children, exits = {pid: None}, {}
    watch_exits(children, exits)
    assert set(exits) == {pid}
    fd = exits[pid]
    assert _pidfds() == [fd]
    ready, _, _ = select.select([fd], [], [], 30)
    assert ready == [fd]
    reap(children, exits)
    assert children == {} and exits == {}
    assert _pidfds() == []


def test_a_served_stage_returns_at_its_exit_not_at_the_servers_tick(tmp_path, tiny_model_dir):
    """With the parent check's tick at 120 s, a served stage still returns within seconds: its exit wakes
    the server (a server that found exits only at its tick would keep the caller 120 s)."""
    from tpgrpo.pipeline.execution.stage_server import _wait_for_socket

    root = make_project(tmp_path / "project", tiny_model_dir)
    path = str(tmp_path / "s.sock")
    code = ("import sys; sys.path.remove(''); from tpgrpo.pipeline.execution.stage_server import serve; "
            f"serve({path!r}, {os.getpid()}, names=(), tick=120)")
    server = subprocess.Popen([sys.executable, "-c", code], cwd=root, env=base_env(), stdin=subprocess.DEVNULL,
                              stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        _wait_for_socket(server, path)  # else the first caller finds no socket and runs the stage itself
        env = dict(base_env(), **{ENV_VAR: path})
        for _ in range(2):
            done = subprocess.run([TPGRPO, "stage", "credit", "--iter", "99"], cwd=root, env=env,
                                  capture_output=True, text=True, timeout=60)
            assert done.returncode == 2 and done.stderr.startswith("error: --iter 99:")
    finally:
        server.terminate()
        log = server.communicate(timeout=30)[0]
    assert log.count("forked") == 2, log  # served, not run by the caller itself


def _pidfds() -> list[int]:
    """This process's open pidfds."""
    found = []
    for name in os.listdir("/proc/self/fd"):
        try:
            if os.readlink(f"/proc/self/fd/{name}") == "anon_inode:[pidfd]":
                found.append(int(name))
        except OSError:  # the listing's own descriptor, closed by now
            pass
    return found


def test_a_caller_with_another_thread_count_runs_the_stage_itself(served):
    root, env = served
    done = stage(root, dict(env, OMP_NUM_THREADS="2"), "credit", "--iter", "99", check=False)
    assert done.returncode == 2 and done.stderr.startswith("error: --iter 99:")
    assert "environment differs in OMP_NUM_THREADS" in log_lines(root)[-1]


def test_without_a_reachable_server_the_caller_runs_the_stage_itself(tmp_path):
    done = subprocess.run([TPGRPO, "stage", "credit", "--iter", "1", "--params", str(tmp_path / "none.yaml")],
                          env=dict(base_env(), **{ENV_VAR: str(tmp_path / "gone.sock")}), capture_output=True,
                          text=True)
    assert done.returncode == 2 and "none.yaml" in done.stderr  # the CLI's own error, from the caller


def test_a_caller_that_comes_the_moment_the_server_starts_is_served(tmp_path):
    import socket

    (tmp_path / ".dvc").mkdir()
    with running(tmp_path) as extra:  # the first stage of a run comes this early: it must not find no socket
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_SEQPACKET)
        probe.connect(extra[ENV_VAR])  # raises FileNotFoundError/ConnectionRefusedError if not listening yet
        probe.close()


def _served_rollout(root: Path, env: dict) -> tuple[subprocess.Popen, int]:
    """Start a rollout through the server; returns its caller and the forked stage's PID."""
    before = len(log_lines(root))
    caller = subprocess.Popen([TPGRPO, "stage", "rollout", "--iter", "1", "--params", "params.yaml"], cwd=root,
                              env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline, pid = time.time() + 60, None
    while pid is None and time.time() < deadline:
        new = [line for line in log_lines(root)[before:] if line.startswith("forked")]
        pid = int(new[0].split()[1].rstrip(":")) if new else None
        time.sleep(0.05)
    assert pid is not None
    return caller, pid


def _ends(pid: int) -> bool:
    """Whether process ``pid`` is gone within 10 s (the server reaps its children)."""
    for _ in range(200):
        if not Path(f"/proc/{pid}").exists():
            return True
        time.sleep(0.05)
    return False


def test_a_signal_to_the_caller_reaches_the_forked_stage(served):
    caller, pid = _served_rollout(*served)
    caller.send_signal(signal.SIGTERM)
    assert caller.wait(timeout=30) == -signal.SIGTERM  # died of the signal the stage died of
    assert _ends(pid)


def test_a_caller_killed_outright_takes_its_forked_stage_with_it(served):
    caller, pid = _served_rollout(*served)
    caller.kill()  # SIGKILL: the caller cannot forward it; the server sees its socket close
    caller.wait()
    assert _ends(pid)
    assert f"caller of {pid} gone: terminating it" in log_lines(served[0])


def test_the_server_exits_when_its_parent_is_killed(tmp_path):
    (tmp_path / ".dvc").mkdir()
    parent = subprocess.Popen([sys.executable, "-c", (
        "import os, signal, sys, time; from pathlib import Path\n"
        "from tpgrpo.pipeline.execution.stage_server import running\n"
        "with running(Path(sys.argv[1])):\n"
        "    time.sleep(600)\n"), str(tmp_path)], env=base_env())
    log = tmp_path / ".dvc" / "tmp" / "stage_server.log"
    deadline = time.time() + 120
    while not (log.is_file() and "ready" in log.read_text()) and time.time() < deadline:
        time.sleep(0.1)
    server = int(log.read_text().split()[2].rstrip(":"))
    parent.kill()
    parent.wait()
    for _ in range(600):  # 30 s: its exit (torch's teardown) took over 5 s under load 4.5 beside two runs
        if _state(server) in ("gone", "Z"):  # exited (a zombie until init reaps it)
            break
        time.sleep(0.05)
    assert _state(server) in ("gone", "Z")


def _state(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except FileNotFoundError:
        return "gone"


@pytest.mark.slow
def test_tpgrpo_run_forks_every_stage_and_writes_what_it_writes_without_the_server(tmp_path, tiny_model_dir):
    from conftest import make_tiny_project

    runs = {}
    for server in (True, False):
        root = make_tiny_project(tmp_path / f"server_{server}", tiny_model_dir)
        params = yaml.safe_load((root / "params.yaml").read_text())
        params["launch"]["stage_server"] = params["launch"]["resident_model"] = server
        (root / "params.yaml").write_text(yaml.safe_dump(params, sort_keys=False))
        env = dict(base_env(), PATH=str(Path(sys.executable).parent) + os.pathsep + os.environ["PATH"])
        done = subprocess.run([sys.executable, "-m", "tpgrpo", "run"], cwd=root, env=env, capture_output=True,
                              text=True)
        assert done.returncode == 0, done.stderr[-2000:]
        runs[server] = root
    forked = [line.split(": ", 1)[1] for line in log_lines(runs[True]) if line.startswith("forked")]
    expected = ["stage code", "stage eval_prompts", "stage baseline", *(f"stage {s} --iter {i}" for i in (1, 2)
                                    for s in ("rollout", "probe", "credit", "update", "eval")), "stage summary"]
    assert forked == expected  # every stage DVC ran went through the server, none was refused
    assert not (runs[False] / ".dvc" / "tmp" / "stage_server.log").exists()
    for name in ("eval_prompt_embeds", "baseline_eval.parquet", "0002/probe.parquet", "0002/credit.parquet",
                 "0002/eval.parquet", "0002/policy"):
        a, b = (runs[s] / "data" / "iters" / name for s in (True, False))
        assert (digest(a) if a.is_dir() else a.read_bytes()) == (digest(b) if b.is_dir() else b.read_bytes()), name


def test_after_a_code_edit_the_server_refuses_and_the_stage_runs_the_new_code(tmp_path, tiny_model_dir):
    """The server imported the code when it started: once a file under tpgrpo/ or stages/ changes, a stage
    it forked would run the old modules while DVC records the new code. It must refuse (the caller then runs
    the stage in a fresh process) and stop serving. The server runs a copy of the code here (PYTHONPATH), so
    the edit touches no file of the checkout."""
    import shutil

    code = tmp_path / "code"
    for package in ("tpgrpo", "stages"):
        shutil.copytree(REPO / package, code / package, ignore=shutil.ignore_patterns("__pycache__"))
    root = make_project(tmp_path / "project", tiny_model_dir)
    env = dict(base_env(), PYTHONPATH=str(code))
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("OMP_NUM_THREADS", "1")
        patch.setenv("PYTHONPATH", str(code))
        with running(root) as extra:
            env.update(extra)
            first = stage(root, env, "credit", "--iter", "99", check=False)
            assert first.stderr.startswith("error: --iter 99: this run has iterations"), first.stderr
            assert log_lines(root)[-1].endswith("stage credit --iter 99")  # served, from the copy
            # imported by the server at start (PRELOAD)
            cli = code / "tpgrpo" / "pipeline" / "execution" / "stage_runner.py"
            text = cli.read_text()
            assert 'typer.echo(f"error: {message}", err=True)' in text
            cli.write_text(text.replace('typer.echo(f"error: {message}"', 'typer.echo(f"error (edited): {message}"'))
            second = stage(root, env, "credit", "--iter", "99", check=False)
            assert second.stderr.startswith("error (edited): --iter 99: this run"), second.stderr  # the new code
            assert second.returncode == 2
            last = log_lines(root)[-1]
            assert last.startswith("refused") and f"code changed since the server started ({cli})" in last
            assert not Path(extra[ENV_VAR]).exists()  # it stopped listening: later stages run themselves
            stage(root, env, "credit", "--iter", "99", check=False)
            assert log_lines(root)[-1] == last


def test_code_state_sees_edits_new_files_and_distributions_but_not_a_touch(tmp_path, monkeypatch):
    from tpgrpo.pipeline.execution.processes import CodeState

    (tmp_path / "pkg").mkdir()
    module = tmp_path / "pkg" / "m.py"
    module.write_text("X = 1\n")
    site = tmp_path / "site"
    (site / "lib-1.0.dist-info").mkdir(parents=True)
    monkeypatch.syspath_prepend(str(site))
    state = CodeState([str(tmp_path / "pkg")])
    assert state.changed() == ""
    os.utime(module, ns=(time.time_ns() + 10**9,) * 2)  # touched: same bytes
    assert state.changed() == ""
    module.write_text("X = 2\n")  # same size, other bytes
    assert state.changed() == str(module)
    state = CodeState([str(tmp_path / "pkg")])
    (site / "lib-1.0.dist-info").rename(site / "lib-1.1.dist-info")  # an upgrade
    assert state.changed() == str(site / "lib-1.0.dist-info")
    state = CodeState([str(tmp_path / "pkg")])
    (tmp_path / "pkg" / "new.py").write_text("")
    assert state.changed() == str(tmp_path / "pkg" / "new.py")


def test_the_server_is_wanted_only_when_the_model_and_the_reward_models_run_on_the_cpu():
    import dataclasses

    from tpgrpo.config import Config
    from tpgrpo.pipeline.execution.stage_server import wanted

    cfg = Config()
    cfg = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, stage_server=True))
    assert wanted(cfg)
    assert not wanted(dataclasses.replace(cfg, model=dataclasses.replace(cfg.model, device="cuda")))
    assert not wanted(dataclasses.replace(cfg, reward_models=dataclasses.replace(cfg.reward_models, device="cuda")))
    held = dataclasses.replace(cfg, launch=dataclasses.replace(cfg.launch, resident_model=True))
    assert wanted(dataclasses.replace(held, model=dataclasses.replace(cfg.model, device="cuda")))  # opted in
    assert not wanted(dataclasses.replace(held, launch=dataclasses.replace(held.launch, stage_server=False),
                                          model=dataclasses.replace(cfg.model, device="cuda")))


def test_once_cuda_is_initialised_the_server_refuses_and_stops_serving(tmp_path, monkeypatch):
    """A process forked after CUDA was initialised cannot use the GPU: the server then answers with a refusal
    (the caller runs the stage itself) and stops forking, as after a code change."""
    import json
    import socket

    from tpgrpo.pipeline.execution import stage_server
    from tpgrpo.pipeline.execution.stage_client import fingerprint

    class Unchanged:
        def changed(self) -> str:
            return ""

    monkeypatch.setattr(stage_server, "cuda_initialised", lambda: True)
    listener, client = _listener_and_client(tmp_path)
    own = fingerprint(dict(os.environ))
    request = {"argv": ["tpgrpo", "stage", "credit"], "fingerprint": own}
    r, w = os.pipe()
    try:
        socket.send_fds(client, [json.dumps(request).encode()], [r, w, r])
        before = sorted(os.listdir("/proc/self/fd"))
        children: dict = {}
        assert stage_server._accept(listener, own, Unchanged(), {}, children) is False  # stops serving
        assert children == {} and sorted(os.listdir("/proc/self/fd")) == before  # nothing forked or leaked
        answer = json.loads(client.recv(1 << 16))
        assert "CUDA" in answer["refused"]
    finally:
        for fd in (r, w):
            os.close(fd)
        client.close()
        listener.close()


def test_cuda_initialised_reads_torch_without_initialising_it():
    import torch

    from tpgrpo.pipeline.execution.stage_server import cuda_initialised

    assert cuda_initialised() is False and not torch.cuda.is_initialized()


def test_an_open_gpu_device_file_counts_as_cuda_initialised(tmp_path, monkeypatch):
    """The driver initialised under another library (torch does not know) shows as an open device file."""
    from tpgrpo.pipeline.execution import stage_server

    monkeypatch.setattr(stage_server, "NVIDIA_DEVICES", str(tmp_path / "nvidia"))
    (tmp_path / "nvidiactl").write_text("")
    assert not stage_server.cuda_initialised()
    with open(tmp_path / "nvidiactl"):
        assert stage_server.cuda_initialised()
    assert not stage_server.cuda_initialised()


def _listener_and_client(tmp_path):
    """A listening Unix socket, as the server's, and a client connected to it."""
    import socket

    path = str(tmp_path / "s.sock")
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path)
    listener.listen(1)
    client = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    client.connect(path)
    return listener, client


@pytest.mark.parametrize("message", [b"not json", b"[1, 2]", b"\xff\xfe"])
def test_a_malformed_request_leaks_no_file_descriptor(tmp_path, message):
    """A request the server cannot read is answered by closing it, with the three descriptors it carried
    (before: each bad request left them open in the server; a JSON list crashed it)."""
    import socket

    from tpgrpo.pipeline.execution.stage_server import _accept

    listener, client = _listener_and_client(tmp_path)
    r, w = os.pipe()
    try:
        socket.send_fds(client, [message], [r, w, r])
        before = sorted(os.listdir("/proc/self/fd"))
        assert _accept(listener, {}, None, {}, {}) is True  # goes on serving
        assert sorted(os.listdir("/proc/self/fd")) == before
        assert client.recv(1) == b""  # closed: the caller reads EOF
    finally:
        for fd in (r, w):
            os.close(fd)
        client.close()
        listener.close()


def test_the_server_holds_the_model_at_any_thread_count_and_keeps_the_count(tiny_model_dir):
    """The server loads on one thread (no OpenMP pool started: a stage forked after one hung) and puts the
    run's thread count back for the stages it forks (tests/test_resident_model.py forks one at 2 threads)."""
    import torch

    from tpgrpo.models import load_backend, resident
    from tpgrpo.models.resident import hold_for_stages

    model = {"kind": "tiny", "path": str(tiny_model_dir), "device": "cpu", "dtype": "fp32", "resolution": 0}
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(2)
        assert hold_for_stages(load_backend, model).startswith("tiny ") and resident.held_key() is not None
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
        resident.release()
