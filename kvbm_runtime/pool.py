"""Per-tier block pool: Reset list, active set, inactive set, registry (docs/design.md §5).

* **Reset list** — free physical blocks.
* **Registry** — sequence hash → the registered physical block holding it, plus a side
  table of further copies (only when duplicates are allowed).  A registered block is
  *active* while an :class:`~kvbm_runtime.block.ImmutableBlock` references it, else
  *inactive*.  Both are matchable.
* **Inactive set** — a multi-level LRU keyed by use frequency (levels for 1, 2–3, 4–7 and
  ≥ 8 uses), one doubly linked list per level through C arrays indexed by block id
  (``_pool_core.InactiveSet``): eviction takes the least recently used block of the lowest
  non-empty level, so a block used often survives a burst of blocks used once (not plain
  LRU).  Insert, remove and evict are O(1).  A block's level is a function of
  its frequency, which does not change while it is inactive.
  A registered block is inactive exactly when its ``ref_count`` is 0.

Finalizers: a handle or pin dropped in a reference cycle gives its block back from the
cycle collector, which can run inside any call here, on the thread that holds the lock
(3.11: at an allocation; 3.12+: at the next Python call or loop).  Every change that
touches more than one of the structures above runs in one call of the compiled core, so
wherever Python code can run (a finalizer, a ``__del__``, a ``gc.callbacks`` hook, a sink)
the counters and lists agree (``kvbm_runtime/_pool_core.pyx``, "Finalizers").

Events: the first copy of a hash registered at this tier publishes one Store; evicting the
last copy publishes one Remove (case C4).  ``storage_location`` is the tier name and
``block_size`` the layout's ``block_bytes``.  One re-entrant lock guards everything, so
``match_blocks`` sees active and inactive blocks consistently.

Hot path: the batch calls (:meth:`BlockPool.allocate_complete`,
:meth:`BlockPool.register_blocks`, :meth:`BlockPool.release_blocks`,
:meth:`BlockPool.match_blocks`) take the lock once and run their per-block loop in the
compiled core (``kvbm_runtime/_pool_core.pyx``; its executable specification is
:mod:`kvbm_runtime.pool_reference`, which a pool can run on instead: ``BlockPool._core``),
which collects the identities (``BlockMeta``) of the blocks whose Store / Remove they owe;
per block they create one handle and nothing else (counters advance per batch).  Errors,
undo, dedup and duplicates stay here.  The events then go out once per
batch call, in the form the sink takes (chosen at construction):

* an ``event_plane.EventPublisher`` that :attr:`~event_plane.EventPublisher.wants_events`:
  the events' wire bytes, encoded from the identities in one compiled call
  (:func:`event_plane._fastenc.encode_meta_events`), to ``publish_encoded``: no
  ``KVEvent`` object per event;
* a publisher that does not want events (``null://``: events off): no event is built, the
  count goes to its ``skip_events``;
* any other sink: a list of ``KVEvent`` to its ``publish``.

The bytes subscribers receive are the same in every case.
"""

from __future__ import annotations

import sys
import threading
from collections import deque
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass
from functools import partial
from itertools import repeat
from operator import attrgetter
from typing import Any, Protocol

from event_plane._fastenc import encode_meta_events, event_tail, make_meta_events
from event_plane.codec import encode_event
from event_plane.schema import U64_MAX as _U64_MAX
from event_plane.schema import EventType, KVEvent

from . import _pool_core
from ._pool_core import new_immutable, new_mutable
from .block import Block, BlockMeta, BlockState, ImmutableBlock, MutableBlock, PinnedBlocks, WeakBlock
from .errors import BlockStateError, ConsumedHandleError, LayoutConfigError, PoolExhaustedError
from .layout import BlockLayout


