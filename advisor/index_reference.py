"""Reference (pure-Python) PrefixIndex: the advisor's fold of the KV event log.

This is the original implementation, kept as the executable specification of the fold:
:class:`advisor.index.PrefixIndex` (compiled core, ``advisor/_index_core.pyx``) must give the
same ``dump()``, ``stats()``, lookups and views for every log
(``tests/unit/test_advisor_core_diff.py``).  The shared types (:class:`BlockInfo`,
:class:`IndexCounters`, :class:`SourceState`, :class:`IndexStateError`) and constants are
defined here and re-exported by :mod:`advisor.index`.

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

Internally a block is one compact record (``h -> _Rec``) and a location is a bit of its
integer mask with a block count; volumes also keep the hashes they hold, each with the
source(s) that stored it there (*storers*, for Cleared).  That keeps ``apply_batch`` and
``lookup`` to a few dict/int operations per event and the index to about 180 bytes per
block (``bench/advisor.py``, ``docs/BENCHMARKS.md``).  A location whose block count drops to
zero gives its bit back at the end of the batch (reused by the next new location), so
short-lived sources do not grow the masks.

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
    * a new epoch of a known source drops that source's ``g1``/``g2`` residency; batches
      of a superseded epoch that arrive later are counted (``stale_batches``) and only their
      volume events are applied, in order (facts about shared storage; their Stores are
      placement only, never accesses); their ``g1``/``g2`` events are ignored.
    * Cleared of a volume from source A removes A from the storers of each block there;
      a block leaves the volume when no storer remains (other sources' blocks stay).  A
      Remove at a volume ends the residency whoever stored it (the copy is gone).
    * hit counts (per block and the global counter) saturate at 2**64 - 1.
"""

from __future__ import annotations

import heapq
import sys
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

import msgspec

from advisor.frequency import FrequencySketch
from event_plane.schema import PARENT_WALK_LIMIT as _WIRE_WALK_LIMIT
from event_plane.schema import EventBatch, EventType
from event_plane.ordering import RetiredEpochs

PRIVATE_TIERS: frozenset[str] = frozenset({"g1", "g2"})
"""Storage locations that are private to the publishing worker."""

MOVE_KEY = "moved_from"
"""``extra_metadata`` key the advisor's mover sets on its Store events: a placement
change, not an access (no hit, last access unchanged)."""

PLACEMENT_KEYS: tuple[str, ...] = (MOVE_KEY, "reconciled")
"""``extra_metadata`` keys marking a Store as a placement change (never an access)."""

STATE_VERSION = 2
"""Version of :meth:`PrefixIndex.export_state` arrays (version 1 states still import)."""

_U64 = 1 << 64
U64_MAX = _U64 - 1
"""Ceiling of every hit count (per block and :attr:`IndexCounters.hits`): adds saturate."""

PARENT_WALK_LIMIT = _WIRE_WALK_LIMIT
"""Parent links a new block's cycle check follows at most (``docs/events.md`` §2.3).

A Store of a new block whose parent chain leads back to the block itself (``A -> B`` then
``B -> A``, or longer) is rejected alone and counted (``parent_cycle_rejected``), like a
self-parented one.  Only a block that orphans are waiting for can close a cycle, so the
walk runs for those alone; it stops at the chain's first block, at a parent that is not
indexed, or after this many links (4096 blocks: 64 Ki tokens of 16-token blocks), which
bounds what one hostile event can cost.  A cycle longer than the limit is not detected."""

_UNKNOWN_STORER = ""
"""Storer of volume residency imported from a version-1 state (no source attribution):
no source's Cleared removes it (a Remove still does)."""


class IndexStateError(ValueError):
    """An exported index state cannot be imported (wrong version or shape)."""


def _located(source: str, storage_location: str) -> str:
    """Index location of a valid ``storage_location``: private tiers qualified by source."""
    return f"{source}/{storage_location}" if storage_location in PRIVATE_TIERS else storage_location


def is_valid_location(storage_location: str) -> bool:
    """Whether ``storage_location`` can be indexed: ``g1``, ``g2`` or a volume id, i.e. not
    empty, not blank and without ``/`` (``/`` separates a source from its private tier)."""
    return bool(storage_location) and "/" not in storage_location and not storage_location.isspace()


def _bits(mask: int) -> list[int]:
    """The set bit numbers of ``mask``, ascending: one step per set bit (a shift per bit
    position made a high bit of a wide mask cost O(bits²))."""
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return out


def held_by_location(records: Iterable[tuple[int, int]], nloc: int) -> list[list[int]]:
    """Per location bit, the hashes whose location mask has that bit set.

    Args:
        records: ``(sequence hash, location mask)`` pairs.
        nloc: number of location bits.

    One pass over the records, O(blocks × locations per block): a scan of every block
    per location grew as locations × blocks (20,000 sources of one block each made a
    snapshot load take minutes).
    """
    out: list[list[int]] = [[] for _ in range(nloc)]
    for h, m in records:
        while m:
            low = m & -m
            out[low.bit_length() - 1].append(h)
            m ^= low
    return out


HITS_KEY = "hits"
"""``extra_metadata`` key a partner may set to report extra hits of a block."""


