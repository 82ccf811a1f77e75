"""Advisor ingest and lookup benchmark: our PrefixIndex vs NVIDIA Dynamo's RadixTree.

Same data for both, in one run: the Mooncake conversation trace's requests become Store
events (one per block, 4 workers round-robin).  Block ids are mapped to u64 sequence hashes
by a bijection (``--ids u64``, the default: real sequence hashes are u64, docs/design.md §4, and
a Python int above 2**60 is bigger than a small id) or used as is (``--ids raw``); both
sides get the same values, as sequence hashes and as Dynamo's local hashes.

* ours: KVEvent v1 batches (msgpack, ``batch_events`` events each) are folded from their
  bytes with ``PrefixIndex.apply_payload(payload)`` (what the advisor service does with a
  stream or journal entry: the compiled core parses and folds in one pass); the breakdown
  lines are :func:`event_plane.codec.decode_batch` alone (msgspec, the general path's
  decode) and ``PrefixIndex.apply_batch`` of already-decoded batches (the general path's
  fold).  Lookups are ``PrefixIndex.lookup(hashes)`` over every request's block list.
* Dynamo: one JSON ``stored`` event per request (its Python binding's input format,
  ``dynamo._core.RadixTree.apply_event(worker_id, json_bytes)``; each event carries the
  request's whole chain, walked from the root); lookups are ``find_matches(local_hashes)``
  with the lists built before timing.  Installed only with the ``bench`` extra.

Both rates count blocks: events/s = Store events (block references, 288,500 for the whole
file) / seconds.  Each side runs ``--repeat`` times, alternating ours and Dynamo so that
both see the same machine load; the medians are printed.

Admission: ``QuotaGuard.admit`` (the advisor service's quota step before the journal) of
every decoded batch against the index as it is before that batch, default limits (the rate
limit aside); printed beside the fold as its own rate and as a share of ``apply_payload``.

Memory per indexed block: ``tracemalloc`` bytes still allocated once the whole file is
decoded and folded (the batches are freed, so every int the index keeps, keys included,
is counted), divided by the number of indexed blocks.

New epoch: an index of ``--epoch-blocks`` blocks (default 1,000,000, on a volume) plus one
worker holding a few blocks in its ``g1``; the median cost of a 1-event batch that starts a
new epoch of that worker (its ``g1``/``g2`` residency is dropped) vs the same batch in its
current epoch, and the ratio; also the membership entries the drop read
(``PrefixIndex.private_visits``): the worker's blocks, not the index's.

Run: ``taskset -c 0 python bench/advisor.py [--trace FILE] [--requests N] [--repeat N] [--epoch-blocks N]``.
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
import tracemalloc
import os
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.index.prefix_index import PrefixIndex  # noqa: E402
from bench._report import Report, add_json_option  # noqa: E402
from advisor.ingest.quotas import QuotaGuard, QuotaLimits  # noqa: E402
from event_plane.codec import decode_batch, encode_batch  # noqa: E402
from event_plane.schema import EventBatch, store  # noqa: E402
from kvadvisor.trace import read_mooncake  # noqa: E402

# the whole Mooncake file where KVADVISOR_TRACES names its directory (docs/traces.md), else the bundled slice
_TRACES = os.environ.get("KVADVISOR_TRACES")
DEFAULT_TRACE = (Path(_TRACES) / "conversation_trace.jsonl" if _TRACES else
                 Path(__file__).resolve().parents[1] / "kvadvisor" / "data" / "mooncake_conversation_2000.jsonl")
WORKERS = 4
BLOCK_BYTES = 1 << 20
_M64 = (1 << 64) - 1


def to_u64(requests: list[tuple[int, ...]]) -> list[tuple[int, ...]]:
    """Map block ids to u64 hashes with an odd-multiplier bijection (distinct ids stay distinct)."""
    return [tuple((h * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & _M64 for h in r) for r in requests]


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


def run_ours(payloads: list[bytes], requests: list[tuple[int, ...]]) -> dict[str, float]:
    """Seconds to fold every payload (``apply_payload``), to decode only (``decode_batch``),
    to fold decoded batches only (``apply_batch``), and to look up every request."""
    t0 = time.perf_counter()
    batches = [decode_batch(p) for p in payloads]
    decode_s = time.perf_counter() - t0
    idx = PrefixIndex()
    guard = QuotaGuard(QuotaLimits(source_rate=1e15, source_burst=1 << 62))  # every other limit at its default
    admit = guard.admit
    admit_s = 0.0
    t0 = time.perf_counter()
    for b in batches:
        t1 = time.perf_counter()
        admit(b, idx)  # the service's admission step, against the index as it is before the batch
        admit_s += time.perf_counter() - t1
        idx.apply_batch(b)
    fold_s = time.perf_counter() - t0 - admit_s
    assert guard.changes == 0, guard.as_dict()  # nothing in the trace goes over a default quota
    del batches, idx
    idx = PrefixIndex()
    apply = idx.apply_payload
    t0 = time.perf_counter()
    for p in payloads:
        apply(p)
    apply_s = time.perf_counter() - t0
    lookup = idx.lookup
    t0 = time.perf_counter()
    for r in requests:
        lookup(r)
    lookup_s = time.perf_counter() - t0
    return {"apply_s": apply_s, "decode_s": decode_s, "fold_s": fold_s, "admit_s": admit_s, "lookup_s": lookup_s,
            "blocks": len(idx)}


def memory_per_block(payloads: list[bytes]) -> tuple[float, int]:
    """Bytes the index keeps per indexed block after folding every payload (tracemalloc)."""
    gc.collect()
    tracemalloc.start()
    base = tracemalloc.get_traced_memory()[0]
    idx = PrefixIndex()
    for p in payloads:
        idx.apply_payload(p)
    used = tracemalloc.get_traced_memory()[0] - base
    tracemalloc.stop()
    return used / max(len(idx), 1), len(idx)


def dynamo_inputs(requests: list[tuple[int, ...]]) -> tuple[list[tuple[int, bytes]], list[list[int]]]:
    """Dynamo's JSON ``stored`` events (one per request) and its lookup lists."""
    events = []
    for i, r in enumerate(requests):
        blocks = [{"block_hash": h, "tokens_hash": h} for h in r]
        events.append((i % WORKERS, json.dumps({"event_id": i, "data": {"stored": {
            "parent_hash": None, "blocks": blocks}}}).encode()))
    return events, [list(r) for r in requests]


