"""Per-tier block pool: Reset list, active set, inactive set, registry (DESIGN.md §5).

* **Reset list** — free physical blocks.
* **Registry** — sequence hash → the registered physical copies holding it (one, unless
  duplicates are allowed).  A registered block is *active* while an
  :class:`~kvbm_runtime.block.ImmutableBlock` references it, else *inactive*.  Both are
  matchable.
* **Inactive set** — a multi-level LRU keyed by use frequency (levels for 1, 2–3, 4–7 and
  ≥ 8 uses): eviction takes the least recently used block of the lowest non-empty level, so
  a block used often survives a burst of blocks used once (not plain LRU).

Events: the first copy of a hash registered at this tier publishes one Store; evicting the
last copy publishes one Remove (case C4).  ``storage_location`` is the tier name and
``block_size`` the layout's ``block_bytes``.  One re-entrant lock guards everything, so
``match_blocks`` sees active and inactive blocks consistently.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Protocol

from event_plane.schema import KVEvent, remove, store

from .block import Block, BlockMeta, BlockState, ImmutableBlock, MutableBlock, WeakBlock
from .errors import BlockStateError, PoolExhaustedError
from .layout import BlockLayout


class EventSink(Protocol):
    """What the pool needs from an ``event_plane.EventPublisher``."""

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue events, in order."""


_LEVEL_CAP = 3


def _level(frequency: int) -> int:
    """Frequency class: 1 → 0, 2–3 → 1, 4–7 → 2, ≥ 8 → 3."""
    return min(max(frequency, 1).bit_length() - 1, _LEVEL_CAP)


class _InactiveSet:
    """Multi-level LRU of inactive registered blocks (see module doc)."""

    __slots__ = ("_levels", "_where")

    def __init__(self) -> None:
        self._levels: list[OrderedDict[int, Block]] = [OrderedDict() for _ in range(_LEVEL_CAP + 1)]
        self._where: dict[int, int] = {}

    def __len__(self) -> int:
        return len(self._where)

    def add(self, block: Block) -> None:
        f = block.frequency
        level = 0 if f < 2 else (1 if f < 4 else (2 if f < 8 else 3))  # == _level(f)
        self._levels[level][block.block_id] = block
        self._where[block.block_id] = level

    def discard(self, block: Block) -> bool:
        level = self._where.pop(block.block_id, None)
        if level is None:
            return False
        del self._levels[level][block.block_id]
        return True

    def pop_victim(self) -> Block | None:
        for level in self._levels:
            if level:
                _, block = level.popitem(last=False)
                del self._where[block.block_id]
                return block
        return None

    def order(self) -> list[int]:
        """Block ids in eviction order."""
        return [bid for level in self._levels for bid in level]


@dataclass(frozen=True, slots=True)
class PoolStats:
    """Counts of one pool (blocks unless stated)."""

    tier: str
    total: int
    reset: int
    active: int
    inactive: int
    registered_hashes: int
    stores_published: int
    removes_published: int
    evictions: int
    dedup_hits: int


