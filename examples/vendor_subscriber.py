#!/usr/bin/env python
"""A storage vendor's subscriber: follow a KV-event stream, keep a prefix tree and an LRU
index of blocks, print a summary.

    python examples/vendor_subscriber.py "zmq://127.0.0.1:5557?replay=5558" --duration 30
    python examples/vendor_subscriber.py "jetstream://127.0.0.1:4222?durable=vendor-a" -n 100000
    python examples/vendor_subscriber.py "vllm+zmq://10.0.0.5:5557?replay=5558&source=pod-a"

* The prefix tree is the SDK's :class:`event_plane.sdk.BlockTracker` (sequence hash →
  parent, prefix family, size, holders), fed batch by batch in per-source order; it is
  idempotent, links orphans when their parent arrives and drops a restarted worker's
  g1/g2 blocks.
* The LRU index models a vendor cache of ``--lru-capacity`` blocks: every Store touches its
  block (a re-Store is a hit), blocks no location holds any more leave it, and the least
  recently stored block is evicted when it is full.
* When the subscriber had to drop or lost batches of a source, the source is listed under
  ``resync_needed``: a real vendor would rebuild that source's state (snapshot, replay).

The summary is one JSON object on stdout.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter, OrderedDict
from typing import Any

from event_plane import EventType, subscribe
from event_plane.sdk import BlockTracker


class LruIndex:
    """Sequence hash → block size, least recently stored first; bounded by ``capacity``."""

    def __init__(self, capacity: int) -> None:
        self.capacity = capacity
        self.blocks: OrderedDict[int, int] = OrderedDict()
        self.hits = 0
        self.inserts = 0
        self.evictions = 0
        self.bytes = 0

    def touch(self, sequence_hash: int, size: int) -> None:
        """A Store of the block: insert it or mark it most recently used (a hit)."""
        if sequence_hash in self.blocks:
            self.hits += 1
            self.blocks.move_to_end(sequence_hash)
            return
        self.inserts += 1
        self.blocks[sequence_hash] = size
        self.bytes += size
        while len(self.blocks) > self.capacity:
            _, old = self.blocks.popitem(last=False)
            self.bytes -= old
            self.evictions += 1

    def discard(self, sequence_hash: int) -> None:
        """The block is gone everywhere: forget it."""
        size = self.blocks.pop(sequence_hash, None)
        if size is not None:
            self.bytes -= size


def follow(url: str, *, max_events: int | None, duration: float | None, idle: float | None, lru_capacity: int) -> dict[str, Any]:
    """Subscribe to ``url`` and fold events until a limit is reached; return the summary."""
    tracker = BlockTracker()
    lru = LruIndex(lru_capacity)
    sub = subscribe(url, queue_capacity=10_000)
    sub.start()
    print("subscribed", url, file=sys.stderr, flush=True)
    events = batches = 0
    epochs: dict[str, int] = {}
    t0 = last_batch = time.monotonic()
    try:
        while max_events is None or events < max_events:
            now = time.monotonic()
            if duration is not None and now - t0 >= duration:
                break
            if idle is not None and batches and now - last_batch >= idle:
                break
            batch = sub.get(timeout=0.1)
            if batch is None:
                continue
            last_batch = time.monotonic()
            batches += 1
            events += len(batch.events)
            if not tracker.apply_batch(batch):
                continue
            for ev in batch.events:
                if ev.type == EventType.STORE and ev.sequence_hash in tracker:
                    lru.touch(ev.sequence_hash, ev.block_size)
            for ev in batch.events:  # blocks that no location holds any more
                if ev.type != EventType.STORE and ev.sequence_hash not in tracker:
                    lru.discard(ev.sequence_hash)
            restarted = epochs.setdefault(batch.source, batch.epoch) != batch.epoch
            epochs[batch.source] = batch.epoch
            if restarted or any(ev.type == EventType.CLEARED for ev in batch.events):
                for h in [h for h in lru.blocks if h not in tracker]:  # whole locations emptied
                    lru.discard(h)
    finally:
        sub.close()
    return summary(tracker, lru, sub, events, batches, time.monotonic() - t0)


def summary(tracker: BlockTracker, lru: LruIndex, sub: Any, events: int, batches: int, seconds: float) -> dict[str, Any]:
    """The JSON-ready summary printed at the end."""
    ts = tracker.stats()
    families: Counter[int] = Counter()
    by_location: Counter[str] = Counter()
    for block in tracker:
        families[block.prefix_hash] += 1
        for _, loc in block.holders:
            by_location[loc] += 1
    ss = sub.stats()
    return {
        "seconds": round(seconds, 3),
        "batches": batches,
        "events": events,
        "blocks": ts.blocks,
        "blocks_by_location": dict(sorted(by_location.items())),
        "prefix_families": len(families),
        "top_prefixes": [{"prefix_hash": p, "blocks": n} for p, n in families.most_common(5)],
        "orphans": ts.orphans,
        "duplicate_stores": ts.duplicate_stores,
        "unknown_removes": ts.unknown_removes,
        "self_parent_rejected": ts.self_parent,
        "restarts": ts.restarts,
        "lru": {
            "capacity": lru.capacity,
            "size": len(lru.blocks),
            "bytes": lru.bytes,
            "inserts": lru.inserts,
            "hits": lru.hits,
            "evictions": lru.evictions,
            "most_recent": list(lru.blocks)[-5:],
        },
        "subscriber": {"gaps": ss.gaps, "replayed": ss.replayed, "unrecovered": ss.unrecovered, "dropped": ss.dropped},
        "resync_needed": sorted(sub.resync_needed),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("url", help="event URL (zmq://, nats://, jetstream://, vllm+zmq://, sglang+zmq://)")
    parser.add_argument("-n", "--max-events", type=int, default=None, help="stop after N events")
    parser.add_argument("-d", "--duration", type=float, default=None, help="stop after S seconds")
    parser.add_argument("--idle", type=float, default=None, help="stop after S seconds without a batch")
    parser.add_argument("--lru-capacity", type=int, default=100_000, help="blocks the LRU index holds")
    args = parser.parse_args(argv)
    if args.max_events is None and args.duration is None and args.idle is None:
        args.duration = 10.0
    result = follow(args.url, max_events=args.max_events, duration=args.duration, idle=args.idle, lru_capacity=args.lru_capacity)
    print(json.dumps(result))
    return 0


if __name__ == "__main__":
    sys.exit(main())
