"""Who may call the REST API: bearer tokens with read / admin scopes, the bind rule,
Host / Origin checks and the request-body limit (docs/operations.md, "Security").

* Tokens come from settings (:class:`ApiSecuritySettings`, environment ``KVADVISOR_API_*``,
  e.g. an env file): ``read_tokens`` may call every read route, ``admin_tokens`` every
  route. With no token configured the API is open, so it may only listen on loopback:
  :func:`check_bind` refuses any other address at start. Tokens are compared with
  :func:`hmac.compare_digest` against every configured token (no early exit), and are
  never logged or echoed.
* ``Host`` must name a loopback host, the bound host or an ``allowed_hosts`` entry (DNS
  rebinding), except when the API listens on a wildcard address with tokens and no
  ``allowed_hosts`` are set (the tokens guard it then).
* A request with an ``Origin`` is refused unless that origin is the request's own
  (``http(s)://<Host>``) or in ``allowed_origins`` (a cross-origin ``text/plain`` POST from
  a browser never runs); CORS headers are sent only for ``allowed_origins`` (off by default).
* Bodies above ``max_body_bytes`` get 413 before they are read whole.

Errors use the API's one shape (:mod:`api.errors`): 401 ``unauthorized``, 403
``forbidden`` / ``host_refused`` / ``origin_refused``, 413 ``body_too_large``.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
from collections.abc import Awaitable, Callable, MutableMapping
from dataclasses import dataclass
from typing import Any, Literal

from fastapi import Depends, Request
from fastapi.security import HTTPAuthorizationCredentials, HTTPBearer
from pydantic import Field, SecretStr, field_validator
from pydantic_settings import BaseSettings, SettingsConfigDict

from api.errors import ApiError

Scope = Literal["read", "admin"]
MIN_TOKEN_CHARS = 16
LOOPBACK_NAMES = frozenset({"localhost", "127.0.0.1", "::1"})
WILDCARDS = frozenset({"0.0.0.0", "::", ""})

class InsecureBindError(RuntimeError):
    """The API would listen beyond loopback without any token configured."""


class ApiSecuritySettings(BaseSettings):
    """Security settings of the REST API (environment prefix ``KVADVISOR_API_``).

    Attributes:
        read_tokens: bearer tokens of the read scope (JSON list in the environment).
        admin_tokens: bearer tokens of the admin scope (read included).
        allowed_hosts: extra ``Host`` names accepted (besides loopback and the bound host).
        allowed_origins: origins allowed cross-origin (CORS); empty = CORS off.
        max_body_bytes: largest request body, bytes.
        register_networks: networks ``POST /register`` endpoints must lie in (CIDR; default
            loopback only; :mod:`api.register_policy`).
        register_resolve_names: resolve host names of registered endpoints (default off:
            only IP addresses are taken).
        max_registrations: registrations held at once (lowered to the file-descriptor
            budget, :class:`api.indexer_registry.IndexerRegistry`).
        max_indexes: ``(model, tenant)`` indexes of the indexer routes.
        max_worker_blocks / max_indexer_blocks: blocks one worker may hold in one index of
            the indexer routes (2^17), and all their indexes together (2^21, about 1.8 GiB);
            a block on several media counts once per medium
            (:class:`api.worker_index.BlockBudget`).

    Raises:
        pydantic.ValidationError: a token shorter than 16 characters or with whitespace.
    """

    # hide_input_in_errors: a refused token must not appear in the error (logs, tracebacks)
    model_config = SettingsConfigDict(env_prefix="KVADVISOR_API_", extra="ignore", hide_input_in_errors=True)

    read_tokens: list[SecretStr] = Field(default_factory=list)
    admin_tokens: list[SecretStr] = Field(default_factory=list)
    allowed_hosts: list[str] = Field(default_factory=list)
    allowed_origins: list[str] = Field(default_factory=list)
    max_body_bytes: int = Field(4 * 1024 * 1024, ge=1024, le=1 << 30)
    register_networks: list[str] = Field(default_factory=lambda: ["127.0.0.0/8", "::1/128"])
    register_resolve_names: bool = False
    max_registrations: int = Field(256, ge=1, le=4096)
    max_indexes: int = Field(64, ge=1, le=4096)
    max_worker_blocks: int = Field(1 << 17, ge=1)
    max_indexer_blocks: int = Field(1 << 21, ge=1)

    @field_validator("register_networks")
    @classmethod
    def _networks(cls, nets: list[str]) -> list[str]:
        import ipaddress

        for n in nets:
            ipaddress.ip_network(n, strict=False)  # ValueError names the bad one
        return nets

    @field_validator("read_tokens", "admin_tokens")
    @classmethod
    def _strong(cls, tokens: list[SecretStr]) -> list[SecretStr]:
        for t in tokens:
            raw = t.get_secret_value()
            if len(raw) < MIN_TOKEN_CHARS or any(c.isspace() for c in raw) or not raw.isascii():
                raise ValueError(f"a token must be at least {MIN_TOKEN_CHARS} ASCII characters without spaces")
        return tokens

    @property
    def auth_enabled(self) -> bool:
        """Whether any token is configured."""
        return bool(self.read_tokens or self.admin_tokens)


def tokens_equal(given: str, expected: str) -> bool:
    """Constant-time comparison of two tokens (:func:`hmac.compare_digest` on UTF-8 bytes):
    the time taken depends on the lengths only, not on where they differ."""
    return hmac.compare_digest(given.encode("utf-8"), expected.encode("utf-8"))


def scope_of(token: str, settings: ApiSecuritySettings) -> Scope | None:
    """The scope ``token`` grants, or ``None``. Every configured token is compared (no early
    exit), so the time does not tell which one matched or how many there are of each."""
    admin = read = False
    for t in settings.admin_tokens:
        admin |= tokens_equal(token, t.get_secret_value())
    for t in settings.read_tokens:
        read |= tokens_equal(token, t.get_secret_value())
    return "admin" if admin else "read" if read else None


def client_id(token: str) -> str:
    """A caller's name for per-client quotas: ``token-`` and the first 16 hex digits of the
    token's SHA-256 (the token itself is never kept)."""
    return "token-" + hashlib.sha256(token.encode("utf-8")).hexdigest()[:16]


