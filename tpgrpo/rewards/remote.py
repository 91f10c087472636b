"""The "remote" reward: score batches on a reward server (`tpgrpo serve-reward`, see `server.py`).

Protocol (JSON over HTTP POST to `remote_reward.url`):
  request  {"images": [{"png": BASE64} | {"raw": BASE64, "shape": [H, W, 3]}, ...], "metas": [dict, ...]}
  reply    {"rewards": [float, ...], "strict": [bool, ...] | null, "reward": NAME}   (one per image, in order)
  error    HTTP 4xx/5xx with {"error": "one line"}
The client sends `remote_reward.batch_size` images per request; a request that cannot connect, has no
complete reply within `timeout` s (the whole request: connecting, sending and every read, so a server that
trickles its reply cannot hold it longer) or gets HTTP 5xx is retried `retries` times, waiting `backoff`,
2 x `backoff`, ... seconds; then, or on HTTP 4xx or a malformed reply, it fails with one line naming the URL.
Proxies (http_proxy) are bypassed: the client connects to the configured address only (http.client).
"""

from __future__ import annotations

import base64
import contextlib
import http.client
import io
import json
import socket
import threading
import time
import urllib.parse
from pathlib import Path

import numpy as np

from tpgrpo.config import ConfigError
from tpgrpo.errors import RewardError
from tpgrpo.tasks.rewards import Reward

REPLY = 'JSON {"rewards": [one number per image], "strict": [one boolean per image] or null}'


def encode_images(images: np.ndarray, encoding: str = "png") -> list[dict]:
    """uint8 (N, H, W, 3) -> JSON-ready items: PNG (lossless) or raw bytes, base64."""
    items = []
    for img in images:
        if encoding == "raw":
            items.append({"raw": base64.b64encode(np.ascontiguousarray(img).tobytes()).decode(),
                          "shape": list(img.shape)})
            continue
        from PIL import Image

        buffer = io.BytesIO()
        Image.fromarray(img).save(buffer, format="PNG", compress_level=1)
        items.append({"png": base64.b64encode(buffer.getvalue()).decode()})
    return items


def decode_images(items: list) -> np.ndarray:
    """JSON items (see `encode_images`) -> uint8 (N, H, W, 3); ValueError (one line) on anything else."""
    from PIL import Image

    images = []
    for i, item in enumerate(items):
        try:
            if "raw" in item:
                h, w, c = (int(v) for v in item["shape"])
                img = np.frombuffer(base64.b64decode(item["raw"], validate=True), dtype=np.uint8).reshape(h, w, c)
            else:
                img = np.asarray(Image.open(io.BytesIO(base64.b64decode(item["png"], validate=True))).convert("RGB"))
        except Exception as exc:  # noqa: BLE001 - any decoding failure is a bad request
            raise ValueError(f"image {i}: expected {{'png': base64}} or {{'raw': base64, 'shape': [H, W, 3]}} "
                             f"({type(exc).__name__})") from None
        images.append(img)
    if len({img.shape for img in images}) > 1:
        raise ValueError("images of different shapes in one request")
    return np.stack(images) if images else np.zeros((0, 1, 1, 3), dtype=np.uint8)


def parse_reply(body: bytes, n: int, url: str) -> tuple[np.ndarray, np.ndarray | None]:
    """A server reply -> (rewards (n,) float64, strict (n,) bool or None); RewardError if malformed."""
    def bad(what: str) -> RewardError:
        return RewardError(f"reward server {url} replied with a malformed body ({what}): expected {REPLY}")

    try:
        reply = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        text = body[:60].decode("utf-8", "replace").replace("\n", " ")
        raise bad(f"not JSON: {text!r}") from None
    if not isinstance(reply, dict) or not isinstance(reply.get("rewards"), list):
        raise bad("no 'rewards' list")
    rewards, strict = reply["rewards"], reply.get("strict")
    if len(rewards) != n:
        raise bad(f"{len(rewards)} rewards for {n} images")
    if not all(isinstance(r, (int, float)) and not isinstance(r, bool) and np.isfinite(r) for r in rewards):
        raise bad("a reward that is not a finite number")
    if strict is not None and (not isinstance(strict, list) or len(strict) != n
                               or not all(isinstance(s, bool) for s in strict)):
        raise bad("'strict' is not null nor one boolean per image")
    return np.asarray(rewards, dtype=np.float64), None if strict is None else np.asarray(strict, dtype=bool)


