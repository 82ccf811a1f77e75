"""Event plane: KVEvent v1 wire format, batching publishers, ZMQ / NATS transports and
the subscriber SDK (vendor helpers in :mod:`event_plane.sdk`, vLLM / SGLang ingestion in
:mod:`event_plane.adapters`, CLI in :mod:`event_plane.cli`). Normative spec:
``docs/events.md``. Imports nothing else of ours."""

from event_plane.codec import CodecError, decode_batch, encode_batch
from event_plane.config import PublisherConfig, PublisherStats, StreamLimits, SubscriberStats
from event_plane.errors import (
    ConfigError,
    EventPlaneError,
    EventURLError,
    InvalidEventError,
    NotStartedError,
    PublisherClosedError,
    StreamMismatchError,
    TransportError,
)
from event_plane.nats_auth import NatsAuth, redact_url
from event_plane.nats_transport import JetStreamPublisher, JetStreamSubscriber, NatsPublisher, NatsSubscriber
from event_plane.publisher import EventPublisher, NullPublisher
from event_plane.schema import WIRE_VERSION, EventBatch, EventType, KVEvent, cleared, remove, store
from event_plane.sdk import BlockTracker, SourcedEvent, TrackerStats, iter_events
from event_plane.subscriber import MultiSubscriber, Subscriber
from event_plane.urls import make_publisher, subscribe
from event_plane.zmq_transport import ZmqPublisher, ZmqSubscriber

__all__ = [
    "WIRE_VERSION",
    "BlockTracker",
    "CodecError",
    "ConfigError",
    "EventBatch",
    "EventPlaneError",
    "EventPublisher",
    "EventType",
    "EventURLError",
    "InvalidEventError",
    "JetStreamPublisher",
    "JetStreamSubscriber",
    "KVEvent",
    "MultiSubscriber",
    "NatsAuth",
    "NatsPublisher",
    "NatsSubscriber",
    "NullPublisher",
    "PublisherClosedError",
    "PublisherConfig",
    "PublisherStats",
    "SourcedEvent",
    "StreamLimits",
    "StreamMismatchError",
    "Subscriber",
    "SubscriberStats",
    "TrackerStats",
    "TransportError",
    "ZmqPublisher",
    "ZmqSubscriber",
    "cleared",
    "decode_batch",
    "NotStartedError",
    "encode_batch",
    "iter_events",
    "make_publisher",
    "redact_url",
    "remove",
    "store",
    "subscribe",
]
