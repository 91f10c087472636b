"""A reference reward server (standard library only): serves any registered reward over HTTP.

`tpgrpo serve-reward --reward NAME --port 8765 --host 127.0.0.1` runs it; the "remote" reward
(`remote.py`, same protocol) is its client. POST / or /score: score a batch; GET /health: the reward's
name. Bad requests get HTTP 400, a failing reward HTTP 500, both with {"error": "one line"}. Requests
are handled in threads but scored one at a time (reward models are not thread-safe).
"""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np

from tpgrpo.rewards.folders import one_line
from tpgrpo.rewards.remote import decode_images
from tpgrpo.tasks.rewards import Reward

MAX_BODY = 1 << 30  # bytes a request may carry


def _handler(reward: Reward, quiet: bool) -> type[BaseHTTPRequestHandler]:
    lock = threading.Lock()

    class Handler(BaseHTTPRequestHandler):
        def _reply(self, code: int, payload: dict) -> None:
            body = json.dumps(payload, allow_nan=False).encode()
            self.send_response(code)
            self.send_header("Content-Type", "application/json")
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:  # noqa: N802 (http.server's naming)
            if self.path.rstrip("/") in ("", "/health"):
                self._reply(200, {"status": "ok", "reward": reward.name})
            else:
                self._reply(404, {"error": f"no such path {self.path}: GET /health, POST /score"})

        def do_POST(self) -> None:  # noqa: N802
            if self.path.rstrip("/") not in ("", "/score"):
                self._reply(404, {"error": f"no such path {self.path}: POST /score"})
                return
            try:
                images, metas = self._read_batch()
            except ValueError as exc:
                self._reply(400, {"error": f"bad request: {one_line(exc)}"})
                return
            try:
                with lock:
                    result = reward(images, metas)
            except ValueError as exc:  # e.g. prompts of another task: the client's mistake
                self._reply(400, {"error": f"reward {reward.name}: {one_line(exc)}"})
                return
            except Exception as exc:  # noqa: BLE001 - report, keep serving
                self._reply(500, {"error": f"reward {reward.name} failed: {one_line(exc)}"})
                return
            if not np.all(np.isfinite(result.reward)):
                self._reply(500, {"error": f"reward {reward.name} returned non-finite values"})
                return
            self._reply(200, {"reward": reward.name, "rewards": result.reward.tolist(),
                              "strict": result.strict.tolist() if result.has_strict else None})

        def _read_batch(self) -> tuple[np.ndarray, list[dict]]:
            length = int(self.headers.get("Content-Length") or -1)
            if not 0 <= length <= MAX_BODY:
                raise ValueError(f"Content-Length {length}: expected 0..{MAX_BODY}")
            request = json.loads(self.rfile.read(length))
            if not isinstance(request, dict) or not isinstance(request.get("images"), list) \
                    or not isinstance(request.get("metas"), list):
                raise ValueError('expected JSON {"images": [...], "metas": [...]}')
            return decode_images(request["images"]), request["metas"]

        def log_message(self, format: str, *args) -> None:  # noqa: A002
            if not quiet:
                super().log_message(format, *args)

    return Handler


def make_server(reward: Reward, host: str = "127.0.0.1", port: int = 0, quiet: bool = False) -> ThreadingHTTPServer:
    """A bound (not yet serving) server; port 0 = an ephemeral port (``server.server_address[1]``)."""
    server = ThreadingHTTPServer((host, port), _handler(reward, quiet))
    server.daemon_threads = True
    return server


def serve(reward: Reward, host: str = "127.0.0.1", port: int = 8765) -> None:
    """Serve until interrupted (Ctrl-C)."""
    server = make_server(reward, host, port)
    print(f"serving reward {reward.name} at http://{host}:{server.server_address[1]}/score", flush=True)
    try:
        server.serve_forever()
    except KeyboardInterrupt:
        pass
    finally:
        server.server_close()