class EventSink(Protocol):
    """What the pool needs from an ``event_plane.EventPublisher``."""

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Queue events, in order."""


_STORE = EventType.STORE
_REMOVE = EventType.REMOVE
_STORE_INT = int(EventType.STORE)
_REMOVE_INT = int(EventType.REMOVE)
_COMPLETE = BlockState.COMPLETE
_REGISTERED = BlockState.REGISTERED
_GENERATION_OF = attrgetter("generation")
_HASH_OF = attrgetter("meta.sequence_hash")


def _acquire_unless_finalizing(lock: Any) -> bool:
    """Wait for ``lock`` (the uncontended try already failed), unless the interpreter is
    shutting down: then a daemon thread stopped by the shutdown may hold the lock forever,
    and a handle that module teardown deallocates gives nothing back instead of hanging
    the exit (nothing reads the pool again).  Returns whether the lock is held."""
    while not lock.acquire(timeout=0.05):
        if sys.is_finalizing():
            return False
    return True


def _names(weak: WeakBlock, block: Block) -> bool:
    """Whether ``weak`` names the current life of ``block`` (block, generation, hash)."""
    return weak._block is block and weak._generation == block.generation and weak.sequence_hash == block.meta.sequence_hash  # type: ignore[union-attr]


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
        publisher: where Store / Remove events go (``None``: publish nothing).  An
            ``event_plane.EventPublisher`` gets the events already encoded
            (``publish_encoded``; they are well-formed by construction: see
            ``BlockMeta``), or none at all when its ``wants_events`` is false at
            construction (``null://``: their number goes to ``skip_events``); a sink
            with ``publish_valid`` but no ``publish_encoded`` gets ``KVEvent`` lists
            there.  Any other sink gets ``KVEvent`` lists through ``publish``.
        allow_duplicates: keep a second physical copy when a registered hash is
            registered again (instead of deduplicating onto the existing block).

    Raises:
        ValueError: with a publisher, ``tier`` is not a str of 1..255 characters (no event
            could carry it).
        LayoutConfigError: with a publisher, the layout's blocks are 4 GiB or more (no
            event's ``block_size`` could carry it).
    """

    # the per-block loops of the batch calls and the inactive set: the compiled core, or
    # (tests, a subclass) its executable specification, kvbm_runtime.pool_reference
    _core = _pool_core

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
        self._publish = None
        # (event type, identities of the blocks) -> the batch call's events go out; None
        # without a publisher
        self._emit_metas: Callable[[int, list[BlockMeta]], None] | None = None
        # a publisher taking encoded events: its publish_encoded and this pool's event tail
        # (the hot paths call them inline: one Python call less per batch call)
        self._put: Callable[[bytes, int], None] | None = None
        self._tail = b""
        if publisher is not None:
            # Checked once here: with the hashes a BlockMeta checks, every event this pool
            # builds is then well-formed by construction.  (A pool whose events could never
            # be published used to fail at its first registration, after changing state.)
            if not isinstance(tier, str) or not 1 <= len(tier) <= 255:
                raise ValueError(f"tier must be a str of 1..255 characters (an event storage_location), got {tier!r}")
            if not 0 <= self._block_bytes <= 0xFFFFFFFF:
                raise LayoutConfigError(
                    f"{tier}: blocks of {self._block_bytes} bytes do not fit an event's block_size (u32)"
                )
            self._publish = publisher.publish
            valid = getattr(publisher, "publish_valid", None)
            if valid is not None:
                # so they go to ``publish_valid`` (no per-event checks), with the size of the
                # largest event this pool can build (u64 hashes, a parent, no metadata): the
                # publisher may queue them and encode each batch in one call at its flush
                bound = len(encode_event(KVEvent(_REMOVE, _U64_MAX, _U64_MAX, _U64_MAX, self._block_bytes, tier)))
                self._publish = partial(valid, max_event_bytes=bound)
            self._emit_metas = self._metas_emitter(publisher)
        self._lock = threading.RLock()
        self._blocks = [Block(i) for i in range(layout.num_blocks)]
        self._reset: deque[int] = deque(range(layout.num_blocks))
        self._registry: dict[int, Block] = {}  # sequence hash -> first registered copy
        self._dups: dict[int, list[Block]] = {}  # further copies (allow_duplicates only)
        self._inactive = self._core.InactiveSet(self._blocks)
        self._stores = 0
        self._removes = 0
        self._evictions = 0
        self._dedup_hits = 0

    def _metas_emitter(self, publisher: EventSink) -> Callable[[int, list[BlockMeta]], None]:
        """How this pool's batch calls hand over their events (see the module docstring):
        a function of (event type, block identities)."""
        if getattr(publisher, "wants_events", True) is False:
            # events off; a sink without skip_events just is not told how many it missed
            skip = getattr(publisher, "skip_events", None) or (lambda count: None)
            self._publish = lambda events: skip(len(events))

            def off(kind: int, metas: list[BlockMeta]) -> None:
                skip(len(metas))

            return off
        put = getattr(publisher, "publish_encoded", None)
        if put is not None:
            tail = self._tail = event_tail(self._block_bytes, self.tier)
            self._put = put
            enc = encode_meta_events

            def encoded(kind: int, metas: list[BlockMeta]) -> None:
                put(enc(kind, metas, tail), len(metas))

            return encoded
        publish = self._publish
        bb, tier = self._block_bytes, self.tier
        types = {_STORE_INT: _STORE, _REMOVE_INT: _REMOVE}

        def objects(kind: int, metas: list[BlockMeta]) -> None:
            publish(make_meta_events(KVEvent, types[kind], metas, bb, tier))  # type: ignore[misc]

        return objects

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
            if sequence_hash not in self._registry:
                return 0
            return 1 + len(self._dups.get(sequence_hash, ()))

    def eviction_order(self) -> list[int]:
        """Sequence hashes of inactive blocks, next victim first."""
        with self._lock:
            return [self._blocks[b].meta.sequence_hash for b in self._inactive.order()]  # type: ignore[union-attr]

    def available(self) -> int:
        """Blocks an ``allocate`` can take now (Reset + inactive)."""
        with self._lock:
            return len(self._reset) + len(self._inactive)

    def resident_blocks(self) -> int:
        """Blocks held under a sequence hash now (active or inactive, reusable)."""
        with self._lock:
            return len(self._registry)

    def stats(self) -> PoolStats:
        """Current counts."""
        with self._lock:
            reset, active, inactive = self._core.counts(self)  # read together
            return PoolStats(
                tier=self.tier,
                total=self.num_blocks,
                reset=reset,
                active=active,
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
            return self._settle_take(count, *self._core.allocate_reset(self, count))

    def allocate_complete(self, metas: Sequence[BlockMeta]) -> list[MutableBlock]:
        """``allocate(len(metas))`` followed by ``init_from(meta)`` on each block, in one
        pass: Complete handles carrying the given identities, ready for their data and
        :meth:`register_blocks` (the offload / onboard path).

        Raises:
            PoolExhaustedError: as :meth:`allocate` (nothing allocated or evicted).
        """
        metas = metas if isinstance(metas, (list, tuple)) else list(metas)
        with self._lock:
            return self._settle_take(len(metas), *self._core.allocate_complete(self, metas))

    def _settle_take(self, count: int, out: list[MutableBlock], removes: list[BlockMeta] | None, evicted: int) -> list[MutableBlock]:
        """Count the evictions of an allocation and publish their Removes (lock held).

        Raises:
            PoolExhaustedError: the core ran out part-way (a finalizer or a ``__del__``
                that re-entered the pool after the room check took blocks): the blocks
                taken are back on the Reset list; the ones evicted stay evicted (their
                Removes are published).
        """
        if evicted:
            self._evictions += evicted
            if removes:
                self._emit_removes(removes)
        if len(out) != count:
            raise PoolExhaustedError(f"{self.tier}: cannot allocate {count} blocks: the pool ran out part-way")
        return out

    def _emit_removes(self, events: list[BlockMeta]) -> None:
        """Count and publish one Remove per identity in ``events`` (lock held)."""
        self._removes += len(events)
        if self._put is not None:
            self._put(encode_meta_events(_REMOVE_INT, events, self._tail), len(events))
        elif self._emit_metas is not None:
            self._emit_metas(_REMOVE_INT, events)

    def _encode_stores(self, events: list[BlockMeta], blocks: Sequence[MutableBlock], n: int) -> bytes | None:
        """The wire bytes of one Store per identity in ``events`` for the encoded publisher
        path (``None`` on the other paths), encoded before the registrations of
        ``blocks[:n]`` are final (lock held).

        Raises:
            Exception: whatever the encoder raises for an identity no Store can carry (not
                a checked BlockMeta), after undoing those ``n`` fresh registrations, so that
                no block is registered here without its Store.
        """
        if self._put is None:
            return None
        try:
            return encode_meta_events(_STORE_INT, events, self._tail)
        except Exception:
            self._unregister_batch(blocks[:n])
            raise

    def _emit_stores(self, events: list[BlockMeta], body: bytes | None) -> None:
        """Count and publish the Stores of ``events`` (``body``: from :meth:`_encode_stores`)."""
        self._stores += len(events)
        if body is not None:
            self._put(body, len(events))  # type: ignore[misc]
        elif self._emit_metas is not None:
            self._emit_metas(_STORE_INT, events)

    def _check_room(self, count: int) -> None:
        """Raise :class:`PoolExhaustedError` unless ``count`` blocks are Reset or inactive."""
        n_reset, n_inactive = len(self._reset), len(self._inactive)
        if count > n_reset + n_inactive:
            raise PoolExhaustedError(
                f"{self.tier}: cannot allocate {count} blocks: {n_reset} reset + "
                f"{n_inactive} inactive of {self.num_blocks} (the rest are in use)"
            )

    def evict(self, count: int | None = None) -> int:
        """Evict up to ``count`` inactive blocks (all when ``None``) back to Reset.

        Returns:
            Blocks evicted.
        """
        with self._lock:
            removes, n = self._core.evict_blocks(self, -1 if count is None else max(count, 0))
            self._evictions += n
            if removes:
                self._emit_removes(removes)
            return n

    # ------------------------------------------------------------------ registration

    def register(self, block: MutableBlock) -> ImmutableBlock:
        """Complete → Registered; see :meth:`register_blocks`."""
        return self.register_blocks((block,))[0]

    def register_blocks(self, blocks: Sequence[MutableBlock]) -> list[ImmutableBlock]:
        """Register Complete blocks, in order, and publish their Stores in that order.

        A hash already registered here dedups: the existing block is returned (strong
        handle) and the new physical block goes back to Reset — unless duplicates are
        allowed, then the new block becomes a second copy.  Either way no second Store is
        published for the hash.

        Returns:
            One strong handle per input, in input order; the inputs are consumed.

        Raises:
            BlockStateError: an input is not Complete, belongs to another pool or appears
                twice (checked for all inputs before anything changes).
            ConsumedHandleError: an input handle was consumed.
            TypeError, OverflowError, AttributeError: an input's identity has no
                ``sequence_hash`` or an unhashable one, or (a publisher taking encoded
                events) it is not a checked ``BlockMeta`` and no Store can carry it (a
                hash not an ``int`` in [0, 2**64), a field missing); nothing changed: the
                inputs stay live and Complete.
        """
        blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)  # indexed on errors
        with self._lock:
            out, events, deferred, body = self._register_loop(blocks, True)
            if deferred:
                self._register_existing(deferred, out)
            if events:
                self._emit_stores(events, body)
            return out  # type: ignore[return-value]

    def _register_loop(self, blocks: Sequence[MutableBlock], strong: bool) -> tuple[list, list[BlockMeta], list | None, bytes | None]:
        """The first part of :meth:`register_blocks` (``strong``) and
        :meth:`register_downgrade` (lock held): the core's ``register_blocks`` loop (a
        hash already registered, here or earlier in the batch, is deferred, so that a bad
        input found part-way only has fresh registrations to undo), then the Stores'
        bytes for an encoded publisher (see :meth:`_encode_stores`).

        Returns:
            ``(out, stores, deferred, body)``: see the core's ``register_blocks``.

        Raises:
            as :meth:`register_blocks`, after undoing the fresh registrations.
        """
        out, events, deferred, bad, error = self._core.register_blocks(self, blocks, strong)
        if bad >= 0:
            done = blocks[:bad]
            self._unregister_batch(done)
            if error is not None:  # an identity that cannot be registered (no hash, unhashable)
                raise error
            raise self._bad_handle(blocks[bad], done, "register", _COMPLETE)
        body = self._encode_stores(events, blocks, len(out)) if events and self._put is not None else None
        return out, events, deferred, body

    def _register_existing(self, deferred: list[tuple[int, MutableBlock, Block]], out: list[ImmutableBlock | None]) -> None:
        """Second part of :meth:`register_blocks` (lock held): inputs whose hash was
        already registered become a further copy (duplicates allowed) or dedup onto the
        existing block, whose new physical block goes back to Reset."""
        for i, handle, existing in deferred:
            out[i] = new_immutable(self, self._settle_existing(handle, existing))

    def _settle_existing(self, handle: MutableBlock, existing: Block) -> Block:
        """One input of a register call whose hash ``existing`` already holds (lock held):
        with duplicates allowed its block becomes a further registered copy (one
        reference), else ``existing`` gains one reference (a dedup hit) and the input's
        block goes back to Reset.  Returns the block the input now stands for."""
        return self._core.settle_existing(self, handle, existing)

    def register_downgrade(self, blocks: Sequence[MutableBlock], weaks: list[WeakBlock] | None = None) -> list[WeakBlock]:
        """:meth:`register_blocks` followed by :meth:`downgrade_many` of its result, in one
        call under one lock, with no strong handle built (the offload path: the copy
        stays matchable, nobody holds it).

        Same outcome, block for block and event for event: the first copy of each hash
        publishes one Store (in input order); a hash already registered dedups onto the
        existing block (one use counted, the new physical block back to Reset) or, with
        duplicates allowed, becomes a further copy; then every registered block whose last
        strong reference this was becomes inactive, in input order, at its frequency level.

        Args:
            blocks: Complete handles of this pool.
            weaks: optional, the caller's weak handles on the inputs' blocks, in input
                order, built while they were Complete (``WeakBlock(pool, block,
                block.generation, meta.sequence_hash)``; the offload path builds them
                before its copy, while the objects are in cache).  When every input
                registers as itself this list is the result; otherwise (a dedup, another
                length) new ones are built.  Only the first and last are checked: a weak
                handle naming another block or life only fails to upgrade.

        Returns:
            One weak handle per input, in input order (on the existing block for a dedup);
            the inputs are consumed.

        Raises:
            as :meth:`register_blocks`, and nothing changed then (the inputs stay live and
            Complete).
        """
        wb = WeakBlock
        hs = blocks if isinstance(blocks, (list, tuple)) else list(blocks)  # indexed below
        with self._lock:
            registered, events, deferred, body = self._register_loop(hs, False)
            n = len(registered)
            if deferred is None:
                # every input registered as itself, frequency 1, holding the batch's
                # reference: dropped in input order (inactive, level 0)
                targets = registered
                self._core.unpin_blocks(self, targets)
            else:
                targets = self._register_downgrade_dedup(hs, deferred)
            if (
                weaks is not None
                and deferred is None
                and len(weaks) == n
                and n
                and _names(weaks[0], targets[0])
                and _names(weaks[-1], targets[-1])
            ):
                # the caller's handles (built while these objects were in cache); only
                # their ends are checked: a weak handle that names another block or life
                # only fails to upgrade, nothing in the pool depends on it
                out = weaks
            else:
                out = list(map(wb, repeat(self, n), targets, map(_GENERATION_OF, targets), map(_HASH_OF, targets)))
            if events:
                self._emit_stores(events, body)
            return out

    def _register_downgrade_dedup(self, hs: list[MutableBlock], deferred: list[tuple[int, MutableBlock, Block]]) -> list[Block]:
        """:meth:`register_downgrade` of a batch with hashes already registered (lock
        held), as register + release would do it: the fresh registrations hold one
        reference each (the batch's, taken by the core) while the dedups count their
        uses, then every reference is dropped in input order.  Returns the registered
        block of each input."""
        targets: list[Block] = [h._block for h in hs]
        for i, handle, existing in deferred:
            targets[i] = self._settle_existing(handle, existing)
        self._core.unpin_blocks(self, targets)
        return targets

    def _unregister_batch(self, done: Sequence[MutableBlock]) -> None:
        """Undo the first part of a failed :meth:`register_blocks` (lock held): the inputs
        in ``done`` are live again and Complete, their fresh registrations gone."""
        for handle in done:
            handle._live = True
            b = handle._block
            if b.state is _REGISTERED:
                del self._registry[b.meta.sequence_hash]  # type: ignore[union-attr]
                b.state = _COMPLETE
                b.ref_count = 0
                b.frequency = 0

    def _bad_handle(self, h: MutableBlock | ImmutableBlock, before: Sequence[object], op: str, state: BlockState) -> Exception:
        """The error for the first invalid handle of a batch (nothing changed yet)."""
        b = h._block
        if b is None:  # a dead handle made through __new__
            return ConsumedHandleError(f"{type(h).__name__} of no block was already consumed")
        if any(x is h for x in before):
            return BlockStateError(f"the same handle of block {b.block_id} appears twice")
        if not h._live:
            return ConsumedHandleError(f"{type(h).__name__} of block {b.block_id} was already consumed")
        if h._pool is not self:
            return BlockStateError(f"block {b.block_id} belongs to pool {h._pool.tier}, not {self.tier}")
        return BlockStateError(f"{op} needs a {state.value.capitalize()} block, block {b.block_id} is {b.state.value}")

    # ------------------------------------------------------------------ matching

    def match_blocks(self, sequence_hashes: Iterable[int]) -> list[ImmutableBlock]:
        """Strong handles for the longest prefix of ``sequence_hashes`` registered here;
        stops at the first miss.  Each hit counts as a use (frequency + 1)."""
        with self._lock:
            return self._core.match_blocks(self, sequence_hashes)

    def scan_matches(self, sequence_hashes: Iterable[int]) -> list[ImmutableBlock]:
        """Strong handles for every hash of ``sequence_hashes`` registered here (misses
        skipped), in input order."""
        with self._lock:
            out: list[ImmutableBlock] = []
            for h in sequence_hashes:
                block = self._registry.get(h)
                if block is not None:
                    self._acquire(block)
                    out.append(new_immutable(self, block))
            return out

    def get(self, sequence_hash: int, *, touch: bool = False) -> ImmutableBlock | None:
        """Strong handle on the block registered under ``sequence_hash``, or ``None``.

        Unlike :meth:`match_blocks` this does not count a use unless ``touch`` (used for
        internal reads such as write-through offload).
        """
        with self._lock:
            block = self._registry.get(sequence_hash)
            if block is None:
                return None
            self._acquire(block, touch=touch)
            return new_immutable(self, block)

    # ------------------------------------------------------------------ batched handle operations

    def get_many(self, sequence_hashes: Iterable[int]) -> list[ImmutableBlock | None]:
        """:meth:`get` (no use counted) for many hashes under one lock."""
        with self._lock:
            return self._core.get_many(self, sequence_hashes)

    def upgrade_many(self, weaks: Iterable[WeakBlock]) -> list[ImmutableBlock | None]:
        """:meth:`WeakBlock.upgrade` for many weak handles of this pool under one lock
        (``None`` for each block evicted or reused since).  Each upgrade counts a use.

        Raises:
            BlockStateError: a weak handle belongs to another pool (nothing upgraded).
        """
        return self._upgrade_weaks(weaks, True, "upgraded")[0]  # type: ignore[return-value]

    def pin_many(self, weaks: Iterable[WeakBlock]) -> PinnedBlocks:
        """Pin the blocks of many weak handles of this pool under one lock, with no strong
        handle built: each block still registered with the handle's identity gets one
        reference (active, cannot be evicted) and one use counted, exactly as
        :meth:`upgrade_many` does; a block evicted or reused since is not pinned (a weak
        handle never resurrects it).

        Returns:
            The pins, to be given back with :meth:`unpin_many` (or ``release()``);
            ``lost`` lists the input indices that were not pinned, in order.  Pins dropped
            without being released are released when the object is collected.

        Raises:
            BlockStateError: a weak handle belongs to another pool (nothing pinned).
        """
        pinned, lost = self._upgrade_weaks(weaks, False, "pinned")
        return PinnedBlocks(self, pinned, lost)

    def _upgrade_weaks(self, weaks: Iterable[WeakBlock], strong: bool, what: str) -> tuple[list, list[int]]:
        """:meth:`upgrade_many` (``strong``) / :meth:`pin_many`: ``(out, lost)`` of the
        core's ``upgrade_weaks``, under the lock.

        Raises:
            BlockStateError: a weak handle belongs to another pool (nothing done).
        """
        ws = weaks if isinstance(weaks, (list, tuple)) else list(weaks)
        with self._lock:
            out, lost, bad = self._core.upgrade_weaks(self, ws, strong)
        if bad >= 0:
            raise BlockStateError(f"weak handle of pool {ws[bad]._pool.tier} {what} through pool {self.tier}")
        return out, lost

    def unpin_many(self, pins: PinnedBlocks) -> None:
        """Give back the pins of one :meth:`pin_many` call under one lock (consumes them):
        the same as releasing that many strong handles in order; each block whose last
        reference this was becomes inactive, at its frequency level.

        Raises:
            ConsumedHandleError: these pins were already given back (nothing changes).
            BlockStateError: the pins belong to another pool (nothing changes).
        """
        if pins._pool is not self:
            raise BlockStateError(f"pins of pool {pins._pool.tier} given back through pool {self.tier}")
        with self._lock:
            if not pins._live:
                raise ConsumedHandleError(f"the {len(pins._blocks)} pins of pool {self.tier} were already given back")
            pins._live = False
            self._core.unpin_blocks(self, pins._blocks)

    def downgrade_many(self, handles: Sequence[ImmutableBlock]) -> list[WeakBlock]:
        """:meth:`ImmutableBlock.downgrade` for many handles under one lock (consumes them).

        Raises:
            ConsumedHandleError: a handle was already consumed (nothing released).
            BlockStateError: a handle belongs to another pool or appears twice.
        """
        hs = handles if isinstance(handles, list) else list(handles)
        wb = WeakBlock
        with self._lock:  # the weak handles must name the generation the release leaves
            for h in hs:
                if not h._live:
                    raise self._bad_handle(h, (), "downgrade", _REGISTERED)
            weaks = [wb(self, b, b.generation, b.meta.sequence_hash) for b in [h._block for h in hs]]  # type: ignore[union-attr]
            self.release_blocks(hs)
        return weaks

    # ------------------------------------------------------------------ internals used by handles

    def _acquire(self, block: Block, touch: bool = True) -> None:
        """One more strong ref (reactivates an inactive block); ``touch`` counts a use."""
        with self._lock:
            self._core.acquire_one(self, block, touch)

    def release_blocks(self, handles: Iterable[ImmutableBlock]) -> None:
        """Release many strong handles under one lock (same as ``h.release()`` for each,
        in order; consumed handles raise before anything is released).

        Raises:
            ConsumedHandleError: a handle was already consumed.
            BlockStateError: a handle belongs to another pool, appears twice, or is a
                ``MutableBlock`` (it holds no reference; release it with its own
                ``release()``).
        """
        hs = handles if isinstance(handles, list) else list(handles)
        with self._lock:
            n = self._core.release_blocks(self, hs)
            if n < len(hs):
                self._unrelease(hs[:n])
                raise self._bad_handle(hs[n], hs[:n], "release", _REGISTERED)

    def _unrelease(self, done: list[ImmutableBlock]) -> None:
        """Undo the releases of ``done`` (a batch failed part-way; lock held), last first,
        so every block is back to its ref count and out of the inactive set."""
        self._core.unrelease(self, done)

    def _release(self, block: Block) -> None:
        """Drop one strong ref; the last one makes the block inactive (also when a handle
        is dropped while live, from its deallocation)."""
        lock = self._lock
        if not lock.acquire(False) and not _acquire_unless_finalizing(lock):
            return
        try:
            self._core.release_one(self, block)
        finally:
            lock.release()

    def _reset_block(self, block: Block) -> None:
        """A mutable handle was dropped: back to the Reset list."""
        lock = self._lock
        if not lock.acquire(False) and not _acquire_unless_finalizing(lock):
            return
        try:
            self._core.reset_block(self, block)
        finally:
            lock.release()

    def _upgrade(self, block: Block, generation: int, sequence_hash: int) -> ImmutableBlock | None:
        with self._lock:
            if block.generation != generation or block.state is not _REGISTERED:
                return None
            assert block.meta is not None
            if block.meta.sequence_hash != sequence_hash:
                return None
            self._acquire(block)
            return new_immutable(self, block)

    def _meta_of(self, sequence_hash: int) -> BlockMeta | None:
        with self._lock:
            block = self._registry.get(sequence_hash)
            return block.meta if block is not None else None
