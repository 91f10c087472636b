"""The remote reward against the reference server (127.0.0.1, ephemeral ports, servers in threads)."""

from __future__ import annotations

import json
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest

from tpgrpo.errors import RewardError
from tpgrpo.rewards.remote import RemoteReward, decode_images, encode_images
from tpgrpo.rewards.server import make_server
from tpgrpo.tasks.prompts import build_prompt_sets
from tpgrpo.tasks.render import render_prompt, render_violation
from tpgrpo.tasks.rewards import build_reward, get_reward

SETS = build_prompt_sets()
METAS = SETS["compositional_eval"][:10]


@pytest.fixture(scope="module")
def images():
    rng = np.random.default_rng(0)
    return np.stack([render_prompt(m, rng) if i % 2 else render_violation(m, "wrong_count", rng)
                     for i, m in enumerate(METAS)])


@contextmanager
def serving(server):
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}/score"
    finally:
        server.shutdown()
        server.server_close()


def client(url, **kwargs) -> RemoteReward:
    return RemoteReward(url, **{"timeout": 5.0, "retries": 2, "backoff": 0.01, **kwargs})


@pytest.mark.parametrize("encoding", ["png", "raw"])
def test_remote_returns_exactly_the_local_rewards(images, encoding):
    local = get_reward("geneval_soft")
    with serving(make_server(get_reward("geneval_soft"), quiet=True)) as url:
        remote = client(url, batch_size=3, encoding=encoding)(images, METAS)  # 4 requests: 3 + 3 + 3 + 1
    expected = local(images, METAS)
    np.testing.assert_array_equal(remote.reward, expected.reward)
    np.testing.assert_array_equal(remote.strict, expected.strict)
    assert remote.has_strict and 0 < expected.strict.sum() < len(METAS)


def test_remote_reward_without_strict_and_the_codec(images):
    with serving(make_server(get_reward("jpeg_compressibility"), quiet=True)) as url:
        result = client(url)(images, METAS)
    np.testing.assert_array_equal(result.reward, get_reward("jpeg_compressibility")(images, METAS).reward)
    assert not result.has_strict and not result.strict.any()
    for encoding in ("png", "raw"):
        np.testing.assert_array_equal(decode_images(encode_images(images, encoding)), images)


def test_server_down_is_a_clear_error_after_bounded_retries(images):
    with socket.socket() as s:  # a port nobody listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}/score"
    start = time.perf_counter()
    with pytest.raises(RewardError) as info:
        client(url, retries=2, backoff=0.05)(images[:2], METAS[:2])
    message = str(info.value)
    assert f"reward server {url} unreachable or failing after 3 attempts" in message and "\n" not in message
    assert "ConnectionRefusedError" in message
    assert 0.15 <= time.perf_counter() - start < 5  # waited 0.05 + 0.1 s between the attempts


class Scripted(BaseHTTPRequestHandler):
    """Replies from a script: a list of (status, body) consumed one per request."""

    script: list = []
    requests: list = []

    def do_POST(self):  # noqa: N802
        self.requests.append(json.loads(self.rfile.read(int(self.headers["Content-Length"]))))
        status, body = self.script.pop(0) if len(self.script) > 1 else self.script[0]
        self.send_response(status)
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


def scripted(replies):
    handler = type("Handler", (Scripted,), {"script": list(replies), "requests": []})
    return ThreadingHTTPServer(("127.0.0.1", 0), handler), handler


@pytest.mark.parametrize("body, what", [
    (b"<html>hello</html>", "not JSON: '<html>hello</html>'"),
    (b'{"scores": [1, 2]}', "no 'rewards' list"),
    (b'{"rewards": [0.5]}', "1 rewards for 2 images"),
    (b'{"rewards": [0.5, NaN], "strict": null}', "a reward that is not a finite number"),
    (b'{"rewards": [0.5, "x"], "strict": null}', "a reward that is not a finite number"),
    (b'{"rewards": [0.5, 0.1], "strict": [true]}', "'strict' is not null nor one boolean per image"),
])
def test_garbage_reply_is_a_clear_error(images, body, what):
    server, handler = scripted([(200, body)])
    with serving(server) as url, pytest.raises(RewardError) as info:
        client(url)(images[:2], METAS[:2])
    message = str(info.value)
    assert message.startswith(f"reward server {url} replied with a malformed body ({what})"), message
    assert "expected JSON" in message and "\n" not in message
    assert len(handler.requests) == 1  # garbage is not retried


def test_http_5xx_is_retried_then_succeeds_and_4xx_is_not(images):
    good = json.dumps({"rewards": [0.25, 0.5], "strict": [False, True]}).encode()
    server, handler = scripted([(503, b'{"error": "warming up"}'), (500, b"oops"), (200, good)])
    with serving(server) as url:
        result = client(url, retries=2)(images[:2], METAS[:2])
        assert result.reward.tolist() == [0.25, 0.5] and result.strict.tolist() == [False, True]
        assert len(handler.requests) == 3 and len(handler.requests[0]["images"]) == 2
        assert handler.requests[0]["metas"] == METAS[:2]
    server, handler = scripted([(500, b'{"error": "model crashed"}')])
    with serving(server) as url, pytest.raises(RewardError, match=r"after 2 attempts .*HTTP 500: model crashed"):
        client(url, retries=1)(images[:2], METAS[:2])