@dataclass(frozen=True, slots=True)
class BlockInfo:
    """A read-only view of one indexed block.

    Attributes:
        sequence_hash: the block (u64).
        parent: sequence hash of the previous block, ``None`` for a chain's first block.
        prefix_hash: sequence hash of the chain's first block (prefix family).
        size: bytes of KV data (from the last Store).
        locations: locations holding the block (volume ids and ``"<source>/g1|g2"``).
        hits: re-Stores of the known block counted as accesses, plus reported hits.
        last_access_ns: ``ts_ns`` of the batch of the last access (first Store counts).
        orphan: ``True`` while the parent is not indexed.
    """

    sequence_hash: int
    parent: int | None
    prefix_hash: int
    size: int
    locations: frozenset[str]
    hits: int
    last_access_ns: int
    orphan: bool


@dataclass
class IndexCounters:
    """Monotonic counters of a :class:`PrefixIndex` (all plain event/batch counts)."""

    batches: int = 0
    events: int = 0
    stores: int = 0
    removes: int = 0
    cleared: int = 0
    hits: int = 0
    orphans: int = 0
    """Stores whose parent was not indexed when they arrived (case C2)."""
    orphans_linked: int = 0
    """Orphans whose parent arrived later."""
    duplicate_stores: int = 0
    """Stores of a block already held at that location (case C3)."""
    unknown_removes: int = 0
    """Removes of a hash not indexed, or at a location that did not hold it (case C5)."""
    self_parent_rejected: int = 0
    """Stores with ``parent_hash == sequence_hash``, rejected alone (case C11)."""
    parent_cycle_rejected: int = 0
    """Stores of a new block whose parent chain leads back to it (a parent cycle), rejected
    alone (see :data:`PARENT_WALK_LIMIT`)."""
    restarts: int = 0
    """New epochs of known sources (their g1/g2 residency was dropped, case C8)."""
    stale_batches: int = 0
    """Batches of a superseded epoch, ignored."""
    forgotten: int = 0
    """Blocks dropped because no location held them any more."""
    invalid_locations: int = 0
    """Events whose ``storage_location`` is empty, blank or contains ``/``, rejected alone."""
    stale_volume_events: int = 0
    """Volume events of superseded-epoch batches, applied (also counted in stores/removes/
    cleared; the batch itself counts only in ``stale_batches``)."""


@dataclass
class SourceState:
    """What the index knows about one event source."""

    epoch: int
    last_seq: int
    batches: int = 0
    events: int = 0
    last_ts_ns: int = 0
    retired_epochs: RetiredEpochs = field(default_factory=RetiredEpochs)
    """The newest :data:`event_plane.ordering.MAX_RETIRED_EPOCHS` superseded epochs."""


class _Rec(msgspec.Struct, gc=False):
    """Mutable per-block record: one 80-byte object per block, no GC header.

    ``h`` is the dict key object itself, so a child's ``parent`` shares it (no second int
    per block); ``kids`` holds the indexed children (``None``, one hash, or a set).  No
    field ever refers to another record, so the struct cannot be part of a cycle and can
    skip the garbage collector (``gc=False``).
    """

    h: int
    parent: int | None
    prefix: int
    size: int
    mask: int
    hits: int
    last: int
    kids: int | set[int] | None = None


def _is_private_name(location: str) -> bool:
    """Whether an index location is a worker's own ``"<source>/g1|g2"``."""
    head, sep, tier = location.rpartition("/")
    return bool(sep and head) and tier in PRIVATE_TIERS


def _storer_add(storers: str | frozenset[str], source: str) -> str | frozenset[str]:
    """Storers of a volume-held block after ``source`` stored it (again)."""
    if storers.__class__ is str:
        return storers if storers == source else frozenset((storers, source))  # type: ignore[arg-type]
    return storers if source in storers else storers | {source}  # type: ignore[operator]


def _storer_tuple(storers: str | frozenset[str]) -> tuple[str, ...]:
    return (storers,) if storers.__class__ is str else tuple(storers)  # type: ignore[return-value,arg-type]


def _kid_add(kids: int | set[int] | None, h: int) -> int | set[int]:
    if kids is None:
        return h
    if kids.__class__ is set:
        kids.add(h)  # type: ignore[union-attr]
        return kids
    return kids if kids == h else {kids, h}  # type: ignore[return-value]


def _kid_discard(kids: int | set[int] | None, h: int) -> int | set[int] | None:
    if kids is None:
        return None
    if kids.__class__ is set:
        kids.discard(h)  # type: ignore[union-attr]
        if len(kids) == 1:  # type: ignore[arg-type]
            return next(iter(kids))  # type: ignore[call-overload]
        return kids or None
    return None if kids == h else kids


def _kid_tuple(kids: int | set[int] | None) -> tuple[int, ...]:
    if kids is None:
        return ()
    if kids.__class__ is set:
        return tuple(kids)  # type: ignore[arg-type]
    return (kids,)  # type: ignore[return-value]


