"""Intrusive doubly linked lists over int arrays, for the compiled policy kernels.

Several lists share ``prev``/``nxt`` arrays (a block is in at most one list at a time);
list ``k`` has ``head[k]`` (newest, most recently inserted) and ``tail[k]`` (oldest) and
``size[k]``.  ``-1`` is the null link.  All functions are numba-compiled and O(1).
"""

from __future__ import annotations

import numba
import numpy as np


@numba.njit(cache=True, inline="always")
def push_head(prev: np.ndarray, nxt: np.ndarray, head: np.ndarray, tail: np.ndarray, size: np.ndarray,
              k: int, x: int) -> None:
    """Insert block ``x`` at the head (newest end) of list ``k``."""
    h = head[k]
    prev[x] = -1
    nxt[x] = h
    if h >= 0:
        prev[h] = x
    else:
        tail[k] = x
    head[k] = x
    size[k] += 1


@numba.njit(cache=True, inline="always")
def unlink(prev: np.ndarray, nxt: np.ndarray, head: np.ndarray, tail: np.ndarray, size: np.ndarray,
           k: int, x: int) -> None:
    """Remove block ``x`` from list ``k`` (``x`` must be in it)."""
    p = prev[x]
    n = nxt[x]
    if p >= 0:
        nxt[p] = n
    else:
        head[k] = n
    if n >= 0:
        prev[n] = p
    else:
        tail[k] = p
    prev[x] = -1
    nxt[x] = -1
    size[k] -= 1


@numba.njit(cache=True)
def new_lists(n_blocks: int, n_lists: int) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """``(prev, nxt, head, tail, size)`` for ``n_lists`` empty lists over ``n_blocks`` blocks."""
    return (np.full(n_blocks, -1, dtype=np.int32), np.full(n_blocks, -1, dtype=np.int32),
            np.full(n_lists, -1, dtype=np.int64), np.full(n_lists, -1, dtype=np.int64),
            np.zeros(n_lists, dtype=np.int64))


__all__ = ["new_lists", "push_head", "unlink"]
