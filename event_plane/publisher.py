"""Batching publisher: turns a stream of events into seq-numbered batches.

A publisher keeps one pending batch per (source, epoch). ``publish`` appends to it and
sends it when it reaches ``max_events`` events or would exceed ``max_bytes`` encoded
event bytes; a timer thread sends it once its oldest event has waited the flush time limit
(``max_delay_s``, lowered as the event rate rises: :mod:`event_plane.flush_policy`);
``flush`` and ``close`` send it at once. Each sent batch gets the next ``seq`` (0, 1, ...),
empty batches are never sent. Transports implement :meth:`EventPublisher._send`.
"""

from __future__ import annotations

import abc
import logging
import secrets
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import replace

from event_plane.codec import encode_batch_parts
from event_plane.config import PublisherConfig, PublisherStats
from event_plane.errors import PublisherClosedError
from event_plane.flush_policy import AdaptiveDelay
from event_plane.schema import WIRE_VERSION, EventBatch, KVEvent
from event_plane.validate import check_source, check_u64, encode_checked_all

logger = logging.getLogger(__name__)

FlushCallback = Callable[[EventBatch, bytes], None]


def new_epoch() -> int:
    """A fresh random u64 epoch (cryptographic RNG, so restarts never collide in practice)."""
    return secrets.randbits(64)


