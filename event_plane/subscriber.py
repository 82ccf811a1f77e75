"""Subscriber interface: a thread-safe queue of ordered batches fed by a transport thread.

The delivery queue (:class:`event_plane.fair_queue.FairQueue`) keeps each source's batches
in order and serves the sources in turn (deficit round robin), so one source's backlog
never delays another source's next batch by more than a turn. It is bounded
(``queue_capacity`` batches in all, ``source_capacity`` per source). A batch that finds it full is
dropped and counted, and its source is put in :attr:`Subscriber.resync_needed` (the
``on_resync(source)`` hook fires once when it enters): the application's view of that
source is no longer exact and should be rebuilt (snapshot, ZMQ replay, JetStream re-read)
before :meth:`Subscriber.resync_done` clears the mark. Batches known lost for good
(unrecovered gaps) schedule a resync the same way.
"""

from __future__ import annotations

import abc
import functools
import logging
import queue
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import replace

from event_plane.config import SubscriberStats
from event_plane.errors import ConfigError, NotStartedError
from event_plane.fair_queue import FairQueue
from event_plane.ordering import GapCallback, SeqTracker
from event_plane.origins import OriginGuard
from event_plane.schema import EventBatch

logger = logging.getLogger(__name__)

_POLL_S = 0.05

ResyncCallback = Callable[[str], None]
"""``on_resync(source)``: called once when ``source`` enters ``resync_needed``."""


class TakenHooks:
    """``batch -> hook`` for queued batches, run once when :meth:`Subscriber.get` hands the
    batch out.  A transport registers a hook while it holds :attr:`lock` from before it
    queues the batch, so ``get`` (which takes the lock to find the hook) cannot hand the
    batch out before its hook is there."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self._hooks: dict[int, Callable[[], None]] = {}

    def add(self, batch: EventBatch, hook: Callable[[], None]) -> None:
        """Run ``hook`` when ``batch`` (queued, by identity) is handed out; call under :attr:`lock`."""
        self._hooks[id(batch)] = hook

    def run(self, batch: EventBatch) -> None:
        """Run and forget ``batch``'s hook, if any (errors are logged)."""
        with self.lock:
            hook = self._hooks.pop(id(batch), None)
        if hook is not None:
            try:
                hook()
            except Exception:  # noqa: BLE001 - a failed acknowledgement is redelivered later
                logger.exception("subscriber: the hook of a handed-out batch failed")


