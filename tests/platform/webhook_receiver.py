"""An application's webhook endpoint on loopback, for the webhook tests: a real HTTP server in a thread that
verifies every try with the official `openai` client (`webhooks.unwrap`), hands each event to the
application once (it keeps the `webhook-id`s it handled), and answers each try with the next status of
its script (200 once the script is used up)."""

import ssl
import threading
import time
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import openai


@dataclass
class Try:
    headers: dict[str, str]
    body: bytes
    received_at: float  # time.monotonic()
    status: int  # what the receiver answered
    verified_by: list[str] = field(default_factory=list)  # the secrets whose signature matched


class Receiver:
    def __init__(self, statuses: list[int] | None = None, tls: ssl.SSLContext | None = None) -> None:
        """`tls`: serve https with this server context (its certificate), at https://localhost:PORT."""
        self.statuses = list(statuses or [])
        self.secrets: list[str] = []  # verified against each; the first must match for the event to count
        self.tries: list[Try] = []
        self.application: list = []  # the events handed on, parsed by the openai client
        self._seen_ids: set[str] = set()
        self._openai = openai.OpenAI(api_key="unused", base_url="http://127.0.0.1:9/v1")  # never called: unwrap only
        self._lock = threading.Lock()
        self._server = ThreadingHTTPServer(("127.0.0.1", 0), self._handler())
        self._tls = tls is not None
        if tls is not None:
            self._server.socket = tls.wrap_socket(self._server.socket, server_side=True)
        self._thread = threading.Thread(target=self._server.serve_forever, daemon=True)

    @property
    def url(self) -> str:
        port = self._server.server_address[1]
        return f"https://localhost:{port}/hooks/diptych" if self._tls else f"http://127.0.0.1:{port}/hooks/diptych"

    def __enter__(self) -> "Receiver":
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._server.shutdown()
        self._server.server_close()

    def wait_for_tries(self, count: int, seconds: float = 20.0) -> list[Try]:
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            with self._lock:
                if len(self.tries) >= count:
                    return list(self.tries)
            time.sleep(0.02)
        raise AssertionError(f"{len(self.tries)} tries arrived in {seconds} s, not {count}")

    def _receive(self, headers: dict[str, str], body: bytes) -> int:
        verified_by = []
        for secret in self.secrets:
            try:
                event = self._openai.webhooks.unwrap(body, headers, secret=secret)
            except openai.InvalidWebhookSignatureError:
                continue
            verified_by.append(secret)
            if secret == self.secrets[0]:
                with self._lock:
                    if headers["webhook-id"] not in self._seen_ids:
                        self._seen_ids.add(headers["webhook-id"])
                        self.application.append(event)
        with self._lock:
            status = self.statuses.pop(0) if self.statuses else 200
            self.tries.append(Try(headers, body, time.monotonic(), status, verified_by))
        return status

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                status = receiver._receive({name.lower(): value for name, value in self.headers.items()}, body)
                reply = b'{"ok": true}' if status < 300 else b"not now"
                self.send_response(status)
                self.send_header("Content-Length", str(len(reply)))
                self.end_headers()
                self.wfile.write(reply)

            def log_message(self, format, *args) -> None:
                pass

        return Handler
