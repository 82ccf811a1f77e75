"""PrefixIndex: the advisor's fold of the KV event log.

Maps a block's sequence hash (u64, docs/design.md §4) to its parent, prefix family, size in
bytes, the set of *locations* that hold it, a hit counter and the time of its last access.

Locations:
    * a volume id (``"fast"``, ``"slow"``, ``"s3"``) is global: every worker and the
      advisor see the same volume, so it is used as is;
    * ``g1`` / ``g2`` are private to one worker, so the index qualifies them with the
      batch's source: ``"<source>/g1"``.
    * a ``storage_location`` that is empty, blank or contains ``/`` is rejected (the event
      alone, counted in ``invalid_locations``): volume ids are single tokens, so a
      qualified private name (always with ``/``) never equals a volume id.

Internally (compiled core, ``advisor/_index_core.pyx``) a block is 72 bytes of C arrays
(hash + location mask, and a record), found through an open-addressing table keyed by the
sequence hash; a location is a bit of its mask with a block count (bits 64 and above live in a side table,
so any number of locations works); volumes also keep the hashes they hold, each with the
source(s) that stored it there (*storers*, for Cleared).  :meth:`PrefixIndex.apply_payload`
folds a wire batch straight from its bytes.  Figures: ``bench/advisor.py``,
``docs/BENCHMARKS.md``.  A location whose block count drops to zero gives its bit back at
the end of the batch (reused by the next new location), so short-lived sources do not grow
the masks.  The pure-Python implementation is kept as the executable specification
(:class:`advisor.index_reference.ReferencePrefixIndex`); the two are checked equal by a
differential test.

The fold is deterministic: it only uses what is in the batches (``ts_ns`` is the clock),
so the same log applied twice gives the same :meth:`PrefixIndex.dump`.

Fault tolerance (failure cases of ``cases/CASES.md``):
    * Store whose parent is unknown: kept as an *orphan*, linked when the parent arrives.
    * duplicate Store (same block, same location): counted, nothing changes.
    * Remove of an unknown hash or of a location that does not hold the block: counted.
    * Remove of an ancestor before its descendants: the descendants stay indexed and
      become orphans until the ancestor is stored again.
    * Remove at one location while others still hold the block: the others stay.
    * a self-parented Store (``parent_hash == sequence_hash``) is rejected alone, and so is
      the Store of a new block that closes a parent cycle (``A -> B`` then ``B -> A``;
      checked up to ``PARENT_WALK_LIMIT`` links).
    * a new epoch of a known source drops that source's ``g1``/``g2`` residency (reading
      that source's own blocks: each private location keeps its members, so the cost does
      not grow with the index, ``bench/advisor.py``); batches
      of a superseded epoch that arrive later are counted (``stale_batches``) and only their
      volume events are applied, in order (facts about shared storage; their Stores are
      placement only, never accesses); their ``g1``/``g2`` events are ignored.
    * Cleared of a volume from source A removes A from the storers of each block there;
      a block leaves the volume when no storer remains (other sources' blocks stay).  A
      Remove at a volume ends the residency whoever stored it (the copy is gone).
    * hit counts (per block and the global counter) saturate at 2**64 - 1.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence
from typing import Any

from advisor._index_core import IndexCore
from advisor.frequency import FrequencySketch
from advisor.index_reference import (
    _UNKNOWN_STORER,
    HITS_KEY,
    MOVE_KEY,
    PLACEMENT_KEYS,
    PRIVATE_TIERS,
    STATE_VERSION,
    U64_MAX,
    BlockInfo,
    IndexCounters,
    IndexStateError,
    IndexStateViews,
    held_by_location,
    SourceState,
    _is_private_name,
    _storer_add,
    is_valid_location,
)
from event_plane.ordering import RetiredEpochs

__all__ = [
    "HITS_KEY", "MOVE_KEY", "PLACEMENT_KEYS", "PRIVATE_TIERS", "STATE_VERSION", "U64_MAX", "BlockInfo",
    "IndexCounters", "IndexStateError", "PrefixIndex", "SourceState", "is_valid_location",
]

_U64 = 1 << 64


def _state_u64(v: Any, what: str, bounded: bool = True) -> int:
    """``v`` when it is an int in [0, 2**64) (not a bool; ``bounded=False``: any int >= 0,
    for counts that may pass 2**64), else :class:`IndexStateError`: an imported epoch,
    hash or counter that later folds could not compare or add to."""
    if v.__class__ is not int or v < 0 or (bounded and v >= _U64):
        raise IndexStateError(f"index state {what} {v!r} is not a{' u64' if bounded else ' non-negative'} int")
    return v


class PrefixIndex(IndexStateViews, IndexCore):
    """Sequence hash → block info, per-location residency and longest-prefix lookup.

    Not thread-safe: the advisor serialises writers and readers with its own lock.  A fold
    started while another fold of the same index is in progress (another thread without
    that lock, or the frequency sketch's ``increment`` calling back) raises ``RuntimeError``.

    Mutations: :meth:`apply_batch` (a decoded :class:`~event_plane.schema.EventBatch`) and
    :meth:`apply_payload` (the batch's wire bytes, same result; raises
    :class:`~event_plane.codec.CodecError` exactly when ``decode_batch`` does).  Queries:
    :meth:`lookup`, :meth:`lookup_any`, :meth:`block`, :meth:`children`, :meth:`blocks_at`,
    :meth:`count_at`, :meth:`holds`, :meth:`locations`, :meth:`orphans`, :meth:`sources`,
    :meth:`hashes`, :meth:`stats`, :meth:`dump`; snapshots: :meth:`export_state` /
    :meth:`from_state`.  Hash arguments are u64 ints; any other value is never indexed.

    Layout (memory per block, see ``docs/BENCHMARKS.md``): C records and hash slots (see
    ``advisor/_index_core.pyx``); children of a hash that is not indexed (orphans waiting
    for their parent) in a side dict; volumes also keep ``h -> storer`` (the source that
    stored it, or a frozenset of sources), so ``blocks_at`` of a volume is a copy while
    ``blocks_at`` of a private ``g1``/``g2`` scans the table.
    """

    def __init__(self, frequency: FrequencySketch | None = None) -> None:
        super().__init__(frequency)

    @classmethod
    def from_state(cls, state: Sequence[Any], frequency: FrequencySketch | None = None) -> PrefixIndex:
        """Rebuild an index from :meth:`export_state` output (``dump()`` is equal).

        A version-1 state (no storers) imports with its volume residency attributed to no
        source (``""``): no source's Cleared removes it, a Remove still does.

        Raises:
            IndexStateError: the state has another version or a malformed shape (including
                hashes, hits or times outside u64, sizes outside u32, record fields that
                are not ints, a block that is its own parent, location bit lists naming
                bits beyond the locations, and counters, source rows or orphans that are
                not non-negative ints): such a state is refused whole, never imported to
                fail later folds half way.
        """
        try:
            version = state[0]
        except (TypeError, IndexError, KeyError) as exc:
            raise IndexStateError(f"index state must be an array: {exc}") from exc
        if version not in (1, STATE_VERSION):
            raise IndexStateError(f"index state version {version!r} is not 1 or {STATE_VERSION}")
        size = 6 if version == 1 else 7
        try:
            if len(state) != size:
                raise ValueError(f"{len(state)} items")
            _v, locs, flat, orphans, sources, counters, *rest = state
        except (TypeError, ValueError) as exc:
            raise IndexStateError(f"index state version {version} must be a {size}-item array: {exc}") from exc
        storers = rest[0] if rest else None
        try:
            n_flat = len(flat)
        except TypeError as exc:
            raise IndexStateError(f"index state block array is not an array: {exc}") from exc
        if n_flat % 7:
            raise IndexStateError(f"index state block array has {n_flat} items, not a multiple of 7")
        idx = cls(frequency)
        try:
            free: list[int] = []
            for bit, name in enumerate(locs):
                name = sys.intern(str(name))
                idx._loc_names.append(name)
                idx._loc_counts.append(0)
                if not name:
                    idx._loc_sets.append(None)
                    free.append(bit)  # ascending: already a heap
                    continue
                if name in idx._loc_bit:
                    raise IndexStateError(f"index state location {name!r} is repeated")
                idx._loc_bit[name] = bit
                idx._loc_sets.append(None if _is_private_name(name) else {})
            idx._free_bits.extend(free)
            free_mask = sum(1 << b for b in free)
            nloc = len(idx._loc_names)
            limit = 1 << nloc
            it = iter(flat)
            for h, parent, prefix, size_, mask, hits, last in zip(it, it, it, it, it, it, it):
                if not isinstance(mask, int):
                    bits = set(mask)
                    if not all(isinstance(b, int) and 0 <= b < nloc for b in bits):
                        raise IndexStateError(f"block {h} uses a location bit beyond {nloc} locations")
                    mask = sum(1 << b for b in bits)
                if mask >= limit or mask < 0 or mask & free_mask:
                    raise IndexStateError(f"block {h} uses a location bit beyond {nloc} locations or a free one")
                idx._put_record(h, parent, prefix, size_, mask, hits, last)
            idx._link_all()
            counts = idx._loc_counts
            held_at = held_by_location(((r[0], r[4]) for r in idx._records()), len(idx._loc_sets))
            for bit, s in enumerate(idx._loc_sets):
                held = held_at[bit]
                counts[bit] = len(held)
                if s is None:
                    if held:
                        idx._add_members(bit, held)  # a private location: its membership
                    continue
                if storers is None:
                    s.update(dict.fromkeys(held, _UNKNOWN_STORER))
                    continue
                for src_name, hs in storers.get(idx._loc_names[bit], {}).items():
                    src_name = sys.intern(str(src_name))
                    for h in hs:
                        if h.__class__ is not int:  # a float 1.0 would pass as block 1
                            raise IndexStateError(f"index state storer hash {h!r} of {src_name!r} is not an int")
                        s[h] = _storer_add(s[h], src_name) if h in s else src_name
                if len(s) != len(held) or not all(h in s for h in held):
                    raise IndexStateError(f"index state storers of {idx._loc_names[bit]!r} do not match its blocks")
            if storers is not None and any(name not in idx._loc_bit for name in storers):
                raise IndexStateError("index state has storers of an unknown location")
            idx._orphans = {_state_u64(h, "orphan") for h in orphans}
            for name, epoch, last_seq, nb, ne, last_ts, retired in sources:
                if not isinstance(name, str):
                    raise IndexStateError(f"index state source name {name!r} is not a str")
                row = [_state_u64(v, f"source {name!r} field", i not in (2, 3))
                       for i, v in enumerate((epoch, last_seq, nb, ne, last_ts))]
                idx._sources[sys.intern(name)] = SourceState(
                    *row, RetiredEpochs(_state_u64(e, f"source {name!r} retired epoch") for e in retired))
            if not isinstance(counters, dict):
                raise IndexStateError(f"index state counters are not a map: {counters!r}")
            idx.counters = IndexCounters(**{str(k): _state_u64(v, f"counter {k!r}", False) for k, v in counters.items()})
        except IndexStateError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError, OverflowError) as exc:
            raise IndexStateError(f"malformed index state: {exc}") from exc
        return idx
