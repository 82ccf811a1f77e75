"""KVEvent v1 wire types (normative copy: ``docs/events.md``).

A *batch* is a MessagePack positional array::

    [version=1, source: str, epoch: u64, seq: u64, ts_ns: u64, events: [Event, ...]]

and an *event* is::

    [type, sequence_hash: u64, prefix_hash: u64, parent_hash: u64 | nil,
     block_size: u32, storage_location: str, extra_metadata: map | nil]

No field names travel on the wire (``array_like=True``), so a Store of one block in
``g1`` costs about 38 bytes inside a batch.  Format defined by docs/design.md §3.
"""

from __future__ import annotations

import enum
from typing import Annotated, Any

import msgspec

WIRE_VERSION = 1
U64_MAX = (1 << 64) - 1
U32_MAX = (1 << 32) - 1
PARENT_WALK_LIMIT = 4096
"""Parent links a receiver follows at most to find out whether a Store of a new block closes
a parent cycle (``docs/events.md`` §2.3): the advisor's index and ``BlockTracker`` reject
such a Store alone, like a self-parented one; a longer cycle is not detected."""

# MessagePack integers never exceed 2**64-1, so ``ge=0`` makes a field an exact u64.
U64 = Annotated[int, msgspec.Meta(ge=0)]
U32 = Annotated[int, msgspec.Meta(ge=0, le=U32_MAX)]
Location = Annotated[str, msgspec.Meta(min_length=1, max_length=255)]


class EventType(enum.IntEnum):
    """Kind of a KVEvent (``type`` field)."""

    STORE = 0
    """A block is now held at ``storage_location``."""
    REMOVE = 1
    """The last copy of the block at ``storage_location`` is gone."""
    CLEARED = 2
    """Every block of this source at ``storage_location`` is gone."""


class KVEvent(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """One block event.

    Attributes:
        type: :class:`EventType`.
        sequence_hash: positional lineage hash of the block (u64, docs/design.md §4).
        prefix_hash: sequence hash of the first block of the chain (u64).
        parent_hash: sequence hash of the previous block, ``None`` for the first.
        block_size: bytes of KV data in the block (u32).
        storage_location: ``"g1"``, ``"g2"`` or a volume id.
        extra_metadata: partner metadata (e.g. ``{"hits": 3}``); unknown keys are kept.
    """

    type: EventType
    sequence_hash: U64
    prefix_hash: U64
    parent_hash: U64 | None
    block_size: U32
    storage_location: Location
    extra_metadata: dict[str, Any] | None = None


class EventBatch(msgspec.Struct, array_like=True, frozen=True, gc=False):
    """A batch of events from one publisher.

    Attributes:
        version: wire version, always :data:`WIRE_VERSION` (1).
        source: worker / instance id.
        epoch: random u64 chosen at publisher start; a new epoch means the source
            restarted and its ``g1``/``g2`` contents are gone.
        seq: per (source, epoch) batch counter, starts at 0, +1 per batch.
        ts_ns: wall-clock time of the flush in nanoseconds since the Unix epoch.
        events: the events, in the order they happened.
    """

    version: int
    source: Annotated[str, msgspec.Meta(min_length=1, max_length=255)]
    epoch: U64
    seq: U64
    ts_ns: U64
    events: list[KVEvent]


def store(
    sequence_hash: int,
    prefix_hash: int,
    parent_hash: int | None,
    block_size: int,
    storage_location: str,
    extra_metadata: dict[str, Any] | None = None,
) -> KVEvent:
    """Build a Store event (see :class:`KVEvent` for field meanings)."""
    return KVEvent(
        EventType.STORE, sequence_hash, prefix_hash, parent_hash, block_size, storage_location, extra_metadata
    )


def remove(
    sequence_hash: int, prefix_hash: int, parent_hash: int | None, block_size: int, storage_location: str
) -> KVEvent:
    """Build a Remove event (see :class:`KVEvent` for field meanings)."""
    return KVEvent(EventType.REMOVE, sequence_hash, prefix_hash, parent_hash, block_size, storage_location, None)


def cleared(storage_location: str) -> KVEvent:
    """Build a Cleared event: every block of this source at ``storage_location`` is gone."""
    return KVEvent(EventType.CLEARED, 0, 0, None, 0, storage_location, None)
