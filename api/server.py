"""Serve the API with uvicorn in a background thread."""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import uvicorn
from fastapi import FastAPI

from api.app import create_app
from api.auth import ApiSecuritySettings, InsecureBindError, check_bind

if TYPE_CHECKING:
    from advisor.ops.query import AdvisorQuery


class ServerError(RuntimeError):
    """The API server did not start (port in use, bad host...)."""


@dataclass
class ServerHandle:
    """A running uvicorn server.

    Attributes:
        url: ``http://HOST:PORT`` (the real port when 0 was asked for).
        host / port: where it listens.
    """

    url: str
    host: str
    port: int
    _server: uvicorn.Server = field(repr=False)
    _thread: threading.Thread = field(repr=False)

    def stop(self, timeout_s: float = 10.0) -> None:
        """Ask uvicorn to exit, wait for its thread and stop the indexer's subscriptions (idempotent)."""
        self._server.should_exit = True
        self._thread.join(timeout=timeout_s)
        registry = getattr(getattr(self._server.config.app, "state", None), "indexer_registry", None)
        if registry is not None:
            registry.close()


def serve_in_thread(app: FastAPI, host: str = "127.0.0.1", port: int = 0, *, start_timeout_s: float = 15.0) -> ServerHandle:
    """Start ``app`` on ``host:port`` (0 = a free port) in a daemon thread; wait until it listens.

    Raises:
        ServerError: the server exited or did not listen within ``start_timeout_s``.
    """
    config = uvicorn.Config(app, host=host, port=port, log_level="warning", access_log=False, lifespan="off")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name=f"kvadvisor-api-{port}", daemon=True)
    thread.start()
    deadline = time.monotonic() + start_timeout_s
    while not server.started:
        if not thread.is_alive():
            raise ServerError(f"API server on {host}:{port} exited during start-up (port in use?)")
        if time.monotonic() > deadline:
            server.should_exit = True
            raise ServerError(f"API server on {host}:{port} did not start within {start_timeout_s} s")
        time.sleep(0.02)
    bound = port
    for srv in getattr(server, "servers", []):
        for sock in srv.sockets:
            bound = int(sock.getsockname()[1])
            break
    url_host = f"[{host}]" if ":" in host else host
    return ServerHandle(f"http://{url_host}:{bound}", host, bound, server, thread)


def serve_query(
    query: AdvisorQuery, host: str = "127.0.0.1", port: int = 0, *, security: ApiSecuritySettings | None = None
) -> ServerHandle:
    """Build the app for ``query`` and serve it in a thread (``AdvisorSettings.api_factory``).

    Args:
        security: tokens and limits (default: from the environment, ``KVADVISOR_API_*``).

    Raises:
        ServerError: ``host`` is not loopback and no token is configured (:func:`api.auth.check_bind`),
            or the server did not start.
    """
    settings = security if security is not None else ApiSecuritySettings()
    try:
        check_bind(host, settings)
    except InsecureBindError as exc:
        raise ServerError(str(exc)) from None
    return serve_in_thread(create_app(query, security=settings, bind_host=host), host, port)
