"""Partitioning of the prefix index across advisors (scaled mode, docs/design.md §8).

A request's blocks form a chain: block ``d`` (0-based depth) is named by its sequence hash,
which covers its tokens and every block before it (docs/design.md §4).  The cluster splits
the index into ``partitions`` by the chain's structure, so that

* every block lives in exactly one partition (except the *trunk*, kept by all), and
* the longest-prefix answer stays exact: a lookup asks the owner of each piece of the
  chain, in order, and stops where a piece is not fully held.

The scheme (:class:`PartitionScheme`):

* **Trunk.** Blocks at depth ``< trunk_depth`` go to every partition.  Real traffic shares
  its first blocks (a system prompt: every request of the Mooncake traces starts with the
  same block), so a key taken from the first block would put everything in one partition.
* **Stretches.** Deeper blocks are cut into stretches of ``stretch`` blocks: depths
  ``[K, K+S)``, ``[K+S, K+2S)``, … (``K = trunk_depth``, ``S = stretch``).  A stretch goes
  to the partition of its *head*, its first block: ``xxh3_64(head hash, little-endian u64)
  mod partitions``.  The head's sequence hash names the whole prefix above it, so every
  request that shares the prefix up to a stretch's end finds that stretch in one place.

Why stretches rather than one ancestor at depth K for the whole chain: agentic sessions
(the WEKA traces) are long chains that grow turn by turn, so routing a whole chain by one
ancestor makes a partition as big as the biggest session.  Measured with
``bench/partition_skew.py`` at 8 partitions (most-loaded partition / mean, trunk
excluded), Mooncake conversation / WEKA: by the first block 8.00 / 1.75, by the ancestor
at depth 1 1.12 / 1.29, by stretches of 64 after a trunk of 1 1.09 / 1.04.  The price is
one piece per ``stretch`` blocks of matched prefix in a lookup (2.1 per Mooncake request,
35 per WEKA request, whose chains run to thousands of 64-token blocks); the pieces of one
partition go to it together, so a lookup asks at most ``partitions`` advisors.

Publishers route each Store/Remove to its partition with :class:`ChainRouter`, which learns
each block's depth and stretch head from its parent; Cleared goes to every partition.
Lookups are routed with :meth:`PartitionScheme.pieces` and combined with
:func:`combine_lookups`.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field

import xxhash

__all__ = [
    "TRUNK", "ChainRouter", "PartitionError", "PartitionScheme", "Piece", "RouterStats", "combine_lookups",
    "partitioned_lookup",
]

TRUNK = -1
"""Partition id of trunk blocks: kept by every partition."""

MAX_PARTITIONS = 4096
_M64 = (1 << 64) - 1


class PartitionError(ValueError):
    """A partition scheme with impossible parameters, or a hash that is not a u64."""


@dataclass(frozen=True, slots=True)
class Piece:
    """A run of a chain owned by one partition: ``hashes[start:end]`` (``partition`` is
    :data:`TRUNK` for the trunk, else 0 … partitions − 1)."""

    partition: int
    start: int
    end: int


@dataclass(frozen=True, slots=True)
class PartitionScheme:
    """How blocks map to partitions.

    Attributes:
        partitions: number of partitions, 1 … 4096.
        trunk_depth: blocks at depth ``< trunk_depth`` (0-based) are the trunk, kept by
            every partition (``>= 0``; 0 = no trunk).
        stretch: blocks per stretch below the trunk (``>= 1``); a stretch is owned by the
            partition of its first block's sequence hash.

    Raises:
        PartitionError: a parameter out of range.
    """

    partitions: int
    trunk_depth: int = 1
    stretch: int = 64

    def __post_init__(self) -> None:
        for name, v, lo, hi in (("partitions", self.partitions, 1, MAX_PARTITIONS),
                                ("trunk_depth", self.trunk_depth, 0, 1 << 20),
                                ("stretch", self.stretch, 1, 1 << 20)):
            if v.__class__ is not int or not lo <= v <= hi:
                raise PartitionError(f"partition scheme: {name}={v!r} must be an int in [{lo}, {hi}]")

    def partition_of_head(self, head_hash: int) -> int:
        """Partition owning the stretch whose first block has sequence hash ``head_hash``
        (u64): ``xxh3_64(head_hash as 8 little-endian bytes) % partitions``.

        Raises:
            PartitionError: ``head_hash`` is not an int in [0, 2**64).
        """
        if head_hash.__class__ is not int or not 0 <= head_hash <= _M64:
            raise PartitionError(f"sequence hash {head_hash!r} is not a u64")
        return xxhash.xxh3_64_intdigest(head_hash.to_bytes(8, "little")) % self.partitions

    def head_depth(self, depth: int) -> int | None:
        """Depth of the head of the stretch holding depth ``depth``; ``None`` in the trunk."""
        k = self.trunk_depth
        if depth < k:
            return None
        return k + ((depth - k) // self.stretch) * self.stretch

    def is_head(self, depth: int) -> bool:
        """Whether a block at ``depth`` starts a stretch (its own hash picks the partition)."""
        return depth >= self.trunk_depth and (depth - self.trunk_depth) % self.stretch == 0

    def pieces(self, hashes: Sequence[int]) -> list[Piece]:
        """Cut a chain (sequence hashes, first block first) into the pieces each partition
        owns, in chain order: at most one :data:`TRUNK` piece, then one per stretch.

        Raises:
            PartitionError: a stretch head is not a u64.
        """
        n = len(hashes)
        out: list[Piece] = []
        k = min(self.trunk_depth, n)
        if k:
            out.append(Piece(TRUNK, 0, k))
        start = k
        while start < n:
            end = min(start + self.stretch, n)
            out.append(Piece(self.partition_of_head(hashes[start]), start, end))
            start = end
        return out

    def owners(self, hashes: Sequence[int]) -> list[int]:
        """Partition of every block of a chain (:data:`TRUNK` for trunk blocks)."""
        out: list[int] = []
        for p in self.pieces(hashes):
            out.extend([p.partition] * (p.end - p.start))
        return out


def combine_lookups(pieces: Sequence[Piece], answers: Sequence[Mapping[str, int]]) -> dict[str, int]:
    """Combine per-piece longest-prefix answers into the chain's answer.

    Args:
        pieces: the chain's pieces, in order (:meth:`PartitionScheme.pieces`).
        answers: for each piece, its owner's ``PrefixIndex.lookup(hashes[start:end])``:
            ``{location: n}`` with ``1 <= n <= end - start``.

    Returns:
        ``{location: n}`` as one index holding every block would answer: a location's
        prefix runs on through a piece only while the previous pieces were held whole.
    """
    result: dict[str, int] = {}
    alive: set[str] | None = None  # locations that held every previous piece whole
    offset = 0
    for piece, ans in zip(pieces, answers):
        length = piece.end - piece.start
        nxt: set[str] = set()
        for loc, n in ans.items():
            if alive is not None and loc not in alive:
                continue
            result[loc] = offset + n
            if n == length:
                nxt.add(loc)
        alive = nxt
        offset += length
        if not alive:
            break
    return result


def partitioned_lookup(scheme: PartitionScheme, hashes: Sequence[int],
                       lookup: Callable[[int, Sequence[int]], Mapping[str, int]]) -> dict[str, int]:
    """Longest cached prefix of a chain at each location, across partitions.

    Args:
        scheme: the cluster's scheme.
        hashes: the chain's sequence hashes, first block first.
        lookup: ``lookup(partition, piece_hashes) -> {location: n}``, the owner's answer
            (the trunk piece is asked of the first stretch's owner, or partition 0).

    Returns:
        ``{location: n}`` as for ``PrefixIndex.lookup``.  Pieces after the first one no
        location held whole are not asked.
    """
    pieces = scheme.pieces(hashes)
    trunk_owner = next((p.partition for p in pieces if p.partition != TRUNK), 0)
    answers: list[Mapping[str, int]] = []
    done: list[Piece] = []
    for p in pieces:
        owner = trunk_owner if p.partition == TRUNK else p.partition
        ans = lookup(owner, hashes[p.start:p.end])
        answers.append(ans)
        done.append(p)
        if not any(n == p.end - p.start for n in ans.values()):
            break
    return combine_lookups(done, answers)


@dataclass(slots=True)
class RouterStats:
    """Counters of a :class:`ChainRouter`: ``routed`` Stores and Removes, ``unrooted``
    Stores whose parent it did not know (routed as a stretch head of their own: a lookup of
    that chain finds them only from there), ``forgotten`` blocks dropped at the size bound."""

    routed: int = 0
    unrooted: int = 0
    forgotten: int = 0


@dataclass(slots=True)
class _Place:
    depth: int
    partition: int


@dataclass
class ChainRouter:
    """Routes a publisher's Store/Remove events to partitions from parent links alone.

    Keeps, per block it has routed, its depth and partition (about 100 bytes a block in
    CPython), at most ``max_blocks`` of them (least recently routed dropped first).  A
    block whose parent is known sits one level below it and stays in the parent's stretch
    unless it starts a new one; a block without a parent is at depth 0 (the trunk when
    ``trunk_depth > 0``).

    Raises (from :meth:`route_store`): PartitionError for a hash that is not a u64.
    """

    scheme: PartitionScheme
    max_blocks: int = 1 << 22
    stats: RouterStats = field(default_factory=RouterStats)
    _places: OrderedDict[int, _Place] = field(default_factory=OrderedDict, repr=False)

    def route_store(self, sequence_hash: int, parent_hash: int | None) -> int:
        """Partition of a Store of ``sequence_hash`` (:data:`TRUNK`: every partition)."""
        place = self._places.get(sequence_hash)
        if place is None:
            parent = None if parent_hash is None else self._places.get(parent_hash)
            if parent is not None:
                depth = parent.depth + 1
            elif parent_hash is None:
                depth = 0
            else:  # lineage unknown here: start a stretch of its own below the trunk
                self.stats.unrooted += 1
                depth = self.scheme.trunk_depth
            if depth < self.scheme.trunk_depth:
                part = TRUNK
            elif parent is None or self.scheme.is_head(depth) or parent.partition == TRUNK:
                part = self.scheme.partition_of_head(sequence_hash)
            else:
                part = parent.partition
            place = _Place(depth, part)
            self._places[sequence_hash] = place
            if len(self._places) > self.max_blocks:
                self._places.popitem(last=False)
                self.stats.forgotten += 1
        else:
            self._places.move_to_end(sequence_hash)
        self.stats.routed += 1
        return place.partition

    def route_remove(self, sequence_hash: int) -> int | None:
        """Partition of a Remove of ``sequence_hash``; ``None`` if this router never routed
        its Store (or forgot it): send it to every partition."""
        place = self._places.get(sequence_hash)
        self.stats.routed += 1
        return None if place is None else place.partition

    def forget(self, sequence_hash: int) -> None:
        """Drop what the router knows of a block (it is gone from every location)."""
        self._places.pop(sequence_hash, None)

    def __len__(self) -> int:
        return len(self._places)
