"""The "remote" reward: score batches on a reward server (`tpgrpo serve-reward`, see `server.py`).

Protocol (JSON over HTTP POST to `remote_reward.url`):
  request  {"images": [{"png": BASE64} | {"raw": BASE64, "shape": [H, W, 3]}, ...], "metas": [dict, ...]}
  reply    {"rewards": [float, ...], "strict": [bool, ...] | null, "reward": NAME}   (one per image, in order)
  error    HTTP 4xx/5xx with {"error": "one line"}
The client sends `remote_reward.batch_size` images per request; a request that cannot connect, times
out (`timeout` s) or gets HTTP 5xx is retried `retries` times, waiting `backoff`, 2 x `backoff`, ...
seconds; then, or on HTTP 4xx or a malformed reply, it fails with one line naming the URL. Proxies
(http_proxy) are bypassed: the client connects to the configured address only.
"""

from __future__ import annotations

import base64
import http.client
import io
import json
import time
import urllib.error
import urllib.request
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
        # Direct connections only: no proxy from the environment between us and the configured address.
        self._opener = urllib.request.build_opener(urllib.request.ProxyHandler({}))

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
            request = urllib.request.Request(self.url, data=body, method="POST",
                                             headers={"Content-Type": "application/json"})
            try:
                with self._opener.open(request, timeout=self.timeout) as response:
                    return response.read()
            except urllib.error.HTTPError as exc:
                last = f"HTTP {exc.code}: {_server_message(exc)}"
                if exc.code < 500:
                    raise RewardError(f"reward server {self.url} refused the request ({last})") from None
            except (urllib.error.URLError, ConnectionError, TimeoutError, http.client.HTTPException) as exc:
                reason = exc.reason if isinstance(exc, urllib.error.URLError) else exc
                last = f"{type(reason).__name__}: {reason}" if str(reason) else type(reason).__name__
        raise RewardError(f"reward server {self.url} unreachable or failing after {attempts} attempts "
                          f"(timeout {self.timeout:g} s; last: {last})")


def _server_message(exc: urllib.error.HTTPError) -> str:
    """The one-line {"error": ...} of an error reply, else its first characters, else the HTTP reason."""
    try:
        body = exc.read()
    except OSError:
        body = b""
    try:
        return str(json.loads(body)["error"]).splitlines()[0]
    except (ValueError, KeyError, TypeError, IndexError):
        return body[:80].decode("utf-8", "replace").replace("\n", " ") or str(exc.reason)
