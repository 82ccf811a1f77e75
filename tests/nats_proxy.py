"""A TCP proxy in front of a test's nats-server that holds JetStream deliveries back.

A push consumer's messages and the answer to a JetStream API request travel different paths
inside a NATS deployment (the consumer's delivery loop, the API handler; on a cluster, other
servers and routes), so a client can read the answer to "consumer info" (nothing pending:
everything was sent) before it reads the messages that were sent.  This proxy makes that
order happen on loopback: every frame from the server that carries a JetStream delivery
(``MSG``/``HMSG`` whose reply subject starts with ``$JS.ACK.``) reaches the client
``delay_s`` later, in order; every other frame passes at once.  The client side is
forwarded unchanged, and a client that closes its connection is not passed on: the server
keeps that connection, with its subscriptions and pending pull requests, until ``close()``
(a server that has not processed a client's close yet).

Frames follow the NATS client protocol (docs.nats.io, "Client Protocol": ``MSG <subject>
<sid> [reply-to] <#bytes>``, ``HMSG <subject> <sid> [reply-to] <#header bytes> <#total
bytes>``, each followed by its payload and CRLF).
"""

from __future__ import annotations

import socket
import threading
import time
from collections import deque


class NatsDeliveryDelayProxy:
    """Loopback proxy to ``127.0.0.1:upstream_port`` (class docstring).

    Attributes:
        url: ``nats://127.0.0.1:<port>`` of the proxy.
        delayed: JetStream deliveries held back so far.
    """

    def __init__(self, upstream_port: int, delay_s: float) -> None:
        self.upstream_port = upstream_port
        self.delay_s = delay_s
        self.delayed = 0
        self._srv = socket.create_server(("127.0.0.1", 0))
        self.url = f"nats://127.0.0.1:{self._srv.getsockname()[1]}"
        self._stop = threading.Event()
        self._socks: list[socket.socket] = []
        threading.Thread(target=self._accept, daemon=True).start()

    def close(self) -> None:
        """Stop accepting and drop every proxied connection."""
        self._stop.set()
        self._srv.close()
        for s in self._socks:
            try:
                s.close()
            except OSError:
                pass

    def __enter__(self) -> NatsDeliveryDelayProxy:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                client, _ = self._srv.accept()
            except OSError:
                return
            server = socket.create_connection(("127.0.0.1", self.upstream_port))
            self._socks += [client, server]
            threading.Thread(target=self._pipe, args=(client, server), daemon=True).start()
            threading.Thread(target=self._from_server, args=(server, client), daemon=True).start()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                dst.sendall(data)
        except OSError:
            pass

    def _from_server(self, server: socket.socket, client: socket.socket) -> None:
        held: deque[tuple[float, bytes]] = deque()
        cond = threading.Condition()

        def release() -> None:  # held deliveries, in order, each delay_s after it arrived
            while not self._stop.is_set():
                with cond:
                    while not held:
                        cond.wait(0.1)
                        if self._stop.is_set():
                            return
                    due, frame = held[0]
                wait = due - time.monotonic()
                if wait > 0:
                    time.sleep(wait)
                with cond:
                    held.popleft()
                try:
                    client.sendall(frame)
                except OSError:
                    return

        threading.Thread(target=release, daemon=True).start()
        buf = b""
        try:
            while data := server.recv(65536):
                buf += data
                while (end := buf.find(b"\r\n")) >= 0:
                    head = buf[:end].split()
                    size = 0
                    if head and head[0] in (b"MSG", b"HMSG"):
                        size = int(head[-1]) + 2  # payload and its CRLF
                    if len(buf) < end + 2 + size:
                        break  # the payload is still on its way
                    frame, buf = buf[:end + 2 + size], buf[end + 2 + size:]
                    reply = head[3] if head and ((head[0] == b"MSG" and len(head) == 5)
                                                 or (head[0] == b"HMSG" and len(head) == 6)) else b""
                    if reply.startswith(b"$JS.ACK."):
                        self.delayed += 1
                        with cond:
                            held.append((time.monotonic() + self.delay_s, frame))
                            cond.notify()
                    else:
                        client.sendall(frame)
        except OSError:
            pass


__all__ = ["NatsDeliveryDelayProxy"]
