"""A scripted HTTP server on loopback for the admin sub-client: real sockets, answers the test decides.

It is not the control plane (tests/e2e/test_sdk_live.py covers that); it lets the SDK's HTTP
handling (headers, retries, error mapping, dropped connections) be checked precisely.
"""

from __future__ import annotations

import contextlib
import json
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer


@dataclass
class Reply:
    status: int = 200
    body: object = None
    headers: dict[str, str] = field(default_factory=dict)
    raw: bytes | None = None  # sent instead of the JSON of `body`
    drop: bool = False  # close the connection without answering
    delay: float = 0.0  # seconds before answering: a slow server
    content_type: str = "application/json"


@dataclass
class Seen:
    method: str
    path: str
    headers: dict[str, str]
    body: object


class ScriptedHttp:
    def __init__(self) -> None:
        self.script: list[Reply] = []  # one reply per request; the last one repeats
        self.seen: list[Seen] = []
        scripted = self

        class Handler(BaseHTTPRequestHandler):
            def log_message(self, *args) -> None:
                pass

            def _answer(self) -> None:
                length = int(self.headers.get("Content-Length") or 0)
                raw = self.rfile.read(length) if length else b""
                scripted.seen.append(
                    Seen(self.command, self.path, dict(self.headers), json.loads(raw) if raw else None)
                )
                reply = scripted.script[min(len(scripted.seen), len(scripted.script)) - 1]
                if reply.delay:
                    time.sleep(reply.delay)
                if reply.drop:
                    self.close_connection = True
                    return
                payload = reply.raw if reply.raw is not None else json.dumps(reply.body).encode()
                self.send_response(reply.status)
                self.send_header("Content-Type", reply.content_type)
                self.send_header("Content-Length", str(len(payload)))
                for name, value in reply.headers.items():
                    self.send_header(name, value)
                self.end_headers()
                with contextlib.suppress(BrokenPipeError, ConnectionResetError):  # the client gave up waiting
                    self.wfile.write(payload)

            do_GET = do_POST = do_PUT = do_PATCH = do_DELETE = _answer

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self._server.server_address[1]}"
        self._thread = threading.Thread(target=self._server.serve_forever, kwargs={"poll_interval": 0.02}, daemon=True)
        self._thread.start()

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
