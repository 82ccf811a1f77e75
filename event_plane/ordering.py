"""Per-source ordering on the subscriber side: seq tracking, gaps, replay, restarts.

Rules (``docs/events.md`` §4):

* per (source, epoch), batches are delivered in seq order, each at most once;
* a seq jump is a gap: the missing seqs are asked from the transport (``recover``) and
  delivered before the later batch; seqs it cannot supply are counted as unrecovered;
* the first batch of a source/epoch never seen before is expected to have seq 0; a higher
  seq is a gap from 0 (a subscriber that joined late recovers what is still buffered);
* a seq more than ``max_gap`` (:data:`MAX_GAP`) past the expected one is implausible, for a
  tracked source and a new source/epoch alike: the batch is dropped and counted as a decode
  error, and nothing else changes;
* a new epoch of a known source is a restart: tracking starts afresh, and batches of the
  superseded epoch that arrive later are dropped (counted as duplicates);
* with a ``keep`` predicate (the subscriber's: the source is bound to an origin, i.e. the
  application admitted it), at most ``max_unkept`` (:data:`MAX_UNKEPT_SOURCES`) sources not
  kept are tracked: beyond, the least recently seen of them is forgotten (counted in
  ``sources_forgotten``; its next batch is taken for a new source). A publisher sending
  under ever new names cannot grow the tracker without bound.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator

from event_plane.config import SubscriberStats
from event_plane.schema import EventBatch

MAX_RETIRED_EPOCHS = 8
"""Superseded epochs kept per source (by the subscriber's tracker and the advisor's index).
A source needs a handful: a batch of an epoch forgotten beyond these (more than this many
restarts ago) is taken for a new epoch. Without a bound, a publisher opening a new epoch
per batch grows both without limit."""


class RetiredEpochs:
    """The newest ``cap`` superseded epochs of one source, in retirement order.

    A set-like container (``add``, ``in``, ``len``, iteration oldest first): adding beyond
    ``cap`` forgets the oldest and counts it in :attr:`forgotten`.

    Args:
        epochs: epochs already retired, oldest first (at most the newest ``cap`` are kept).
        cap: how many are kept (:data:`MAX_RETIRED_EPOCHS`).
    """

    __slots__ = ("_epochs", "cap", "forgotten")

    def __init__(self, epochs: Iterable[int] = (), cap: int = MAX_RETIRED_EPOCHS) -> None:
        self.cap = cap
        self.forgotten = 0
        self._epochs: dict[int, None] = {}
        for e in epochs:
            self.add(e)
        self.forgotten = 0

    def add(self, epoch: int) -> None:
        """Retire ``epoch`` (moved to the newest end if already there)."""
        d = self._epochs
        d.pop(epoch, None)
        d[epoch] = None
        if len(d) > self.cap:
            del d[next(iter(d))]
            self.forgotten += 1

    def __contains__(self, epoch: object) -> bool:
        return epoch in self._epochs

    def __iter__(self) -> Iterator[int]:
        return iter(self._epochs)

    def __len__(self) -> int:
        return len(self._epochs)

    def __eq__(self, other: object) -> bool:
        if isinstance(other, RetiredEpochs):
            return list(self._epochs) == list(other._epochs)
        if isinstance(other, set | frozenset):
            return set(self._epochs) == other
        return NotImplemented

    def __repr__(self) -> str:
        return f"RetiredEpochs({list(self._epochs)!r})"

logger = logging.getLogger(__name__)

GapCallback = Callable[[str, int, int, int], None]
"""``on_gap(source, epoch, first_missing, last_missing)``; seqs are inclusive."""

LostCallback = Callable[[str, int, int], None]
"""``on_lost(source, epoch, count)``: ``count`` batches of that source are known lost."""

Recover = Callable[[str, int, int, int], list[EventBatch]]
"""``recover(source, epoch, first, last)`` -> the batches of that range it could fetch."""


MAX_UNKEPT_SOURCES = 4096
"""Sources a :class:`SeqTracker` with a ``keep`` predicate tracks at most while they are not
kept (for the advisor: not bound to an origin, so never admitted); as many as the origin
guard's claims (:class:`event_plane.origins.OriginGuard`)."""

MAX_GAP = 1 << 24
"""Largest seq jump accepted (16.7 M batches): past the next expected seq of a tracked
source, or past 0 for the first batch of a new source/epoch on a live transport."""