class IndexStateViews:
    """The views both prefix indexes derive the same way from their records: the index
    location of an event, :meth:`stats`, :meth:`export_state` and :meth:`dump`.

    A class using it provides ``_records()`` (one ``(h, parent, prefix, size, mask, hits,
    last_access)`` per indexed block), ``__len__``, ``_names(mask)`` and the location,
    source, orphan and counter attributes (``_loc_bit``, ``_loc_names``, ``_loc_counts``,
    ``_loc_sets``, ``_sources``, ``_orphans``, ``counters``).
    """

    @staticmethod
    def qualify(source: str, storage_location: str) -> str:
        """Index location of an event: ``"<source>/g1"`` for private tiers, else the volume id.

        Raises:
            ValueError: ``storage_location`` is empty, blank or contains ``/`` (see
                :func:`is_valid_location`); :meth:`apply_batch` rejects such events first.
        """
        if not is_valid_location(storage_location):
            raise ValueError(f"storage_location {storage_location!r} is empty, blank or contains '/'")
        return _located(source, storage_location)

    def has_location(self, location: str) -> bool:
        """Whether index location ``location`` (a volume id or ``"<source>/g1|g2"``) holds a block now."""
        return location in self._loc_bit  # type: ignore[attr-defined]

    def volume_count(self) -> int:
        """Volume (global) locations holding a block now: O(location bits), for the
        location quota (``advisor/quotas.py``), which calls it only for a new volume name."""
        return sum(1 for s in self._loc_sets if s is not None)  # type: ignore[attr-defined]

    def stats(self) -> dict[str, Any]:
        """Blocks per location, total blocks, pending orphans and the counters.

        Returns:
            ``{"blocks": int, "blocks_per_location": {loc: n}, "orphans_pending": int,
            "counters": {name: int}}``.
        """
        per_loc = {name: n for name, n in zip(self._loc_names, self._loc_counts) if n}
        return {
            "blocks": len(self),
            "blocks_per_location": dict(sorted(per_loc.items())),
            "orphans_pending": len(self._orphans),
            "counters": dict(vars(self.counters)),
        }

    def export_state(self) -> list[Any]:
        """The whole fold state as plain msgpack-able values (for :mod:`advisor.snapshot`).

        Returns:
            ``[STATE_VERSION, locations, blocks, orphans, sources, counters, storers]`` with
            ``locations`` the location names in bit order (``""`` for a free bit),
            ``storers`` ``{volume: {source: [hashes it stored there]}}`` and ``blocks`` a flat list of
            ``h, parent, prefix, size, mask, hits, last_access`` repeated per block
            (``mask`` an int below 2**64, else the list of its bit numbers), ``sources``
            rows ``[name, epoch, last_seq, batches, events, last_ts_ns, retired epochs (oldest first)]``
            and ``counters`` the :class:`IndexCounters` fields.  Children and
            per-location sets are derived again on import.  The frequency sketch is not
            part of the state (like :meth:`dump`).
        """
        flat: list[Any] = []
        ext = flat.extend
        for h, parent, prefix, size, m, hits, last in self._records():
            ext((h, parent, prefix, size, m if m < _U64 else _bits(m), hits, last))
        sources = [
            [name, st.epoch, st.last_seq, st.batches, st.events, st.last_ts_ns, list(st.retired_epochs)]
            for name, st in self._sources.items()
        ]
        storers: dict[str, dict[str, list[int]]] = {}
        for name, held in zip(self._loc_names, self._loc_sets):
            if not held:
                continue
            by_src: dict[str, list[int]] = {}
            for h, st in held.items():
                if st.__class__ is str:
                    by_src.setdefault(st, []).append(h)  # type: ignore[arg-type]
                else:
                    for one in st:  # type: ignore[union-attr]
                        by_src.setdefault(one, []).append(h)
            storers[name] = by_src
        return [STATE_VERSION, list(self._loc_names), flat, sorted(self._orphans), sources,
                dict(vars(self.counters)), storers]

    # ------------------------------------------------------------------ snapshots
    def dump(self) -> dict[str, Any]:
        """Canonical, order-independent state (for equality checks of two folds).

        Returns:
            ``{"blocks": {h: (parent, prefix, size, sorted locations, hits, last_access)},
            "orphans": sorted list, "sources": {source: (epoch, last_seq)}, "counters": {...},
            "storers": {volume: {h: sorted sources that stored it there}}}``.
        """
        return {
            "blocks": {
                h: (parent, prefix, size, tuple(sorted(self._names(m))), hits, last)
                for h, parent, prefix, size, m, hits, last in sorted(self._records())
            },
            "orphans": sorted(self._orphans),
            "sources": {s: (st.epoch, st.last_seq) for s, st in sorted(self._sources.items())},
            "counters": dict(vars(self.counters)),
            "storers": {
                name: {h: tuple(sorted(_storer_tuple(st))) for h, st in sorted(held.items())}
                for name, held in sorted(zip(self._loc_names, self._loc_sets), key=lambda x: x[0])
                if held
            },
        }


