"""Publisher settings and the counters that publishers and subscribers report."""

from __future__ import annotations

from dataclasses import dataclass

from event_plane.errors import ConfigError


@dataclass(frozen=True)
class PublisherConfig:
    """Batching and buffering limits of an :class:`~event_plane.publisher.EventPublisher`.

    Attributes:
        max_events: a batch is sent as soon as it holds this many events.
        max_bytes: a batch is sent before the encoded size of its events (sum of each
            event's MessagePack size, envelope excluded) would exceed this many bytes.
            An event larger than the limit travels alone.
        max_delay_s: seconds; no event waits in the pending batch longer than this.
        replay_buffer: number of most recent batches a ZMQ publisher keeps for replay.
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
    replay_buffer: int = 10_000
    queue_capacity: int = 100_000
    overflow: str = "drop"

    def __post_init__(self) -> None:
        for name in ("max_events", "max_bytes", "replay_buffer", "queue_capacity"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise ConfigError(f"PublisherConfig.{name} must be a positive int, got {value!r}")
        if not isinstance(self.max_delay_s, int | float) or not self.max_delay_s > 0:
            raise ConfigError(f"PublisherConfig.max_delay_s must be > 0 seconds, got {self.max_delay_s!r}")
        if self.overflow not in ("drop", "block"):
            raise ConfigError(f"PublisherConfig.overflow must be 'drop' or 'block', got {self.overflow!r}")


@dataclass
class PublisherStats:
    """Counters of one publisher since it started.

    Attributes:
        events: events sent in batches.
        batches: batches sent (== next seq).
        payload_bytes: sum of encoded batch sizes (envelope included).
        event_bytes: sum of each event's encoded size inside its batch.
        dropped: events in batches the transport could not take (queue full, send error).
    """

    events: int = 0
    batches: int = 0
    payload_bytes: int = 0
    event_bytes: int = 0
    dropped: int = 0


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

    def add(self, other: SubscriberStats) -> SubscriberStats:
        """Return the field-wise sum of ``self`` and ``other`` (for merged subscribers)."""
        return SubscriberStats(
            **{name: getattr(self, name) + getattr(other, name) for name in self.__dataclass_fields__}
        )
