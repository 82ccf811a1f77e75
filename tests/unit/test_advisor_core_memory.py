"""The compiled index's C arrays are allocated through PyMem, so tracemalloc counts them:
the memory-per-block figures (bench/advisor.py, docs/BENCHMARKS.md) include everything."""

from __future__ import annotations

import gc
import tracemalloc

from advisor.index.prefix_index import PrefixIndex
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


def test_a_huge_batch_does_not_keep_its_scratch_array() -> None:
    evs = [store(i + 1, 1, i if i else None, 4096, "g1") for i in range(50_000)]
    b = EventBatch(1, "w0", 1, 0, 10, evs)
    for apply in ("apply_payload", "apply_batch"):
        idx = PrefixIndex()
        getattr(idx, apply)(encode_batch(b) if apply == "apply_payload" else b)
        assert len(idx) == 50_000
        same = PrefixIndex()  # the same blocks through 100-event batches
        for k in range(0, 50_000, 100):
            same.apply_batch(EventBatch(1, "w0", 1, k // 100, 10, evs[k:k + 100]))
        assert same.dump()["blocks"] == idx.dump()["blocks"]
        # the 50,000-event scratch (48 B per event, 2.4 MB) is not kept
        assert idx._memory_bytes() <= same._memory_bytes() + 8192 * 48
