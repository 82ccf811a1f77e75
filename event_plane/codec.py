"""Encode and decode KVEvent v1 batches (MessagePack, positional).

Every failure to decode raises :class:`CodecError` and nothing else, so a subscriber can
count and skip a malformed batch without losing the ones around it.

:func:`decode_batch` is the one decoder of the wire format: live subscribers, the advisor's
journal (append and replay) and its index's payload fold all use it, so a batch accepted
live is accepted again when the journal is replayed. ``extra_metadata`` may nest at most
:data:`MAX_METADATA_DEPTH` containers deep (arrays used as map keys included); a deeper batch is refused whole, whatever stack
depth the decoder runs at (msgspec alone fails such input only on a deep enough stack).
"""

from __future__ import annotations

from operator import attrgetter

import msgspec

from event_plane.schema import WIRE_VERSION, EventBatch, KVEvent

_encoder = msgspec.msgpack.Encoder()
_batch_decoder = msgspec.msgpack.Decoder(EventBatch)
_event_decoder = msgspec.msgpack.Decoder(KVEvent)
_metadata_of = attrgetter("extra_metadata")


MAX_METADATA_DEPTH = 32
"""Deepest nesting of an event's ``extra_metadata``: the map itself is level 1, each map or
array inside it one more, an array used as a map key too (``{"a": [{"b": 1}]}`` and
``{"a": {[1]: 1}}`` are 3 levels). Deeper metadata is invalid."""


class CodecError(ValueError):
    """A byte string is not a valid KVEvent v1 batch (or event)."""


def metadata_depth_error(meta: object, limit: int = MAX_METADATA_DEPTH) -> str | None:
    """Why ``meta`` (an ``extra_metadata`` value) nests too deep, or ``None`` if it does not.

    Walks the maps and arrays without recursion, so it runs at any stack depth and stops at
    the first container past ``limit`` levels. An array used as a map key (decoded as a
    tuple) nests like any array: it counts too.
    """
    if not isinstance(meta, dict | list | tuple):
        return None
    stack: list[tuple[object, int]] = [(meta, 1)]
    while stack:
        obj, depth = stack.pop()
        if depth > limit:
            return f"extra_metadata nests more than {limit} levels deep"
        if isinstance(obj, dict):
            for key in obj:
                if key.__class__ is tuple:
                    stack.append((key, depth + 1))
            children = obj.values()
        else:
            children = obj
        for child in children:  # type: ignore[attr-defined]
            if isinstance(child, dict | list | tuple):
                stack.append((child, depth + 1))
    return None


def check_batch(batch: EventBatch) -> EventBatch:
    """Return ``batch`` if it passes the checks msgspec's schema cannot express (wire
    version, :data:`MAX_METADATA_DEPTH`); :func:`decode_batch` applies them to every batch.

    Raises:
        CodecError: the batch has another version or too deep ``extra_metadata``.
    """
    if batch.version != WIRE_VERSION:
        raise CodecError(f"unsupported wire version {batch.version} (this build reads {WIRE_VERSION})")
    for meta in filter(None, map(_metadata_of, batch.events)):  # C-speed skip of the nil ones
        why = metadata_depth_error(meta)
        if why is not None:
            raise CodecError(why)
    # A self-parented Store is structurally valid; the index rejects it alone (C11).
    return batch


def encode_batch(batch: EventBatch) -> bytes:
    """Serialize ``batch`` to its wire form (bytes)."""
    return _encoder.encode(batch)


def encode_event(event: KVEvent) -> bytes:
    """Serialize one event as it appears inside a batch (used to size batches)."""
    return _encoder.encode(event)


MAX_EVENT_WIRE_BYTES = 1 + 1 + 3 * 9 + 5 + 3 + 255 + 1
"""Most bytes one event takes on the wire without its ``extra_metadata`` (docs/events.md
§2.1): array header, type, three u64 hashes (9 bytes each at most), a u32 block size, a
storage location of at most 255 bytes (with a str8 header) and a nil metadata."""

MAX_ENVELOPE_BYTES = 1 + 1 + 3 + 255 + 3 * 9 + 5
"""Most bytes of a batch's envelope (array header, version, source of at most 255 bytes,
epoch, seq, ts_ns, the events' array header)."""


def max_batch_bytes(max_events: int, max_metadata_bytes: int) -> int:
    """Most bytes a batch of at most ``max_events`` events carrying at most
    ``max_metadata_bytes`` of encoded ``extra_metadata`` in all can take on the wire (the
    size limit a subscriber sets on its sockets: a bigger message cannot pass the quotas)."""
    return MAX_ENVELOPE_BYTES + max_events * MAX_EVENT_WIRE_BYTES + max_metadata_bytes


