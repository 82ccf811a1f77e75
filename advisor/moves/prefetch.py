"""Prefetch hints: a router's lookup starts promoting that prefix to the fast volume.

A router asks ``POST /v1/lookup`` before it dispatches a request, so the advisor learns
which prefix is about to be read before the engine reads it (docs/operations.md,
"Prefetch hints").  :meth:`Prefetcher.hint` takes the lookup's sequence hashes (a prefix,
first block first) and returns at once; a worker thread walks the prefix in the index,
turns each block held on a slow or archive volume (and not on the fast volume) into a
PROMOTE :class:`~advisor.policy.plan.PlanItem` to the fast volume, and hands it to the service's
own path for plan items (move guard, full-volume backoff, planner, the one mover): a
prefetch is a promotion the policy round would otherwise do later, just earlier.

Budgets and quotas:

* ``bytes_per_s`` / ``burst_bytes``: a token bucket (:class:`advisor.moves.planner.TokenBucket`)
  on the bytes prefetches copy; items wait in the queue until their bytes fit;
* ``max_pending_blocks``: blocks queued and not yet moved; a hint that does not fit is
  refused whole and counted (``refused``);
* ``max_blocks_per_hint``: the first blocks of a prefix only (the ones read first);
* ``max_tracked``: prefetched blocks awaiting a used / wasted verdict; the oldest is
  judged wasted when the table is full.

Outcome of a prefetched block (counters ``used`` / ``wasted``):

* **used**: its hit count rose after the move, i.e. a worker Stored it at ``g1``/``g2``
  again (it onboarded the block; ``BlockInfo.hits`` counts such re-Stores);
* **wasted**: before any such hit it left the fast volume (demoted, evicted, deleted), or
  ``used_window_s`` passed.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field

from advisor.index.prefix_index import BlockInfo
from advisor.policy.plan import PlanItem, PlanKind, PlanResult, PlanStatus
from advisor.moves.planner import TokenBucket

logger = logging.getLogger(__name__)


class PrefetchSettings(BaseModel):
    """Prefetch hints from lookups (``prefetch`` in the advisor settings).

    Attributes:
        enabled: take ``/v1/lookup`` s as prefetch hints.
        bytes_per_s: bandwidth budget of prefetch copies, bytes per second (default
            256 MiB/s, a quarter of a 10 Gb/s link to S3).
        burst_bytes: token-bucket depth; ``0`` = one second of ``bytes_per_s``.
        max_pending_blocks: blocks queued for a prefetch at once (the hint quota).
        max_blocks_per_hint: leading blocks of one looked-up prefix considered.
        used_window_s: seconds a prefetched block may wait for its first hit before it
            counts as wasted.
        max_tracked: prefetched blocks awaiting their verdict.
    """

    enabled: bool = True
    bytes_per_s: float = Field(256.0 * (1 << 20), gt=0.0, allow_inf_nan=False)
    burst_bytes: int = Field(0, ge=0)
    max_pending_blocks: int = Field(4096, ge=1)
    max_blocks_per_hint: int = Field(1024, ge=1)
    used_window_s: float = Field(600.0, gt=0.0, allow_inf_nan=False)
    max_tracked: int = Field(65_536, ge=1)


@dataclass
class PrefetchCounters:
    """What the prefetcher did since start.

    Attributes:
        hints: lookups taken as hints.
        refused: hints refused because the queue was full (``max_pending_blocks``).
        queued: blocks queued for a prefetch.
        issued: prefetch moves done (the block is on the fast volume).
        held: items the service held back (move guard, full-volume backoff, planner
            limits); dropped, a later lookup hints them again.
        skipped / failed: prefetch moves the mover skipped (stale) or failed.
        bytes: bytes the issued prefetches copied.
        used / wasted: verdicts on issued prefetches (module docstring).
    """

    hints: int = 0
    refused: int = 0
    queued: int = 0
    held: int = 0
    issued: int = 0
    skipped: int = 0
    failed: int = 0
    bytes: int = 0
    used: int = 0
    wasted: int = 0


class Prefetcher:
    """Turns lookup hints into promotions to the fast volume (module docstring).

    Args:
        settings: :class:`PrefetchSettings`.
        fast: the fast volume's id.
        sources: volumes a prefetch copies from, preferred first (slow volumes, then the
            archive).
        blocks: ``blocks(hashes)`` -> the index's :class:`BlockInfo` (or ``None``) of each
            hash, read under the index's lock.
        execute: ``execute(items)`` -> one :class:`PlanResult` per item carried out (the
            service's move guard, planner and mover; items it holds back get no result).
        clock: monotonic seconds (injectable for tests).
        room: ``room()`` -> bytes the fast volume may still take (``None``: unbounded). A
            prefetch never makes room: a pass takes queued items only while their bytes fit,
            and drops the rest as ``held`` (the router's next lookup brings them back), so a
            full fast volume costs no failed move.
    """

    def __init__(
        self,
        settings: PrefetchSettings,
        fast: str,
        sources: Sequence[str],
        blocks: Callable[[Sequence[int]], list[BlockInfo | None]],
        execute: Callable[[list[PlanItem]], list[PlanResult]],
        clock: Callable[[], float] = time.monotonic,
        room: Callable[[], int] | None = None,
    ) -> None:
        self.settings = settings
        self.fast = fast
        self.sources = list(sources)
        self._blocks = blocks
        self._execute = execute
        self._clock = clock
        self._room = room
        self.bucket = TokenBucket(settings.bytes_per_s, settings.burst_bytes or settings.bytes_per_s, clock)
        self.counters = PrefetchCounters()
        self._hints: deque[tuple[int, ...]] = deque()
        self._hint_blocks = 0  # blocks in self._hints (an upper bound of what they queue)
        self._in_flight = 0  # blocks taken from the hints or the queue and not yet done
        self._queue: OrderedDict[int, PlanItem] = OrderedDict()  # sequence hash -> item, oldest first
        self._tracked: OrderedDict[int, tuple[float, int]] = OrderedDict()  # hash -> (moved at, hits then)
        self._lock = threading.Lock()
        self._wake = threading.Event()

    # ---------------------------------------------------------------- producer side
    def hint(self, hashes: Sequence[int]) -> bool:
        """Take one lookup's prefix as a hint; cheap, never blocks on storage.

        Args:
            hashes: sequence hashes of the prefix, first block first (u64).

        Returns:
            Whether it was queued (``False``: refused by the quota, or empty).
        """
        if not hashes:
            return False
        head = tuple(hashes[: self.settings.max_blocks_per_hint])
        with self._lock:
            self.counters.hints += 1
            if self._pending() + len(head) > self.settings.max_pending_blocks:
                self.counters.refused += 1
                return False
            self._hints.append(head)
            self._hint_blocks += len(head)
        self._wake.set()
        return True

    # ---------------------------------------------------------------- worker side
    def _plan_hints(self) -> None:
        """Turn queued hints into queued PROMOTE items (blocks not yet on the fast volume)."""
        with self._lock:
            hints = list(self._hints)
            self._hints.clear()
            self._in_flight, self._hint_blocks = self._hint_blocks, 0  # still pending while planned
        for head in hints:
            for info in self._blocks(head):
                if info is None:
                    break  # the prefix ends where the index does
                h = info.sequence_hash
                if self.fast in info.locations or h in self._queue:
                    continue
                src = next((v for v in self.sources if v in info.locations), None)
                if src is None:
                    continue  # only in GPU / host memory of workers: nothing to promote
                item = PlanItem(PlanKind.PROMOTE, f"prefetch: a lookup named this prefix; {src} -> {self.fast}",
                                src, self.fast, sequence_hash=h, bytes=info.size)
                with self._lock:
                    self._queue[h] = item
                    self.counters.queued += 1
        with self._lock:
            self._in_flight = 0

    def step(self) -> list[PlanResult]:
        """One pass: plan the hints, move what the bandwidth budget allows, judge outcomes.

        Returns:
            The results of the prefetch moves carried out in this pass.
        """
        self._plan_hints()
        batch: list[PlanItem] = []
        room = self._room() if self._room is not None and self._queue else None
        no_room = 0
        with self._lock:
            while self._queue:
                h, item = next(iter(self._queue.items()))
                if room is not None and item.bytes > room:
                    del self._queue[h]  # the fast volume has no room for it: dropped, not failed
                    no_room += 1
                    continue
                if not self.bucket.try_take(item.bytes):
                    break  # the rest waits for the budget
                del self._queue[h]
                batch.append(item)
                if room is not None:
                    room -= item.bytes
            self._in_flight = len(batch)
            self.counters.held += no_room
        try:
            results = self._execute(batch) if batch else []
        finally:
            with self._lock:
                self._in_flight = 0
        with self._lock:
            self.counters.held += len(batch) - len(results)
        self._record(results)
        self.sweep()
        return results

    def _record(self, results: Sequence[PlanResult]) -> None:
        done = [r.item.sequence_hash for r in results if r.status is PlanStatus.DONE]
        infos = dict(zip(done, self._blocks(done))) if done else {}
        now = self._clock()
        with self._lock:
            for r in results:
                if r.status is PlanStatus.DONE:
                    self.counters.issued += 1
                    self.counters.bytes += r.bytes_moved
                    info = infos.get(r.item.sequence_hash)
                    self._track(r.item.sequence_hash, now, info.hits if info is not None else 0)
                elif r.status is PlanStatus.SKIPPED:
                    self.counters.skipped += 1
                else:
                    self.counters.failed += 1

    def _track(self, h: int, now: float, hits: int) -> None:
        self._tracked[h] = (now, hits)
        self._tracked.move_to_end(h)
        while len(self._tracked) > self.settings.max_tracked:
            self._tracked.popitem(last=False)
            self.counters.wasted += 1

    def sweep(self) -> None:
        """Judge each prefetched block: used (a hit since), wasted (off the fast volume, or
        ``used_window_s`` passed), or still waiting."""
        with self._lock:
            hashes = list(self._tracked)
        if not hashes:
            return
        infos = self._blocks(hashes)
        now = self._clock()
        with self._lock:
            for h, info in zip(hashes, infos):
                entry = self._tracked.get(h)
                if entry is None:
                    continue
                at, hits = entry
                if info is not None and info.hits > hits:
                    self.counters.used += 1
                elif info is None or self.fast not in info.locations or now - at > self.settings.used_window_s:
                    self.counters.wasted += 1
                else:
                    continue
                del self._tracked[h]

    def run(self, stop: threading.Event, idle_s: float = 0.5) -> None:
        """The worker loop: :meth:`step` on each hint, and every ``idle_s`` seconds, until
        ``stop`` is set.  Errors are logged; the loop goes on."""
        while not stop.is_set():
            self._wake.wait(idle_s)
            self._wake.clear()
            if stop.is_set():
                return
            try:
                self.step()
            except Exception:  # noqa: BLE001 - a failed pass must not end prefetching
                logger.exception("advisor: prefetch pass failed")
            with self._lock:
                waiting = bool(self._queue)
            if waiting and not stop.is_set():
                stop.wait(min(idle_s, 0.05))  # waiting for the bandwidth budget

    def stop(self) -> None:
        """Wake the worker loop so it sees its stop event."""
        self._wake.set()

    def _pending(self) -> int:
        """Blocks in hints not yet planned, queued, or being moved (caller holds the lock)."""
        return self._hint_blocks + len(self._queue) + self._in_flight

    def stats(self) -> dict[str, int]:
        """The counters (:class:`PrefetchCounters`) plus ``pending`` (blocks in hints not yet
        planned, queued, or being moved: 0 once every hint so far is carried out) and
        ``tracked`` (prefetched blocks awaiting a verdict)."""
        with self._lock:
            out = dict(vars(self.counters))
            out["pending"] = self._pending()
            out["tracked"] = len(self._tracked)
        return out


class PrefetchCollector(Collector):
    """Prometheus view of a :class:`Prefetcher`: ``kvadvisor_prefetch_total{outcome}``
    (``hint``, ``refused``, ``queued``, ``held``, ``issued``, ``skipped``, ``failed``, ``used``,
    ``wasted``), ``kvadvisor_prefetch_bytes_total`` and ``kvadvisor_prefetch_pending``."""

    def __init__(self, prefetcher: Prefetcher) -> None:
        self._p = prefetcher

    def collect(self) -> Iterator[Metric]:
        st = self._p.stats()
        c = CounterMetricFamily("kvadvisor_prefetch", "Prefetch hints and prefetch moves by outcome",
                                labels=["outcome"])
        for name in ("hints", "refused", "queued", "held", "issued", "skipped", "failed", "used", "wasted"):
            c.add_metric([name.removesuffix("s") if name == "hints" else name], st[name])
        yield c
        yield CounterMetricFamily("kvadvisor_prefetch_bytes", "Bytes copied by prefetch moves", value=st["bytes"])
        yield GaugeMetricFamily("kvadvisor_prefetch_pending", "Blocks waiting for a prefetch", value=st["pending"])


__all__ = ["PrefetchCollector", "PrefetchCounters", "PrefetchSettings", "Prefetcher"]