class Subscriber(abc.ABC):
    """Receives batches from one or more publishers and delivers them in per-source order.

    Args:
        on_gap: ``on_gap(source, epoch, first_missing, last_missing)``, called from the
            transport thread for every gap, before the batches recovered for it are
            delivered (ZMQ fetches them asynchronously, so there it comes once the fetch
            is over: ``docs/events.md`` §4.3).
        queue_capacity: batches held for ``get``; when full, further batches are dropped
            and counted in ``stats().dropped``, and their source needs a resync.
        source_capacity: batches of one source held for ``get`` (default a quarter of
            ``queue_capacity``); past it that source's batches are dropped the same way,
            so a flooding source cannot take the room of the others. One origin (a ZMQ
            endpoint) holds at most a quarter of ``queue_capacity`` too.
        on_resync: ``on_resync(source)``, called from the transport thread when ``source``
            enters :attr:`resync_needed` (a batch of it was dropped or lost for good). It
            must be quick; exceptions are logged and ignored.

    Raises:
        ConfigError: ``queue_capacity`` or ``source_capacity`` < 1.
    """

    def __init__(
        self,
        *,
        on_gap: GapCallback | None = None,
        queue_capacity: int = 100_000,
        on_resync: ResyncCallback | None = None,
        source_capacity: int | None = None,
    ) -> None:
        if not isinstance(queue_capacity, int) or isinstance(queue_capacity, bool) or queue_capacity < 1:
            raise ConfigError(f"queue_capacity must be a positive int, got {queue_capacity!r}")
        if source_capacity is None:
            source_capacity = max(1, queue_capacity // 4)
        self._queue = FairQueue(queue_capacity, source_capacity, lane_capacity=max(1, queue_capacity // 4))
        self._on_taken = TakenHooks()
        """Hooks run when :meth:`get` hands a queued batch out (a durable transport
        acknowledges it then); a :class:`MultiSubscriber`'s children share it, as the queue."""
        self._stats = SubscriberStats()
        self._on_gap = on_gap
        self._on_resync = on_resync
        self._resync: set[str] = set()
        self._resync_lock = threading.Lock()
        self._tracker = self._make_tracker()
        self._closed = threading.Event()
        self._started = threading.Event()
        self._answered = threading.Event()

    def __init_subclass__(cls, **kwargs: object) -> None:
        """Wrap each subclass's ``start`` so that a successful start marks the subscriber
        started (``get`` refuses to wait on one that never was)."""
        super().__init_subclass__(**kwargs)  # type: ignore[arg-type]
        start = cls.__dict__.get("start")
        if start is None or getattr(start, "_marks_started", False) or getattr(start, "__isabstractmethod__", False):
            return

        @functools.wraps(start)
        def marked_start(self: Subscriber) -> None:
            start(self)
            self._started.set()

        marked_start._marks_started = True  # type: ignore[attr-defined]
        cls.start = marked_start  # type: ignore[method-assign]

    _origins: OriginGuard | None = None
    failing: str | None = None
    """Why the transport's receive loop failed last, while it keeps failing (``None`` once
    it runs again); the loop pauses and retries."""
    _max_events: int | None = None
    _max_bytes: int | None = None
    _lane: str | None = None
    """The origin of the batches being delivered now (set by the transport thread before it
    feeds the ordering tracker): their lane in the fair queue; ``None``: each source its own."""

    def limit_batches(self, max_events: int | None, max_bytes: int | None) -> None:
        """Refuse a message over ``max_bytes`` bytes (ZMQ: ``MAXMSGSIZE`` on every socket
        that receives, so libzmq drops it and the connection before it is read; NATS: before
        decoding) and a batch declaring more than ``max_events`` events (from its header,
        before any event object is built); both count as decode errors. Call before
        :meth:`start`; ``None`` lifts a limit."""
        self._max_events = max_events
        self._max_bytes = max_bytes

    def guard_origins(self, guard: OriginGuard | None) -> None:
        """Check every received batch against ``guard`` before ordering (call before
        :meth:`start`): a batch whose source is bound to another origin is dropped there
        and counted by the guard (:mod:`event_plane.origins`). ``None`` turns it off."""
        self._origins = guard

    def _origin_admits(self, batch: EventBatch, origin: str) -> bool:
        """Whether ``batch``, received from ``origin``, may enter ordering (transport threads)."""
        guard = self._origins
        return guard is None or guard.admit(batch.source, origin)

    def _make_tracker(self, *, first_seq_gap: bool = True) -> SeqTracker:
        """The ordering state machine feeding this subscriber's queue."""
        return SeqTracker(
            self._stats,
            self._deliver,
            self._on_gap,
            first_seq_gap=first_seq_gap,
            on_lost=lambda source, epoch, count: self._schedule_resync(source),
            keep=self._kept,
            on_forget=self._forget_resync,
        )

    def _kept(self, source: str) -> bool:
        """Whether the ordering tracker keeps ``source`` for good: always without an origin
        guard, else once it is bound (the application admitted a batch of it)."""
        guard = self._origins
        return guard is None or guard.origin_of(source) is not None

    def _forget_resync(self, source: str) -> None:
        """The tracker forgot ``source`` (never admitted): drop its resync mark too."""
        with self._resync_lock:
            self._resync.discard(source)

    @abc.abstractmethod
    def start(self) -> None:
        """Connect and begin receiving. Idempotent.

        Raises:
            TransportError: the transport could not connect.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop receiving and release sockets. Idempotent; batches already queued stay readable."""

    @property
    def alive(self) -> bool:
        """Whether the transport still receives: its thread runs (or it needs none) and its
        receive loop is not failing. ``False`` after :meth:`close`."""
        return not self._closed.is_set() and self.failing is None

    @property
    def answered(self) -> bool:
        """Whether anything came from the other side since start: a batch, a replay answer,
        a message that did not decode, or (NATS) a connection to the server. ``False`` after
        a while means nothing listens at the endpoint (or a ZMQ publisher without replay
        that has not sent yet)."""
        return self._answered.is_set()

    def get(self, timeout: float | None = None) -> EventBatch | None:
        """Next batch in delivery order, or ``None`` after ``timeout`` seconds (or once closed
        and drained). Thread-safe.

        Raises:
            NotStartedError: the subscriber was never started (nor closed): no batch could
                ever come, so it does not wait.
        """
        if not self._started.is_set() and not self._closed.is_set():
            raise NotStartedError(f"{type(self).__name__}.get() before start(): call start() or use it as a "
                                  "context manager")
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            try:
                batch = self._queue.get(timeout=max(wait, 0.0))
            except queue.Empty:
                if self._closed.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    return None
                continue
            self._on_taken.run(batch)
            return batch

    def get_many(self, count: int, timeout: float) -> list[EventBatch]:
        """Up to ``count`` batches, waiting at most ``timeout`` seconds in total."""
        deadline = time.monotonic() + timeout
        out: list[EventBatch] = []
        while len(out) < count:
            batch = self.get(timeout=max(0.0, deadline - time.monotonic()))
            if batch is None:
                break
            out.append(batch)
        return out

    def __iter__(self) -> Iterator[EventBatch]:
        """Iterate over batches until the subscriber is closed and drained."""
        while True:
            batch = self.get()
            if batch is None:
                return
            yield batch

    def stats(self) -> SubscriberStats:
        """A snapshot of this subscriber's counters."""
        return replace(self._stats)

    @property
    def resync_needed(self) -> frozenset[str]:
        """Sources whose delivered stream is incomplete (a batch dropped on a full queue or
        lost for good) since their last :meth:`resync_done`."""
        with self._resync_lock:
            return frozenset(self._resync)

    def resync_done(self, source: str) -> None:
        """Mark ``source`` as resynchronised (its next loss schedules a new resync)."""
        with self._resync_lock:
            self._resync.discard(source)

    def _schedule_resync(self, source: str) -> None:
        with self._resync_lock:
            if source in self._resync:
                return
            self._resync.add(source)
            self._stats.resyncs += 1
        if self._on_resync is not None:
            try:
                self._on_resync(source)
            except Exception:  # noqa: BLE001 - a user callback must not stop delivery
                logger.exception("on_resync callback failed for %s", source)

    def __enter__(self) -> Subscriber:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deliver(self, batch: EventBatch) -> None:
        self._answered.set()
        try:
            self._queue.put_nowait(batch, self._lane)
        except queue.Full:
            self._stats.dropped += 1
            self._schedule_resync(batch.source)
            return
        self._stats.batches += 1
        self._stats.events += len(batch.events)


class MultiSubscriber(Subscriber):
    """Merges several subscribers into one queue; ordering holds per source within each child.

    Args:
        children: subscribers not yet started; their deliveries go to this one's queue.
        queue_capacity, source_capacity: bounds of the shared queue (the children's own is unused).
    """

    def __init__(
        self,
        children: Sequence[Subscriber],
        *,
        queue_capacity: int = 100_000,
        on_resync: ResyncCallback | None = None,
        source_capacity: int | None = None,
    ) -> None:
        super().__init__(queue_capacity=queue_capacity, on_resync=on_resync, source_capacity=source_capacity)
        if not children:
            raise ConfigError("MultiSubscriber needs at least one child subscriber")
        self._children = list(children)
        for child in self._children:
            child._queue = self._queue
            child._on_taken = self._on_taken
            if on_resync is not None and child._on_resync is None:
                child._on_resync = on_resync

    def guard_origins(self, guard: OriginGuard | None) -> None:
        super().guard_origins(guard)
        for child in self._children:
            child.guard_origins(guard)

    def limit_batches(self, max_events: int | None, max_bytes: int | None) -> None:
        super().limit_batches(max_events, max_bytes)
        for child in self._children:
            child.limit_batches(max_events, max_bytes)

    def start(self) -> None:
        for child in self._children:
            child.start()

    def close(self) -> None:
        for child in self._children:
            child.close()
        self._closed.set()

    @property
    def answered(self) -> bool:
        return any(child.answered for child in self._children)

    @property
    def alive(self) -> bool:
        return all(child.alive for child in self._children)

    @property
    def failing(self) -> str | None:  # type: ignore[override]
        return next((c.failing for c in self._children if c.failing is not None), None)

    def stats(self) -> SubscriberStats:
        total = SubscriberStats()
        for child in self._children:
            total = total.add(child.stats())
        return total

    @property
    def resync_needed(self) -> frozenset[str]:
        out: frozenset[str] = frozenset()
        for child in self._children:
            out |= child.resync_needed
        return out

    def resync_done(self, source: str) -> None:
        for child in self._children:
            child.resync_done(source)
