"""Vendor SDK helpers: typed events in per-source order, and an idempotent block tracker.

A storage vendor subscribes with :func:`event_plane.subscribe` (``zmq://``, ``nats://``,
``jetstream://``, ``vllm+zmq://``, ``sglang+zmq://``), iterates typed events with
:func:`iter_events`, and folds them into a :class:`BlockTracker`: sequence hash → parent,
prefix family, size and the (source, location) pairs that hold the block. The tracker
follows the receiver rules of ``docs/events.md`` §2.3 and §4:

* Store is idempotent: storing a block already held at (source, location) changes nothing
  (counted as ``duplicate_stores``);
* Remove takes one (source, location) off a block; a Remove nobody matches is counted
  (``unknown_removes``), never an error; a block is forgotten when no location holds it;
* a Store whose ``parent_hash`` equals its ``sequence_hash`` is rejected alone and counted
  (``self_parent``); the rest of its batch applies; so is a Store of a new block whose
  parent chain leads back to it (a parent cycle, counted in ``parent_cycle``; checked up to
  :data:`~event_plane.schema.PARENT_WALK_LIMIT` links);
* a Store whose parent is not held is an *orphan*: kept, counted, and linked when the parent
  arrives (``match`` then walks through it);
* Cleared drops every block the source holds at that location;
* a new epoch of a known source is a restart: that source's volatile locations (``g1``,
  ``g2``) are dropped before its new batches apply; batches of a superseded epoch and
  batches already applied (seq not above the last applied one) are ignored and counted.

This is the vendor-facing helper, not the advisor's index (``advisor/`` has its own).
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace

import msgspec

from event_plane.schema import PARENT_WALK_LIMIT, EventBatch, EventType, KVEvent
from event_plane.subscriber import Subscriber

_STORE, _REMOVE = EventType.STORE, EventType.REMOVE

Holder = tuple[str, str]
"""``(source, storage_location)`` holding a block."""


class SourcedEvent(msgspec.Struct, frozen=True, gc=False):
    """One event with the batch coordinates it came in.

    Attributes:
        source, epoch, seq: of the batch (see :class:`~event_plane.schema.EventBatch`).
        index: position of the event in its batch (0-based).
        event: the :class:`~event_plane.schema.KVEvent`.
    """

    source: str
    epoch: int
    seq: int
    index: int
    event: KVEvent


def iter_events(subscriber: Subscriber, timeout: float | None = None) -> Iterator[SourcedEvent]:
    """Typed events of ``subscriber`` in delivery order (per source: seq order, then the
    order within the batch). Stops when the subscriber is closed and drained, or when no
    batch came for ``timeout`` seconds (``None``: wait forever).

    Raises:
        NotStartedError: ``subscriber`` was never started (it would wait forever).
    """
    while True:
        batch = subscriber.get(timeout=timeout)
        if batch is None:
            return
        for i, ev in enumerate(batch.events):
            yield SourcedEvent(batch.source, batch.epoch, batch.seq, i, ev)


@dataclass
class TrackerStats:
    """Counters of a :class:`BlockTracker` (cumulative unless said otherwise).

    Attributes:
        batches: batches applied.
        stores / removes / clears: events of each kind that changed something (a
            duplicate Store or an unknown Remove is counted apart).
        duplicate_stores: Stores of a block already held at that (source, location).
        unknown_removes: Removes of a block not held at that (source, location).
        self_parent: Stores rejected because their parent is themselves.
        parent_cycle: Stores of a new block rejected because they close a parent cycle.
        orphan_stores: Stores whose parent was not held when they arrived.
        orphans_linked: orphans whose parent arrived later.
        restarts: new epochs of known sources.
        stale_batches: batches of a superseded epoch, ignored.
        duplicate_batches: batches whose seq was already applied, ignored.
        blocks: blocks held now (gauge).
        orphans: blocks held now whose parent is not held (gauge).
    """

    batches: int = 0
    stores: int = 0
    removes: int = 0
    clears: int = 0
    duplicate_stores: int = 0
    unknown_removes: int = 0
    self_parent: int = 0
    parent_cycle: int = 0
    orphan_stores: int = 0
    orphans_linked: int = 0
    restarts: int = 0
    stale_batches: int = 0
    duplicate_batches: int = 0
    blocks: int = 0
    orphans: int = 0


@dataclass(slots=True)
class TrackedBlock:
    """What a :class:`BlockTracker` knows of one block.

    Attributes:
        sequence_hash / parent_hash / prefix_hash / block_size: from its latest Store.
        holders: ``(source, location)`` pairs holding it.
    """

    sequence_hash: int
    parent_hash: int | None
    prefix_hash: int
    block_size: int
    holders: set[Holder] = field(default_factory=set)


class BlockTracker:
    """Idempotent fold of KVEvent batches into block → holders (rules: module docstring).

    Args:
        volatile_locations: locations a restart (new epoch) of their source empties.

    Not thread-safe: feed it from one thread.
    """

    def __init__(self, volatile_locations: Iterable[str] = ("g1", "g2")) -> None:
        self.volatile_locations = frozenset(volatile_locations)
        self._blocks: dict[int, TrackedBlock] = {}
        self._children: dict[int, set[int]] = {}  # parent hash -> child hashes (held)
        self._by_holder: dict[Holder, set[int]] = {}  # (source, location) -> hashes
        self._epochs: dict[str, int] = {}  # source -> current epoch
        self._retired: dict[str, set[int]] = {}  # source -> superseded epochs
        self._applied: dict[str, int] = {}  # source -> last applied seq (current epoch)
        # Cycle check shortcuts: held block -> (held ancestor it leads to, parent links to
        # it, cut generation). Valid while no held block with held children was dropped
        # or re-parented since (``_cut_gen`` unchanged): until then, ancestry and link
        # counts only grow at the top (a block stored above a chain's first block).
        self._up: dict[int, tuple[int, int, int]] = {}
        self._cut_gen = 0
        self.cycle_walk_steps = 0
        """Parent links followed one by one by the cycle check (cumulative; shortcuts
        skip the rest): a diagnostic for tests and benchmarks."""
        self._stats = TrackerStats()

    # ------------------------------------------------------------------ queries
    def __len__(self) -> int:
        return len(self._blocks)

    def __iter__(self) -> Iterator[TrackedBlock]:
        """The tracked blocks (live objects: do not modify), in insertion order."""
        return iter(list(self._blocks.values()))

    def __contains__(self, sequence_hash: object) -> bool:
        return sequence_hash in self._blocks

    def get(self, sequence_hash: int) -> TrackedBlock | None:
        """The tracked block (a live object: do not modify), or ``None``."""
        return self._blocks.get(sequence_hash)

    def holders(self, sequence_hash: int) -> frozenset[Holder]:
        """``(source, location)`` pairs holding the block (empty if unknown)."""
        block = self._blocks.get(sequence_hash)
        return frozenset(block.holders) if block is not None else frozenset()

    def count_at(self, location: str, source: str | None = None) -> int:
        """Blocks held at ``location`` (by ``source``, or by any source)."""
        if source is not None:
            return len(self._by_holder.get((source, location), ()))
        hashes: set[int] = set()
        for (_, loc), held in self._by_holder.items():
            if loc == location:
                hashes |= held
        return len(hashes)

    def match(self, sequence_hashes: Sequence[int], location: str | None = None) -> int:
        """Length of the longest prefix of ``sequence_hashes`` held as a linked chain: every
        block held (at ``location`` when given) and each one's parent the previous one."""
        n = 0
        prev: int | None = None
        for h in sequence_hashes:
            block = self._blocks.get(h)
            if block is None or (n and block.parent_hash != prev):
                break
            if location is not None and not any(loc == location for _, loc in block.holders):
                break
            n += 1
            prev = h
        return n

    def is_orphan(self, sequence_hash: int) -> bool:
        """The block is held but its parent is not."""
        block = self._blocks.get(sequence_hash)
        return block is not None and block.parent_hash is not None and block.parent_hash not in self._blocks

    def stats(self) -> TrackerStats:
        """A snapshot of the counters."""
        orphans = sum(1 for b in self._blocks.values() if b.parent_hash is not None and b.parent_hash not in self._blocks)
        return replace(self._stats, blocks=len(self._blocks), orphans=orphans)

    # ------------------------------------------------------------------ updates
    def apply_batch(self, batch: EventBatch) -> bool:
        """Apply a batch: epoch / duplicate checks, then each event in order.

        Returns:
            ``True`` if applied, ``False`` if ignored (stale epoch or seq already applied).
        """
        st = self._stats
        source = batch.source
        current = self._epochs.get(source)
        if current != batch.epoch:
            if batch.epoch in self._retired.get(source, ()):
                st.stale_batches += 1
                return False
            if current is not None:
                self._retired.setdefault(source, set()).add(current)
                st.restarts += 1
                for loc in self.volatile_locations:
                    self._clear(source, loc)
            self._epochs[source] = batch.epoch
            self._applied.pop(source, None)
        last = self._applied.get(source)
        if last is not None and batch.seq <= last:
            st.duplicate_batches += 1
            return False
        self._applied[source] = batch.seq
        for ev in batch.events:
            self.apply(source, ev)
        st.batches += 1
        return True

    def apply(self, source: str, event: KVEvent) -> None:
        """Apply one event of ``source`` (no epoch / seq checks: see :meth:`apply_batch`)."""
        kind = event.type
        if kind is _STORE or kind == _STORE:
            self._store(source, event)
        elif kind is _REMOVE or kind == _REMOVE:
            self._remove(source, event.sequence_hash, event.storage_location)
        elif kind == EventType.CLEARED:
            self._stats.clears += 1
            self._clear(source, event.storage_location)

    def forget_source(self, source: str) -> int:
        """Drop everything ``source`` holds (all locations), e.g. a decommissioned worker.
        Returns the number of (block, location) entries removed."""
        n = 0
        for src, loc in [h for h in self._by_holder if h[0] == source]:
            n += self._clear(src, loc)
        self._epochs.pop(source, None)
        self._applied.pop(source, None)
        return n

    # ------------------------------------------------------------------ internals
    def _store(self, source: str, ev: KVEvent) -> None:
        st = self._stats
        h, parent = ev.sequence_hash, ev.parent_hash
        if parent is not None and parent == h:
            st.self_parent += 1
            return
        holder = (source, ev.storage_location)
        block = self._blocks.get(h)
        if block is None and parent is not None and h in self._children and self._closes_cycle(h, parent):
            st.parent_cycle += 1
            return
        if block is None:
            block = TrackedBlock(h, parent, ev.prefix_hash, ev.block_size)
            self._blocks[h] = block
            if parent is not None:
                self._children.setdefault(parent, set()).add(h)
                if parent not in self._blocks:
                    st.orphan_stores += 1
            kids = self._children.get(h)
            if kids:
                st.orphans_linked += len(kids)
        elif holder in block.holders:
            st.duplicate_stores += 1
            return
        elif block.parent_hash != parent:  # re-stored with another lineage: latest wins
            self._cut()
            if block.parent_hash is not None:
                self._unlink(block.parent_hash, h)
            if parent is not None:
                self._children.setdefault(parent, set()).add(h)
            block.parent_hash = parent
        st.stores += 1
        block.holders.add(holder)
        self._by_holder.setdefault(holder, set()).add(h)

    def _closes_cycle(self, h: int, parent: int) -> bool:
        """Whether new block ``h`` under ``parent`` closes a parent cycle: the chain from
        ``parent`` reaches ``h`` within ``PARENT_WALK_LIMIT`` links (same answer as a walk
        of one link at a time, and as the advisor's index).

        ``h`` is not held, so the chain can reach it only from its top: the first block on
        it whose parent is not held. The walk goes there through the shortcuts of earlier
        walks (each ``(ancestor, links)``) and leaves a shortcut to the top on every block
        it passed, so a later walk from any of them costs O(1) (path compression, as in
        union-find) until a cut (see ``__init__``) clears them: amortized O(1) per Store
        on a stream that does not drop chained blocks from their middle.
        """
        blocks = self._blocks
        up = self._up
        gen = self._cut_gen
        x = parent
        links = 0  # links followed from ``parent`` to ``x``
        path: list[tuple[int, int]] = []  # (block passed, links from ``parent`` to it)
        while links < PARENT_WALK_LIMIT:
            block = blocks.get(x)
            if block is None:
                return False  # only ``parent`` itself can be missing: shortcuts lead to held blocks
            sc = up.get(x)
            if sc is not None and sc[2] == gen and sc[0] != x:
                if links + sc[1] >= PARENT_WALK_LIMIT:
                    # the blocks up to the shortcut's end are held, so none is ``h``: the walk
                    # would run out of links before it could reach ``h``
                    return False
                path.append((x, links))
                x, links = sc[0], links + sc[1]
                continue
            nxt = block.parent_hash
            if nxt is None:
                break
            if nxt == h:
                return True  # reached at link ``links + 1 <= PARENT_WALK_LIMIT``
            if nxt not in blocks:
                break  # ``x`` is the top and its parent is another hash
            path.append((x, links))
            self.cycle_walk_steps += 1
            x, links = nxt, links + 1
        else:
            return False  # the limit ran out first (a longer cycle is not detected)
        for node, at in path:  # every block passed now leads straight to the top ``x``
            up[node] = (x, links - at, gen)
        return False

    def _cut(self) -> None:
        """A held block with held children left, or a block changed parent: chains may
        have split, so every cycle-check shortcut is dropped."""
        self._cut_gen += 1
        if self._up:
            self._up.clear()

    def _remove(self, source: str, h: int, location: str) -> None:
        holder = (source, location)
        block = self._blocks.get(h)
        if block is None or holder not in block.holders:
            self._stats.unknown_removes += 1
            return
        self._stats.removes += 1
        self._drop_holder(block, holder)
        held = self._by_holder.get(holder)
        if held is not None:
            held.discard(h)
            if not held:
                del self._by_holder[holder]

    def _clear(self, source: str, location: str) -> int:
        holder = (source, location)
        hashes = self._by_holder.pop(holder, set())
        for h in hashes:
            block = self._blocks.get(h)
            if block is not None:
                self._drop_holder(block, holder)
        return len(hashes)

    def _drop_holder(self, block: TrackedBlock, holder: Holder) -> None:
        block.holders.discard(holder)
        if block.holders:
            return
        del self._blocks[block.sequence_hash]
        if self._up:
            self._up.pop(block.sequence_hash, None)
            if block.sequence_hash in self._children:
                self._cut()  # its children's chains no longer reach above it
        if block.parent_hash is not None:
            self._unlink(block.parent_hash, block.sequence_hash)

    def _unlink(self, parent: int, child: int) -> None:
        kids = self._children.get(parent)
        if kids is not None:
            kids.discard(child)
            if not kids:
                del self._children[parent]