class EventPublisher(abc.ABC):
    """Batches events of one source and hands each batch to a transport.

    Args:
        source: worker / instance id (1..255 characters).
        epoch: u64; a random one is drawn when ``None``.
        config: batching limits (:class:`PublisherConfig` defaults when ``None``).
        on_flush: called as ``on_flush(batch, payload)`` for every batch, in seq order,
            right after the batch was handed to the transport (under the publisher's
            lock, so it must be quick; it may call ``publish``).

    Thread safety: every public method may be called from any thread.

    Raises:
        InvalidEventError: bad ``source`` or ``epoch``.
    """

    def __init__(
        self,
        source: str,
        *,
        epoch: int | None = None,
        config: PublisherConfig | None = None,
        on_flush: FlushCallback | None = None,
    ) -> None:
        self.source: str = check_source(source)
        self.epoch: int = new_epoch() if epoch is None else check_u64("epoch", epoch)
        self.config: PublisherConfig = config or PublisherConfig()
        self._on_flush = on_flush
        self._lock = threading.RLock()
        self._cond = threading.Condition(self._lock)
        self._events: list[KVEvent] = []
        self._encoded: list[bytes] = []
        self._pending_bytes = 0
        self._oldest_at: float | None = None  # time.monotonic() of the oldest pending event
        self._next_seq = 0
        self._stats = PublisherStats()
        self._closed = False
        self._timer: threading.Thread | None = None
        cfg = self.config
        self._delay = AdaptiveDelay(
            cfg.max_delay_s, cfg.min_delay_s, cfg.target_batch_events, cfg.rate_window_s, enabled=cfg.adaptive_delay
        )
        # Monotonic time the pending batch must be sent by: set when its first event
        # arrives, moved earlier (never later) as the event rate rises.
        self._deadline: float | None = None

    # ------------------------------------------------------------------ public API
    def publish(self, events: Sequence[KVEvent]) -> None:
        """Append ``events`` (in order) to the pending batch; may send one or more batches.

        Raises:
            InvalidEventError: an event is malformed; none of ``events`` is accepted.
            PublisherClosedError: the publisher is closed.
        """
        encoded = encode_checked_all(events)
        if not encoded:
            return
        max_events, max_bytes = self.config.max_events, self.config.max_bytes
        n = len(encoded)
        with self._lock:
            if self._closed:
                raise PublisherClosedError(f"publisher {self.source!r} is closed")
            if self._timer is None:
                self._ensure_timer()
            now = time.monotonic()
            self._delay.observe(n, now)
            pending = len(self._events)
            size = sum(map(len, encoded))
            if pending + n <= max_events and self._pending_bytes + size <= max_bytes:
                # All of them fit the pending batch: no event would trip a limit before the
                # last, so append in bulk (same result as the per-event loop below).
                if not pending:
                    self._oldest_at = now
                    self._deadline = now + self._delay.delay(now)
                    self._cond.notify_all()
                self._events.extend(events)
                self._encoded.extend(encoded)
                self._pending_bytes += size
                if pending + n >= max_events:
                    self._flush_locked()
                events = ()
            for ev, data in zip(events, encoded):
                if self._events and self._pending_bytes + len(data) > max_bytes:
                    self._flush_locked()
                if not self._events:
                    self._oldest_at = now
                    self._deadline = now + self._delay.delay(now)
                    self._cond.notify_all()
                self._events.append(ev)
                self._encoded.append(data)
                self._pending_bytes += len(data)
                if len(self._events) >= max_events:
                    self._flush_locked()
            # A rising rate shortens the time limit: move the deadline earlier, wake the timer.
            if self._oldest_at is not None and self._deadline is not None:
                deadline = self._oldest_at + self._delay.delay(now)
                if deadline < self._deadline - 0.001:
                    self._deadline = deadline
                    self._cond.notify_all()

    def flush(self) -> None:
        """Send the pending batch now (if any) and wait until the transport took it."""
        with self._lock:
            self._flush_locked()
        self._wait_sent()

    def close(self) -> None:
        """Send the pending batch, stop the timer, release the transport. Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._flush_locked()
            self._closed = True
            self._cond.notify_all()
        if self._timer is not None and self._timer is not threading.current_thread():
            self._timer.join()
        self._close_transport()

    def stats(self) -> PublisherStats:
        """A snapshot of this publisher's counters."""
        with self._lock:
            now = time.monotonic()
            return replace(
                self._stats,
                dropped=self._stats.dropped + self._transport_dropped(),
                flush_delay_s=self._delay.delay(now),
                event_rate=self._delay.rate(now),
            )

    def current_flush_delay(self) -> float:
        """The flush time limit now in force, seconds (``docs/events.md`` §3.1)."""
        with self._lock:
            return self._delay.delay(time.monotonic())

    @property
    def next_seq(self) -> int:
        """The seq the next batch will carry (== batches sent so far)."""
        return self._next_seq

    def __enter__(self) -> EventPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ transport hooks
    @abc.abstractmethod
    def _send(self, batch: EventBatch, payload: bytes) -> None:
        """Hand one encoded batch to the transport. Called under the lock, in seq order."""

    def _wait_sent(self) -> None:
        """Block until batches handed to ``_send`` left the process (default: no-op)."""

    def _close_transport(self) -> None:
        """Release sockets / connections (default: nothing to release)."""

    def _transport_dropped(self) -> int:
        """Events the transport dropped after ``_send`` accepted them (default 0)."""
        return 0

    # ------------------------------------------------------------------ internals
    def _flush_locked(self) -> None:
        if not self._events:
            return
        events, encoded = self._events, self._encoded
        self._events, self._encoded = [], []
        event_bytes, self._pending_bytes, self._oldest_at, self._deadline = self._pending_bytes, 0, None, None
        seq = self._next_seq
        self._next_seq += 1
        ts_ns = time.time_ns()
        payload = encode_batch_parts(self.source, self.epoch, seq, ts_ns, encoded)
        batch = EventBatch(WIRE_VERSION, self.source, self.epoch, seq, ts_ns, events)
        st = self._stats
        st.batches += 1
        st.events += len(events)
        st.payload_bytes += len(payload)
        st.event_bytes += event_bytes
        try:
            self._send(batch, payload)
        except Exception:
            st.dropped += len(events)
            logger.exception("event publisher %s: sending batch seq=%d failed", self.source, seq)
        if self._on_flush is not None:
            self._on_flush(batch, payload)

    def _ensure_timer(self) -> None:
        if self._timer is None:
            self._timer = threading.Thread(target=self._timer_loop, name=f"kvevents-timer-{self.source}", daemon=True)
            self._timer.start()

    def _timer_loop(self) -> None:
        with self._cond:
            while not self._closed:
                if self._deadline is None:
                    self._cond.wait()
                    continue
                remaining = self._deadline - time.monotonic()
                if remaining > 0:
                    self._cond.wait(remaining)
                    continue
                try:
                    self._flush_locked()
                except Exception:  # noqa: BLE001 - on_flush errors must not kill the timer
                    logger.exception("event publisher %s: timed flush failed", self.source)


class NullPublisher(EventPublisher):
    """Batches, numbers and reports batches to ``on_flush`` but sends nothing.

    Used by embedded setups (the advisor journals its own moves) and in tests.
    """

    def _send(self, batch: EventBatch, payload: bytes) -> None:
        return None
