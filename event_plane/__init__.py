"""Event plane: KVEvent v1 wire format, batching publishers, ZMQ / NATS transports and
the subscriber SDK. Normative spec: ``docs/events.md``. Imports nothing else of ours."""

from event_plane.codec import CodecError, decode_batch, encode_batch
from event_plane.config import PublisherConfig, PublisherStats, SubscriberStats
from event_plane.errors import (
    ConfigError,
    EventPlaneError,
    EventURLError,
    InvalidEventError,
    PublisherClosedError,
    TransportError,
)
from event_plane.nats_transport import JetStreamPublisher, JetStreamSubscriber, NatsPublisher, NatsSubscriber
from event_plane.publisher import EventPublisher, NullPublisher
from event_plane.schema import WIRE_VERSION, EventBatch, EventType, KVEvent, cleared, remove, store
from event_plane.subscriber import MultiSubscriber, Subscriber
from event_plane.urls import make_publisher, subscribe
from event_plane.zmq_transport import ZmqPublisher, ZmqSubscriber

__all__ = [
    "WIRE_VERSION",
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
    "NatsPublisher",
    "NatsSubscriber",
    "NullPublisher",
    "PublisherClosedError",
    "PublisherConfig",
    "PublisherStats",
    "Subscriber",
    "SubscriberStats",
    "TransportError",
    "ZmqPublisher",
    "ZmqSubscriber",
    "cleared",
    "decode_batch",
    "encode_batch",
    "make_publisher",
    "remove",
    "store",
    "subscribe",
]
