"""An HTTP proxy in front of the tests' moto_server that injects S3 faults.

Shared by the S3 retry tests (tests/integration/test_storage_s3_admin.py: the next ``n``
requests fail with 503 SlowDown or 403 AccessDenied) and the hostile S3 tests
(tests/integration/test_storage_hostile_s3.py: a rule chooses per request).
"""

from __future__ import annotations

import http.client
import threading
import time
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from urllib.parse import urlparse

Rule = Callable[[str, str, int], object]
"""``rule(method, path, nth)`` -> what to do with the ``nth`` (from 0) request of that method
and path (no query): ``None`` forward it; an int, answer that HTTP status with an S3 error
body; ``("delay", s)`` forward it after ``s`` seconds; ``("short", _)`` forward it and send
half the body as a well-formed shorter reply; ``("cut", _)`` send half the body, then drop
the connection."""

_SLOWDOWN = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>SlowDown</Code>'
             b"<Message>Please reduce your request rate.</Message></Error>")
_DENIED = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>AccessDenied</Code>'
           b"<Message>Access Denied</Message></Error>")
_INTERNAL = (b'<?xml version="1.0" encoding="UTF-8"?><Error><Code>InternalError</Code>'
             b"<Message>We encountered an internal error. Please try again.</Message></Error>")


def _error_body(status: int) -> bytes:
    return {403: _DENIED, 503: _SLOWDOWN}.get(status, _INTERNAL)


class S3FaultProxy:
    """HTTP proxy to ``127.0.0.1:upstream_port`` whose answers a :data:`Rule` chooses.

    Attributes:
        endpoint: the proxy's URL, to give a volume as its S3 endpoint.
        requests: ``"METHOD /path?query"`` of every request, in arrival order.
        injected: the same for the requests answered with an error status.
        log: ``(monotonic time, method, path, action)`` of every request.
        in_flight: requests read and not yet fully answered (a delayed one counts).
    """

    def __init__(self, upstream_port: int, port: int = 0) -> None:
        self.upstream_port = upstream_port
        self.lock = threading.Lock()
        self.rule: Rule = lambda m, p, n: None
        self.seen: dict[tuple[str, str], int] = {}
        self.log: list[tuple[float, str, str, object]] = []
        self.requests: list[str] = []
        self.injected: list[str] = []
        self.in_flight = 0
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args: object) -> None:
                pass

            def _body(self) -> bytes:
                if "chunked" in self.headers.get("Transfer-Encoding", "").lower():
                    parts = []
                    while True:
                        size = int(self.rfile.readline().split(b";")[0], 16)
                        if size == 0:
                            self.rfile.readline()
                            return b"".join(parts)
                        parts.append(self.rfile.read(size))
                        self.rfile.readline()
                n = int(self.headers.get("Content-Length") or 0)
                return self.rfile.read(n) if n else b""

            def _handle(self) -> None:
                with proxy.lock:
                    proxy.in_flight += 1
                try:
                    self._answer()
                finally:
                    with proxy.lock:
                        proxy.in_flight -= 1

            def _answer(self) -> None:
                body = self._body()
                path = urlparse(self.path).path
                with proxy.lock:
                    k = (self.command, path)
                    nth = proxy.seen.get(k, 0)
                    proxy.seen[k] = nth + 1
                    action = proxy.rule(self.command, path, nth)
                    proxy.log.append((time.monotonic(), self.command, path, action))
                    proxy.requests.append(f"{self.command} {self.path}")
                    if isinstance(action, int):
                        proxy.injected.append(f"{self.command} {self.path}")
                if isinstance(action, int):
                    payload = _error_body(action)
                    self.send_response(action)
                    self.send_header("Content-Type", "application/xml")
                    self.send_header("Content-Length", str(len(payload)))
                    self.end_headers()
                    if self.command != "HEAD":
                        self.wfile.write(payload)
                    return
                if isinstance(action, tuple) and action[0] == "delay":
                    time.sleep(float(action[1]))  # type: ignore[arg-type]
                cut = isinstance(action, tuple) and action[0] in ("cut", "short")
                conn = http.client.HTTPConnection("127.0.0.1", proxy.upstream_port, timeout=60)
                hdrs = {k: v for k, v in self.headers.items()
                        if k.lower() not in ("transfer-encoding", "expect", "content-length")}
                hdrs["Content-Length"] = str(len(body))
                conn.request(self.command, self.path, body=body, headers=hdrs)
                r = conn.getresponse()
                data = r.read()
                self.send_response(r.status)
                for k, v in r.getheaders():
                    if k.lower() not in ("transfer-encoding", "content-length", "connection", "server", "date",
                                         "content-range"):
                        self.send_header(k, v)
                if cut and action[0] == "short":  # type: ignore[index]
                    data = data[: len(data) // 2]  # a short body, announced as such
                if r.getheader("Content-Range"):
                    rng = r.getheader("Content-Range") or ""
                    unit_first = rng.split("-")[0]
                    first = int(unit_first.split()[-1])
                    total = rng.split("/")[-1]
                    self.send_header("Content-Range", f"bytes {first}-{first + len(data) - 1}/{total}")
                length = r.getheader("Content-Length") if self.command == "HEAD" else str(len(data))
                self.send_header("Content-Length", length or "0")
                self.end_headers()
                if self.command != "HEAD":
                    if cut and action[0] == "cut":  # type: ignore[index]
                        self.wfile.write(data[: len(data) // 2])  # the connection drops mid-body
                        self.wfile.flush()
                        self.close_connection = True
                        conn.close()
                        return
                    self.wfile.write(data)
                conn.close()

            do_GET = do_PUT = do_POST = do_DELETE = do_HEAD = _handle

        self._handler = Handler
        self._serve(port)

    def _serve(self, port: int) -> None:
        self.server = ThreadingHTTPServer(("127.0.0.1", port), self._handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def down(self) -> None:
        """The endpoint dies: the listening socket closes (connections are refused) until :meth:`up`."""
        self.close()

    def up(self) -> None:
        """The endpoint comes back on the same port (the objects behind it are still there)."""
        self._serve(int(self.endpoint.rsplit(":", 1)[1]))

    def set_rule(self, rule: Rule) -> None:
        """Answer from now on as ``rule`` says (request counts and records start again)."""
        with self.lock:
            self.rule = rule
            self.seen.clear()
            self.log.clear()
            self.requests.clear()
            self.injected.clear()

    def fail(self, n: int, methods: set[str] | None = None, status: int = 503) -> None:
        """Fail the next ``n`` requests of ``methods`` (all: ``None``) with ``status``
        (503 SlowDown, which the aws-sdk retries on its own, or 403 AccessDenied)."""
        left = [n]
        only = set(methods or ())

        def rule(method: str, path: str, nth: int) -> int | None:  # called under self.lock
            if left[0] > 0 and (not only or method in only):
                left[0] -= 1
                return status
            return None

        self.set_rule(rule)

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()