class SeqTracker:
    """Applies the ordering rules to batches of one or more sources.

    Not thread-safe: feed it from one thread (a transport's receiver thread).

    Args:
        stats: counters to update in place.
        deliver: called with each batch to hand to the application, in delivery order.
        on_gap: optional gap callback; its exceptions are logged and ignored.
        first_seq_gap: treat a first batch with seq > 0 of an unseen source/epoch as a gap
            from 0 (live transports). ``False`` for a durable log read from a stored
            position (JetStream durable consumers), where earlier seqs were consumed before.
        on_lost: optional ``on_lost(source, epoch, count)``, called once per gap that
            recovery could not fill completely; its exceptions are logged and ignored.
        max_gap: a batch whose seq jumps further than this past the expected one (for a new
            source or epoch on a live transport: past 0) is counted as a decode error and
            dropped, not treated as a gap.
        keep: ``keep(source)``: whether ``source`` is tracked for good; ``None``: every
            source is. Sources not kept are tracked at most ``max_unkept`` at a time, the
            least recently seen forgotten beyond (``on_forget(source)`` is then called).
    """

    def __init__(
        self,
        stats: SubscriberStats,
        deliver: Callable[[EventBatch], None],
        on_gap: GapCallback | None = None,
        *,
        first_seq_gap: bool = True,
        on_lost: LostCallback | None = None,
        max_gap: int = MAX_GAP,
        keep: Callable[[str], bool] | None = None,
        max_unkept: int = MAX_UNKEPT_SOURCES,
        on_forget: Callable[[str], None] | None = None,
    ) -> None:
        self._first_seq_gap = first_seq_gap
        self._max_gap = max_gap
        self._on_lost = on_lost
        self._stats = stats
        self._deliver = deliver
        self._on_gap = on_gap
        self._current: dict[str, tuple[int, int]] = {}  # source -> (epoch, next expected seq)
        self._retired: dict[str, RetiredEpochs] = {}  # source -> superseded epochs (bounded)
        self._keep = keep
        self._max_unkept = max(1, max_unkept)
        self._on_forget = on_forget
        self._unkept: OrderedDict[str, None] = OrderedDict()  # tracked while not kept, least recently seen first

    def position(self, source: str) -> tuple[int, int] | None:
        """``(epoch, next expected seq)`` of ``source``, or ``None`` if never seen."""
        return self._current.get(source)

    def pending_gap(self, batch: EventBatch) -> tuple[int, int] | None:
        """The missing seqs ``(first, last)`` that :meth:`accept` would try to recover
        before delivering ``batch``, or ``None`` (no gap, a duplicate, or an implausible
        seq). Changes nothing; a transport that fetches the range asynchronously asks
        this first and calls :meth:`accept` once the fetch is over."""
        cur = self._current.get(batch.source)
        if cur is not None and cur[0] == batch.epoch:
            expected = cur[1]
        elif cur is not None and batch.epoch in self._retired.get(batch.source, ()):
            return None
        else:
            expected = 0 if self._first_seq_gap else batch.seq
        if batch.seq <= expected or batch.seq - expected > self._max_gap:
            return None
        return expected, batch.seq - 1

    def accept(self, batch: EventBatch, recover: Recover | None = None) -> None:
        """Deliver ``batch`` (and any recovered predecessors) or drop it as a duplicate."""
        st = self._stats
        source, epoch, seq = batch.source, batch.epoch, batch.seq
        cur = self._current.get(source)
        known = cur is not None and cur[0] == epoch
        if known:
            expected = cur[1]  # type: ignore[index]
        else:
            if cur is not None and epoch in self._retired.get(source, ()):
                st.duplicates += 1
                return
            expected = 0 if self._first_seq_gap else seq
        if seq < expected:
            st.duplicates += 1
            return
        if seq - expected > self._max_gap:
            # No source skips this many batches, tracked or new (a new source/epoch starts
            # at 0): a corrupt or hostile batch must neither silence the source (every real
            # later seq would be a "duplicate") nor count ~2**64 batches unrecovered. It is
            # dropped before it changes anything (a new epoch does not retire the old one).
            st.decode_errors += 1
            logger.warning("dropped batch of %s epoch=%d: seq %d is %d past the expected %d (max gap %d)",
                           source, epoch, seq, seq - expected, expected, self._max_gap)
            return
        if not known and cur is not None:
            self._retired.setdefault(source, RetiredEpochs()).add(cur[0])
            st.restarts += 1
        if self._keep is not None:
            if cur is None:
                self._track(source)
            elif source in self._unkept:
                self._unkept.move_to_end(source)
        if seq > expected:
            expected = self._fill_gap(source, epoch, expected, seq - 1, recover)
        self._current[source] = (epoch, seq + 1)
        self._deliver(batch)

    def _track(self, source: str) -> None:
        """A new ``source``: note it if it is not kept, and forget the least recently seen
        sources not kept beyond ``max_unkept`` (one kept since is only unnoted)."""
        keep = self._keep
        assert keep is not None
        if keep(source):
            return
        unkept = self._unkept
        unkept[source] = None
        while len(unkept) > self._max_unkept:
            old, _ = unkept.popitem(last=False)
            if keep(old):
                continue
            self._current.pop(old, None)
            self._retired.pop(old, None)
            self._stats.sources_forgotten += 1
            if self._on_forget is not None:
                try:
                    self._on_forget(old)
                except Exception:  # noqa: BLE001 - a user callback must not stop delivery
                    logger.exception("on_forget callback failed for %s", old[:64])

    def _fill_gap(self, source: str, epoch: int, first: int, last: int, recover: Recover | None) -> int:
        st = self._stats
        st.gaps += 1
        if self._on_gap is not None:
            try:
                self._on_gap(source, epoch, first, last)
            except Exception:  # noqa: BLE001 - a user callback must not stop delivery
                logger.exception("on_gap callback failed for %s epoch=%d seqs %d..%d", source, epoch, first, last)
        expected = first
        lost = 0
        fetched: list[EventBatch] = []
        if recover is not None:
            try:
                fetched = recover(source, epoch, first, last)
            except Exception:  # noqa: BLE001 - replay failure = unrecovered, not a crash
                logger.exception("replay of %s epoch=%d seqs %d..%d failed", source, epoch, first, last)
        for b in sorted(fetched, key=lambda b: b.seq):
            if b.source != source or b.epoch != epoch or not expected <= b.seq <= last:
                continue
            lost += b.seq - expected
            st.replayed += 1
            self._current[source] = (epoch, b.seq + 1)
            self._deliver(b)
            expected = b.seq + 1
        lost += last + 1 - expected
        st.unrecovered += lost
        if last + 1 > expected:
            logger.warning("lost batches of %s epoch=%d: seqs %d..%d", source, epoch, expected, last)
        if lost and self._on_lost is not None:
            try:
                self._on_lost(source, epoch, lost)
            except Exception:  # noqa: BLE001 - a user callback must not stop delivery
                logger.exception("on_lost callback failed for %s epoch=%d", source, epoch)
        return last + 1