class ReferencePrefixIndex(IndexStateViews):
    """Sequence hash → block info, per-location residency and longest-prefix lookup.

    Not thread-safe: the advisor serialises writers and readers with its own lock.

    Layout (memory per block, see ``docs/BENCHMARKS.md``): one dict ``h -> _Rec``; the
    children of an indexed block live in its record, those of a hash that is not indexed
    (orphans waiting for their parent) in a side dict; a location is a bit of
    ``_Rec.mask`` with a block count, and global locations (volumes) also keep the hashes
    they hold (``h -> storer``: the source that stored it, or a frozenset of sources), so
    ``blocks_at`` of a volume is a copy while ``blocks_at`` of a private ``g1``/``g2`` scans
    the index.  A location whose count is zero at the end of a batch frees its bit.
    """

    def __init__(self, frequency: FrequencySketch | None = None) -> None:
        self.frequency = frequency
        """Optional decayed frequency sketch fed by first Stores, re-Stores that are accesses
        and ``extra_metadata["hits"]`` (not part of :meth:`dump`)."""
        self._blocks: dict[int, _Rec] = {}
        # parent hash not indexed -> its indexed children (orphans): one hash or a set.
        self._waiting: dict[int, int | set[int]] = {}
        self._orphans: set[int] = set()
        self._loc_bit: dict[str, int] = {}
        self._loc_names: list[str] = []  # "" for a free bit
        # volumes: held hash -> storer (interned source name, or a frozenset of them);
        # None for private locations (scanned) and free bits.
        self._loc_sets: list[dict[int, str | frozenset[str]] | None] = []
        self._loc_counts: list[int] = []
        self._free_bits: list[int] = []  # heap: lowest free bit is reused first
        self._touched: list[int] = []  # bits whose count may have reached 0 in this batch
        self._sources: dict[str, SourceState] = {}
        self._sizes: dict[int, int] = {}  # intern table of block sizes (a handful of values)
        self.counters = IndexCounters()

    # ------------------------------------------------------------------ locations
    def _bit(self, location: str) -> int:
        bit = self._loc_bit.get(location)
        if bit is None:
            held = None if _is_private_name(location) else {}
            if self._free_bits:
                bit = heapq.heappop(self._free_bits)
                self._loc_names[bit] = location
                self._loc_sets[bit] = held
            else:
                bit = len(self._loc_names)
                self._loc_names.append(location)
                self._loc_sets.append(held)
                self._loc_counts.append(0)
            self._loc_bit[location] = bit
            self._touched.append(bit)  # freed again if the batch leaves it empty
        return bit

    def _free_empty_bits(self) -> None:
        """Give back the bits of touched locations that hold no block any more.

        Called between batches only: the batch loop caches the current location's bit.
        """
        counts = self._loc_counts
        names = self._loc_names
        for bit in set(self._touched):
            if counts[bit] == 0 and names[bit]:
                del self._loc_bit[names[bit]]
                names[bit] = ""
                self._loc_sets[bit] = None
                heapq.heappush(self._free_bits, bit)
        self._touched.clear()

    def _names(self, mask: int) -> frozenset[str]:
        names = self._loc_names
        return frozenset([names[b] for b in _bits(mask)])

    def _held(self, bit: int) -> list[int]:
        """Hashes held at location ``bit`` (set copy for volumes, index scan for g1/g2)."""
        s = self._loc_sets[bit]
        if s is not None:
            return list(s)
        flag = 1 << bit
        return [h for h, r in self._blocks.items() if r.mask & flag]

    # ------------------------------------------------------------------ mutations
    def apply_batch(self, batch: EventBatch) -> None:
        """Fold one batch into the index.

        Never raises on event content: every anomaly is counted (see :class:`IndexCounters`).
        ``batch.ts_ns`` is the clock used for last access, so the fold is deterministic.
        A Cleared event empties the source's ``g1``/``g2``; for a volume id (global) it
        removes this source from the storers of the volume's blocks, and a block leaves the
        volume when no storer remains (``docs/events.md`` §2.3).  A batch of a superseded
        epoch applies only its volume events (see the module docstring).
        """
        source = sys.intern(batch.source)
        events = batch.events
        c = self.counters
        src = self._sources.get(source)
        if src is None:
            src = self._sources[source] = SourceState(epoch=batch.epoch, last_seq=batch.seq)
        elif batch.epoch != src.epoch:
            if batch.epoch in src.retired_epochs:
                c.stale_batches += 1
                self._apply_stale(source, batch)
                if self._touched:
                    self._free_empty_bits()
                return
            src.retired_epochs.add(src.epoch)
            src.epoch = batch.epoch
            c.restarts += 1
            self._drop_private(source)
        n_ev = len(events)
        ts = batch.ts_ns
        src.last_seq = batch.seq
        src.batches += 1
        src.events += n_ev
        src.last_ts_ns = ts
        c.batches += 1
        c.events += n_ev

        # One tight loop over the batch with everything bound to locals.  Inlined cases:
        #   * a new block with no parent or an indexed one, and no orphan waiting for it;
        #   * a duplicate Store;
        #   * a known block at a new location (onboarding, another worker, an offload);
        #   * a Remove that leaves another copy.
        # Everything else (orphans, extra_metadata, the frequency sketch, forgetting,
        # Cleared, self-parented Stores) goes through _store / _remove / _clear_*.
        # The current location's flag/bit/held-dict/count delta are locals that change only
        # when storage_location does (an invalid location is skipped without touching them).
        # Bits are only freed after the loop (_free_empty_bits), so the cached bit stays valid.
        STORE = EventType.STORE
        REMOVE = EventType.REMOVE
        PRIV = PRIVATE_TIERS
        valid = is_valid_location
        located = _located
        HMAX = U64_MAX
        blocks = self._blocks
        get = blocks.get
        waiting = self._waiting
        counts = self._loc_counts
        sizes = self._sizes
        touched = self._touched
        fast = self.frequency is None
        Rec = _Rec
        cur_sl: str | None = None
        flag = bit = priv = delta = 0
        lset: dict[int, Any] | None = None
        is_g1 = False
        last_sz = -1
        sz_obj = 0
        n_new = n_dup = n_known = n_hits = n_rm = 0
        for ev in events:
            t = ev.type
            if t is STORE:
                sl = ev.storage_location
                if sl != cur_sl:
                    if not valid(sl):
                        c.invalid_locations += 1
                        continue
                    if delta:
                        counts[bit] += delta
                        delta = 0
                    bit = self._bit(located(source, sl))
                    flag = 1 << bit
                    lset = self._loc_sets[bit]
                    is_g1 = sl == "g1"
                    priv = self._private_mask(source)
                    cur_sl = sl
                h = ev.sequence_hash
                r = get(h)
                if r is not None:
                    m = r.mask
                    if m & flag:
                        if ev.parent_hash != h:
                            n_dup += 1
                            if lset is not None:
                                st = lset[h]
                                if st is not source:
                                    lset[h] = _storer_add(st, source)
                            continue
                    elif fast and ev.extra_metadata is None and ev.parent_hash != h:
                        r.mask = m | flag
                        sz = ev.block_size
                        if sz != last_sz:
                            last_sz = sz
                            sz_obj = sizes.setdefault(sz, sz)
                        r.size = sz_obj
                        if lset is not None:
                            lset[h] = source
                        delta += 1
                        n_known += 1
                        if is_g1 or not (m & priv):
                            if r.hits != HMAX:
                                r.hits += 1
                            r.last = ts
                            n_hits += 1
                        continue
                elif fast and ev.extra_metadata is None and h not in waiting:
                    parent = ev.parent_hash
                    sz = ev.block_size
                    if sz != last_sz:
                        last_sz = sz
                        sz_obj = sizes.setdefault(sz, sz)
                    if parent is None:
                        prefix = ev.prefix_hash
                        blocks[h] = Rec(h, None, h if prefix == h else prefix, sz_obj, flag, 0, ts)
                    elif parent != h and (pr := get(parent)) is not None:
                        prefix = ev.prefix_hash
                        if prefix == pr.prefix:
                            prefix = pr.prefix
                        blocks[h] = Rec(h, pr.h, prefix, sz_obj, flag, 0, ts)
                        k = pr.kids
                        if k is None:
                            pr.kids = h
                        elif k.__class__ is set:
                            k.add(h)  # type: ignore[union-attr]
                        else:
                            pr.kids = {k, h}  # type: ignore[assignment]
                    else:
                        if delta:
                            counts[bit] += delta
                            delta = 0
                        self._store(source, h, ev.prefix_hash, parent, sz, sl, None, ts)
                        continue
                    if lset is not None:
                        lset[h] = source
                    delta += 1
                    n_new += 1
                    continue
                if delta:
                    counts[bit] += delta
                    delta = 0
                self._store(source, h, ev.prefix_hash, ev.parent_hash, ev.block_size, sl, ev.extra_metadata, ts)
            elif t is REMOVE:
                sl = ev.storage_location
                if sl != cur_sl:
                    if not valid(sl):
                        c.invalid_locations += 1
                        continue
                    if delta:
                        counts[bit] += delta
                        delta = 0
                    bit = self._bit(located(source, sl))
                    touched.append(bit)
                    flag = 1 << bit
                    lset = self._loc_sets[bit]
                    is_g1 = sl == "g1"
                    priv = self._private_mask(source)
                    cur_sl = sl
                h = ev.sequence_hash
                r = get(h)
                if r is not None:
                    m = r.mask
                    if m & flag and m != flag:
                        r.mask = m & ~flag
                        if lset is not None:
                            del lset[h]
                        delta -= 1
                        n_rm += 1
                        continue
                if delta:
                    counts[bit] += delta
                    delta = 0
                self._remove(located(source, sl), h)
            else:
                sl = ev.storage_location
                if not valid(sl):
                    c.invalid_locations += 1
                    continue
                if delta:
                    counts[bit] += delta
                    delta = 0
                c.cleared += 1
                if sl in PRIV:
                    self._clear_location(f"{source}/{sl}")
                else:
                    self._clear_storer(sl, source)
        if delta:
            counts[bit] += delta
        c.stores += n_new + n_dup + n_known
        c.duplicate_stores += n_dup
        if n_hits:
            c.hits = min(c.hits + n_hits, U64_MAX)
        c.removes += n_rm
        if touched:
            self._free_empty_bits()

    def _apply_stale(self, source: str, batch: EventBatch) -> None:
        """Apply the volume events of a superseded-epoch batch, in order (private ones are
        ignored: that epoch's g1/g2 is gone).  Stores are placement only (no hit)."""
        c = self.counters
        ts = batch.ts_ns
        for ev in batch.events:
            sl = ev.storage_location
            if not is_valid_location(sl):
                c.invalid_locations += 1
                continue
            if sl in PRIVATE_TIERS:
                continue
            c.stale_volume_events += 1
            t = ev.type
            if t == EventType.STORE:
                self._store(source, ev.sequence_hash, ev.prefix_hash, ev.parent_hash, ev.block_size, sl,
                            ev.extra_metadata, ts, access=False)
            elif t == EventType.REMOVE:
                self._remove(sl, ev.sequence_hash)
            else:
                c.cleared += 1
                self._clear_storer(sl, source)

    def _private_mask(self, source: str) -> int:
        """Bits of ``source``'s own g1/g2 locations (0 for those not seen yet)."""
        m = 0
        for tier in ("g1", "g2"):
            bit = self._loc_bit.get(f"{source}/{tier}")
            if bit is not None:
                m |= 1 << bit
        return m

    def _hold(self, bit: int, h: int, source: str) -> None:
        s = self._loc_sets[bit]
        if s is not None:
            s[h] = source
        self._loc_counts[bit] += 1

    def _release(self, bit: int, h: int) -> None:
        s = self._loc_sets[bit]
        if s is not None:
            s.pop(h, None)
        self._loc_counts[bit] -= 1
        self._touched.append(bit)

    def _store(
        self,
        source: str,
        h: int,
        prefix: int,
        parent: int | None,
        size: int,
        storage_location: str,
        extra: dict[str, Any] | None,
        ts: int,
        access: bool = True,
    ) -> None:
        """One Store (``access=False``: a placement fact only, never a hit)."""
        c = self.counters
        c.stores += 1
        if parent == h:
            c.self_parent_rejected += 1
            return
        if parent is not None and h in self._waiting and h not in self._blocks and self._closes_cycle(h, parent):
            c.parent_cycle_rejected += 1
            return
        private = storage_location in PRIVATE_TIERS
        loc = f"{source}/{storage_location}" if private else storage_location
        bit = self._loc_bit.get(loc)
        if bit is None:
            bit = self._bit(loc)
        flag = 1 << bit
        blocks = self._blocks
        e = blocks.get(h)
        if e is None:
            size = self._sizes.setdefault(size, size)
            if parent is None:
                e = blocks[h] = _Rec(h, None, h if prefix == h else prefix, size, flag, 0, ts)
            else:
                pr = blocks.get(parent)
                if pr is None:
                    e = blocks[h] = _Rec(h, parent, prefix, size, flag, 0, ts)
                    self._waiting[parent] = _kid_add(self._waiting.get(parent), h)
                    c.orphans += 1
                    self._orphans.add(h)
                else:
                    if prefix == pr.prefix:
                        prefix = pr.prefix
                    e = blocks[h] = _Rec(h, pr.h, prefix, size, flag, 0, ts)
                    pr.kids = _kid_add(pr.kids, h)
            self._hold(bit, h, source)
            kids = self._waiting.pop(h, None)
            if kids is not None:
                e.kids = kids
                for child in _kid_tuple(kids):
                    if child in self._orphans:
                        self._orphans.discard(child)
                        c.orphans_linked += 1
            hits = self._reported_hits(extra)
            if hits:
                e.hits = hits
                c.hits = min(c.hits + hits, U64_MAX)
            if self.frequency is not None:
                self.frequency.increment(h, 1 + hits)
            return
        if e.mask & flag:
            c.duplicate_stores += 1
            held = self._loc_sets[bit]
            if held is not None:
                held[h] = _storer_add(held[h], source)
            return
        # A known block at a new location: onboarding, another worker, offload or a move.
        e.mask |= flag
        e.size = self._sizes.setdefault(size, size)
        self._hold(bit, h, source)
        hits = self._reported_hits(extra)
        placement_only = not access or (extra is not None and any(k in extra for k in PLACEMENT_KEYS))
        if not placement_only and self._is_access(source, storage_location, e.mask & ~flag):
            hits += 1
        if hits:
            e.hits = min(e.hits + hits, U64_MAX)
            c.hits = min(c.hits + hits, U64_MAX)
            e.last = ts
            if self.frequency is not None:
                self.frequency.increment(h, hits)

    def _closes_cycle(self, h: int, parent: int) -> bool:
        """Whether linking new block ``h`` under ``parent`` closes a parent cycle: the chain
        from ``parent`` reaches ``h`` within :data:`PARENT_WALK_LIMIT` links."""
        blocks = self._blocks
        x: int | None = parent
        for _ in range(PARENT_WALK_LIMIT):
            r = blocks.get(x)  # type: ignore[arg-type]
            if r is None:
                return False
            x = r.parent
            if x is None:
                return False
            if x == h:
                return True
        return False

    def _is_access(self, source: str, storage_location: str, other_mask: int) -> bool:
        """Whether a Store of a known block at a new location is a reuse of the block.

        Onboarding into ``g1`` and a block (re)computed by any worker are accesses; a copy
        down the hierarchy by a worker that already holds the block in its own g1/g2
        (write-through offload) is not.  Decayed frequency plugs in here.
        """
        if storage_location == "g1":
            return True
        return not (other_mask & self._private_mask(source))

    @staticmethod
    def _reported_hits(extra: dict[str, Any] | None) -> int:
        if not extra:
            return 0
        n = extra.get(HITS_KEY)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n if n < U64_MAX else U64_MAX
        return 0

    def _remove(self, loc: str, h: int) -> None:
        c = self.counters
        c.removes += 1
        e = self._blocks.get(h)
        bit = self._loc_bit.get(loc)
        if e is None or bit is None or not (e.mask >> bit & 1):
            c.unknown_removes += 1
            return
        e.mask &= ~(1 << bit)
        self._release(bit, h)
        if not e.mask:
            self._forget(h, e)

    def _forget(self, h: int, e: _Rec) -> None:
        """Drop a block no location holds; its indexed children become orphans."""
        blocks = self._blocks
        del blocks[h]
        self.counters.forgotten += 1
        self._orphans.discard(h)
        parent = e.parent
        if parent is not None:
            pr = blocks.get(parent)
            if pr is not None:
                pr.kids = _kid_discard(pr.kids, h)
            else:
                kids = _kid_discard(self._waiting.get(parent), h)
                if kids is None:
                    self._waiting.pop(parent, None)
                else:
                    self._waiting[parent] = kids
        if e.kids is not None:
            self._waiting[h] = e.kids
            self._orphans.update(_kid_tuple(e.kids))

    def _clear_location(self, loc: str) -> None:
        """Empty location ``loc`` whole (a source's own g1/g2)."""
        bit = self._loc_bit.get(loc)
        if bit is None:
            return
        hashes = self._held(bit)
        s = self._loc_sets[bit]
        if s is not None:
            s.clear()  # in place: apply_batch holds the current location's dict
        self._loc_counts[bit] = 0
        self._touched.append(bit)
        keep = ~(1 << bit)
        blocks = self._blocks
        for h in sorted(hashes):  # sorted: forgetting order must not depend on set order
            e = blocks[h]
            e.mask &= keep
            if not e.mask:
                self._forget(h, e)

    def _clear_storer(self, volume: str, source: str) -> None:
        """Cleared of ``volume`` from ``source``: ``source`` stops being a storer of each
        block there; blocks with no storer left leave the volume (others' blocks stay)."""
        bit = self._loc_bit.get(volume)
        if bit is None:
            return
        held = self._loc_sets[bit]
        if held is None:  # cannot happen for a valid volume id (no '/')
            return
        gone = []
        for h, st in held.items():
            if st.__class__ is str:
                if st == source:
                    gone.append(h)
            elif source in st:  # type: ignore[operator]
                rest = st - {source}  # type: ignore[operator]
                held[h] = next(iter(rest)) if len(rest) == 1 else rest  # value change only
        if not gone:
            return
        gone.sort()  # forgetting order must not depend on dict order
        for h in gone:
            del held[h]
        self._loc_counts[bit] -= len(gone)
        self._touched.append(bit)
        keep = ~(1 << bit)
        blocks = self._blocks
        for h in gone:
            e = blocks[h]
            e.mask &= keep
            if not e.mask:
                self._forget(h, e)

    def _drop_private(self, source: str) -> None:
        for tier in sorted(PRIVATE_TIERS):
            self._clear_location(f"{source}/{tier}")

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._blocks)

    def __contains__(self, h: object) -> bool:
        return h in self._blocks

    def block(self, h: int) -> BlockInfo | None:
        """Info of block ``h``, or ``None`` when no location holds it."""
        e = self._blocks.get(h)
        if e is None:
            return None
        return BlockInfo(h, e.parent, e.prefix, e.size, self._names(e.mask), e.hits, e.last, h in self._orphans)

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """Longest cached prefix of ``hashes`` at each location.

        One pass over ``hashes``: the running AND of the blocks' location masks; a
        location's answer is the depth where its bit drops out.

        Args:
            hashes: sequence hashes of a request's full blocks, first block first.

        Returns:
            ``{location: n}``: the first ``n`` blocks are all held at ``location``
            (``n >= 1``; locations holding none of the prefix are absent).
        """
        result: dict[str, int] = {}
        names = self._loc_names
        active = -1
        n = 0
        for e in map(self._blocks.get, hashes):
            if e is None:
                break
            m = active & e.mask
            if m != active:
                if n:
                    lost = active & ~m
                    if lost & (lost - 1):
                        self._record(result, lost, n)
                    else:  # one location drops out (inlined _record)
                        result[names[lost.bit_length() - 1]] = n
                if not m:
                    return result
                active = m
            n += 1
        if n:
            self._record(result, active, n)
        return result

    def _record(self, result: dict[str, int], mask: int, n: int) -> None:
        names = self._loc_names
        if not mask & (mask - 1):  # one location: most drops
            result[names[mask.bit_length() - 1]] = n
            return
        bit = 0
        while mask:
            if mask & 1:
                result[names[bit]] = n
            mask >>= 1
            bit += 1

    def lookup_any(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` held at *some* location (tiers may mix)."""
        n = 0
        blocks = self._blocks
        for h in hashes:
            if h not in blocks:
                break
            n += 1
        return n

    def blocks_at(self, location: str) -> set[int]:
        """Sequence hashes held at ``location`` (a copy; a scan of the index for g1/g2)."""
        bit = self._loc_bit.get(location)
        return set(self._held(bit)) if bit is not None else set()

    def count_at(self, location: str) -> int:
        """Number of blocks held at ``location``."""
        bit = self._loc_bit.get(location)
        return self._loc_counts[bit] if bit is not None else 0

    def holds(self, h: int, location: str) -> bool:
        """Whether block ``h`` is held at ``location``."""
        e = self._blocks.get(h)
        bit = self._loc_bit.get(location)
        return e is not None and bit is not None and bool(e.mask >> bit & 1)

    def children(self, h: int) -> set[int]:
        """Indexed blocks whose parent is ``h`` (``h`` itself need not be indexed)."""
        e = self._blocks.get(h)
        return set(_kid_tuple(e.kids if e is not None else self._waiting.get(h)))

    def locations(self) -> list[str]:
        """Locations that hold at least one block, sorted."""
        return sorted(name for name, n in zip(self._loc_names, self._loc_counts) if n)

    def orphans(self) -> set[int]:
        """Indexed blocks whose parent is not indexed (a copy)."""
        return set(self._orphans)

    def sources(self) -> dict[str, SourceState]:
        """Per-source epoch / last seq / counts (live objects; do not mutate)."""
        return self._sources

    def hashes(self) -> Iterable[int]:
        """Every indexed sequence hash (a live view; do not mutate the index while iterating)."""
        return self._blocks.keys()

    def _records(self) -> Iterator[tuple[int, int | None, int, int, int, int, int]]:
        """``(h, parent, prefix, size, mask, hits, last_access)`` of every indexed block."""
        for h, e in self._blocks.items():
            yield h, e.parent, e.prefix, e.size, e.mask, e.hits, e.last

    @classmethod
    def from_state(cls, state: Sequence[Any], frequency: FrequencySketch | None = None) -> ReferencePrefixIndex:
        """Rebuild an index from :meth:`export_state` output (``dump()`` is equal).

        A version-1 state (no storers) imports with its volume residency attributed to no
        source (``""``): no source's Cleared removes it, a Remove still does.

        Raises:
            IndexStateError: the state has another version or a malformed shape.
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
        if len(flat) % 7:
            raise IndexStateError(f"index state block array has {len(flat)} items, not a multiple of 7")
        idx = cls(frequency)
        try:
            for bit, name in enumerate(locs):
                name = sys.intern(str(name))
                idx._loc_names.append(name)
                idx._loc_counts.append(0)
                if not name:
                    idx._loc_sets.append(None)
                    idx._free_bits.append(bit)  # ascending: already a heap
                    continue
                if name in idx._loc_bit:
                    raise IndexStateError(f"index state location {name!r} is repeated")
                idx._loc_bit[name] = bit
                idx._loc_sets.append(None if _is_private_name(name) else {})
            free_mask = sum(1 << b for b in idx._free_bits)
            blocks = idx._blocks
            sizes = idx._sizes
            nloc = len(idx._loc_names)
            limit = 1 << nloc
            it = iter(flat)
            for h, parent, prefix, size, mask, hits, last in zip(it, it, it, it, it, it, it):
                if not isinstance(mask, int):
                    mask = sum(1 << b for b in set(mask))
                if mask >= limit or mask < 0 or mask & free_mask:
                    raise IndexStateError(f"block {h} uses a location bit beyond {nloc} locations or a free one")
                blocks[h] = _Rec(h, parent, prefix, sizes.setdefault(size, size), mask, hits, last)
            waiting = idx._waiting
            get = blocks.get
            for h, e in blocks.items():
                parent = e.parent
                if parent is None:
                    if e.prefix == h:
                        e.prefix = h
                    continue
                pr = get(parent)
                if pr is None:
                    waiting[parent] = _kid_add(waiting.get(parent), h)
                else:
                    e.parent = pr.h
                    if e.prefix == pr.prefix:
                        e.prefix = pr.prefix
                    pr.kids = _kid_add(pr.kids, h)
            counts = idx._loc_counts
            held_at = held_by_location(((h, e.mask) for h, e in blocks.items()), len(idx._loc_sets))
            for bit, s in enumerate(idx._loc_sets):
                held = held_at[bit]
                counts[bit] = len(held)
                if s is None:
                    continue
                if storers is None:
                    s.update(dict.fromkeys(held, _UNKNOWN_STORER))
                    continue
                for src_name, hs in storers.get(idx._loc_names[bit], {}).items():
                    src_name = sys.intern(str(src_name))
                    for h in hs:
                        s[h] = _storer_add(s[h], src_name) if h in s else src_name
                if len(s) != len(held) or not all(h in s for h in held):
                    raise IndexStateError(f"index state storers of {idx._loc_names[bit]!r} do not match its blocks")
            if storers is not None and any(name not in idx._loc_bit for name in storers):
                raise IndexStateError("index state has storers of an unknown location")
            idx._orphans = set(orphans)
            for name, epoch, last_seq, nb, ne, last_ts, retired in sources:
                idx._sources[sys.intern(str(name))] = SourceState(epoch, last_seq, nb, ne, last_ts, RetiredEpochs(retired))
            idx.counters = IndexCounters(**counters)
        except IndexStateError:
            raise
        except (TypeError, ValueError, AttributeError, KeyError) as exc:
            raise IndexStateError(f"malformed index state: {exc}") from exc
        return idx
