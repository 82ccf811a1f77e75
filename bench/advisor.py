"""Advisor ingest and lookup benchmark: our PrefixIndex vs NVIDIA Dynamo's RadixTree.

Same data for both, in one run: the Mooncake conversation trace's requests become Store
events (one per block, 4 workers round-robin, block ids as sequence and local hashes).

* ours: KVEvent v1 batches (msgpack, ``batch_events`` events each) are decoded with
  :func:`event_plane.codec.decode_batch` and folded with ``PrefixIndex.apply_batch``;
  lookups are ``PrefixIndex.lookup(hashes)`` over every request's block list.
* Dynamo: one JSON ``stored`` event per request (its Python binding's input format,
  ``dynamo._core.RadixTree.apply_event(worker_id, json_bytes)``); lookups are
  ``find_matches(local_hashes)``.  Installed only with the ``bench`` extra.

Memory per indexed block: ``tracemalloc`` bytes allocated by building the index, divided
by its number of blocks.

Run: ``python bench/advisor.py [--trace FILE] [--requests N]``.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
import tracemalloc
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.index import PrefixIndex  # noqa: E402
from event_plane.codec import decode_batch, encode_batch  # noqa: E402
from event_plane.schema import EventBatch, store  # noqa: E402
from kvadvisor.trace import read_mooncake  # noqa: E402

DEFAULT_TRACE = Path(__file__).resolve().parents[2] / "shared" / "traces" / "conversation_trace.jsonl"
WORKERS = 4
BLOCK_BYTES = 1 << 20


def build_payloads(requests: list[tuple[int, ...]], batch_events: int) -> tuple[list[bytes], int]:
    """Encode every request's blocks as Store events into KVEvent v1 batches per worker."""
    pending: dict[int, list] = {w: [] for w in range(WORKERS)}
    seqs = dict.fromkeys(range(WORKERS), 0)
    out: list[bytes] = []
    n = 0

    def flush(w: int) -> None:
        out.append(encode_batch(EventBatch(1, f"w{w}", 7, seqs[w], 1_000 + len(out), pending[w])))
        seqs[w] += 1
        pending[w] = []

    for i, r in enumerate(requests):
        w = i % WORKERS
        parent = None
        for h in r:
            pending[w].append(store(h, r[0], parent, BLOCK_BYTES, "g1"))
            parent = h
            n += 1
        if len(pending[w]) >= batch_events:
            flush(w)
    for w in range(WORKERS):
        if pending[w]:
            flush(w)
    return out, n


def bench_ours(payloads: list[bytes], requests: list[tuple[int, ...]], n_events: int) -> dict[str, float]:
    idx = PrefixIndex()
    t0 = time.perf_counter()
    for p in payloads:
        idx.apply_batch(decode_batch(p))
    apply_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in requests:
        idx.lookup(r)
    lookup_s = time.perf_counter() - t0
    return {"events_per_s": n_events / apply_s, "lookups_per_s": len(requests) / lookup_s,
            "blocks": float(len(idx))}


def memory_per_block(payloads: list[bytes]) -> tuple[float, int]:
    batches = [decode_batch(p) for p in payloads]
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex()
    for b in batches:
        idx.apply_batch(b)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / max(len(idx), 1), len(idx)


def bench_dynamo(requests: list[tuple[int, ...]], n_events: int) -> dict[str, float] | str:
    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - report why it is unavailable
        return f"Dynamo RadixTree unavailable: {type(exc).__name__}: {exc} (pip install -e '.[bench]')"
    events = []
    for i, r in enumerate(requests):
        blocks = [{"block_hash": h, "tokens_hash": h} for h in r]
        events.append((i % WORKERS, json.dumps({"event_id": i, "data": {"stored": {
            "parent_hash": None, "blocks": blocks}}}).encode()))
    tree = RadixTree()
    t0 = time.perf_counter()
    for w, ev in events:
        tree.apply_event(w, ev)
    apply_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for r in requests:
        tree.find_matches(list(r))
    lookup_s = time.perf_counter() - t0
    return {"events_per_s": n_events / apply_s, "lookups_per_s": len(requests) / lookup_s}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=0, help="first N requests (0 = all)")
    ap.add_argument("--batch-events", type=int, default=256)
    args = ap.parse_args(argv)
    reqs = [r.hash_ids for r in read_mooncake(args.trace, args.requests or None)]
    payloads, n_events = build_payloads(reqs, args.batch_events)
    ours = bench_ours(payloads, reqs, n_events)
    mem, blocks = memory_per_block(payloads)
    dyn = bench_dynamo(reqs, n_events)
    print(f"data: {len(reqs):,} requests, {n_events:,} Store events (block refs), {blocks:,} distinct blocks, "
          f"{len(payloads):,} batches")
    print(f"{'':24}{'events/s applied':>20}{'lookups/s':>14}")
    print(f"{'ours (decode + apply)':24}{ours['events_per_s']:>20,.0f}{ours['lookups_per_s']:>14,.0f}")
    if isinstance(dyn, str):
        print(dyn)
    else:
        print(f"{'Dynamo RadixTree':24}{dyn['events_per_s']:>20,.0f}{dyn['lookups_per_s']:>14,.0f}")
        print(f"{'ratio ours / Dynamo':24}{ours['events_per_s'] / dyn['events_per_s']:>19.1f}x"
              f"{ours['lookups_per_s'] / dyn['lookups_per_s']:>13.1f}x")
    print(f"memory per indexed block: {mem:.0f} bytes ({blocks:,} blocks)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
