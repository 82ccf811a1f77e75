"""Exception classes of the event plane.

Every error the event plane raises on bad input or misuse is an :class:`EventPlaneError`
(``CodecError`` from :mod:`event_plane.codec` is the one exception: it stays a plain
``ValueError`` subclass so the codec has no dependency).
"""

from __future__ import annotations


class EventPlaneError(Exception):
    """Base class of the event plane's own errors."""


class InvalidEventError(EventPlaneError, ValueError):
    """An event handed to a publisher violates KVEvent v1 (type, range or size of a field).

    Raised before any event of the offending ``publish`` call is accepted.
    """


class PublisherClosedError(EventPlaneError, RuntimeError):
    """``publish`` was called after ``close``."""


class EventURLError(EventPlaneError, ValueError):
    """An event-plane URL (``zmq://``, ``nats://``, ...) is malformed or unsupported."""


class ConfigError(EventPlaneError, ValueError):
    """A publisher or subscriber setting is out of range."""


class StreamMismatchError(ConfigError):
    """The JetStream stream exists with a configuration other than the one this publisher
    or subscriber was given, and it was told to refuse (``strict``) rather than warn."""


class TransportError(EventPlaneError, RuntimeError):
    """A transport could not be set up (bind/connect failure, server unreachable)."""


class NotStartedError(EventPlaneError, RuntimeError):
    """``get`` (or iteration) on a subscriber that was never started: nothing could ever
    arrive, so it fails at once instead of waiting forever."""
