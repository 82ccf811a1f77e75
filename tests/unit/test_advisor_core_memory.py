"""The compiled index's C arrays are allocated through PyMem, so tracemalloc counts them:
the memory-per-block figures (bench/advisor.py, docs/BENCHMARKS.md) include everything."""

from __future__ import annotations

import gc
import tracemalloc

from advisor.index import PrefixIndex
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch, store


def test_tracemalloc_sees_the_c_arrays() -> None:
    payloads = []
    for b in range(40):
        base = b * 1000
        evs = [store(base + i, base, base + i - 1 if i else None, 4096, "g1") for i in range(1000)]
        payloads.append(encode_batch(EventBatch(1, "w0", 1, b, 10 + b, evs)))
    gc.collect()
    tracemalloc.start()
    try:
        before = tracemalloc.get_traced_memory()[0]
        idx = PrefixIndex()
        for p in payloads:
            idx.apply_payload(p)
        used = tracemalloc.get_traced_memory()[0] - before
    finally:
        tracemalloc.stop()
    assert len(idx) == 40_000
    c_bytes = idx._memory_bytes()
    assert c_bytes >= 40_000 * 72  # records + hash/mask per block, at least
    assert used >= c_bytes  # every C array is traced
    assert used / len(idx) <= 200