def client_of(request: Request) -> str | None:
    """Who called (:func:`client_id` of the bearer token that passed :func:`require_read` or
    :func:`require_admin`), or ``None`` without tokens (every caller is then one client)."""
    return getattr(request.state, "client", None)


def is_loopback(host: str) -> bool:
    """Whether ``host`` (name or address, IPv6 with or without brackets) is loopback."""
    h = host.strip("[]").lower()
    if h in LOOPBACK_NAMES:
        return True
    try:
        return ipaddress.ip_address(h).is_loopback
    except ValueError:
        return False


def check_bind(host: str, settings: ApiSecuritySettings) -> None:
    """Refuse to listen beyond loopback without tokens.

    Raises:
        InsecureBindError: ``host`` is not loopback and no token is configured.
    """
    if not settings.auth_enabled and not is_loopback(host):
        raise InsecureBindError(
            f"refusing to serve the API on {host!r} without tokens: set KVADVISOR_API_ADMIN_TOKENS / "
            "KVADVISOR_API_READ_TOKENS (docs/operations.md, Security) or bind to 127.0.0.1")


_bearer = HTTPBearer(auto_error=False, description="read or admin token (docs/operations.md, Security)")


@dataclass(frozen=True)
class ApiSecurity:
    """Settings plus where the API listens; stored as ``app.state.security``."""

    settings: ApiSecuritySettings
    bind_host: str = "127.0.0.1"

    def host_allowed(self, host_header: str) -> bool:
        """Whether a ``Host`` header (port ignored) is acceptable (see the module doc)."""
        name = _host_name(host_header)
        if name is None:
            return False
        s = self.settings
        if is_loopback(name) or name in (h.lower() for h in s.allowed_hosts):
            return True
        if self.bind_host not in WILDCARDS and name == self.bind_host.strip("[]").lower():
            return True
        return self.bind_host in WILDCARDS and s.auth_enabled and not s.allowed_hosts


def _host_name(host_header: str) -> str | None:
    h = host_header.strip().lower()
    if not h or len(h) > 300:
        return None
    if h.startswith("["):
        end = h.find("]")
        return h[1:end] if end > 0 else None
    return h.rsplit(":", 1)[0] if h.count(":") == 1 else h


def _authorize(request: Request, creds: HTTPAuthorizationCredentials | None, need: Scope) -> None:
    sec: ApiSecurity = request.app.state.security
    if not sec.settings.auth_enabled:
        return
    if creds is None or creds.scheme.lower() != "bearer" or not creds.credentials:
        raise ApiError(401, "unauthorized", "a bearer token is required (Authorization: Bearer <token>)",
                       {"WWW-Authenticate": "Bearer"})
    scope = scope_of(creds.credentials, sec.settings)
    if scope is None:
        raise ApiError(401, "unauthorized", "unknown token", {"WWW-Authenticate": "Bearer"})
    request.state.client = client_id(creds.credentials)
    if need == "admin" and scope != "admin":
        raise ApiError(403, "forbidden", "this route needs an admin token")


