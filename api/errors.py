"""The one error shape of the REST API (docs/operations.md, "Errors").

Every 4xx/5xx body is ``{"error": code, "detail": text}``: ``code`` is a stable machine
word (``unauthorized``, ``forbidden``, ``unknown_block``, ``invalid_request``...), ``detail``
a human sentence that never repeats a whole request body or a token.
"""

from __future__ import annotations

import math
from typing import Any

import msgspec
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, Field
from starlette.exceptions import HTTPException as StarletteHTTPException

from advisor.cluster.node import PartitionUnavailable

_encode = msgspec.json.Encoder().encode


def json_response(body: Any, status: int = 200) -> Response:
    """A JSON response encoded once with msgspec (hot routes: no second validation pass;
    the route's ``response_model`` still documents the shape)."""
    return Response(_encode(body), status_code=status, media_type="application/json")


class ApiError(Exception):
    """An error with an HTTP status, a machine code and a human detail.

    Args:
        status: HTTP status (400, 401, 403, 404, 409, 413, 422...).
        error: stable machine code.
        detail: human explanation (no secrets, no whole inputs).
        headers: extra response headers (e.g. ``WWW-Authenticate`` on 401).
    """

    def __init__(self, status: int, error: str, detail: str, headers: dict[str, str] | None = None) -> None:
        super().__init__(detail)
        self.status = status
        self.error = error
        self.detail = detail
        self.headers = headers


class ErrorResponse(BaseModel):
    """Every error body: a stable machine code and a human explanation."""

    error: str = Field(examples=["unknown_block"])
    detail: str = Field(examples=["block 42 (0x000000000000002a) is not indexed at any location"])


ERROR_RESPONSES: dict[int | str, dict[str, object]] = {
    code: {"model": ErrorResponse, "description": text}
    for code, text in (
        (400, "bad input (e.g. a malformed hash)"),
        (401, "no or unknown bearer token"),
        (403, "token lacks the scope, or Host / Origin refused"),
        (404, "unknown object"),
        (413, "request body above the limit"),
        (422, "request failed validation"),
    )
}
"""``responses=`` entry every route carries, so the OpenAPI documents the error shape."""

CONFLICT_RESPONSES: dict[int | str, dict[str, object]] = {
    409: {"model": ErrorResponse, "description": "already registered, or another block size for the pair"},
    429: {"model": ErrorResponse, "description": "registration limit reached"},
}
"""Extra documented errors of the routes that register workers or indexes."""


MAX_DETAIL_CHARS = 600
"""A 422 detail is cut here: it names fields and reasons, never the whole input."""

_HTTP_CODES = {404: "not_found", 405: "method_not_allowed", 401: "unauthorized", 403: "forbidden"}


def _validation_detail(exc: RequestValidationError) -> str:
    parts = []
    for e in exc.errors()[:5]:
        loc = ".".join(str(x) for x in e.get("loc", ()) if x != "body")[:120]
        msg = str(e.get("msg", "invalid"))[:200]
        parts.append(f"{loc}: {msg}" if loc else msg)
    more = len(exc.errors()) - 5
    if more > 0:
        parts.append(f"and {more} more")
    text = "; ".join(parts)
    return text if len(text) <= MAX_DETAIL_CHARS else text[: MAX_DETAIL_CHARS - 1] + "…"


def install_error_handlers(app: FastAPI) -> None:
    """Answer every error of ``app`` in the one shape: :class:`ApiError` as raised, a
    partition being taken over 503 with ``Retry-After`` (never a partial answer), a route
    that this advisor kind does not offer 501, an invalid request 422, Starlette's own
    errors (404, 405, 401, 403...) with their status."""

    @app.exception_handler(ApiError)
    async def _api_error(_req: Request, exc: ApiError) -> JSONResponse:
        return JSONResponse(status_code=exc.status, content={"error": exc.error, "detail": exc.detail},
                            headers=exc.headers)

    @app.exception_handler(PartitionUnavailable)
    async def _unavailable(_req: Request, exc: PartitionUnavailable) -> JSONResponse:
        # a partition of a scaled cluster is being taken over: never a partial answer
        retry = max(1, math.ceil(exc.retry_after_s))
        return JSONResponse(status_code=503, content={"error": "partition_unavailable", "detail": str(exc)[:200]},
                            headers={"Retry-After": str(retry)})

    @app.exception_handler(NotImplementedError)
    async def _not_here(_req: Request, exc: NotImplementedError) -> JSONResponse:
        return JSONResponse(status_code=501, content={"error": "not_implemented", "detail": str(exc)[:200]})

    @app.exception_handler(RequestValidationError)
    async def _invalid(_req: Request, exc: RequestValidationError) -> JSONResponse:
        return JSONResponse(status_code=422, content={"error": "invalid_request", "detail": _validation_detail(exc)})

    @app.exception_handler(StarletteHTTPException)
    async def _http(_req: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = _HTTP_CODES.get(exc.status_code, "http_error")
        return JSONResponse(status_code=exc.status_code, content={"error": code, "detail": str(exc.detail)[:200]},
                            headers=getattr(exc, "headers", None))
