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
* ``max_pending_blocks``: blocks queued and not yet moved, shared by the routers that hint
  (below); a hint that does not fit is refused whole and counted (``refused``);
* ``max_blocks_per_hint``: the first blocks of a prefix only (the ones read first);
* ``max_tracked``: prefetched blocks awaiting a used / wasted verdict; the oldest is
  judged wasted when the table is full.

Fair share between routers (clients): each hint carries its client (the API passes a
digest of the bearer token, :func:`api.auth.client_of`; one ``anonymous`` client without
tokens), and each client has its own queue.  A client's pending blocks are those of its
hints not yet walked, of the hint being walked, its queued items and its items being moved.
Admission is *longest queue drop* (LQD, the shared-buffer rule of Suter et al., "Design
Considerations for Supporting TCP with Per-flow Queueing", INFOCOM 1998): a hint that does
not fit in ``max_pending_blocks`` takes room from the client holding the most pending blocks,
newest blocks first (``displaced``; any but those being moved), as long as that client still
holds more than the newcomer will; otherwise it is refused.  So a client that floods lookups
fills the queue only while nobody else needs it: any other client can queue up to an equal
share (``max_pending_blocks`` / clients with pending blocks), less only what of the longer
queues is being moved (one batch, the bandwidth budget's burst at most).  Room is taken by
water-filling over a heap, whole runs at a time: an admission costs O((clients + blocks) log
clients), never clients x blocks.  Service is round robin over the clients, one item each
per turn, within the bandwidth budget: a flood does not delay another client's prefetch by
more than one item per flooding client per turn.  Clients are kept only while they have
pending blocks, so their number is bounded by ``max_pending_blocks``.

Outcome of a prefetched block (counters ``used`` / ``wasted``):

* **used**: its hit count rose after the move, i.e. a worker Stored it at ``g1``/``g2``
  again (it onboarded the block; ``BlockInfo.hits`` counts such re-Stores);
* **wasted**: before any such hit it left the fast volume (demoted, evicted, deleted), or
  ``used_window_s`` passed.
"""

from __future__ import annotations

import heapq
import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector
from pydantic import BaseModel, Field

from advisor.index.prefix_index import BlockInfo
from advisor.policy.eviction.experts import ANONYMOUS
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
        refused: hints refused because the queue was full (``max_pending_blocks``) and no
            client held more than the hinting one would (module docstring, "Fair share").
        displaced: blocks dropped from the longest client's queue to admit another
            client's hint (its next lookup hints them again).
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
    displaced: int = 0
    queued: int = 0
    held: int = 0
    issued: int = 0
    skipped: int = 0
    failed: int = 0
    bytes: int = 0
    used: int = 0
    wasted: int = 0



@dataclass
class _ClientQueue:
    """One client's pending work: hints not yet planned, the blocks of the hint being planned
    (LQD may cut its tail), queued items, and blocks being moved (never dropped)."""

    hints: deque[tuple[int, ...]] = field(default_factory=deque)
    hint_blocks: int = 0
    planning: int = 0
    items: OrderedDict[int, PlanItem] = field(default_factory=OrderedDict)  # sequence hash -> item, oldest first
    flight: int = 0

    def pending(self) -> int:
        return self.hint_blocks + self.planning + len(self.items) + self.flight

    def droppable(self) -> int:
        return self.hint_blocks + self.planning + len(self.items)


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
        # client -> its queue, in round-robin order (served clients move to the end); a client
        # is dropped once it has nothing pending
        self._clients: OrderedDict[str, _ClientQueue] = OrderedDict()
        self._owner: dict[int, str] = {}  # sequence hash -> client whose queue holds its item
        self._total = 0  # sum of the clients' pending blocks
        self._tracked: OrderedDict[int, tuple[float, int]] = OrderedDict()  # hash -> (moved at, hits then)
        self._lock = threading.Lock()
        self._wake = threading.Event()

    # ---------------------------------------------------------------- producer side
    def hint(self, hashes: Sequence[int], client: str = ANONYMOUS) -> bool:
        """Take one lookup's prefix as a hint; cheap, never blocks on storage.

        Args:
            hashes: sequence hashes of the prefix, first block first (u64).
            client: who hinted (module docstring, "Fair share"; not a secret: the API
                passes a digest of the token).

        Returns:
            Whether it was queued (``False``: refused by the quota, or empty).
        """
        if not hashes:
            return False
        head = tuple(hashes[: self.settings.max_blocks_per_hint])
        with self._lock:
            self.counters.hints += 1
            mine = self._clients.get(client)
            after = (mine.pending() if mine is not None else 0) + len(head)
            if not self._make_room(self._pending() + len(head) - self.settings.max_pending_blocks, client, after):
                self.counters.refused += 1
                return False
            if mine is None:
                mine = self._clients[client] = _ClientQueue()
            mine.hints.append(head)
            mine.hint_blocks += len(head)
            self._total += len(head)
        self._wake.set()
        return True

    def _make_room(self, need: int, client: str, after: int) -> bool:
        """Free ``need`` blocks for ``client`` (who will hold ``after``) by longest queue drop;
        ``False`` (and nothing dropped) when that cannot free enough (caller holds the lock)."""
        if need <= 0:
            return True
        # what LQD may take: each other client down to ``after`` blocks, from what is droppable
        heap = [(-p, name) for name, q in self._clients.items()
                if name != client and (p := q.pending()) > after and q.droppable()]
        if sum(min(self._clients[n].droppable(), -p - after) for p, n in heap) < need:
            return False
        heapq.heapify(heap)
        while need > 0:  # water-filling: from the client holding the most, down to the next one
            p, name = heapq.heappop(heap)
            q = self._clients[name]
            level = max(after, -heap[0][0]) if heap else after
            dropped = self._drop_newest(name, min(need, q.droppable(), max(1, -p - level)))
            need -= dropped
            if -p - dropped > after and q.droppable():
                heapq.heappush(heap, (p + dropped, name))
        return True

    def _drop_newest(self, name: str, n: int) -> int:
        """Drop up to ``n`` of client ``name``'s newest blocks: the last blocks of its newest
        hint, then the last of the hint being planned, then its newest queued items (caller
        holds the lock); returns how many."""
        q = self._clients[name]
        dropped = 0
        while dropped < n and q.hints:
            last = q.hints.pop()
            keep = max(0, len(last) - (n - dropped))
            dropped += len(last) - keep
            q.hint_blocks -= len(last) - keep
            if keep:
                q.hints.append(last[:keep])
        cut = min(n - dropped, q.planning)  # _plan_hints queues only the first ``planning`` blocks
        q.planning -= cut
        dropped += cut
        while dropped < n and q.items:
            h, _ = q.items.popitem(last=True)
            del self._owner[h]
            dropped += 1
        self._total -= dropped
        self.counters.displaced += dropped
        if not q.pending():
            del self._clients[name]
        return dropped

    # ---------------------------------------------------------------- worker side
    def _plan_hints(self) -> None:
        """Turn queued hints into queued PROMOTE items (blocks not yet on the fast volume), one
        hint at a time (each hint queued before this pass): the hint being walked stays
        pending (``planning``) and its tail may be displaced meanwhile; its blocks leave
        ``planning`` as they become items, under one lock, so none counts twice."""
        with self._lock:
            work = [(name, len(q.hints)) for name, q in self._clients.items() if q.hints]
        for name, n in work:
            for _ in range(n):
                with self._lock:
                    q = self._clients.get(name)
                    if q is None or not q.hints:
                        break  # displaced meanwhile
                    head = q.hints.popleft()
                    q.hint_blocks -= len(head)
                    q.planning = len(head)
                items: list[tuple[int, PlanItem]] = []  # (position in the hint, item)
                for pos, info in enumerate(self._blocks(head)):
                    if info is None:
                        break  # the prefix ends where the index does
                    if self.fast in info.locations:
                        continue
                    src = next((v for v in self.sources if v in info.locations), None)
                    if src is None:
                        continue  # only in GPU / host memory of workers: nothing to promote
                    items.append((pos, PlanItem(PlanKind.PROMOTE,
                                                f"prefetch: a lookup named this prefix; {src} -> {self.fast}",
                                                src, self.fast, sequence_hash=info.sequence_hash, bytes=info.size)))
                with self._lock:
                    keep, q.planning = q.planning, 0  # LQD may have cut the tail (q is gone if all of it)
                    self._total -= keep
                    for pos, item in items:
                        h = item.sequence_hash
                        if pos >= keep:
                            break
                        if h in self._owner:
                            continue  # queued already (by this client or another)
                        q.items[h] = item
                        self._owner[h] = name
                        self._total += 1
                        self.counters.queued += 1
                    if not q.pending() and self._clients.get(name) is q:
                        del self._clients[name]

    def step(self) -> list[PlanResult]:
        """One pass: plan the hints, move what the bandwidth budget allows, judge outcomes.

        Returns:
            The results of the prefetch moves carried out in this pass.
        """
        self._plan_hints()
        batch: list[PlanItem] = []
        with self._lock:
            waiting = self._waiting()
        room = self._room() if self._room is not None and waiting else None
        no_room = 0
        flying: dict[str, int] = {}  # client -> its blocks in this batch
        with self._lock:
            budget = True
            while budget and self._waiting():
                for name in list(self._clients):  # one turn: an item of each client, in order
                    q = self._clients[name]
                    if not q.items:
                        continue
                    h, item = next(iter(q.items.items()))
                    if room is not None and item.bytes > room:
                        self._take(name, h)  # the fast volume has no room for it: dropped, not failed
                        no_room += 1
                        continue
                    if not self.bucket.try_take(item.bytes):
                        budget = False  # the rest waits for the budget; this client goes first next time
                        break
                    self._take(name, h, flight=True)
                    flying[name] = flying.get(name, 0) + 1
                    self._clients.move_to_end(name)  # its turn is over: the others go first
                    batch.append(item)
                    if room is not None:
                        room -= item.bytes
            self.counters.held += no_room
        try:
            results = self._execute(batch) if batch else []
        finally:
            with self._lock:  # the moves are over: out of their clients' shares
                for name, n in flying.items():
                    q = self._clients[name]  # kept while it has blocks in flight (never dropped)
                    q.flight -= n
                    self._total -= n
                    if not q.pending():
                        del self._clients[name]
        with self._lock:
            self.counters.held += len(batch) - len(results)
        self._record(results)
        self.sweep()
        return results

    def _take(self, name: str, h: int, flight: bool = False) -> None:
        """Take item ``h`` off client ``name``'s queue (caller holds the lock): dropped, or into
        the blocks it has being moved (``flight``, still in its share until the move ends)."""
        q = self._clients[name]
        del q.items[h]
        del self._owner[h]
        if flight:
            q.flight += 1
            return
        self._total -= 1
        if not q.pending():
            del self._clients[name]

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
                waiting = self._waiting()
            if waiting and not stop.is_set():
                stop.wait(min(idle_s, 0.05))  # waiting for the bandwidth budget

    def stop(self) -> None:
        """Wake the worker loop so it sees its stop event."""
        self._wake.set()

    def _waiting(self) -> bool:
        """Whether some client has queued items (caller holds the lock)."""
        return any(q.items for q in self._clients.values())

    def _pending(self) -> int:
        """Blocks in hints not yet planned, queued, or being moved (caller holds the lock)."""
        return self._total

    def stats(self) -> dict[str, int]:
        """The counters (:class:`PrefetchCounters`) plus ``pending`` (blocks in hints not yet
        planned, queued, or being moved: 0 once every hint so far is carried out),
        ``clients`` (clients with pending blocks) and ``tracked`` (prefetched blocks awaiting
        a verdict)."""
        with self._lock:
            out = dict(vars(self.counters))
            out["pending"] = self._pending()
            out["clients"] = len(self._clients)
            out["tracked"] = len(self._tracked)
        return out


class PrefetchCollector(Collector):
    """Prometheus view of a :class:`Prefetcher`: ``kvadvisor_prefetch_total{outcome}``
    (``hint``, ``refused``, ``displaced``, ``queued``, ``held``, ``issued``, ``skipped``, ``failed``, ``used``,
    ``wasted``), ``kvadvisor_prefetch_bytes_total`` and ``kvadvisor_prefetch_pending``."""

    def __init__(self, prefetcher: Prefetcher) -> None:
        self._p = prefetcher

    def collect(self) -> Iterator[Metric]:
        st = self._p.stats()
        c = CounterMetricFamily("kvadvisor_prefetch", "Prefetch hints and prefetch moves by outcome",
                                labels=["outcome"])
        for name in ("hints", "refused", "displaced", "queued", "held", "issued", "skipped", "failed", "used",
                     "wasted"):
            c.add_metric([name.removesuffix("s") if name == "hints" else name], st[name])
        yield c
        yield CounterMetricFamily("kvadvisor_prefetch_bytes", "Bytes copied by prefetch moves", value=st["bytes"])
        yield GaugeMetricFamily("kvadvisor_prefetch_pending", "Blocks waiting for a prefetch", value=st["pending"])


__all__ = ["PrefetchCollector", "PrefetchCounters", "PrefetchSettings", "Prefetcher"]
