"""Check events before a publisher accepts them.

``msgspec`` structs do not check their constraints when built in Python, so a publisher
checks each event against KVEvent v1 (docs/design.md §3, ``docs/events.md``) and encodes it
once; a bad event raises :class:`InvalidEventError` before anything is accepted.
"""

from __future__ import annotations

from collections.abc import Iterable

import msgspec

from event_plane.codec import MAX_METADATA_DEPTH, encode_event, metadata_depth_error
from event_plane.errors import InvalidEventError
from event_plane.schema import U32_MAX, U64_MAX, EventType, KVEvent

_MAX_LOCATION = 255
_MAX_SOURCE = 255


def check_source(source: object) -> str:
    """Return ``source`` if it is a valid batch source (str of 1..255 characters).

    Raises:
        InvalidEventError: otherwise.
    """
    if not isinstance(source, str) or not 1 <= len(source) <= _MAX_SOURCE:
        raise InvalidEventError(f"source must be a str of 1..{_MAX_SOURCE} characters, got {source!r}")
    return source


def check_u64(name: str, value: object) -> int:
    """Return ``value`` if it is an int in [0, 2**64); raise :class:`InvalidEventError` otherwise."""
    if type(value) is not int or not 0 <= value <= U64_MAX:  # noqa: E721 - bool is not a hash
        raise InvalidEventError(f"{name} must be an int in [0, 2**64), got {value!r}")
    return value


def encode_checked(event: object) -> bytes:
    """Validate one event and return its wire encoding (as inside a batch).

    Args:
        event: candidate :class:`KVEvent`.

    Returns:
        MessagePack bytes of the event (typically 30-40 bytes for a Store).

    Raises:
        InvalidEventError: not a KVEvent, unknown type, hash outside u64, block_size outside
            u32, storage_location not a str of 1..255 characters, extra_metadata not a map
            with str keys of encodable values, or nested deeper than
            :data:`~event_plane.codec.MAX_METADATA_DEPTH` levels (receivers refuse it).
    """
    if not isinstance(event, KVEvent):
        raise InvalidEventError(f"expected KVEvent, got {type(event).__name__}")
    if not isinstance(event.type, EventType):
        try:
            EventType(event.type)
        except ValueError:
            raise InvalidEventError(f"unknown event type {event.type!r}") from None
    check_u64("sequence_hash", event.sequence_hash)
    check_u64("prefix_hash", event.prefix_hash)
    if event.parent_hash is not None:
        check_u64("parent_hash", event.parent_hash)
    if type(event.block_size) is not int or not 0 <= event.block_size <= U32_MAX:  # noqa: E721
        raise InvalidEventError(f"block_size must be an int in [0, 2**32), got {event.block_size!r}")
    loc = event.storage_location
    if not isinstance(loc, str) or not 1 <= len(loc) <= _MAX_LOCATION:
        raise InvalidEventError(f"storage_location must be a str of 1..{_MAX_LOCATION} characters, got {loc!r}")
    meta = event.extra_metadata
    if meta is not None:
        if not isinstance(meta, dict) or not all(isinstance(k, str) for k in meta):
            raise InvalidEventError("extra_metadata must be None or a dict with str keys")
        why = metadata_depth_error(meta, MAX_METADATA_DEPTH)
        if why is not None:
            raise InvalidEventError(why)
    try:
        return encode_event(event)
    except (msgspec.EncodeError, TypeError, ValueError, OverflowError) as exc:
        raise InvalidEventError(f"event cannot be encoded: {exc}") from exc


_encode = msgspec.msgpack.Encoder().encode  # same settings as codec's encoder: identical bytes


def encode_checked_all(events: Iterable[object]) -> list[bytes]:
    """Validate and encode a sequence of events; ``[encode_checked(ev) for ev in events]``.

    The common event (exactly a :class:`KVEvent`, an :class:`EventType` member, exact
    ``int`` fields in range, a plain ``str`` location of 1..255 characters, no
    ``extra_metadata``) is checked inline; anything else goes through
    :func:`encode_checked`, so it is accepted or rejected (same message) exactly as there.

    Returns:
        The events' MessagePack bytes, in order.

    Raises:
        InvalidEventError: the first malformed event (nothing is returned).
    """
    out: list[bytes] = []
    app = out.append
    enc = _encode
    kv, et, int_, str_, type_, len_ = KVEvent, EventType, int, str, type, len
    for ev in events:
        if type_(ev) is kv and ev.extra_metadata is None:
            s = ev.sequence_hash
            p = ev.prefix_hash
            par = ev.parent_hash
            bs = ev.block_size
            loc = ev.storage_location
            # ``not x >> 64`` on an exact int <=> 0 <= x < 2**64 (negatives shift to -1).
            if (
                type_(ev.type) is et
                and type_(s) is int_
                and type_(p) is int_
                and type_(bs) is int_
                and type_(loc) is str_
                and not (s | p) >> 64
                and not bs >> 32
                and 0 < len_(loc) <= _MAX_LOCATION
                and (par is None or (type_(par) is int_ and not par >> 64))
            ):
                app(enc(ev))
                continue
        app(encode_checked(ev))
    return out
