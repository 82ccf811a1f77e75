"""Subscriber interface: a thread-safe queue of ordered batches fed by a transport thread."""

from __future__ import annotations

import abc
import queue
import threading
import time
from collections.abc import Iterator, Sequence
from dataclasses import replace

from event_plane.config import SubscriberStats
from event_plane.errors import ConfigError
from event_plane.ordering import GapCallback, SeqTracker
from event_plane.schema import EventBatch

_POLL_S = 0.05


class Subscriber(abc.ABC):
    """Receives batches from one or more publishers and delivers them in per-source order.

    Args:
        on_gap: ``on_gap(source, epoch, first_missing, last_missing)``, called from the
            transport thread whenever a gap is detected (before recovery).
        queue_capacity: batches held for ``get``; when full, further batches are dropped
            and counted in ``stats().dropped``.

    Raises:
        ConfigError: ``queue_capacity`` < 1.
    """

    def __init__(
        self,
        *,
        on_gap: GapCallback | None = None,
        queue_capacity: int = 100_000,
    ) -> None:
        if not isinstance(queue_capacity, int) or queue_capacity < 1:
            raise ConfigError(f"queue_capacity must be a positive int, got {queue_capacity!r}")
        self._queue: queue.Queue[EventBatch] = queue.Queue(queue_capacity)
        self._stats = SubscriberStats()
        self._tracker = SeqTracker(self._stats, self._deliver, on_gap)
        self._closed = threading.Event()

    @abc.abstractmethod
    def start(self) -> None:
        """Connect and begin receiving. Idempotent.

        Raises:
            TransportError: the transport could not connect.
        """

    @abc.abstractmethod
    def close(self) -> None:
        """Stop receiving and release sockets. Idempotent; batches already queued stay readable."""

    def get(self, timeout: float | None = None) -> EventBatch | None:
        """Next batch in delivery order, or ``None`` after ``timeout`` seconds (or once closed
        and drained). Thread-safe."""
        deadline = None if timeout is None else time.monotonic() + timeout
        while True:
            wait = _POLL_S if deadline is None else min(_POLL_S, deadline - time.monotonic())
            try:
                return self._queue.get(timeout=max(wait, 0.0))
            except queue.Empty:
                if self._closed.is_set() or (deadline is not None and time.monotonic() >= deadline):
                    return None

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

    def __enter__(self) -> Subscriber:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def _deliver(self, batch: EventBatch) -> None:
        try:
            self._queue.put_nowait(batch)
        except queue.Full:
            self._stats.dropped += 1
            return
        self._stats.batches += 1
        self._stats.events += len(batch.events)


class MultiSubscriber(Subscriber):
    """Merges several subscribers into one queue; ordering holds per source within each child.

    Args:
        children: subscribers not yet started; their deliveries go to this one's queue.
        queue_capacity: capacity of the shared queue (the children's own is unused).
    """

    def __init__(self, children: Sequence[Subscriber], *, queue_capacity: int = 100_000) -> None:
        super().__init__(queue_capacity=queue_capacity)
        if not children:
            raise ConfigError("MultiSubscriber needs at least one child subscriber")
        self._children = list(children)
        for child in self._children:
            child._queue = self._queue

    def start(self) -> None:
        for child in self._children:
            child.start()

    def close(self) -> None:
        for child in self._children:
            child.close()
        self._closed.set()

    def stats(self) -> SubscriberStats:
        total = SubscriberStats()
        for child in self._children:
            total = total.add(child.stats())
        return total