def event_count(data: bytes | bytearray | memoryview) -> int | None:
    """The number of events a wire batch declares in its header, read without building any
    event object (the envelope decodes; the events stay raw bytes), or ``None`` when the
    envelope does not decode."""
    head = decode_head(data)
    if head is None:
        return None
    raw = memoryview(head.events)
    if not raw:
        return None
    b = raw[0]
    if 0x90 <= b <= 0x9F:
        return b & 0x0F
    if b == 0xDC and len(raw) >= 3:
        return int.from_bytes(raw[1:3], "big")
    if b == 0xDD and len(raw) >= 5:
        return int.from_bytes(raw[1:5], "big")
    return None


def decode_batch(data: bytes | bytearray | memoryview, max_events: int | None = None) -> EventBatch:
    """Parse one wire batch.

    Args:
        data: the payload.
        max_events: refuse a batch declaring more events than this before decoding any
            event (:func:`event_count`); ``None``: no limit.

    Raises:
        CodecError: on any malformed input (bad msgpack, wrong arity or types,
            out-of-range integers, unknown event type, unsupported version,
            ``extra_metadata`` deeper than :data:`MAX_METADATA_DEPTH`), or more events
            than ``max_events``.
    """
    if max_events is not None:
        n = event_count(data)
        if n is not None and n > max_events:
            raise CodecError(f"the batch declares {n} events, more than {max_events}: not decoded")
    try:
        batch = _batch_decoder.decode(data)
    except (msgspec.DecodeError, msgspec.ValidationError) as exc:
        raise CodecError(str(exc)) from exc
    except Exception as exc:  # noqa: BLE001 - msgspec may raise others on hostile input
        raise CodecError(f"{type(exc).__name__}: {exc}") from exc
    return check_batch(batch)


def decode_event(data: bytes | bytearray | memoryview) -> KVEvent:
    """Parse one wire event. Raises :class:`CodecError` on malformed input (including
    ``extra_metadata`` deeper than :data:`MAX_METADATA_DEPTH`)."""
    try:
        event = _event_decoder.decode(data)
    except Exception as exc:  # noqa: BLE001
        raise CodecError(f"{type(exc).__name__}: {exc}") from exc
    if event.extra_metadata is not None and (why := metadata_depth_error(event.extra_metadata)) is not None:
        raise CodecError(why)
    return event


class BatchHead(msgspec.Struct, array_like=True):
    """The envelope of a wire batch (docs/events.md §2.1) with its events left undecoded:
    what a log reader needs to route or vet a batch without decoding it."""

    version: int
    source: str
    epoch: int
    seq: int
    ts_ns: int
    events: msgspec.Raw


_head_decoder = msgspec.msgpack.Decoder(BatchHead)


def decode_head(data: bytes | bytearray | memoryview) -> BatchHead | None:
    """The envelope of a wire batch, or ``None`` when it does not decode (the index rejects
    and counts such a batch; a caller peeking at the envelope just skips it)."""
    try:
        return _head_decoder.decode(data)
    except Exception:  # noqa: BLE001 - msgspec may raise others than DecodeError on hostile input
        return None


def _array_header(n: int) -> bytes:
    """MessagePack array header for ``n`` elements (fixarray / array16 / array32)."""
    if n < 16:
        return bytes((0x90 | n,))
    if n < 1 << 16:
        return b"\xdc" + n.to_bytes(2, "big")
    return b"\xdd" + n.to_bytes(4, "big")


def encode_batch_parts(
    source: str, epoch: int, seq: int, ts_ns: int, encoded_events: list[bytes], count: int | None = None
) -> bytes:
    """Build a wire batch from events already encoded with :func:`encode_event`.

    The result is byte-identical to ``encode_batch(EventBatch(WIRE_VERSION, source, epoch,
    seq, ts_ns, events))``; publishers use it so every event is encoded once.

    Args:
        source, epoch, seq, ts_ns: batch envelope fields (see :class:`EventBatch`).
        encoded_events: the events' MessagePack bytes, in order; one part may hold several
            consecutive events (their encodings concatenated).
        count: number of events in ``encoded_events`` (default: one per part).

    Returns:
        The batch payload (bytes).
    """
    # The envelope with an empty event list ends in 0x90 (fixarray of 0): swap that byte
    # for the real array header and append the events.
    head = _encoder.encode((WIRE_VERSION, source, epoch, seq, ts_ns, ()))
    n = len(encoded_events) if count is None else count
    return b"".join((head[:-1], _array_header(n), *encoded_events))
