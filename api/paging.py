"""Paging of list routes: ``limit`` (1..:data:`MAX_PAGE`) and an opaque ``cursor``
(docs/operations.md, "Paging").

A cursor is the decimal position of the next item in the route's sorted order; a page
that is not the last one names its successor (``next_cursor`` in the body, or the
``X-Next-Cursor`` header for routes whose body shape is fixed by another API). Items added
or removed between pages may shift a page by as many items; nothing is repeated twice in a
row and the walk always ends.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar

from api.errors import ApiError

MAX_PAGE = 1000
"""Largest ``limit`` a list route accepts (its default too, unless stated)."""

T = TypeVar("T")


def parse_cursor(cursor: str | None) -> int:
    """Position a cursor names (0 for ``None``).

    Raises:
        ApiError: 400 ``bad_cursor`` when it is not a decimal position below 2**31.
    """
    if cursor is None or cursor == "":
        return 0
    if not cursor.isascii() or not cursor.isdigit() or len(cursor) > 10 or int(cursor) >= 1 << 31:
        raise ApiError(400, "bad_cursor", "cursor must be a value returned as next_cursor")
    return int(cursor)


def page(items: Sequence[T], limit: int, cursor: str | None) -> tuple[list[T], str | None]:
    """The page of ``items`` starting at ``cursor``, at most ``limit`` long, and the next cursor
    (``None`` on the last page).

    Raises:
        ApiError: 400 ``bad_cursor`` (see :func:`parse_cursor`).
    """
    start = parse_cursor(cursor)
    end = start + limit
    return list(items[start:end]), (str(end) if end < len(items) else None)
