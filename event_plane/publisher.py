"""Batching publisher: turns a stream of events into seq-numbered batches.

A publisher keeps one pending batch per (source, epoch). ``publish`` (or ``publish_valid``
for events well-formed by construction) appends to it and sends it when it reaches
``max_events`` events or would exceed ``max_bytes`` encoded event bytes; a timer thread sends it once its oldest event has waited the flush time limit
(``max_delay_s``, lowered as the event rate rises: :mod:`event_plane.flush_policy`);
``flush`` and ``close`` send it at once. Each sent batch gets the next ``seq`` (0, 1, ...),
empty batches are never sent. Transports implement :meth:`EventPublisher._send` (or, when
they only need a batch's seq, event count and bytes, :meth:`EventPublisher._send_payload`).

Producers that build events from identities checked once (the runtime's block pools) may
hand a publisher their events already encoded (:meth:`EventPublisher.publish_encoded`,
bytes from :mod:`event_plane._fastenc`), so no ``KVEvent`` object exists per event: such a
batch's ``EventBatch`` (its ``events`` list) is then built, by decoding its payload, only
when something reads it (an ``on_flush`` callback, a transport overriding ``_send``).
The bytes on the wire are the same either way.

Events off: a publisher whose :attr:`EventPublisher.wants_events` is false (the
:class:`NullPublisher` of ``null://`` without an ``on_flush``: nothing could ever see an
event) tells producers not to build events at all; they report how many they skipped
(:meth:`EventPublisher.skip_events`), counted in ``stats().events``.
"""

from __future__ import annotations

import abc
import logging
import math
import secrets
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace

import msgspec

from event_plane.codec import _array_header, decode_batch, encode_batch_parts, encode_event
from event_plane.config import PublisherConfig, PublisherStats
from event_plane.errors import InvalidEventError, PublisherClosedError
from event_plane.flush_policy import AdaptiveDelay
from event_plane.schema import WIRE_VERSION, EventBatch, KVEvent
from event_plane.validate import check_source, check_u64, encode_checked_all

_encode = msgspec.msgpack.Encoder().encode  # same settings as event_plane.codec's: identical bytes
_decode_events = msgspec.msgpack.Decoder(list[KVEvent]).decode

logger = logging.getLogger(__name__)

FlushCallback = Callable[[EventBatch, bytes], None]


def forwards_to_send_payload(send: Callable[..., None]) -> Callable[..., None]:
    """Mark a transport's ``_send(batch, payload)`` as only forwarding ``batch.seq``,
    ``len(batch.events)`` and ``payload`` to its ``_send_payload``: the publisher then calls
    ``_send_payload`` directly and builds no ``EventBatch`` unless an ``on_flush`` callback
    reads it.  A subclass overriding ``_send`` without the mark gets full batches."""
    send._forwards_to_send_payload = True  # type: ignore[attr-defined]
    return send


def new_epoch() -> int:
    """A fresh random u64 epoch (cryptographic RNG, so restarts never collide in practice)."""
    return secrets.randbits(64)


