"""The one error shape of the REST API (docs/operations.md, "Errors").

Every 4xx/5xx body is ``{"error": code, "detail": text}``: ``code`` is a stable machine
word (``unauthorized``, ``forbidden``, ``unknown_block``, ``invalid_request``...), ``detail``
a human sentence that never repeats a whole request body or a token.
"""

from __future__ import annotations

from typing import Any

import msgspec
from fastapi.responses import Response
from pydantic import BaseModel, Field

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