def run_dynamo(tree_cls: Any, events: list[tuple[int, bytes]], queries: list[list[int]]) -> dict[str, float]:
    """Seconds for Dynamo's RadixTree to apply every event and to answer every query."""
    tree = tree_cls()
    t0 = time.perf_counter()
    for w, ev in events:
        tree.apply_event(w, ev)
    apply_s = time.perf_counter() - t0
    t0 = time.perf_counter()
    for q in queries:
        tree.find_matches(q)
    lookup_s = time.perf_counter() - t0
    return {"apply_s": apply_s, "lookup_s": lookup_s}


def bench_new_epoch(total: int, own: int, repeat: int = 21) -> dict[str, float]:
    """Median seconds of a new-epoch batch vs a normal batch of a worker holding ``own``
    g1 blocks, in an index of ``total`` blocks (see the module docstring)."""
    idx = PrefixIndex()
    step = 4096
    for start in range(0, total - own, step):
        n = min(step, total - own - start)
        idx.apply_payload(encode_batch(EventBatch(1, "bulk", 1, start // step, 1, [
            store((1 << 40) + start + i, (1 << 40) + start + i, None, BLOCK_BYTES, "fast") for i in range(n)])))
    mine = [store(h, h, None, BLOCK_BYTES, "g1") for h in range(1, own + 1)]
    probe = [store(1 << 50, 1 << 50, None, BLOCK_BYTES, "g2")]
    epoch, seq = 1, 0
    idx.apply_payload(encode_batch(EventBatch(1, "w1", epoch, seq, 1, mine)))
    normal: list[float] = []
    restart: list[float] = []
    visits: list[int] = []
    for _ in range(repeat):
        seq += 1
        payload = encode_batch(EventBatch(1, "w1", epoch, seq, 2, probe))
        t0 = time.perf_counter()
        idx.apply_payload(payload)
        normal.append(time.perf_counter() - t0)
        epoch, seq = epoch + 1, 0
        payload = encode_batch(EventBatch(1, "w1", epoch, seq, 3, probe))
        v0 = idx.private_visits
        t0 = time.perf_counter()
        idx.apply_payload(payload)  # drops w1/g1 (own blocks) and w1/g2
        restart.append(time.perf_counter() - t0)
        visits.append(idx.private_visits - v0)
        assert idx.count_at("w1/g1") == 0 and len(idx) == total - own + 1
        seq += 1
        idx.apply_payload(encode_batch(EventBatch(1, "w1", epoch, seq, 4, mine)))  # back for the next round
    return {"normal_s": statistics.median(normal), "epoch_s": statistics.median(restart),
            "visits": statistics.median(visits), "blocks": float(len(idx))}


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--trace", type=Path, default=DEFAULT_TRACE)
    ap.add_argument("--requests", type=int, default=0, help="first N requests (0 = all)")
    ap.add_argument("--batch-events", type=int, default=256)
    ap.add_argument("--ids", choices=("u64", "raw"), default="u64", help="hash values: u64 bijection or trace ids")
    ap.add_argument("--repeat", type=int, default=5, help="runs per side (medians are printed)")
    ap.add_argument("--epoch-blocks", type=int, default=1_000_000, help="index size of the new-epoch case (0 = skip)")
    add_json_option(ap)
    args = ap.parse_args(argv)
    report = Report("advisor", "prefix index: events folded and lookups against NVIDIA Dynamo's RadixTree",
                    argv=sys.argv[1:] if argv is None else argv)
    reqs = [r.hash_ids for r in read_mooncake(args.trace, args.requests or None)]
    if args.ids == "u64":
        reqs = to_u64(reqs)
    payloads, n_events = build_payloads(reqs, args.batch_events)
    try:
        from dynamo._core import RadixTree  # type: ignore[import-not-found]
    except Exception as exc:  # noqa: BLE001 - report why it is unavailable
        RadixTree = None  # noqa: N806
        why = f"Dynamo RadixTree unavailable: {type(exc).__name__}: {exc} (pip install -e '.[bench]')"
    dyn_in = dynamo_inputs(reqs) if RadixTree is not None else None
    ours: list[dict[str, float]] = []
    dyn: list[dict[str, float]] = []
    for _ in range(max(args.repeat, 1)):
        ours.append(run_ours(payloads, reqs))
        if dyn_in is not None:
            dyn.append(run_dynamo(RadixTree, *dyn_in))
    mem, blocks = memory_per_block(payloads)

    def med(runs: list[dict[str, float]], key: str) -> float:
        return statistics.median(r[key] for r in runs)

    o_apply = n_events / med(ours, "apply_s")
    o_lookup = len(reqs) / med(ours, "lookup_s")
    print(f"data: {len(reqs):,} requests, {n_events:,} Store events (block refs), {blocks:,} distinct blocks, "
          f"{len(payloads):,} batches, {args.ids} hashes; medians of {len(ours)} runs")
    print(f"{'':24}{'events/s applied':>20}{'lookups/s':>14}")
    print(f"{'ours (decode + apply)':24}{o_apply:>20,.0f}{o_lookup:>14,.0f}   apply_payload(bytes)")
    print(f"{'  decode only':24}{n_events / med(ours, 'decode_s'):>20,.0f}{'':14}   decode_batch (msgspec)")
    print(f"{'  apply only':24}{n_events / med(ours, 'fold_s'):>20,.0f}{'':14}   apply_batch(decoded batch)")
    print(f"{'  admission only':24}{n_events / med(ours, 'admit_s'):>20,.0f}{'':14}   QuotaGuard.admit (advisor/ingest/quotas.py), "
          f"{med(ours, 'admit_s') / med(ours, 'apply_s'):.2f}x the time of apply_payload")
    d_apply = d_lookup = None
    if not dyn:
        print(why)
    else:
        d_apply = n_events / med(dyn, "apply_s")
        d_lookup = len(reqs) / med(dyn, "lookup_s")
        print(f"{'Dynamo RadixTree':24}{d_apply:>20,.0f}{d_lookup:>14,.0f}")
        print(f"{'ratio ours / Dynamo':24}{o_apply / d_apply:>19.1f}x{o_lookup / d_lookup:>13.1f}x")
    print(f"memory per indexed block: {mem:.0f} bytes ({blocks:,} blocks, index kept after the batches are freed)")
    report.add("events folded, apply_payload (decode + apply), one core", o_apply, d_apply, unit="events/s",
               reference_name="Dynamo RadixTree.apply_event", goal=">= 3x Dynamo, >= 1,000,000 events/s",
               met=None if d_apply is None else (o_apply >= 3 * d_apply and o_apply >= 1e6))
    report.add("lookups of whole requests, one core", o_lookup, d_lookup, unit="lookups/s",
               reference_name="Dynamo RadixTree.find_matches", goal=">= 10x Dynamo",
               met=None if d_lookup is None else o_lookup >= 10 * d_lookup, headline=True)
    report.add("admission (QuotaGuard.admit)", n_events / med(ours, "admit_s"), o_apply, unit="events/s",
               reference_name="apply_payload of the same batches")
    report.add("memory per indexed block", mem, unit="B", goal="<= 200", met=mem <= 200, better="lower")
    if args.epoch_blocks > 0:
        for own in (16, 1024):
            r = bench_new_epoch(args.epoch_blocks, own)
            print(f"new epoch at {r['blocks']:,.0f} blocks, worker holding {own} g1 blocks: "
                  f"{r['epoch_s'] * 1e6:,.1f} us vs normal batch {r['normal_s'] * 1e6:,.1f} us = "
                  f"{r['epoch_s'] / r['normal_s']:.1f}x ({r['visits']:,.0f} membership entries read)")
            report.add(f"new epoch at {r['blocks']:,.0f} blocks, worker holding {own} g1 blocks", r["epoch_s"] * 1e6,
                       r["normal_s"] * 1e6, unit="µs", reference_name="the same batch in its epoch", better="lower")
    report.extra = {"requests": len(reqs), "events": n_events, "blocks": blocks, "ids": args.ids,
                    "repeat": len(ours)}
    report.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