class EventPublisher(abc.ABC):
    """Batches events of one source and hands each batch to a transport.

    Args:
        source: worker / instance id (1..255 characters).
        epoch: u64; a random one is drawn when ``None``.
        config: batching limits (:class:`PublisherConfig` defaults when ``None``).
        on_flush: called as ``on_flush(batch, payload)`` for every batch, exactly once,
            in seq order, after the batch was handed to the transport, outside the
            publisher's lock (so it may call ``publish``, or read a block pool that
            publishes here: a thread inside the pool holds the pool's lock and then takes
            the publisher's, never the other way round).  One thread at a time runs it:
            the call that sent a batch runs it, with the earlier batches still waiting,
            and returns after its own; when another thread is running ``on_flush`` it
            leaves its batches to that thread or to a delivery thread, except that with
            more than ``_MAX_BACKLOG`` batches waiting it first waits up to
            ``_BACKPRESSURE_S`` for them (back-pressure that cannot deadlock).
            :meth:`flush` and :meth:`close` return after ``on_flush`` ran for every batch
            sent before they returned, so they must not be called while holding a lock
            that ``on_flush`` takes (from inside ``on_flush`` they do not wait).  An
            exception from it is raised by the call whose batch it was; for a batch run
            for another thread (the timer's, or one left behind) it is logged and raised
            by the next :meth:`flush` / :meth:`close` covering that batch.  Events it
            publishes while :meth:`close` waits for it are still sent and run (see there).

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
        # Batches sent but not yet given to on_flush (seq order), appended under _lock and
        # run outside it by one thread at a time (_run_callbacks): see ``on_flush`` above.
        # The fields below are guarded by _deliver_cond's own lock.
        self._deliver_q: deque[tuple[EventBatch, bytes]] = deque()
        self._deliver_cond = threading.Condition(threading.Lock())
        self._deliverer: int | None = None  # thread ident running on_flush, if any
        self._done_seq = -1  # on_flush has run (or was interrupted) for every seq <= this
        self._unreported: dict[int, Exception] = {}  # seq -> error of a batch run for another thread
        self._delivery_thread: threading.Thread | None = None
        self._delivery_wanted = False
        self._delivery_stop = False
        self._cond = threading.Condition(self._lock)
        # The pending batch: ``_count`` events whose bytes are ``_encoded`` (in order) plus
        # a tail of ``_events`` queued by publish_valid without encoding (after the first
        # ``_n_encoded``).  ``_events`` holds the batch's KVEvent objects unless ``_opaque``
        # (it has parts publish_encoded handed over: its events are decoded when needed).
        self._events: list[KVEvent] = []
        self._encoded: list[bytes] = []
        self._count = 0
        self._opaque = False
        self._pending_bytes = 0
        self._oldest_at: float | None = None  # time.monotonic() of the oldest pending event
        self._next_seq = 0
        self._stats = PublisherStats()
        self._closed = False
        self._draining = False  # close() is running on_flush: re-entrant publishes accepted
        self._timer: threading.Thread | None = None
        cfg = self.config
        self._delay = AdaptiveDelay(
            cfg.max_delay_s, cfg.min_delay_s, cfg.target_batch_events, cfg.rate_window_s, enabled=cfg.adaptive_delay
        )
        # Monotonic time the pending batch must be sent by: set when its first event
        # arrives, moved earlier (never later) as the event rate rises.
        self._deadline: float | None = None
        # Monotonic time the timer thread sleeps until (inf: until notified); a new or
        # earlier deadline only needs a notify when it falls before this.
        self._timer_until = math.inf
        self._max_events = self.config.max_events
        self._max_bytes = self.config.max_bytes
        # Events publish_valid queued without encoding are the pending batch's tail after
        # its first ``_n_encoded`` (encoded) events; ``_lazy_bytes`` bounds their size.
        self._n_encoded = 0
        self._lazy_bytes = 0
        # A transport whose ``_send`` only forwards to ``_send_payload`` needs no EventBatch
        # (a subclass overriding ``_send`` gets the full batch, as before).
        self._payload_only: bool = getattr(type(self)._send, "_forwards_to_send_payload", False)

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
        with self._lock:
            first = self._next_seq
            self._accept_locked(events, encoded, None)
            last = self._next_seq - 1
        if last >= first and self._on_flush is not None:
            self._run_callbacks(first, last)

    def publish_valid(self, events: Sequence[KVEvent], max_event_bytes: int | None = None) -> None:
        """:meth:`publish` for events that are well-formed by construction: the same
        batches and bytes, without checking each event again.

        For producers that build their events from fields they checked once where those
        fields were made (the runtime's block pools: a ``BlockMeta`` checks its hashes, a
        pool its tier name and block size).  An event that is malformed in a way MessagePack
        can still encode (a negative hash, an empty location) is *not* caught here and would
        make subscribers reject its batch: anything built from unchecked input must go
        through :meth:`publish`.  Events that cannot be encoded at all are handed to
        :meth:`publish`, which rejects them (nothing accepted) with its usual error.

        Args:
            events: the events, in order.
            max_event_bytes: an upper bound of each event's encoded size, when the producer
                knows one (a pool: no metadata, its own tier name).  While the pending
                batch is sure to stay within ``max_bytes`` by this bound, the events are
                only queued and encoded together when the batch is sent (one encoder call
                per batch); otherwise (or without a bound) they are encoded at once in one
                call.  Either way the batches and their bytes are those :meth:`publish`
                would send; a bound found too small when the events are encoded is
                corrected for (the events are re-batched by their real sizes).

        Raises:
            InvalidEventError: an event cannot be encoded; none of ``events`` is accepted
                (with ``max_event_bytes`` this is found only when they are encoded: a
                queued event msgpack cannot encode is dropped then, alone, logged and
                counted in ``stats().dropped``).
            PublisherClosedError: the publisher is closed.
        """
        if not events:
            return
        evs = events if type(events) is list else list(events)
        n = len(evs)
        if max_event_bytes is not None:
            with self._lock:
                # Fast path, the common case: the pending batch is open (its deadline is
                # set), the events fit it by count and, by the bound, by bytes, and the rate
                # estimate is not due for an update (AdaptiveDelay.observe's no-update
                # branch, inlined): queue them, encode at the flush.
                pending = self._count
                delay = self._delay
                now = time.monotonic()
                bound = n * max_event_bytes
                if (
                    pending
                    and pending + n < self._max_events
                    and self._pending_bytes + self._lazy_bytes + bound <= self._max_bytes
                    and 0.0 <= now - delay._at < delay._step
                    and not self._closed
                ):
                    delay._pending += n
                    self._events.extend(evs)
                    self._count += n
                    self._lazy_bytes += bound
                    return
        try:
            data = _encode(evs)  # one call for all: [array header, event, event, ...]
        except (msgspec.EncodeError, TypeError, ValueError, OverflowError):
            self.publish(evs)  # names the bad event, accepts nothing
            return
        body = data[1 if n < 16 else (3 if n < 1 << 16 else 5) :]  # drop the array header: the events' bytes
        size = len(body)
        with self._lock:
            first = self._next_seq
            if self._lazy_bytes:
                self._encode_queued_locked()
            pending = self._count
            delay = self._delay
            now = time.monotonic()
            if (
                pending
                and pending + n < self._max_events
                and self._pending_bytes + size <= self._max_bytes
                and 0.0 <= now - delay._at < delay._step
                and not self._closed
            ):
                delay._pending += n
                self._events.extend(evs)
                self._count += n
                self._n_encoded = len(self._events)
                self._encoded.append(body)
                self._pending_bytes += size
            else:
                self._accept_locked(evs, None, body)
            last = self._next_seq - 1
        if last >= first and self._on_flush is not None:
            self._run_callbacks(first, last)

    @property
    def wants_events(self) -> bool:
        """Whether events given to this publisher can reach anyone (a transport or an
        ``on_flush`` callback).  False only for a :class:`NullPublisher` without
        ``on_flush`` (``null://``: events off): producers that check it build no events and
        report their number to :meth:`skip_events` instead."""
        return True

    def skip_events(self, count: int) -> None:
        """Count ``count`` events a producer did not build because :attr:`wants_events`
        is false: they are added to ``stats().events`` (no batch, no seq: nothing is
        sent).

        Raises:
            ValueError: ``count`` is not an ``int`` >= 0 (``bool`` included); nothing counted.
        """
        if type(count) is not int or count < 0:  # noqa: E721 - bool is not a count
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        with self._lock:
            self._stats.events += count

    def publish_encoded(self, body: bytes, count: int) -> None:
        """Append ``count`` events given as their wire bytes: the MessagePack encodings of
        ``count`` KVEvents as :func:`event_plane.codec.encode_event` writes them,
        concatenated (e.g. :func:`event_plane._fastenc.encode_meta_events` of a pool's
        block identities).  Same batches, seqs and bytes as :meth:`publish` of those
        events; no ``KVEvent`` object is made unless an ``on_flush`` callback or a
        transport overriding ``_send`` reads the batch (then its payload is decoded).

        For producers whose events are well-formed by construction only: when nothing
        reads the batch in this process (a payload-only transport, no ``on_flush``) the
        bytes are not checked (a malformed part would make subscribers reject its batch);
        otherwise the part is decoded at once and refused whole (``InvalidEventError``)
        unless it holds exactly ``count`` events.  A part that does not fit the pending
        batch (``max_events`` / ``max_bytes``) is split into its events (decoded) and they
        are appended one by one, as :meth:`publish` would.

        Args:
            body: the events' bytes (``bytes``), in order.
            count: the number of events in ``body`` (>= 0; 0 does nothing).

        Raises:
            TypeError: ``body`` is not ``bytes``.
            ValueError: ``count`` is not an ``int`` >= 0 (``bool`` included); nothing
                accepted.
            PublisherClosedError: the publisher is closed.
            InvalidEventError: when a part must be split, or the batch is read in this
                process (``on_flush``, a transport taking ``EventBatch``), ``body`` does not
                decode to ``count`` valid events (nothing accepted).
        """
        if type(body) is not bytes:
            raise TypeError(f"body must be bytes, got {type(body).__name__}")
        if type(count) is not int or count < 0:  # noqa: E721 - bool is not a count
            raise ValueError(f"count must be an int >= 0, got {count!r}")
        if not count:
            return
        if not self._payload_only or self._on_flush is not None:
            # This batch's events will be read (an on_flush callback, a transport taking
            # EventBatch): decode the part now, so that bytes which are not ``count``
            # events are refused whole here, not found at the flush after the batch drew
            # its seq (a seq gap, the batch's other events lost).
            try:
                events = _decode_events(_array_header(count) + body)
            except Exception as exc:  # noqa: BLE001 - msgspec's decode errors
                raise InvalidEventError(f"publish_encoded: body is not {count} encoded events: {exc}") from exc
            with self._lock:
                first = self._next_seq
                self._accept_locked(events, None, body)
                last = self._next_seq - 1
            if last >= first and self._on_flush is not None:
                self._run_callbacks(first, last)
            return
        with self._lock:
            # Fast path (the common case): the pending batch is open, the part fits it,
            # nothing is queued unencoded and the rate estimate is not due for an update.
            pending = self._count
            delay = self._delay
            now = time.monotonic()
            size = len(body)
            if (
                pending
                and pending + count < self._max_events
                and self._pending_bytes + size <= self._max_bytes
                and not self._lazy_bytes
                and 0.0 <= now - delay._at < delay._step
                and not self._closed
            ):
                delay._pending += count
                if not self._opaque:
                    self._opaque = True
                    self._events, self._n_encoded = [], 0
                self._encoded.append(body)
                self._count = pending + count
                self._pending_bytes += size
                return
            self._accept_encoded_locked(body, count)

    def _open_for_events_locked(self) -> None:
        """Before appending (lock held): refuse a closed publisher, start the flush timer,
        and give size-bounded queued events (``publish_valid``) their bytes.

        Raises:
            PublisherClosedError: the publisher is closed.
        """
        if self._closed:
            # close() accepts what the on_flush calls it waits for publish (re-entrant)
            if not (self._draining and self._deliverer == threading.get_ident()):
                raise PublisherClosedError(f"publisher {self.source!r} is closed")
        elif self._timer is None:
            self._ensure_timer()
        if self._lazy_bytes:
            self._encode_queued_locked()

    def _accept_encoded_locked(self, body: bytes, count: int) -> None:
        """:meth:`publish_encoded`'s general case (lock held)."""
        self._open_for_events_locked()
        now = time.monotonic()
        size = len(body)
        pending = self._count
        if pending + count <= self._max_events and self._pending_bytes + size <= self._max_bytes:
            updated = self._delay.observe(count, now)
            if not pending:
                self._open_batch_locked(now)
            self._opaque = True
            self._events, self._n_encoded = [], 0
            self._encoded.append(body)
            self._count = pending + count
            self._pending_bytes += size
            if self._count >= self._max_events:
                self._flush_locked()
        else:
            try:
                events = _decode_events(_array_header(count) + body)
            except Exception as exc:  # noqa: BLE001 - msgspec's decode errors
                raise InvalidEventError(f"publish_encoded: body is not {count} encoded events: {exc}") from exc
            updated = self._delay.observe(count, now)
            self._append_each_locked(events, [encode_event(ev) for ev in events], now)
        if updated:
            self._rate_moved_locked(now)

    def _encode_queued_locked(self) -> None:
        """Encode the events ``publish_valid`` queued without encoding (lock held): they
        are the tail of the pending batch after the encoded ones.  Their real size keeps
        the batch within ``max_bytes`` when the producer's bound held; if it did not, they
        are taken out and appended again one by one by their real sizes (sending what the
        byte limit requires), as :meth:`publish` would have."""
        if not self._lazy_bytes:
            return
        self._lazy_bytes = 0
        k = self._n_encoded
        queued = self._events[k:]
        if not queued:
            return
        try:
            data = _encode(queued)
        except Exception:  # noqa: BLE001 - a producer broke the publish_valid contract
            # keep every event that encodes, drop (count, log) the ones that do not
            del self._events[k:]
            self._count -= len(queued)
            good: list[KVEvent] = []
            parts: list[bytes] = []
            for ev in queued:
                try:
                    parts.append(encode_event(ev))
                    good.append(ev)
                except Exception:  # noqa: BLE001
                    self._stats.dropped += 1
                    logger.error("event publisher %s: a queued event cannot be encoded, dropped: %r", self.source, ev)
            self._append_each_locked(good, parts, time.monotonic())
            return
        n = len(queued)
        body = data[1 if n < 16 else (3 if n < 1 << 16 else 5) :]
        if self._pending_bytes + len(body) <= self._max_bytes:
            self._encoded.append(body)
            self._pending_bytes += len(body)
            self._n_encoded = len(self._events)
            return
        del self._events[k:]  # the bound was too small: re-batch them by their real sizes
        self._count -= len(queued)
        self._append_each_locked(queued, [encode_event(ev) for ev in queued], time.monotonic())

    def _accept_locked(self, events: Sequence[KVEvent], encoded: list[bytes] | None, body: bytes | None) -> None:
        """Append checked events (lock held): ``encoded`` holds each event's bytes, or
        ``body`` all of them concatenated."""
        self._open_for_events_locked()
        max_events, max_bytes = self.config.max_events, self.config.max_bytes
        n = len(events)
        now = time.monotonic()
        updated = self._delay.observe(n, now)
        pending = self._count
        size = len(body) if body is not None else sum(map(len, encoded))  # type: ignore[arg-type]
        if pending + n <= max_events and self._pending_bytes + size <= max_bytes:
            # All of them fit the pending batch: no event would trip a limit before the
            # last, so append in bulk (same result as the per-event loop below).
            if not pending:
                self._open_batch_locked(now)
            self._events.extend(events)
            self._count += n
            self._n_encoded = len(self._events)
            if body is not None:
                self._encoded.append(body)
            else:
                self._encoded.extend(encoded)  # type: ignore[arg-type]
            self._pending_bytes += size
            if pending + n >= max_events:
                self._flush_locked()
        else:
            if encoded is None:
                encoded = [encode_event(ev) for ev in events]
            self._append_each_locked(events, encoded, now)
        if updated:
            self._rate_moved_locked(now)

    def _rate_moved_locked(self, now: float) -> None:
        """The rate estimate was updated (lock held): a rising rate shortens the time
        limit, so move the pending batch's deadline earlier and wake the timer (checked
        when the estimate moved: at most once a millisecond)."""
        if self._oldest_at is not None and self._deadline is not None:
            deadline = self._oldest_at + self._delay.delay(now)
            if deadline < self._deadline - 0.001:
                self._deadline = deadline
                if deadline < self._timer_until:
                    self._cond.notify_all()

    def flush(self) -> None:
        """Send the pending batch now (if any), wait until ``on_flush`` ran for every batch
        sent so far (see ``on_flush``) and until the transport took them."""
        with self._lock:
            self._flush_locked()
            last = self._next_seq - 1
        if self._on_flush is not None:
            self._wait_callbacks(last)
        self._wait_sent()

    def close(self) -> None:
        """Send the pending batch, wait until ``on_flush`` ran for every batch, stop the
        timer, release the transport.  Idempotent (a second call also waits for
        ``on_flush``).

        From the moment ``close`` starts, ``publish`` and friends raise
        :class:`PublisherClosedError`, except inside an ``on_flush`` call that ``close``
        is waiting for: events published re-entrantly there are still accepted, sent and
        given to ``on_flush`` before ``close`` returns (up to ``_MAX_CLOSE_ROUNDS`` rounds
        of batches sent by ``on_flush`` itself; after that they are refused too).

        Raises:
            Exception: the first error ``on_flush`` raised for a batch that no caller was
                given yet (see ``on_flush``); the publisher is closed all the same.
        """
        with self._lock:
            already = self._closed
            if not already:
                self._flush_locked()
                self._closed = True
                self._draining = self._on_flush is not None
                self._cond.notify_all()
            last = self._next_seq - 1
        try:
            if self._on_flush is not None:
                if already:
                    self._wait_callbacks(last)
                else:
                    self._drain_on_close(last)
        finally:
            if not already:
                with self._lock:
                    self._draining = False
                self._stop_delivery_thread()
                if self._timer is not None and self._timer is not threading.current_thread():
                    self._timer.join()
                self._close_transport()

    def _drain_on_close(self, last: int) -> None:
        """:meth:`close`'s wait: run ``on_flush`` up to seq ``last``, then send and run
        what those calls published re-entrantly, until a round sends nothing (at most
        ``_MAX_CLOSE_ROUNDS`` rounds accept new events).  Raises the first error kept for
        the caller (after the last round)."""
        first_error: Exception | None = None
        rounds = 0
        while True:
            try:
                self._wait_callbacks(last)
            except Exception as exc:  # noqa: BLE001 - raised once every round ran
                if first_error is None:
                    first_error = exc
            rounds += 1
            with self._lock:
                if rounds >= _MAX_CLOSE_ROUNDS:
                    self._draining = False  # an on_flush that always publishes: stop here
                self._flush_locked()
                now_last = self._next_seq - 1
                if now_last == last:
                    self._draining = False
                    break
                last = now_last
        if first_error is not None:
            raise first_error

    def stats(self) -> PublisherStats:
        """A snapshot of this publisher's counters."""
        with self._lock:
            now = time.monotonic()
            return replace(
                self._stats,
                dropped=self._stats.dropped + self._transport_dropped(),
                refused=self._stats.refused + self._transport_refused(),
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

    def _send_payload(self, seq: int, count: int, payload: bytes) -> None:
        """Hand one encoded batch (``seq``, ``count`` events, its wire bytes) to the
        transport; called instead of :meth:`_send` (under the lock, in seq order) when the
        class's ``_send`` is marked with :func:`forwards_to_send_payload`, so no
        ``EventBatch`` needs to be built.  The default raises ``NotImplementedError``."""
        raise NotImplementedError(f"{type(self).__name__} has no _send_payload")

    def _wait_sent(self) -> None:
        """Block until batches handed to ``_send`` left the process (default: no-op)."""

    def _close_transport(self) -> None:
        """Release sockets / connections (default: nothing to release)."""

    def _transport_dropped(self) -> int:
        """Events the transport dropped after ``_send`` accepted them (default 0)."""
        return 0

    def _transport_refused(self) -> int:
        """Batches the transport's server refused for a full store (default 0)."""
        return 0

    # ------------------------------------------------------------------ internals
    def _flush_locked(self) -> None:
        if self._lazy_bytes:
            self._encode_queued_locked()  # may itself send batches (a bound too small)
        count = self._count
        if not count:
            return
        events, encoded, opaque = self._events, self._encoded, self._opaque
        self._events, self._encoded, self._n_encoded, self._count, self._opaque = [], [], 0, 0, False
        event_bytes, self._pending_bytes, self._oldest_at, self._deadline = self._pending_bytes, 0, None, None
        seq = self._next_seq
        self._next_seq += 1
        ts_ns = time.time_ns()
        payload = encode_batch_parts(self.source, self.epoch, seq, ts_ns, encoded, count)
        st = self._stats
        st.batches += 1
        st.events += count
        st.payload_bytes += len(payload)
        st.event_bytes += event_bytes
        on_flush = self._on_flush
        if self._payload_only and on_flush is None:
            # nothing reads the batch's events: no EventBatch, no KVEvent objects
            try:
                self._send_payload(seq, count, payload)
            except Exception:
                st.dropped += count
                logger.exception("event publisher %s: sending batch seq=%d failed", self.source, seq)
            return
        if opaque:  # parts handed over encoded: the events, as every subscriber will decode them
            events = decode_batch(payload).events
        batch = EventBatch(WIRE_VERSION, self.source, self.epoch, seq, ts_ns, events)
        try:
            if self._payload_only:
                self._send_payload(seq, count, payload)
            else:
                self._send(batch, payload)
        except Exception:
            st.dropped += count
            logger.exception("event publisher %s: sending batch seq=%d failed", self.source, seq)
        if on_flush is not None:
            self._deliver_q.append((batch, payload))  # run by _deliver, outside the lock

    def _append_each_locked(self, events: Sequence[KVEvent], encoded: list[bytes], now: float) -> None:
        """Append encoded events one by one (lock held), sending the pending batch before an
        event that would take it past ``max_bytes`` and when it reaches ``max_events``."""
        max_events, max_bytes = self._max_events, self._max_bytes
        for ev, data in zip(events, encoded):
            if self._count and self._pending_bytes + len(data) > max_bytes:
                self._flush_locked()
            if not self._count:
                self._open_batch_locked(now)
            self._events.append(ev)
            self._encoded.append(data)
            self._count += 1
            self._n_encoded = len(self._events)
            self._pending_bytes += len(data)
            if self._count >= max_events:
                self._flush_locked()

    def _open_batch_locked(self, now: float) -> None:
        """The first event of a new pending batch arrived at ``now`` (lock held): set its
        deadline, and wake the timer only if it sleeps past it (a timer already sleeping
        until an earlier time re-reads the deadline when it wakes)."""
        self._oldest_at = now
        deadline = self._deadline = now + self._delay.delay(now)
        if deadline < self._timer_until:
            self._cond.notify_all()

    def _ensure_timer(self) -> None:
        if self._timer is None:
            self._timer = threading.Thread(target=self._timer_loop, name=f"kvevents-timer-{self.source}", daemon=True)
            self._timer.start()

    # ------------------------------------------------------------------ on_flush delivery
    def _run_callbacks(self, first: int, last: int) -> None:
        """After a call sent batches ``first..last`` (publisher lock released): run
        ``on_flush`` for them and for the batches still waiting before them, unless another
        thread is running ``on_flush`` (then they are left to it or to the delivery thread;
        with more than ``_MAX_BACKLOG`` waiting, after waiting up to ``_BACKPRESSURE_S``
        for them).  Raises the first error ``on_flush`` raised for this call's batches."""
        cond, me = self._deliver_cond, threading.get_ident()
        with cond:
            if self._deliverer is not None:
                if self._deliverer == me or len(self._deliver_q) <= _MAX_BACKLOG:
                    return  # re-entrant (the running loop takes them), or left to the running thread
                deadline = time.monotonic() + _BACKPRESSURE_S
                while self._deliverer is not None and self._done_seq < last:
                    left = deadline - time.monotonic()
                    if left <= 0:
                        return  # never wait for good: the running on_flush may need a lock we hold
                    cond.wait(left)
            if self._done_seq >= last:
                return
        self._run_claimed(last, first)

    def _wait_callbacks(self, last: int) -> None:
        """Wait until ``on_flush`` ran for every batch up to seq ``last``, running them on
        this thread when no other thread is (:meth:`flush`, :meth:`close`).  From inside
        ``on_flush`` it returns at once.  Raises the first error of those batches that no
        caller was given yet."""
        cond, me = self._deliver_cond, threading.get_ident()
        while True:
            with cond:
                if self._deliverer == me:
                    return
                while self._deliverer is not None and self._done_seq < last:
                    cond.wait()
                if self._done_seq >= last:
                    errors = sorted(k for k in self._unreported if k <= last)
                    first_error = self._unreported[errors[0]] if errors else None
                    for k in errors:
                        del self._unreported[k]
                    break
            self._run_claimed(last, None)
        if first_error is not None:
            raise first_error

    def _run_claimed(self, last: int | None, own_first: int | None) -> None:
        """Claim the right to run ``on_flush`` (if free) and run the waiting batches in seq
        order up to ``last`` (``None``: all of them); batches ``own_first..last`` are the
        caller's own.  Batches left waiting after ``last`` are handed to the delivery
        thread.  Raises the first error of the caller's own batches; errors of the others
        are logged and kept for the next :meth:`flush` covering them."""
        cond, q, me = self._deliver_cond, self._deliver_q, threading.get_ident()
        claimed = more = False
        own_error: Exception | None = None
        try:
            with cond:
                if self._deliverer is not None:
                    return  # taken meanwhile: its loop or the delivery thread runs them
                claimed = True
                self._deliverer = me
            while True:
                with cond:
                    if not q or (last is not None and q[0][0].seq > last and not self._delivery_stop):
                        more = bool(q)
                        self._deliverer = None
                        claimed = False
                        cond.notify_all()
                        break
                    batch, payload = q.popleft()
                try:
                    self._on_flush(batch, payload)  # type: ignore[misc]
                except Exception as exc:  # noqa: BLE001 - the rest still runs
                    if own_first is not None and last is not None and own_first <= batch.seq <= last:
                        if own_error is None:
                            own_error = exc
                    else:
                        logger.exception("event publisher %s: on_flush of batch seq=%d failed", self.source, batch.seq)
                        with cond:
                            if len(self._unreported) >= _MAX_UNREPORTED:
                                del self._unreported[min(self._unreported)]
                            self._unreported[batch.seq] = exc
                finally:
                    with cond:  # run (or interrupted): never waited for again
                        self._done_seq = batch.seq
                        cond.notify_all()
        finally:
            if claimed:  # an exception (KeyboardInterrupt & co.) left the loop: give up the claim
                with cond:
                    if self._deliverer == me:
                        self._deliverer = None
                    more = bool(q)
                    cond.notify_all()
            if more:
                self._wake_delivery()
        if own_error is not None:
            raise own_error

    def _wake_delivery(self) -> None:
        """Batches wait and no thread runs them: have the delivery thread run them."""
        with self._deliver_cond:
            if self._delivery_stop:
                return
            self._delivery_wanted = True
            if self._delivery_thread is None:
                self._delivery_thread = threading.Thread(
                    target=self._delivery_loop, name=f"kvevents-onflush-{self.source}", daemon=True)
                self._delivery_thread.start()
            self._deliver_cond.notify_all()

    def _delivery_loop(self) -> None:
        cond = self._deliver_cond
        while True:
            with cond:
                while not self._delivery_stop and not (self._delivery_wanted and self._deliverer is None):
                    cond.wait()
                if self._delivery_stop and (not self._deliver_q or self._deliverer is not None):
                    return
                self._delivery_wanted = False
            try:
                self._run_claimed(None, None)
            except BaseException:  # noqa: BLE001 - must not kill the delivery thread
                logger.exception("event publisher %s: on_flush on the delivery thread failed", self.source)

    def _stop_delivery_thread(self) -> None:
        with self._deliver_cond:
            self._delivery_stop = True
            t = self._delivery_thread
            self._deliver_cond.notify_all()
        if t is not None and t is not threading.current_thread():
            t.join()

    def _timer_loop(self) -> None:
        while True:
            with self._cond:
                while not self._closed:
                    if self._deadline is None:
                        self._timer_until = math.inf
                        self._cond.wait()
                        continue
                    remaining = self._deadline - time.monotonic()
                    if remaining > 0:
                        self._timer_until = self._deadline
                        self._cond.wait(remaining)
                        continue
                    self._timer_until = math.inf
                    first = self._next_seq
                    try:
                        self._flush_locked()
                    except Exception:  # noqa: BLE001 - a failed flush must not kill the timer
                        logger.exception("event publisher %s: timed flush failed", self.source)
                    last = self._next_seq - 1
                    break
                else:
                    return
            if last >= first and self._on_flush is not None:
                try:
                    # no caller to raise to: errors are logged and kept for the next flush()
                    self._run_claimed_for_timer(last)
                except BaseException:  # noqa: BLE001 - on_flush errors must not kill the timer
                    logger.exception("event publisher %s: on_flush after a timed flush failed", self.source)

    def _run_claimed_for_timer(self, last: int) -> None:
        """:meth:`_run_callbacks` for the timer's batches (up to seq ``last``), none of them
        a caller's: their errors are logged and kept for :meth:`flush`."""
        with self._deliver_cond:
            if self._deliverer is not None or self._done_seq >= last:
                return  # the running thread (or the delivery thread after it) runs them
        self._run_claimed(last, None)


_MAX_BACKLOG = 64
"""Batches waiting for ``on_flush`` above which a publishing thread waits (up to
``_BACKPRESSURE_S``) for its own instead of leaving them to the thread running it."""
_BACKPRESSURE_S = 0.05
_MAX_CLOSE_ROUNDS = 100
"""Rounds of batches published re-entrantly by ``on_flush`` that :meth:`EventPublisher.close`
still sends and runs (a callback that publishes for every batch would never let it end)."""
_MAX_UNREPORTED = 64
"""``on_flush`` errors kept for a later :meth:`EventPublisher.flush` (the oldest go first)."""


class NullPublisher(EventPublisher):
    """Batches, numbers and reports batches to ``on_flush`` but sends nothing.

    Used by embedded setups (the advisor journals its own moves) and in tests.

    Without ``on_flush`` (``null://``) no event could reach anyone: :attr:`wants_events`
    is false, so producers that check it (the runtime's block pools) build no events at
    all (like vLLM with ``enable_kv_cache_events=False``) and only report how many they
    skipped (:meth:`skip_events`, counted in ``stats().events``; no batches then).  Events
    given to ``publish`` and friends are still batched, numbered and counted.
    """

    @property
    def wants_events(self) -> bool:
        """False without an ``on_flush`` callback (events off), else True."""
        return self._on_flush is not None

    @forwards_to_send_payload
    def _send(self, batch: EventBatch, payload: bytes) -> None:
        return None

    def _send_payload(self, seq: int, count: int, payload: bytes) -> None:
        return None