class RemoteReward(Reward):
    """Scores on a reward server: any task (the server's reward checks it); strict as the server says."""

    name = "remote"
    task = None
    bounded = False

    def __init__(self, url: str, timeout: float = 120.0, retries: int = 3, backoff: float = 1.0,
                 batch_size: int = 64, encoding: str = "png"):
        self.url, self.timeout, self.retries, self.backoff = url, timeout, retries, backoff
        self.batch_size, self.encoding = batch_size, encoding

    @classmethod
    def from_config(cls, cfg, root: Path | None = None) -> RemoteReward:
        r = cfg.remote_reward
        if not r.url.startswith(("http://", "https://")):
            raise ConfigError(f"params: remote_reward.url = {r.url!r}: expected the http(s) URL of a reward "
                              "server (tpgrpo serve-reward), e.g. http://127.0.0.1:8765/score")
        return cls(r.url, r.timeout, r.retries, r.backoff, r.batch_size, r.encoding)

    def _score(self, images: np.ndarray, metas: list[dict]) -> tuple[np.ndarray, np.ndarray | None]:
        rewards, stricts = [], []
        for start in range(0, len(images), self.batch_size):
            chunk = images[start:start + self.batch_size]
            body = json.dumps({"images": encode_images(chunk, self.encoding),
                               "metas": metas[start:start + self.batch_size]}).encode()
            reward, strict = parse_reply(self._post(body), len(chunk), self.url)
            rewards.append(reward)
            stricts.append(strict)
        if any(s is None for s in stricts):
            return np.concatenate(rewards), None
        return np.concatenate(rewards), np.concatenate(stricts)

    def _post(self, body: bytes) -> bytes:
        """POST with bounded retries and exponential backoff; the reply body, or a one-line RewardError."""
        attempts, last = self.retries + 1, ""
        for attempt in range(attempts):
            if attempt:
                time.sleep(self.backoff * 2 ** (attempt - 1))
            try:
                status, reason, data = _post_once(self.url, body, self.timeout)
            except (OSError, http.client.HTTPException) as exc:  # refused, reset, timed out, bad HTTP
                last = f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
                continue
            if status < 400:
                return data
            last = f"HTTP {status}: {_server_message(data, reason)}"
            if status < 500:
                raise RewardError(f"reward server {self.url} refused the request ({last})") from None
        raise RewardError(f"reward server {self.url} unreachable or failing after {attempts} attempts "
                          f"(timeout {self.timeout:g} s; last: {last})")


def _post_once(url: str, body: bytes, timeout: float) -> tuple[int, str, bytes]:
    """One POST of ``body`` (JSON) to ``url``, bounded as a whole by ``timeout`` seconds; returns (status,
    reason, reply body). A socket timeout alone bounds each read, so a server sending a byte every few
    seconds could hold the request for ever: a timer shuts the socket down at the deadline, which ends any
    read in progress, and the request then raises ``TimeoutError``."""
    parts = urllib.parse.urlsplit(url)
    kind = http.client.HTTPSConnection if parts.scheme == "https" else http.client.HTTPConnection
    conn = kind(parts.hostname, parts.port, timeout=timeout)
    expired = threading.Event()

    def expire() -> None:
        expired.set()
        if conn.sock is not None:
            with contextlib.suppress(OSError):
                conn.sock.shutdown(socket.SHUT_RDWR)

    timer = threading.Timer(timeout, expire)
    timer.daemon = True
    deadline = time.monotonic() + timeout
    timer.start()
    try:
        conn.connect()
        conn.sock.settimeout(max(deadline - time.monotonic(), 1e-3))  # the timer may have fired during connect
        path = (parts.path or "/") + (f"?{parts.query}" if parts.query else "")
        conn.request("POST", path, body=body, headers={"Content-Type": "application/json"})
        response = conn.getresponse()
        data = response.read()
    except (OSError, http.client.HTTPException):
        if expired.is_set():
            raise TimeoutError(f"no complete reply within {timeout:g} s") from None
        raise
    finally:
        timer.cancel()
        conn.close()
    if expired.is_set():  # a reply without Content-Length reads as complete when the socket is shut down
        raise TimeoutError(f"no complete reply within {timeout:g} s")
    return response.status, response.reason, data


def _server_message(body: bytes, reason: str) -> str:
    """The one-line {"error": ...} of an error reply, else its first characters, else the HTTP reason."""
    try:
        return str(json.loads(body)["error"]).splitlines()[0]
    except (ValueError, KeyError, TypeError, IndexError):
        return body[:80].decode("utf-8", "replace").replace("\n", " ") or str(reason)
