"""Names of the evaluator's policies and the function that replays each.

Every entry maps a name to ``simulate(trace, capacity, lookahead, promote) -> hits per
request`` (int64 ``[requests]``).  Baselines ignore ``lookahead`` and ``promote`` (they take
no hints); the default policy (:data:`DEFAULT_POLICY`) uses them
(:mod:`advisor.policy.eviction.prefix_value`).
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from advisor.policy.eviction import (arc, belady, experts, finish_aware, lfu_da, lru, prefix_lru, prefix_value, s3fifo,
                                     sieve)
from advisor.policy.eviction.compact import CompactTrace

Simulator = Callable[[CompactTrace, int, int, bool], np.ndarray]

LRU = "lru"
BELADY = "belady"
DEFAULT_POLICY = "adaptive"
BASELINES: tuple[str, ...] = ("lru", "arc", "lfu_da", "s3fifo", "sieve", "prefix_lru")
"""Online baselines from the literature, in report order (LRU first)."""

LABELS: dict[str, str] = {
    "lru": "LRU", "arc": "ARC", "lfu_da": "LFU-DA", "s3fifo": "S3-FIFO", "sieve": "SIEVE",
    "prefix_lru": "prefix-LRU", "belady": "Belady", "prefix_value": "prefix_value",
    "finish_aware": "finish-aware", "adaptive": "default", "arc_tail": "ARC tail-first",
    "s3fifo_tail": "S3-FIFO tail-first", "lfu_da_tail": "LFU-DA tail-first", "lru_tail": "LRU tail-first",
}


def _no_hints(mod: object, **kwargs: bool) -> Simulator:
    def run(trace: CompactTrace, capacity: int, lookahead: int = 0, promote: bool = True) -> np.ndarray:
        return mod.simulate(trace, capacity, **kwargs)  # type: ignore[attr-defined,no-any-return]
    return run


POLICIES: dict[str, Simulator] = {
    "lru": _no_hints(lru),
    "arc": _no_hints(arc),
    "lfu_da": _no_hints(lfu_da),
    "s3fifo": _no_hints(s3fifo),
    "sieve": _no_hints(sieve),
    "arc_tail": _no_hints(arc, tail_first=True),
    "lfu_da_tail": _no_hints(lfu_da, tail_first=True),
    "s3fifo_tail": _no_hints(s3fifo, tail_first=True),
    "lru_tail": _no_hints(lru, tail_first=True),
    "prefix_lru": _no_hints(prefix_lru),
    "belady": _no_hints(belady),
    "finish_aware": _no_hints(finish_aware),
    "prefix_value": lambda trace, capacity, lookahead=0, promote=True: prefix_value.simulate(
        trace, capacity, lookahead, promote=promote),
    "adaptive": lambda trace, capacity, lookahead=0, promote=True: (
        experts.simulate(trace, capacity) if lookahead <= 0
        else prefix_value.simulate(trace, capacity, lookahead, promote=promote)),
}

__all__ = ["BASELINES", "BELADY", "DEFAULT_POLICY", "LABELS", "LRU", "POLICIES", "Simulator"]
