"""PrefixIndex: the advisor's fold of the KV event log.

Maps a block's sequence hash (u64, DESIGN.md §4) to its parent, prefix family, size in
bytes, the set of *locations* that hold it, a hit counter and the time of its last access.

Locations:
    * a volume id (``"fast"``, ``"slow"``, ``"s3"``) is global: every worker and the
      advisor see the same volume, so it is used as is;
    * ``g1`` / ``g2`` are private to one worker, so the index qualifies them with the
      batch's source: ``"<source>/g1"``.

Internally a location is a bit in a per-block integer mask and every location also keeps
the set of sequence hashes it holds; that keeps ``apply_batch`` and ``lookup`` to a few
dict/int operations per event.

The fold is deterministic: it only uses what is in the batches (``ts_ns`` is the clock),
so the same log applied twice gives the same :meth:`PrefixIndex.dump`.

Fault tolerance (failure cases of ``cases/CASES.md``):
    * Store whose parent is unknown: kept as an *orphan*, linked when the parent arrives.
    * duplicate Store (same block, same location): counted, nothing changes.
    * Remove of an unknown hash or of a location that does not hold the block: counted.
    * Remove of an ancestor before its descendants: the descendants stay indexed and
      become orphans until the ancestor is stored again.
    * Remove at one location while others still hold the block: the others stay.
    * a self-parented Store (``parent_hash == sequence_hash``) is rejected alone.
    * a new epoch of a known source drops that source's ``g1``/``g2`` residency; batches
      of a superseded epoch that arrive later are ignored and counted.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from advisor.frequency import FrequencySketch
from event_plane.schema import EventBatch, EventType

PRIVATE_TIERS: frozenset[str] = frozenset({"g1", "g2"})
"""Storage locations that are private to the publishing worker."""

MOVE_KEY = "moved_from"
"""``extra_metadata`` key the advisor's mover sets on its Store events: a placement
change, not an access (no hit, last access unchanged)."""

PLACEMENT_KEYS: tuple[str, ...] = (MOVE_KEY, "reconciled")
"""``extra_metadata`` keys marking a Store as a placement change (never an access)."""

STATE_VERSION = 1
"""Version of :meth:`PrefixIndex.export_state` arrays."""

_U64 = 1 << 64


class IndexStateError(ValueError):
    """An exported index state cannot be imported (wrong version or shape)."""


def _bits(mask: int) -> list[int]:
    out = []
    bit = 0
    while mask:
        if mask & 1:
            out.append(bit)
        mask >>= 1
        bit += 1
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
    restarts: int = 0
    """New epochs of known sources (their g1/g2 residency was dropped, case C8)."""
    stale_batches: int = 0
    """Batches of a superseded epoch, ignored."""
    forgotten: int = 0
    """Blocks dropped because no location held them any more."""


@dataclass
class SourceState:
    """What the index knows about one event source."""

    epoch: int
    last_seq: int
    batches: int = 0
    events: int = 0
    last_ts_ns: int = 0
    retired_epochs: set[int] = field(default_factory=set)


class _Entry:
    """Mutable per-block record (kept small: one slotted object per block)."""

    __slots__ = ("parent", "prefix", "size", "mask", "hits", "last_access")

    def __init__(self, parent: int | None, prefix: int, size: int, mask: int, last_access: int) -> None:
        self.parent = parent
        self.prefix = prefix
        self.size = size
        self.mask = mask
        self.hits = 0
        self.last_access = last_access


class PrefixIndex:
    """Sequence hash → block info, per-location residency and longest-prefix lookup.

    Not thread-safe: the advisor serialises writers and readers with its own lock.
    """

    def __init__(self, frequency: FrequencySketch | None = None) -> None:
        self.frequency = frequency
        """Optional decayed frequency sketch fed by first Stores, re-Stores that are accesses
        and ``extra_metadata["hits"]`` (not part of :meth:`dump`)."""
        self._blocks: dict[int, _Entry] = {}
        # parent hash -> child hash (int) or set of child hashes; parents may be unknown.
        self._children: dict[int, int | set[int]] = {}
        self._orphans: set[int] = set()
        self._loc_bit: dict[str, int] = {}
        self._loc_names: list[str] = []
        self._loc_blocks: list[set[int]] = []
        self._sources: dict[str, SourceState] = {}
        self._sizes: dict[int, int] = {}  # intern table of block sizes (a handful of values)
        self.counters = IndexCounters()

    # ------------------------------------------------------------------ locations
    def _bit(self, location: str) -> int:
        bit = self._loc_bit.get(location)
        if bit is None:
            bit = len(self._loc_names)
            self._loc_bit[location] = bit
            self._loc_names.append(location)
            self._loc_blocks.append(set())
        return bit

    @staticmethod
    def qualify(source: str, storage_location: str) -> str:
        """Index location of an event: ``"<source>/g1"`` for private tiers, else the volume id."""
        if storage_location in PRIVATE_TIERS:
            return f"{source}/{storage_location}"
        return storage_location

    def _names(self, mask: int) -> frozenset[str]:
        names = []
        bit = 0
        while mask:
            if mask & 1:
                names.append(self._loc_names[bit])
            mask >>= 1
            bit += 1
        return frozenset(names)

    # ------------------------------------------------------------------ children
    def _add_child(self, parent: int, child: int) -> None:
        cur = self._children.get(parent)
        if cur is None:
            self._children[parent] = child
        elif isinstance(cur, set):
            cur.add(child)
        elif cur != child:
            self._children[parent] = {cur, child}

    def _remove_child(self, parent: int, child: int) -> None:
        cur = self._children.get(parent)
        if cur is None:
            return
        if isinstance(cur, set):
            cur.discard(child)
            if len(cur) == 1:
                self._children[parent] = next(iter(cur))
            elif not cur:
                del self._children[parent]
        elif cur == child:
            del self._children[parent]

    def _iter_children(self, parent: int) -> Iterator[int]:
        cur = self._children.get(parent)
        if cur is None:
            return iter(())
        if isinstance(cur, set):
            return iter(tuple(cur))
        return iter((cur,))

    # ------------------------------------------------------------------ mutations
    def apply_batch(self, batch: EventBatch) -> None:
        """Fold one batch into the index.

        Never raises on event content: every anomaly is counted (see :class:`IndexCounters`).
        ``batch.ts_ns`` is the clock used for last access, so the fold is deterministic.
        A Cleared event empties the source's ``g1``/``g2``; for a volume id (global) it
        empties that volume's residency in the index.
        """
        src = self._sources.get(batch.source)
        if src is None:
            src = self._sources[batch.source] = SourceState(epoch=batch.epoch, last_seq=batch.seq)
        elif batch.epoch != src.epoch:
            if batch.epoch in src.retired_epochs:
                self.counters.stale_batches += 1
                return
            src.retired_epochs.add(src.epoch)
            src.epoch = batch.epoch
            self.counters.restarts += 1
            self._drop_private(batch.source)
        src.last_seq = batch.seq
        src.batches += 1
        src.events += len(batch.events)
        src.last_ts_ns = batch.ts_ns
        self.counters.batches += 1
        self.counters.events += len(batch.events)

        source = batch.source
        ts = batch.ts_ns
        # Hot path inlined with local bindings (no extra_metadata, no frequency sketch):
        #   * a new block whose parent is indexed (or that has none) and no orphan child;
        #   * a duplicate Store;
        #   * a known block at a new location (onboarding, another worker, an offload);
        #   * a Remove that does not forget the block.
        # Every other case goes through _store / _remove.  Sizes and prefix hashes are
        # shared with the parent's entry / a small intern table (memory per block).
        STORE = EventType.STORE
        REMOVE = EventType.REMOVE
        blocks = self._blocks
        children = self._children
        loc_blocks = self._loc_blocks
        sizes = self._sizes
        c = self.counters
        flags: dict[str, tuple[int, int, bool]] = {}
        priv = self._private_mask(source)
        fast_new = fast_dup = fast_known = fast_hits = fast_rm = 0
        freq = self.frequency
        for ev in batch.events:
            t = ev.type
            if t == STORE:
                h = ev.sequence_hash
                parent = ev.parent_hash
                sl = ev.storage_location
                fl = flags.get(sl)
                if fl is None:
                    bit = self._bit(self.qualify(source, sl))
                    fl = flags[sl] = (1 << bit, bit, sl == "g1")
                    priv = self._private_mask(source)
                e = blocks.get(h)
                if e is not None:
                    if parent != h:
                        m = e.mask
                        if m & fl[0]:
                            fast_dup += 1
                            continue
                        if ev.extra_metadata is None and freq is None:
                            e.mask = m | fl[0]
                            sz = ev.block_size
                            e.size = sizes.setdefault(sz, sz)
                            loc_blocks[fl[1]].add(h)
                            fast_known += 1
                            if fl[2] or not (m & priv):
                                e.hits += 1
                                e.last_access = ts
                                fast_hits += 1
                            continue
                elif ev.extra_metadata is None and freq is None and parent != h and h not in children:
                    prefix = ev.prefix_hash
                    if parent is None:
                        if prefix == h:
                            prefix = h
                    else:
                        pe = blocks.get(parent)
                        if pe is None:
                            self._store(source, h, prefix, parent, ev.block_size, sl, None, ts)
                            continue
                        if pe.prefix == prefix:
                            prefix = pe.prefix
                    sz = ev.block_size
                    blocks[h] = _Entry(parent, prefix, sizes.setdefault(sz, sz), fl[0], ts)
                    loc_blocks[fl[1]].add(h)
                    if parent is not None:
                        cur = children.get(parent)
                        if cur is None:
                            children[parent] = h
                        elif cur.__class__ is set:
                            cur.add(h)
                        else:
                            children[parent] = {cur, h}
                    fast_new += 1
                    continue
                self._store(source, h, ev.prefix_hash, parent, ev.block_size, sl, ev.extra_metadata, ts)
            elif t == REMOVE:
                h = ev.sequence_hash
                sl = ev.storage_location
                fl = flags.get(sl)
                if fl is None:
                    bit = self._bit(self.qualify(source, sl))
                    fl = flags[sl] = (1 << bit, bit, sl == "g1")
                    priv = self._private_mask(source)
                e = blocks.get(h)
                if e is not None:
                    m = e.mask
                    if m & fl[0] and m != fl[0]:
                        e.mask = m & ~fl[0]
                        loc_blocks[fl[1]].discard(h)
                        fast_rm += 1
                        continue
                self._remove(self.qualify(source, sl), h)
            else:
                c.cleared += 1
                self._clear_location(self.qualify(source, ev.storage_location))
        c.stores += fast_new + fast_dup + fast_known
        c.duplicate_stores += fast_dup
        c.hits += fast_hits
        c.removes += fast_rm

    def _private_mask(self, source: str) -> int:
        """Bits of ``source``'s own g1/g2 locations (0 for those not seen yet)."""
        m = 0
        for tier in ("g1", "g2"):
            bit = self._loc_bit.get(f"{source}/{tier}")
            if bit is not None:
                m |= 1 << bit
        return m

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
    ) -> None:
        c = self.counters
        c.stores += 1
        if parent == h:
            c.self_parent_rejected += 1
            return
        private = storage_location in PRIVATE_TIERS
        loc = f"{source}/{storage_location}" if private else storage_location
        bit = self._loc_bit.get(loc)
        if bit is None:
            bit = self._bit(loc)
        flag = 1 << bit
        e = self._blocks.get(h)
        if e is None:
            e = self._blocks[h] = _Entry(parent, prefix, size, flag, ts)
            self._loc_blocks[bit].add(h)
            if parent is not None:
                self._add_child(parent, h)
                if parent not in self._blocks:
                    c.orphans += 1
                    self._orphans.add(h)
            if h in self._children:
                for child in self._iter_children(h):
                    if child in self._orphans:
                        self._orphans.discard(child)
                        c.orphans_linked += 1
            hits = self._reported_hits(extra)
            if hits:
                e.hits += hits
                c.hits += hits
            if self.frequency is not None:
                self.frequency.increment(h, 1 + hits)
            return
        if e.mask & flag:
            c.duplicate_stores += 1
            return
        # A known block at a new location: onboarding, another worker, offload or a move.
        e.mask |= flag
        e.size = size
        self._loc_blocks[bit].add(h)
        hits = self._reported_hits(extra)
        placement_only = extra is not None and any(k in extra for k in PLACEMENT_KEYS)
        if not placement_only and self._is_access(source, storage_location, e.mask & ~flag):
            hits += 1
        if hits:
            e.hits += hits
            c.hits += hits
            e.last_access = ts
            if self.frequency is not None:
                self.frequency.increment(h, hits)

    def _is_access(self, source: str, storage_location: str, other_mask: int) -> bool:
        """Whether a Store of a known block at a new location is a reuse of the block.

        Onboarding into ``g1`` and a block (re)computed by any worker are accesses; a copy
        down the hierarchy by a worker that already holds the block in its own g1/g2
        (write-through offload) is not.  Decayed frequency (issue 5) plugs in here.
        """
        if storage_location == "g1":
            return True
        for tier in ("g1", "g2"):
            bit = self._loc_bit.get(f"{source}/{tier}")
            if bit is not None and other_mask >> bit & 1:
                return False
        return True

    @staticmethod
    def _reported_hits(extra: dict[str, Any] | None) -> int:
        if not extra:
            return 0
        n = extra.get(HITS_KEY)
        if isinstance(n, int) and not isinstance(n, bool) and n > 0:
            return n
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
        self._loc_blocks[bit].discard(h)
        if not e.mask:
            self._forget(h, e)

    def _forget(self, h: int, e: _Entry) -> None:
        """Drop a block no location holds; its indexed children become orphans."""
        del self._blocks[h]
        self.counters.forgotten += 1
        self._orphans.discard(h)
        if e.parent is not None:
            self._remove_child(e.parent, h)
        if h in self._children:
            for child in self._iter_children(h):
                if child in self._blocks:
                    self._orphans.add(child)

    def _clear_location(self, loc: str) -> None:
        bit = self._loc_bit.get(loc)
        if bit is None:
            return
        hashes = self._loc_blocks[bit]
        self._loc_blocks[bit] = set()
        keep = ~(1 << bit)
        for h in sorted(hashes):  # sorted: forgetting order must not depend on set order
            e = self._blocks[h]
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
        return BlockInfo(h, e.parent, e.prefix, e.size, self._names(e.mask), e.hits, e.last_access,
                         h in self._orphans)

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """Longest cached prefix of ``hashes`` at each location.

        Args:
            hashes: sequence hashes of a request's full blocks, first block first.

        Returns:
            ``{location: n}``: the first ``n`` blocks are all held at ``location``
            (``n >= 1``; locations holding none of the prefix are absent).
        """
        result: dict[str, int] = {}
        if not hashes:
            return result
        blocks = self._blocks
        first = blocks.get(hashes[0])
        if first is None:
            return result
        active = first.mask
        n = 1
        for h in hashes[1:]:
            e = blocks.get(h)
            mask = e.mask if e is not None else 0
            lost = active & ~mask
            if lost:
                self._record(result, lost, n)
                active &= mask
                if not active:
                    return result
            n += 1
        self._record(result, active, n)
        return result

    def _record(self, result: dict[str, int], mask: int, n: int) -> None:
        bit = 0
        while mask:
            if mask & 1:
                result[self._loc_names[bit]] = n
            mask >>= 1
            bit += 1

    def lookup_any(self, hashes: Sequence[int]) -> int:
        """Number of leading blocks of ``hashes`` held at *some* location (tiers may mix)."""
        n = 0
        for h in hashes:
            if h not in self._blocks:
                break
            n += 1
        return n

    def blocks_at(self, location: str) -> set[int]:
        """Sequence hashes held at ``location`` (a copy)."""
        bit = self._loc_bit.get(location)
        return set(self._loc_blocks[bit]) if bit is not None else set()

    def count_at(self, location: str) -> int:
        """Number of blocks held at ``location``."""
        bit = self._loc_bit.get(location)
        return len(self._loc_blocks[bit]) if bit is not None else 0

    def holds(self, h: int, location: str) -> bool:
        """Whether block ``h`` is held at ``location``."""
        e = self._blocks.get(h)
        bit = self._loc_bit.get(location)
        return e is not None and bit is not None and bool(e.mask >> bit & 1)

    def children(self, h: int) -> set[int]:
        """Indexed blocks whose parent is ``h`` (``h`` itself need not be indexed)."""
        return {c for c in self._iter_children(h) if c in self._blocks}

    def locations(self) -> list[str]:
        """Locations that hold at least one block, sorted."""
        return sorted(name for name, s in zip(self._loc_names, self._loc_blocks) if s)

    def orphans(self) -> set[int]:
        """Indexed blocks whose parent is not indexed (a copy)."""
        return set(self._orphans)

    def sources(self) -> dict[str, SourceState]:
        """Per-source epoch / last seq / counts (live objects; do not mutate)."""
        return self._sources

    def hashes(self) -> Iterable[int]:
        """Every indexed sequence hash (a live view; do not mutate the index while iterating)."""
        return self._blocks.keys()

    def stats(self) -> dict[str, Any]:
        """Blocks per location, total blocks, pending orphans and the counters.

        Returns:
            ``{"blocks": int, "blocks_per_location": {loc: n}, "orphans_pending": int,
            "counters": {name: int}}``.
        """
        per_loc = {name: len(s) for name, s in zip(self._loc_names, self._loc_blocks) if s}
        return {
            "blocks": len(self._blocks),
            "blocks_per_location": dict(sorted(per_loc.items())),
            "orphans_pending": len(self._orphans),
            "counters": dict(vars(self.counters)),
        }

    # ------------------------------------------------------------------ snapshots
    def export_state(self) -> list[Any]:
        """The whole fold state as plain msgpack-able values (for :mod:`advisor.snapshot`).

        Returns:
            ``[STATE_VERSION, locations, blocks, orphans, sources, counters]`` with
            ``locations`` the location names in bit order, ``blocks`` a flat list of
            ``h, parent, prefix, size, mask, hits, last_access`` repeated per block
            (``mask`` an int below 2**64, else the list of its bit numbers), ``sources``
            rows ``[name, epoch, last_seq, batches, events, last_ts_ns, retired epochs]``
            and ``counters`` the :class:`IndexCounters` fields.  Children and
            per-location sets are derived again on import.  The frequency sketch is not
            part of the state (like :meth:`dump`).
        """
        flat: list[Any] = []
        ext = flat.extend
        for h, e in self._blocks.items():
            m = e.mask
            ext((h, e.parent, e.prefix, e.size, m if m < _U64 else _bits(m), e.hits, e.last_access))
        sources = [
            [name, st.epoch, st.last_seq, st.batches, st.events, st.last_ts_ns, sorted(st.retired_epochs)]
            for name, st in self._sources.items()
        ]
        return [STATE_VERSION, list(self._loc_names), flat, sorted(self._orphans), sources, dict(vars(self.counters))]

    @classmethod
    def from_state(cls, state: Sequence[Any], frequency: FrequencySketch | None = None) -> PrefixIndex:
        """Rebuild an index from :meth:`export_state` output (``dump()`` is equal).

        Raises:
            IndexStateError: the state has another version or a malformed shape.
        """
        try:
            version, locs, flat, orphans, sources, counters = state
        except (TypeError, ValueError) as exc:
            raise IndexStateError(f"index state must be a 6-item array: {exc}") from exc
        if version != STATE_VERSION:
            raise IndexStateError(f"index state version {version!r} is not {STATE_VERSION}")
        if len(flat) % 7:
            raise IndexStateError(f"index state block array has {len(flat)} items, not a multiple of 7")
        idx = cls(frequency)
        try:
            for name in locs:
                idx._bit(str(name))
            blocks = idx._blocks
            children = idx._children
            loc_blocks = idx._loc_blocks
            nloc = len(loc_blocks)
            it = iter(flat)
            for h, parent, prefix, size, mask, hits, last in zip(it, it, it, it, it, it, it):
                if not isinstance(mask, int):
                    mask = sum(1 << b for b in mask)
                e = _Entry(parent, prefix, size, mask, last)
                e.hits = hits
                blocks[h] = e
                if parent is not None:
                    cur = children.get(parent)
                    if cur is None:
                        children[parent] = h
                    elif isinstance(cur, set):
                        cur.add(h)
                    else:
                        children[parent] = {cur, h}
                bit = 0
                while mask:
                    if mask & 1:
                        if bit >= nloc:
                            raise IndexStateError(f"block {h} uses location bit {bit} of {nloc}")
                        loc_blocks[bit].add(h)
                    mask >>= 1
                    bit += 1
            idx._orphans = set(orphans)
            for name, epoch, last_seq, nb, ne, last_ts, retired in sources:
                idx._sources[name] = SourceState(epoch, last_seq, nb, ne, last_ts, set(retired))
            idx.counters = IndexCounters(**counters)
        except IndexStateError:
            raise
        except (TypeError, ValueError) as exc:
            raise IndexStateError(f"malformed index state: {exc}") from exc
        return idx

    def dump(self) -> dict[str, Any]:
        """Canonical, order-independent state (for equality checks of two folds).

        Returns:
            ``{"blocks": {h: (parent, prefix, size, sorted locations, hits, last_access)},
            "orphans": sorted list, "sources": {source: (epoch, last_seq)}, "counters": {...}}``.
        """
        return {
            "blocks": {
                h: (e.parent, e.prefix, e.size, tuple(sorted(self._names(e.mask))), e.hits, e.last_access)
                for h, e in sorted(self._blocks.items())
            },
            "orphans": sorted(self._orphans),
            "sources": {s: (st.epoch, st.last_seq) for s, st in sorted(self._sources.items())},
            "counters": dict(vars(self.counters)),
        }