async def require_read(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """FastAPI dependency of read routes (any token; open without tokens); the bearer scheme
    appears in the OpenAPI.

    Raises:
        ApiError: 401 ``unauthorized``.
    """
    _authorize(request, creds, "read")


async def require_admin(request: Request, creds: HTTPAuthorizationCredentials | None = Depends(_bearer)) -> None:
    """FastAPI dependency of mutating routes (an admin token; open without tokens).

    Raises:
        ApiError: 401 ``unauthorized``, 403 ``forbidden``.
    """
    _authorize(request, creds, "admin")


ASGIApp = Callable[[MutableMapping[str, Any], Callable[[], Awaitable[Any]], Callable[[Any], Awaitable[None]]],
                   Awaitable[None]]


_SINGLE_HEADERS = ("host", "origin", "content-length", "authorization")
"""Headers a request may carry once (a repeated one is refused, 400)."""


class GuardMiddleware:
    """Pure ASGI middleware: Host and Origin checks, body limit, CORS for allowed origins.

    Args:
        app: the wrapped ASGI app.
        security: settings and bound host.
    """

    def __init__(self, app: ASGIApp, security: ApiSecurity) -> None:
        self.app = app
        self.security = security
        self._origins = {o.rstrip("/").lower() for o in security.settings.allowed_origins}

    async def __call__(self, scope: MutableMapping[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        raw = scope.get("headers", ())
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in raw}
        if len(headers) != len(raw):
            names = [k.decode("latin-1").lower() for k, _ in raw]
            if any(names.count(n) > 1 for n in _SINGLE_HEADERS):
                # which one would count (first or last) differs between proxies and us
                await _reject(send, 400, "duplicate_header", "Host, Origin, Content-Length and Authorization "
                              "may appear once")
                return
        host = headers.get("host", "")
        if not self.security.host_allowed(host):
            await _reject(send, 403, "host_refused", "the Host header names no host this API serves")
            return
        origin = headers.get("origin")
        cors_origin = None
        if origin is not None:
            o = origin.rstrip("/").lower()
            own = {f"http://{host.lower()}", f"https://{host.lower()}"}
            if o in self._origins:
                cors_origin = origin
            elif o not in own:
                await _reject(send, 403, "origin_refused", "cross-origin requests are not allowed")
                return
        if scope["method"] == "OPTIONS" and cors_origin is not None:
            await _send_json(send, 204, None, _cors(cors_origin, preflight=True))
            return
        limit = self.security.settings.max_body_bytes
        length = headers.get("content-length")
        if length is not None and (not length.isdigit() or int(length) > limit):
            await _reject(send, 413, "body_too_large", f"request bodies are limited to {limit} bytes")
            return
        seen = 0
        too_big = False

        async def limited_receive() -> Any:
            nonlocal seen, too_big
            msg = await receive()
            if msg["type"] == "http.request":
                seen += len(msg.get("body", b""))
                if seen > limit:
                    too_big = True
                    raise _BodyTooLarge
            return msg

        started = False
        replaced = False

        async def wrapped_send(msg: Any) -> None:
            nonlocal started, replaced
            if too_big:
                # the app turned the aborted read into its own error (FastAPI: 400): answer 413
                if msg["type"] == "http.response.start" and not started:
                    started = replaced = True
                    await _reject(send, 413, "body_too_large", f"request bodies are limited to {limit} bytes")
                return
            if msg["type"] == "http.response.start":
                started = True
                if cors_origin is not None:
                    msg = {**msg, "headers": [*msg.get("headers", []), *_cors(cors_origin)]}
            await send(msg)

        try:
            await self.app(scope, limited_receive, wrapped_send)
        except Exception:
            if too_big and not started:
                await _reject(send, 413, "body_too_large", f"request bodies are limited to {limit} bytes")
            elif not too_big:
                raise


class _BodyTooLarge(Exception):
    pass


def _cors(origin: str, preflight: bool = False) -> list[tuple[bytes, bytes]]:
    out = [(b"access-control-allow-origin", origin.encode("latin-1")), (b"vary", b"Origin")]
    if preflight:
        out += [(b"access-control-allow-methods", b"GET, POST"),
                (b"access-control-allow-headers", b"authorization, content-type"),
                (b"access-control-max-age", b"600")]
    return out


async def _send_json(send: Any, status: int, body: dict[str, str] | None,
                     extra: list[tuple[bytes, bytes]] | None = None) -> None:
    raw = b"" if body is None else json.dumps(body).encode()
    headers = [(b"content-length", str(len(raw)).encode())]
    if body is not None:
        headers.append((b"content-type", b"application/json"))
    await send({"type": "http.response.start", "status": status, "headers": [*headers, *(extra or [])]})
    await send({"type": "http.response.body", "body": raw})


async def _reject(send: Any, status: int, error: str, detail: str) -> None:
    await _send_json(send, status, {"error": error, "detail": detail})