def test_the_server_refuses_bad_requests_with_one_line(images):
    with serving(make_server(get_reward("geneval"), quiet=True)) as url:
        with pytest.raises(RewardError, match=r"refused the request \(HTTP 400: reward geneval: .*'text'"):
            client(url)(images[:1], SETS["text_eval"][:1])  # another task's prompt
        import urllib.request

        request = urllib.request.Request(url, data=b'{"images": [{"png": "!!"}], "metas": [{}]}', method="POST")
        with pytest.raises(urllib.error.HTTPError) as info:
            urllib.request.build_opener(urllib.request.ProxyHandler({})).open(request, timeout=5)
        assert info.value.code == 400 and b"image 0: expected" in info.value.read()


def test_remote_from_config_and_in_a_combination(images):
    import dataclasses

    from tpgrpo.config import Config, ConfigError

    cfg = Config()
    with pytest.raises(ConfigError, match="params: remote_reward.url = '': expected the http"):
        build_reward("remote", cfg)
    with serving(make_server(get_reward("geneval"), quiet=True)) as url:
        cfg = dataclasses.replace(cfg, remote_reward=dataclasses.replace(cfg.remote_reward, url=url, batch_size=4))
        combined = build_reward({"jpeg_compressibility": 1.0, "remote": 2.0}, cfg)(images, METAS)
    local = get_reward("geneval")(images, METAS)
    jpeg = get_reward("jpeg_compressibility")(images, METAS)
    np.testing.assert_allclose(combined.reward, jpeg.reward + 2.0 * local.reward)
    np.testing.assert_array_equal(combined.strict, local.strict)  # the first component with strict: remote's


def test_serve_reward_command_serves_a_registered_reward(tmp_path, images):
    """`tpgrpo serve-reward` in a subprocess (port 0: it prints the URL it bound)."""
    process = subprocess.Popen([sys.executable, "-m", "tpgrpo", "serve-reward", "--reward", "geneval", "--port", "0",
                                "--params", str(tmp_path / "none.yaml")],
                               stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        line = process.stdout.readline()
        assert line.startswith("serving reward geneval at http://127.0.0.1:"), line + process.stderr.read()
        result = client(line.split()[-1])(images, METAS)
        np.testing.assert_array_equal(result.reward, get_reward("geneval")(images, METAS).reward)
    finally:
        process.terminate()
        process.wait(timeout=10)
    failed = subprocess.run([sys.executable, "-m", "tpgrpo", "serve-reward", "--reward", "pickscor",
                             "--params", str(tmp_path / "none.yaml")], capture_output=True, text=True)
    assert failed.returncode == 2 and failed.stderr.startswith("error: unknown reward 'pickscor'")
    assert failed.stderr.count("\n") == 1


class Trickling(BaseHTTPRequestHandler):
    """Answers every request correctly, but one byte at a time, 0.05 s apart (in the headers or in the body):
    each read gets a byte well within the client's timeout, the whole reply takes 2-4 s. Stops at the end of
    the reply, or as soon as the client has gone."""

    where = "body"
    requests: list = []

    def do_POST(self):  # noqa: N802
        self.requests.append(time.monotonic())
        self.rfile.read(int(self.headers["Content-Length"]))
        body = json.dumps({"rewards": [0.25, 0.5], "strict": None}).encode()
        head = (f"HTTP/1.1 200 OK\r\nContent-Length: {len(body)}\r\n\r\n").encode()
        whole, slow_from = head + body, (0 if self.where == "headers" else len(head))
        try:
            self.wfile.write(whole[:slow_from])
            for k in range(slow_from, len(whole)):
                self.wfile.write(whole[k:k + 1])
                self.wfile.flush()
                time.sleep(0.05)
        except OSError:
            pass  # the client gave up: stop
        self.close_connection = True

    def log_message(self, *args):
        pass


@pytest.mark.parametrize("where", ["headers", "body"])
def test_the_timeout_bounds_the_whole_request_not_each_read(images, where):
    handler = type("Handler", (Trickling,), {"where": where, "requests": []})
    with serving(ThreadingHTTPServer(("127.0.0.1", 0), handler)) as url:
        start = time.monotonic()
        with pytest.raises(RewardError) as info:  # each read waits 0.05 s, the whole reply 2-4 s
            client(url, timeout=0.3, retries=1, backoff=0.01)(images[:2], METAS[:2])
        took = time.monotonic() - start
        message = str(info.value)
        assert "after 2 attempts (timeout 0.3 s; last: TimeoutError: no complete reply within 0.3 s)" in message
        assert "\n" not in message
        assert len(handler.requests) == 2 and took < 1.5, took  # 2 x 0.3 s, not 2 x the trickle
        if where == "body":  # a patient client gets the whole reply: the server is slow, not broken
            assert client(url, timeout=30.0, retries=0)(images[:2], METAS[:2]).reward.tolist() == [0.25, 0.5]
