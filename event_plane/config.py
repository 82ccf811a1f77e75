"""Publisher settings, JetStream stream limits and the counters that publishers and
subscribers report."""

from __future__ import annotations

import math
from dataclasses import dataclass

from event_plane.errors import ConfigError

DEFAULT_STREAM_MAX_BYTES = 1 << 30
"""Default size limit of the ``KVADVISOR_EVENTS`` JetStream stream: 1 GiB."""
DEFAULT_STREAM_MAX_AGE_S = 24 * 3600.0
"""Default age limit of the ``KVADVISOR_EVENTS`` JetStream stream: 24 h, in seconds."""


@dataclass(frozen=True)
class PublisherConfig:
    """Batching and buffering limits of an :class:`~event_plane.publisher.EventPublisher`.

    Attributes:
        max_events: a batch is sent as soon as it holds this many events.
        max_bytes: a batch is sent before the encoded size of its events (sum of each
            event's MessagePack size, envelope excluded) would exceed this many bytes.
            An event larger than the limit travels alone.
        max_delay_s: seconds; ceiling of the flush time limit: no event waits in the
            pending batch longer than this.
        adaptive_delay: lower the time limit as the event rate rises (rule in
            :mod:`event_plane.flush_policy`, ``docs/events.md`` §3.1); ``False`` keeps it
            at ``max_delay_s``.
        min_delay_s: seconds; floor of the adaptive time limit.
        target_batch_events: the adaptive time limit is about the time the current rate
            needs to gather this many events.
        rate_window_s: seconds; time constant of the event-rate estimate.
        replay_buffer: number of most recent batches a ZMQ publisher keeps for replay.
        replay_hwm: messages ZMQ may queue towards one replay client (the ROUTER's send
            high-water mark). A reply is paced to it: the next batches are sent as the
            client reads, so a client that never reads holds at most this many.
        replay_max_bytes: payload bytes one replay answer sends at most; the answer then
            ends early with the end marker (counted ``truncated``). At least one batch is
            always sent.
        replay_peer_rate: replay requests per second one client (ROUTER identity) may
            make; bursts of ``max(1, rate)``. Others get only the end marker.
        replay_total_rate: replay requests per second from all clients together; bursts
            of ``max(1, rate)``.
        replay_max_active: replay answers in progress at once; a request past it gets
            only the end marker. A second request from a client whose answer is still in
            progress is dropped unanswered (counted ``refused_busy``).
        replay_peer_active: answers in progress at once for one peer (its network address,
            and its CURVE key with CURVE on; a peer keeps it across reconnections); a
            request past it gets only the end marker (``refused_peer_active``).
        replay_reserved: of ``replay_max_active``, the slots kept for peers that read
            (``None``: half). A peer whose answer it stopped reading (``stalled``,
            ``preempted``, or gone after ``replay_idle_s`` without reading) is *not
            reading* for ``replay_penalty_s``: one answer at a time, only in the other
            slots, and its requests draw on ``replay_suspect_rate`` instead of
            ``replay_total_rate``. When every slot is taken, a request of a reading peer
            takes the slot of the answer idle longest (at least ``replay_idle_s``),
            which is abandoned (``preempted``).
        replay_idle_s: seconds without reading after which an answer's slot may be taken.
        replay_penalty_s: seconds a peer stays *not reading* after its last abandoned answer.
        replay_suspect_rate: replay requests per second from all peers not reading together.
        replay_stall_s: seconds; an answer whose client has read nothing for this long
            (its queue stays at ``replay_hwm``) is abandoned (counted ``stalled``).
        replay_max_stalled: after this many abandoned answers the replay ROUTER is closed
            and bound again (counted ``recycles``): ZMQ frees what it queued for a client
            only when that connection closes, and a ROUTER cannot close one. Answers in
            progress then are dropped (their clients count the rest unrecovered).
        queue_capacity: events a transport may hold in flight (queued, not yet handed
            to the network / acknowledged by JetStream).
        overflow: what a full transport queue does to the next batch: ``"drop"`` (count it
            in ``stats().dropped``; the caller never waits) or ``"block"`` (the flushing
            caller waits for room).

    Raises:
        ConfigError: on a non-positive limit.
    """

    max_events: int = 1024
    max_bytes: int = 64 * 1024
    max_delay_s: float = 10.0
    adaptive_delay: bool = True
    min_delay_s: float = 0.01
    target_batch_events: int = 256
    rate_window_s: float = 1.0
    replay_buffer: int = 10_000
    replay_hwm: int = 128
    replay_max_bytes: int = 64 << 20
    replay_peer_rate: float = 2.0
    replay_total_rate: float = 20.0
    replay_max_active: int = 8
    replay_peer_active: int = 4
    replay_reserved: int | None = None
    replay_idle_s: float = 0.25
    replay_penalty_s: float = 30.0
    replay_suspect_rate: float = 2.0
    replay_stall_s: float = 5.0
    replay_max_stalled: int = 8
    queue_capacity: int = 100_000
    overflow: str = "drop"

    def __post_init__(self) -> None:
        for name in ("max_events", "max_bytes", "replay_buffer", "queue_capacity", "target_batch_events",
                     "replay_hwm", "replay_max_bytes", "replay_max_active", "replay_max_stalled", "replay_peer_active"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"PublisherConfig.{name} must be a positive int, got {value!r}")
        for name in ("max_delay_s", "min_delay_s", "rate_window_s", "replay_peer_rate", "replay_total_rate",
                     "replay_stall_s", "replay_idle_s", "replay_penalty_s", "replay_suspect_rate"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not value > 0:
                raise ConfigError(f"PublisherConfig.{name} must be > 0, got {value!r}")
        r = self.replay_reserved
        if r is not None and (not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.replay_max_active):
            raise ConfigError(f"PublisherConfig.replay_reserved must be an int in [0, replay_max_active), got {r!r}")
        if not isinstance(self.adaptive_delay, bool):
            raise ConfigError(f"PublisherConfig.adaptive_delay must be a bool, got {self.adaptive_delay!r}")
        if self.overflow not in ("drop", "block"):
            raise ConfigError(f"PublisherConfig.overflow must be 'drop' or 'block', got {self.overflow!r}")


    @property
    def replay_reserved_slots(self) -> int:
        """Replay slots kept for peers that read (``replay_reserved``, default half)."""
        return self.replay_max_active // 2 if self.replay_reserved is None else self.replay_reserved


@dataclass(frozen=True)
class StreamLimits:
    """Retention limits of the ``KVADVISOR_EVENTS`` JetStream stream, and what to do when
    the stream already exists with other settings.

    Whoever creates the stream (a publisher or a subscriber, whichever starts first)
    creates it with these limits; whoever finds it already there compares its
    configuration with these and logs a warning naming each differing field, or refuses
    to start (``strict``).

    Attributes:
        max_bytes: bytes the stream may hold (> 0), ``None`` = unlimited.  Default 1 GiB.
        max_age_s: seconds a batch is kept (> 0), ``None`` = unlimited.  Default 24 h.
        discard: what the stream does at a limit: ``"old"`` (default: it deletes its
            oldest batches, a ring of the most recent history: publishers are never
            refused, a consumer that lags behind the deleted ones sees a gap) or ``"new"``
            (it refuses new batches until old ones age out: publishers count them as
            dropped and ``refused``).
        strict: refuse (:class:`~event_plane.errors.StreamMismatchError`) instead of
            warning when an existing stream's configuration differs.
        replicas: copies of the stream on a NATS cluster (1, 3 or 5; 3 on a 3-node
            cluster keeps the log through the loss of one node).

    Raises:
        ConfigError: a limit that is not a positive number (``bool`` included), an unknown
            ``discard``, a non-bool ``strict``.
    """

    max_bytes: int | None = DEFAULT_STREAM_MAX_BYTES
    max_age_s: float | None = DEFAULT_STREAM_MAX_AGE_S
    discard: str = "old"
    strict: bool = False
    replicas: int = 1

    def __post_init__(self) -> None:
        mb = self.max_bytes
        if mb is not None and (not isinstance(mb, int) or isinstance(mb, bool) or mb < 1):
            raise ConfigError(f"StreamLimits.max_bytes must be a positive int of bytes or None, got {mb!r}")
        age = self.max_age_s
        if age is not None and (
            not isinstance(age, int | float) or isinstance(age, bool) or not 0 < age < math.inf
        ):
            raise ConfigError(f"StreamLimits.max_age_s must be a number of seconds > 0 or None, got {age!r}")
        if self.replicas.__class__ is not int or self.replicas not in (1, 3, 5):
            raise ConfigError(f"StreamLimits.replicas must be 1, 3 or 5, got {self.replicas!r}")
        if self.discard not in ("old", "new"):
            raise ConfigError(f"StreamLimits.discard must be 'old' or 'new', got {self.discard!r}")
        if not isinstance(self.strict, bool):
            raise ConfigError(f"StreamLimits.strict must be a bool, got {self.strict!r}")


@dataclass
class PublisherStats:
    """Counters of one publisher since it started.

    Attributes:
        events: events sent in batches.
        batches: batches sent (== next seq).
        payload_bytes: sum of encoded batch sizes (envelope included).
        event_bytes: sum of each event's encoded size inside its batch.
        dropped: events in batches the transport could not take (queue full, send error,
            refused by a full JetStream store).
        refused: batches a JetStream server refused at once because the stream or the
            server's storage is full (their events are counted in ``dropped`` too).
        flush_delay_s: the flush time limit in force when the snapshot was taken, seconds
            (``max_delay_s`` at rest, lower under load when ``adaptive_delay`` is on).
        event_rate: the publisher's recent event rate, events per second.
    """

    events: int = 0
    batches: int = 0
    payload_bytes: int = 0
    event_bytes: int = 0
    dropped: int = 0
    refused: int = 0
    flush_delay_s: float = 0.0
    event_rate: float = 0.0


@dataclass
class SubscriberStats:
    """Counters of one subscriber since it started.

    Attributes:
        batches: batches delivered to ``get``'s queue.
        events: events in those batches.
        gaps: gaps detected (a seq jump, or a first batch of a source/epoch with seq > 0).
        replayed: batches recovered through replay and delivered.
        unrecovered: batches known to be lost (missing seqs replay could not supply).
        decode_errors: messages skipped because their frames or payload were malformed.
        duplicates: batches dropped as already delivered (or from a superseded epoch).
        restarts: new epochs seen for a known source.
        dropped: batches dropped because the delivery queue was full.
        resyncs: resyncs scheduled (a source entered ``resync_needed``: a dropped or
            unrecovered batch means the application's state of it is no longer exact).
        discarded: JetStream: messages this consumer was to read that the stream had
            already deleted (its limits) when the consumer started; counted over the whole
            stream (all namespaces), so an upper bound of this subscriber's share.
        recoveries_refused: gaps not fetched because the most sources allowed were already
            in recovery on that endpoint (ZMQ ``max_recovering``); their seqs count as
            unrecovered.
        parked_dropped: batches dropped because their source already had the most batches
            allowed held back behind its recovery (ZMQ ``max_parked``).
        reconnects: ZMQ: connections to a publisher made again after it dropped (among
            them, a message over the size limit, which libzmq answers by disconnecting).
        receive_errors: unexpected errors of the transport's receive loop (out of sockets
            or file descriptors...); the loop pauses and goes on.
        sources_forgotten: sources whose ordering state (and resync mark) was dropped:
            never admitted (not bound to an origin) and beyond the most tracked at once
            (:data:`event_plane.ordering.MAX_UNKEPT_SOURCES`), least recently seen first.
    """

    batches: int = 0
    events: int = 0
    gaps: int = 0
    replayed: int = 0
    unrecovered: int = 0
    decode_errors: int = 0
    duplicates: int = 0
    restarts: int = 0
    dropped: int = 0
    resyncs: int = 0
    discarded: int = 0
    recoveries_refused: int = 0
    parked_dropped: int = 0
    reconnects: int = 0
    receive_errors: int = 0
    sources_forgotten: int = 0

    def add(self, other: SubscriberStats) -> SubscriberStats:
        """Return the field-wise sum of ``self`` and ``other`` (for merged subscribers)."""
        return SubscriberStats(
            **{name: getattr(self, name) + getattr(other, name) for name in self.__dataclass_fields__}
        )
