"""Shared machinery of the vLLM / SGLang adapters: parse their KV-event batches and turn them
into KVEvent v1 batches.

Peer wire format (described in ``docs/events.md`` §10):

* batch: MessagePack ``[ts: float seconds, events: list, dp_rank?]`` (a map with ``ts``,
  ``events``, ``data_parallel_rank`` / ``attn_dp_rank`` is accepted too);
* event, array form: ``[tag, field0, field1, ...]`` with the fields in the class's order and
  trailing default fields left out (so every index is guarded);
* event, map form: ``{"type": tag, field: value, ...}``, default fields left out;
* tags ``BlockStored``, ``BlockRemoved``, ``AllBlocksCleared``; other tags are counted and
  skipped (a newer peer may add kinds);
* a block hash is an int (unsigned or signed 64-bit) or raw digest bytes, reduced to a u64 by
  :func:`hash_to_u64`.

Mapping (one peer batch → one KVEvent v1 batch with the peer's seq, the adapter's epoch):

* ``BlockStored`` with N hashes → N Stores in order; block i's parent is block i-1, block 0's
  parent is ``parent_block_hash`` (when absent: the parent the adapter recorded for block 0,
  else nil); ``prefix_hash`` is the chain's first block: the parent's recorded prefix when
  the adapter saw the parent, else block 0 itself;
  ``block_size`` = peer ``block_size`` (tokens) × ``bytes_per_token``;
* ``BlockRemoved`` with N hashes → N Removes (parent / prefix / size from what the adapter
  recorded at Store time, else nil / the hash / 0);
* ``AllBlocksCleared`` → one Cleared per ``cleared_locations`` (``g1`` by default);
* ``medium`` → ``storage_location``: GPU (or absent) → ``g1``; CPU, CPU_PINNED → ``g2``;
  DISK → ``disk_volume``; EXTERNAL → ``external_volume``; anything else → its lower-case name;
* ``only_media``: Stores and Removes of any other medium are skipped and counted
  (``other_media_events``), e.g. ``("GPU",)`` for a receiver that gets an offloading
  connector's tiers from the connector's own publisher.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, replace
from typing import Any, Literal

import msgspec

from event_plane.codec import CodecError
from event_plane.errors import ConfigError, EventPlaneError
from event_plane.schema import U32_MAX, U64_MAX, WIRE_VERSION, EventBatch, EventType, KVEvent
from event_plane.zmq_transport import ZmqSubscriber

logger = logging.getLogger(__name__)

DigestRule = Literal["last8", "first8"]

STORED, REMOVED, CLEARED = "BlockStored", "BlockRemoved", "AllBlocksCleared"

DEFAULT_MEDIA: Mapping[str, str] = {"GPU": "g1", "CPU": "g2", "CPU_PINNED": "g2"}


class PeerFormatError(EventPlaneError, ValueError):
    """One peer event is malformed (wrong type or range of a field); it is skipped alone."""


def hash_to_u64(value: object, digest_rule: DigestRule = "last8") -> int:
    """Reduce a peer block hash to the u64 KVEvent v1 carries.

    * int in ``[0, 2**64)``: unchanged;
    * int in ``[-2**63, 0)`` (signed 64-bit, SGLang): two's complement, ``value + 2**64``;
    * bytes (raw digest, e.g. vLLM with ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``):
      ``"last8"`` → the last 8 bytes as a big-endian unsigned int (exactly what vLLM sends
      as its int form, so both settings give the same u64); ``"first8"`` → the first 8 bytes,
      big-endian (the bytes SGLang's signed int form is made of). A digest shorter than 8
      bytes is read whole, big-endian.

    Raises:
        PeerFormatError: any other type, an int outside both ranges, empty bytes.
    """
    if type(value) is int:  # noqa: E721 - bool is not a hash
        if 0 <= value <= U64_MAX:
            return value
        if -(1 << 63) <= value < 0:
            return value + (1 << 64)
        raise PeerFormatError(f"block hash {value} is outside 64 bits")
    if isinstance(value, bytes | bytearray | memoryview):
        raw = bytes(value)
        if not raw:
            raise PeerFormatError("empty block hash digest")
        part = raw[-8:] if digest_rule == "last8" else raw[:8]
        return int.from_bytes(part, "big")
    raise PeerFormatError(f"block hash must be an int or bytes, got {type(value).__name__}")


@dataclass(frozen=True)
class PeerConfig:
    """How an adapter maps a peer's KV events to KVEvent v1.

    Attributes:
        source: KVEvent ``source`` of the converted batches (e.g. the pod id; 1..255 chars).
        bytes_per_token: KV bytes per token of the model, so ``block_size`` bytes =
            tokens × this (0 = unknown: sizes are 0).
        disk_volume: location of blocks whose medium is ``DISK``.
        external_volume: location of blocks whose medium is ``EXTERNAL`` (SGLang).
        media: extra / overriding medium → location entries (upper-case medium names).
        cleared_locations: locations an ``AllBlocksCleared`` empties.
        keep_peer_fields: copy ``medium``, ``lora_name``, ``group_idx`` and the batch's DP
            rank into ``extra_metadata`` (costs bytes; off by default); an event whose
            ``lora_name`` is not a str or ``group_idx`` not an int is then malformed.
        prefix_memory: hashes whose (parent, prefix, size) the adapter remembers, LRU.
        digest_rule: see :func:`hash_to_u64`.
        epoch: KVEvent epoch of the first peer process seen (random when ``None``).
        only_media: when not empty, the peer media (upper-case; ``GPU`` also stands for an
            absent medium) whose Stores and Removes are converted; the others are skipped
            and counted (``other_media_events``).  ``AllBlocksCleared`` is always converted.

    Raises:
        ConfigError: an empty / over-long source or location, a negative or non-int size.
    """

    source: str
    bytes_per_token: int = 0
    disk_volume: str = "disk"
    external_volume: str = "external"
    media: Mapping[str, str] = field(default_factory=dict)
    cleared_locations: tuple[str, ...] = ("g1",)
    keep_peer_fields: bool = False
    prefix_memory: int = 262_144
    digest_rule: DigestRule = "last8"
    epoch: int | None = None
    only_media: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        for name in ("source", "disk_volume", "external_volume"):
            value = getattr(self, name)
            if not isinstance(value, str) or not 1 <= len(value) <= 255:
                raise ConfigError(f"PeerConfig.{name} must be a str of 1..255 characters, got {value!r}")
        for loc in (*self.media.values(), *self.cleared_locations):
            if not isinstance(loc, str) or not 1 <= len(loc) <= 255:
                raise ConfigError(f"PeerConfig location {loc!r} must be a str of 1..255 characters")
        for name in ("bytes_per_token", "prefix_memory"):
            value = getattr(self, name)
            if type(value) is not int or value < 0:  # noqa: E721
                raise ConfigError(f"PeerConfig.{name} must be an int >= 0, got {value!r}")
        if self.digest_rule not in ("last8", "first8"):
            raise ConfigError(f"PeerConfig.digest_rule must be 'last8' or 'first8', got {self.digest_rule!r}")
        if self.epoch is not None and (type(self.epoch) is not int or not 0 <= self.epoch <= U64_MAX):  # noqa: E721
            raise ConfigError(f"PeerConfig.epoch must be a u64, got {self.epoch!r}")
        if not isinstance(self.only_media, tuple) or not all(isinstance(m, str) and m and m == m.upper()
                                                              for m in self.only_media):
            raise ConfigError(f"PeerConfig.only_media must be a tuple of upper-case medium names, got {self.only_media!r}")


@dataclass
class PeerStats:
    """Counters of one converter.

    Attributes:
        batches: peer batches converted.
        peer_events: peer events read (all tags).
        events: KVEvent v1 events produced.
        invalid_events: peer events skipped as malformed (:class:`PeerFormatError`).
        unknown_events: peer events of an unknown tag, skipped.
        restarts: peer restarts detected (live seq went backwards) → new epoch.
        other_media_events: Stores and Removes skipped for their medium (``only_media``).
    """

    batches: int = 0
    peer_events: int = 0
    events: int = 0
    invalid_events: int = 0
    unknown_events: int = 0
    restarts: int = 0
    other_media_events: int = 0


_decoder = msgspec.msgpack.Decoder()


class PeerConverter:
    """Converts one peer's batches (vLLM or SGLang) to KVEvent v1 batches.

    Args:
        config: mapping settings.
        fields: per tag, the field names of the array form in order (after the tag).

    Not thread-safe: one receiver thread feeds it.
    """

    def __init__(self, config: PeerConfig, fields: Mapping[str, Sequence[str]]) -> None:
        self.config = config
        self._fields = {tag: tuple(names) for tag, names in fields.items()}
        self._media = {**DEFAULT_MEDIA, "DISK": config.disk_volume, "EXTERNAL": config.external_volume}
        self._media.update({k.upper(): v for k, v in config.media.items()})
        self.epoch: int = secrets.randbits(64) if config.epoch is None else config.epoch
        self._last_live_seq: int | None = None
        # sequence hash -> (parent, prefix, block_size bytes), LRU-bounded
        self._known: OrderedDict[int, tuple[int | None, int, int]] = OrderedDict()
        self.stats = PeerStats()

    # ------------------------------------------------------------------ batches
    def convert(self, seq: int, payload: bytes, *, live: bool = True) -> EventBatch:
        """``enrich(parse(seq, payload, live=live))``: one peer payload, converted in order.

        Raises:
            CodecError: see :meth:`parse`.
        """
        return self.enrich(self.parse(seq, payload, live=live))

    def parse(self, seq: int, payload: bytes, *, live: bool = True) -> EventBatch:
        """Convert one peer payload (seq from its 8-byte seq frame) to a KVEvent v1 batch,
        without the adapter's memory: Stores carry their event's first block as prefix,
        Removes carry nil parent, their own hash as prefix and size 0. :meth:`enrich`
        fills those from earlier batches and must see batches in seq order (a subscriber
        parses when a message arrives, possibly before replayed predecessors, and enriches
        at delivery).

        A live seq not above the previous live seq means the peer restarted (its frames say
        nothing else): a new random epoch is drawn before converting. Malformed or unknown
        events are skipped alone and counted; the batch keeps the others (possibly none).

        Raises:
            CodecError: the payload is not a peer batch at all (bad MessagePack, not an
                array / map, no event list).
        """
        if live:
            if self._last_live_seq is not None and seq <= self._last_live_seq:
                self.epoch = secrets.randbits(64)
                self.stats.restarts += 1
                logger.info("peer %s restarted (seq %d after %d): new epoch", self.config.source, seq, self._last_live_seq)
            self._last_live_seq = seq
        try:
            obj = _decoder.decode(payload)
        except Exception as exc:  # noqa: BLE001 - msgspec raises several kinds on hostile input
            raise CodecError(f"not a MessagePack peer batch: {exc}") from exc
        ts, events, dp_rank = _split_batch(obj)
        out: list[KVEvent] = []
        st = self.stats
        for ev in events:
            st.peer_events += 1
            try:
                out.extend(self.convert_event(ev, dp_rank))
            except PeerFormatError as exc:
                st.invalid_events += 1
                logger.debug("peer %s: skipped malformed event: %s", self.config.source, exc)
        st.batches += 1
        st.events += len(out)
        return EventBatch(WIRE_VERSION, self.config.source, self.epoch, seq, _ts_ns(ts), out)

    def enrich(self, batch: EventBatch) -> EventBatch:
        """Apply the adapter's memory to a parsed batch, in delivery (seq) order: a Store's
        prefix becomes its parent's recorded prefix when the parent was seen (else it keeps
        its own); a Store without a parent of a block already recorded with one (vLLM sends
        ``parent_block_hash=None`` when it offloads a known block, e.g. to medium CPU)
        keeps the recorded parent and prefix, so a record never loses its parent; every
        Store is recorded; a Remove gets the recorded parent, prefix and size of its block.
        Returns a new batch (or ``batch`` when nothing changed)."""
        out: list[KVEvent] = []
        changed = False
        known = self._known
        for ev in batch.events:
            if ev.type == EventType.STORE:
                parent = ev.parent_hash
                if parent is None:
                    # vLLM's offloading events (e.g. a BlockStored with medium CPU for a
                    # block first stored on GPU) send no parent: the block keeps the parent
                    # and prefix recorded when it was first stored
                    own = known.get(ev.sequence_hash)
                    if own is not None and own[0] is not None:
                        parent, prefix = own[0], own[1]
                    else:
                        prefix = ev.sequence_hash
                else:
                    rec = known.get(parent)
                    prefix = rec[1] if rec is not None else ev.sequence_hash
                if (prefix, parent) != (ev.prefix_hash, ev.parent_hash):
                    ev = KVEvent(ev.type, ev.sequence_hash, prefix, parent, ev.block_size, ev.storage_location, ev.extra_metadata)
                    changed = True
                self._remember(ev.sequence_hash, parent, prefix, ev.block_size)
            elif ev.type == EventType.REMOVE:
                rec = known.get(ev.sequence_hash)
                if rec is not None and (rec[0], rec[1], rec[2]) != (ev.parent_hash, ev.prefix_hash, ev.block_size):
                    ev = KVEvent(ev.type, ev.sequence_hash, rec[1], rec[0], rec[2], ev.storage_location, ev.extra_metadata)
                    changed = True
            out.append(ev)
        return batch if not changed else EventBatch(batch.version, batch.source, batch.epoch, batch.seq, batch.ts_ns, out)

    # ------------------------------------------------------------------ events
    def convert_event(self, ev: object, dp_rank: int | None = None) -> list[KVEvent]:
        """Convert one peer event (array or map form) to KVEvent v1 events.

        Raises:
            PeerFormatError: malformed event (an unknown tag returns ``[]`` and is counted).
        """
        tag, f = self._fields_of(ev)
        if tag in (STORED, REMOVED) and self.config.only_media and not self._kept(f.get("medium")):
            self.stats.other_media_events += 1
            return []
        if tag == STORED:
            return self._stored(f, dp_rank)
        if tag == REMOVED:
            return self._removed(f, dp_rank)
        if tag == CLEARED:
            return [KVEvent(EventType.CLEARED, 0, 0, None, 0, loc, None) for loc in self.config.cleared_locations]
        self.stats.unknown_events += 1
        return []

    def _fields_of(self, ev: object) -> tuple[str, dict[str, Any]]:
        if isinstance(ev, list):
            if not ev or not isinstance(ev[0], str):
                raise PeerFormatError("array-form event without a str tag")
            names = self._fields.get(ev[0], ())
            return ev[0], dict(zip(names, ev[1:]))  # zip stops at the shorter: trailing defaults
        if isinstance(ev, dict):
            tag = ev.get("type")
            if not isinstance(tag, str):
                raise PeerFormatError("map-form event without a str 'type'")
            return tag, ev
        raise PeerFormatError(f"event must be an array or a map, got {type(ev).__name__}")

    def _kept(self, medium: object) -> bool:
        """Whether ``only_media`` keeps an event of ``medium`` (absent = ``GPU``)."""
        name = "GPU" if medium is None else medium.upper() if isinstance(medium, str) else None
        return name in self.config.only_media

    def _location(self, medium: object) -> str:
        if medium is None:
            return "g1"
        if not isinstance(medium, str) or not medium:
            raise PeerFormatError(f"medium must be a non-empty str, got {medium!r}")
        loc = self._media.get(medium.upper(), medium.lower())
        if len(loc) > 255:
            raise PeerFormatError("medium name longer than 255 characters")
        return loc

    def _hashes(self, f: Mapping[str, Any]) -> list[int]:
        hashes = f.get("block_hashes")
        if not isinstance(hashes, list):
            raise PeerFormatError("block_hashes must be a list")
        rule = self.config.digest_rule
        return [hash_to_u64(h, rule) for h in hashes]

    def _meta(self, f: Mapping[str, Any], dp_rank: int | None) -> dict[str, Any] | None:
        if not self.config.keep_peer_fields:
            return None
        # only values of the peers' documented types are copied: anything else (e.g. a list
        # nested past MAX_METADATA_DEPTH) could make a batch receivers refuse whole
        lora, group = f.get("lora_name"), f.get("group_idx")
        if lora is not None and not isinstance(lora, str):
            raise PeerFormatError(f"lora_name must be a str, got {type(lora).__name__}")
        if group is not None and type(group) is not int:  # noqa: E721 - bool is not an index
            raise PeerFormatError(f"group_idx must be an int, got {type(group).__name__}")
        meta = {k: f[k] for k in ("medium", "lora_name", "group_idx") if f.get(k) is not None}
        if dp_rank is not None:
            meta["dp_rank"] = dp_rank
        return meta or None

    def _stored(self, f: Mapping[str, Any], dp_rank: int | None) -> list[KVEvent]:
        hashes = self._hashes(f)
        parent_raw = f.get("parent_block_hash")
        parent = None if parent_raw is None else hash_to_u64(parent_raw, self.config.digest_rule)
        tokens = f.get("block_size", 0)
        if type(tokens) is not int or tokens < 0:  # noqa: E721
            raise PeerFormatError(f"block_size must be an int >= 0, got {tokens!r}")
        size = tokens * self.config.bytes_per_token
        if size > U32_MAX:
            raise PeerFormatError(f"block of {tokens} tokens is {size} bytes, above u32")
        loc = self._location(f.get("medium"))
        meta = self._meta(f, dp_rank)
        out: list[KVEvent] = []
        for h in hashes:
            out.append(KVEvent(EventType.STORE, h, hashes[0], parent, size, loc, meta))
            parent = h
        return out

    def _removed(self, f: Mapping[str, Any], dp_rank: int | None) -> list[KVEvent]:
        hashes = self._hashes(f)
        loc = self._location(f.get("medium"))
        meta = self._meta(f, dp_rank)
        out: list[KVEvent] = []
        for h in hashes:
            out.append(KVEvent(EventType.REMOVE, h, h, None, 0, loc, meta))
        return out

    def _remember(self, h: int, parent: int | None, prefix: int, size: int) -> None:
        known = self._known
        known[h] = (parent, prefix, size)
        known.move_to_end(h)
        while len(known) > self.config.prefix_memory:
            known.popitem(last=False)


def _split_batch(obj: object) -> tuple[object, list[object], int | None]:
    """``[ts, events, dp_rank?]`` or a map → (ts, events, dp_rank). Raises CodecError."""
    if isinstance(obj, list):
        if len(obj) < 2:
            raise CodecError(f"peer batch needs [ts, events, ...], got {len(obj)} elements")
        ts, events = obj[0], obj[1]
        dp = obj[2] if len(obj) > 2 else None
    elif isinstance(obj, dict):
        ts, events = obj.get("ts"), obj.get("events")
        dp = obj.get("data_parallel_rank", obj.get("attn_dp_rank"))
    else:
        raise CodecError(f"peer batch must be an array or a map, got {type(obj).__name__}")
    if not isinstance(events, list):
        raise CodecError("peer batch events must be a list")
    return ts, events, dp if type(dp) is int else None  # noqa: E721


def _ts_ns(ts: object) -> int:
    """Peer ``ts`` (float seconds) → u64 ns; anything unusable → now."""
    if isinstance(ts, int | float) and not isinstance(ts, bool) and 0 <= ts < 1.8e10:
        return int(ts * 1e9)
    return time.time_ns()


class PeerSubscriber(ZmqSubscriber):
    """A :class:`~event_plane.zmq_transport.ZmqSubscriber` for a vLLM / SGLang publisher: it
    reads their ZMQ frames (live ``[topic, seq, payload]``; replay replies ``[topic, seq,
    payload]`` or ``[seq, payload]``, end marker seq = 8 × 0xFF) and yields KVEvent v1
    batches. Ordering, gap recovery through the peer's replay socket, drops and resync
    work as for our own publishers.

    Args:
        endpoint: the peer's PUB endpoint, e.g. ``tcp://10.0.0.5:5557``.
        replay_endpoint: the peer's ROUTER replay endpoint, or ``None``.
        converter: the peer's :class:`PeerConverter`.
        topic: topic prefix to subscribe to (peers publish an empty topic by default).
        **kw: :class:`ZmqSubscriber` keywords (``on_gap``, ``queue_capacity``,
            ``on_resync``, ``replay_timeout_s``, ``context``).
    """

    def __init__(
        self,
        endpoint: str,
        replay_endpoint: str | None,
        converter: PeerConverter,
        topic: bytes = b"",
        **kw: Any,
    ) -> None:
        super().__init__([(endpoint, replay_endpoint)], topic, **kw)
        self.converter = converter

    def _decode(self, seq: int, payload: bytes, *, live: bool) -> EventBatch:
        return self.converter.parse(seq, payload, live=live)

    def _deliver(self, batch: EventBatch) -> None:
        # Called in seq order (after any replayed predecessors): the converter's memory of
        # parents and prefixes is applied here, not at parse time.
        super()._deliver(self.converter.enrich(batch))

    def peer_stats(self) -> PeerStats:
        """A snapshot of the converter's counters."""
        return replace(self.converter.stats)