class BlockPool:
    """Blocks of one tier of one worker.

    Args:
        tier: storage location name used in events (``"g1"``, ``"g2"``).
        layout: the allocated layout; its ``num_blocks`` is the pool size.
        publisher: where Store / Remove events go (``None``: publish nothing).
        allow_duplicates: keep a second physical copy when a registered hash is
            registered again (instead of deduplicating onto the existing block).
    """

    def __init__(
        self,
        tier: str,
        layout: BlockLayout,
        publisher: EventSink | None = None,
        *,
        allow_duplicates: bool = False,
    ) -> None:
        self.tier = tier
        self.layout = layout
        self.page_size = layout.config.page_size
        self._block_bytes = layout.block_bytes
        self.allow_duplicates = allow_duplicates
        self._publisher = publisher
        self._lock = threading.RLock()
        self._blocks = [Block(i) for i in range(layout.num_blocks)]
        self._reset: deque[int] = deque(range(layout.num_blocks))
        self._registry: dict[int, list[Block]] = {}
        self._inactive = _InactiveSet()
        self._tick = 0
        self._stores = 0
        self._removes = 0
        self._evictions = 0
        self._dedup_hits = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_blocks(self) -> int:
        """Pool size in blocks."""
        return len(self._blocks)

    @property
    def block_bytes(self) -> int:
        """Bytes of KV data per block."""
        return self._block_bytes

    def contains(self, sequence_hash: int) -> bool:
        """Whether a block with this hash is registered (active or inactive); no side effect."""
        with self._lock:
            return sequence_hash in self._registry

    def resident(self) -> set[int]:
        """Sequence hashes registered here (active or inactive)."""
        with self._lock:
            return set(self._registry)

    def copies(self, sequence_hash: int) -> int:
        """Physical copies registered under ``sequence_hash``."""
        with self._lock:
            return len(self._registry.get(sequence_hash, ()))

    def eviction_order(self) -> list[int]:
        """Sequence hashes of inactive blocks, next victim first."""
        with self._lock:
            return [self._blocks[b].meta.sequence_hash for b in self._inactive.order()]  # type: ignore[union-attr]

    def available(self) -> int:
        """Blocks an ``allocate`` can take now (Reset + inactive)."""
        with self._lock:
            return len(self._reset) + len(self._inactive)

    def stats(self) -> PoolStats:
        """Current counts."""
        with self._lock:
            inactive = len(self._inactive)
            reset = len(self._reset)
            return PoolStats(
                tier=self.tier,
                total=self.num_blocks,
                reset=reset,
                active=sum(1 for b in self._blocks if b.state is BlockState.REGISTERED and b.ref_count > 0),
                inactive=inactive,
                registered_hashes=len(self._registry),
                stores_published=self._stores,
                removes_published=self._removes,
                evictions=self._evictions,
                dedup_hits=self._dedup_hits,
            )

    # ------------------------------------------------------------------ allocation

    def allocate(self, count: int) -> list[MutableBlock]:
        """Take ``count`` blocks in Reset state, evicting inactive blocks when the Reset
        list runs short (each eviction of a hash's last copy publishes one Remove).

        Returns:
            ``count`` Reset :class:`MutableBlock` handles.

        Raises:
            ValueError: ``count < 0``.
            PoolExhaustedError: fewer than ``count`` Reset + inactive blocks; nothing is
                allocated or evicted then.
        """
        if count < 0:
            raise ValueError(f"count must be >= 0, got {count}")
        with self._lock:
            return [MutableBlock(self, b) for b in self._take(count)]

    def _take(self, count: int) -> list[Block]:
        """Reset blocks, evicting inactive ones as needed (all-or-nothing); lock held."""
        reset, inactive = self._reset, self._inactive
        if count > len(reset) + len(inactive):
            raise PoolExhaustedError(
                f"{self.tier}: cannot allocate {count} blocks: {len(reset)} reset + "
                f"{len(inactive)} inactive of {self.num_blocks} (the rest are in use)"
            )
        out: list[Block] = []
        events: list[KVEvent] = []
        blocks = self._blocks
        for _ in range(count):
            if reset:
                out.append(blocks[reset.popleft()])
                continue
            victim = inactive.pop_victim()
            assert victim is not None
            self._evictions += 1
            ev = self._unregister(victim)
            if ev is not None:
                events.append(ev)
            victim.clear()
            out.append(victim)
        self._emit(events)
        return out

    def allocate_complete(self, metas: Sequence[BlockMeta]) -> list[MutableBlock]:
        """``allocate(len(metas))`` followed by ``init_from(meta)`` on each block, in one
        pass: Complete handles carrying the given identities, ready for their data and
        :meth:`register_blocks` (the offload / onboard path).

        Raises:
            PoolExhaustedError: as :meth:`allocate` (nothing allocated or evicted).
        """
        out: list[MutableBlock] = []
        complete = BlockState.COMPLETE
        with self._lock:
            for b, meta in zip(self._take(len(metas)), metas, strict=True):
                b.salt = meta.salt
                b.meta = meta
                b.state = complete
                out.append(MutableBlock(self, b))
        return out

    def evict(self, count: int | None = None) -> int:
        """Evict up to ``count`` inactive blocks (all when ``None``) back to Reset.

        Returns:
            Blocks evicted.
        """
        with self._lock:
            n = 0
            events: list[KVEvent] = []
            while count is None or n < count:
                victim = self._inactive.pop_victim()
                if victim is None:
                    break
                self._evictions += 1
                ev = self._unregister(victim)
                if ev is not None:
                    events.append(ev)
                victim.clear()
                self._reset.append(victim.block_id)
                n += 1
            self._emit(events)
            return n

    # ------------------------------------------------------------------ registration

    def register(self, block: MutableBlock) -> ImmutableBlock:
        """Complete → Registered; see :meth:`register_blocks`."""
        return self.register_blocks([block])[0]

    def register_blocks(self, blocks: Sequence[MutableBlock]) -> list[ImmutableBlock]:
        """Register Complete blocks, in order, and publish their Stores in that order.

        A hash already registered here dedups: the existing block is returned (strong
        handle) and the new physical block goes back to Reset — unless duplicates are
        allowed, then the new block becomes a second copy.  Either way no second Store is
        published for the hash.

        Returns:
            One strong handle per input, in input order; the inputs are consumed.

        Raises:
            BlockStateError: an input is not Complete or belongs to another pool (checked
                for all inputs before anything changes).
            ConsumedHandleError: an input handle was consumed.
        """
        with self._lock:
            raw: list[Block] = []
            for handle in blocks:
                b = handle._get()
                if handle._pool is not self:
                    raise BlockStateError(f"block {b.block_id} belongs to pool {handle._pool.tier}, not {self.tier}")
                if b.state is not BlockState.COMPLETE:
                    raise BlockStateError(f"register needs a Complete block, block {b.block_id} is {b.state.value}")
                raw.append(b)
            if len({id(b) for b in raw}) != len(raw):
                raise BlockStateError("the same block handle appears twice")
            events: list[KVEvent] = []
            out: list[ImmutableBlock] = []
            for handle, b in zip(blocks, raw, strict=True):
                handle._live = False
                meta = b.meta
                assert meta is not None
                copies = self._registry.get(meta.sequence_hash)
                if copies and not self.allow_duplicates:
                    existing = copies[0]
                    self._dedup_hits += 1
                    self._acquire(existing)
                    b.clear()
                    self._reset.append(b.block_id)
                    out.append(ImmutableBlock(self, existing))
                    continue
                b.state = BlockState.REGISTERED
                b.ref_count = 1
                b.frequency = 1
                self._tick += 1
                b.last_use = self._tick
                if copies:
                    copies.append(b)
                    self._dedup_hits += 1
                else:
                    self._registry[meta.sequence_hash] = [b]
                    events.append(
                        store(meta.sequence_hash, meta.prefix_hash, meta.parent_hash, self._block_bytes, self.tier)
                    )
                    self._stores += 1
                out.append(ImmutableBlock(self, b))
            self._emit(events)
            return out

    # ------------------------------------------------------------------ matching

    def match_blocks(self, sequence_hashes: Iterable[int]) -> list[ImmutableBlock]:
        """Strong handles for the longest prefix of ``sequence_hashes`` registered here;
        stops at the first miss.  Each hit counts as a use (frequency + 1)."""
        with self._lock:
            out: list[ImmutableBlock] = []
            registry = self._registry
            inactive = self._inactive
            for h in sequence_hashes:
                copies = registry.get(h)
                if not copies:
                    break
                block = copies[0]
                # inline of _acquire (the hot path of every request)
                if block.ref_count == 0:
                    inactive.discard(block)
                block.ref_count += 1
                block.frequency += 1
                self._tick += 1
                block.last_use = self._tick
                out.append(ImmutableBlock(self, block))
            return out

    def scan_matches(self, sequence_hashes: Iterable[int]) -> list[ImmutableBlock]:
        """Strong handles for every hash of ``sequence_hashes`` registered here (misses
        skipped), in input order."""
        with self._lock:
            out: list[ImmutableBlock] = []
            for h in sequence_hashes:
                copies = self._registry.get(h)
                if copies:
                    self._acquire(copies[0])
                    out.append(ImmutableBlock(self, copies[0]))
            return out

    def get(self, sequence_hash: int, *, touch: bool = False) -> ImmutableBlock | None:
        """Strong handle on the block registered under ``sequence_hash``, or ``None``.

        Unlike :meth:`match_blocks` this does not count a use unless ``touch`` (used for
        internal reads such as write-through offload).
        """
        with self._lock:
            copies = self._registry.get(sequence_hash)
            if not copies:
                return None
            self._acquire(copies[0], touch=touch)
            return ImmutableBlock(self, copies[0])

    # ------------------------------------------------------------------ batched handle operations

    def get_many(self, sequence_hashes: Iterable[int]) -> list[ImmutableBlock | None]:
        """:meth:`get` (no use counted) for many hashes under one lock."""
        with self._lock:
            out: list[ImmutableBlock | None] = []
            for h in sequence_hashes:
                copies = self._registry.get(h)
                if not copies:
                    out.append(None)
                    continue
                block = copies[0]
                if block.ref_count == 0:
                    self._inactive.discard(block)
                block.ref_count += 1
                out.append(ImmutableBlock(self, block))
            return out

    def upgrade_many(self, weaks: Iterable[WeakBlock]) -> list[ImmutableBlock | None]:
        """:meth:`WeakBlock.upgrade` for many weak handles of this pool under one lock
        (``None`` for each block evicted or reused since).

        Raises:
            BlockStateError: a weak handle belongs to another pool.
        """
        with self._lock:
            out: list[ImmutableBlock | None] = []
            for w in weaks:
                if w._pool is not self:
                    raise BlockStateError(f"weak handle of pool {w._pool.tier} upgraded through pool {self.tier}")
                out.append(self._upgrade(w._block, w._generation, w.sequence_hash))
            return out

    def downgrade_many(self, handles: Sequence[ImmutableBlock]) -> list[WeakBlock]:
        """:meth:`ImmutableBlock.downgrade` for many handles under one lock (consumes them)."""
        weaks = [WeakBlock(self, h._get(), h._block.generation, h.sequence_hash) for h in handles]
        self.release_blocks(handles)
        return weaks

    # ------------------------------------------------------------------ internals used by handles

    def _emit(self, events: list[KVEvent]) -> None:
        if events and self._publisher is not None:
            self._publisher.publish(events)

    def _unregister(self, block: Block) -> KVEvent | None:
        """Remove one registered copy; a Remove event when it was the last copy."""
        meta = block.meta
        assert meta is not None
        copies = self._registry[meta.sequence_hash]
        copies.remove(block)
        if copies:
            return None
        del self._registry[meta.sequence_hash]
        self._removes += 1
        return remove(meta.sequence_hash, meta.prefix_hash, meta.parent_hash, self._block_bytes, self.tier)

    def _acquire(self, block: Block, touch: bool = True) -> None:
        """One more strong ref (reactivates an inactive block); ``touch`` counts a use."""
        with self._lock:
            if block.state is not BlockState.REGISTERED:
                raise BlockStateError(f"block {block.block_id} is {block.state.value}, not registered")
            if block.ref_count == 0:
                self._inactive.discard(block)
            block.ref_count += 1
            if touch:
                block.frequency += 1
                self._tick += 1
                block.last_use = self._tick

    def release_blocks(self, handles: Iterable[ImmutableBlock]) -> None:
        """Release many strong handles under one lock (same as ``h.release()`` for each,
        in order; consumed handles raise before anything is released).

        Raises:
            ConsumedHandleError: a handle was already consumed.
            BlockStateError: a handle belongs to another pool.
        """
        hs = list(handles)
        for h in hs:
            h._get()
            if h._pool is not self:
                raise BlockStateError(f"handle of pool {h._pool.tier} released through pool {self.tier}")
        with self._lock:
            inactive = self._inactive
            for h in hs:
                h._live = False
                block = h._block
                if block.state is not BlockState.REGISTERED or block.ref_count <= 0:
                    continue
                block.ref_count -= 1
                if block.ref_count == 0:
                    inactive.add(block)

    def _release(self, block: Block) -> None:
        """Drop one strong ref; the last one makes the block inactive."""
        with self._lock:
            if block.state is not BlockState.REGISTERED or block.ref_count <= 0:
                return
            block.ref_count -= 1
            if block.ref_count == 0:
                self._inactive.add(block)

    def _reset_block(self, block: Block) -> None:
        """A mutable handle was dropped: back to the Reset list."""
        with self._lock:
            if block.state is BlockState.REGISTERED:
                return
            block.clear()
            self._reset.append(block.block_id)

    def _upgrade(self, block: Block, generation: int, sequence_hash: int) -> ImmutableBlock | None:
        with self._lock:
            if block.generation != generation or block.state is not BlockState.REGISTERED:
                return None
            assert block.meta is not None
            if block.meta.sequence_hash != sequence_hash:
                return None
            self._acquire(block)
            return ImmutableBlock(self, block)

    def _meta_of(self, sequence_hash: int) -> BlockMeta | None:
        with self._lock:
            copies = self._registry.get(sequence_hash)
            return copies[0].meta if copies else None
