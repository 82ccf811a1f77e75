"""Block lifecycle states and the handles engines hold (docs/design.md §5).

States::

    Reset --init_sequence(salt)--> Partial --commit() (full)--> Complete --register()--> Registered
    Reset --init_from(meta)--> Complete          (a copy of a block of another tier)

Handles:

* :class:`MutableBlock` — exclusive handle on a Reset / Partial / Complete block.  Every
  transition returns a *new* handle and consumes the old one; using a consumed handle
  raises :class:`ConsumedHandleError`.  Dropping (or :meth:`MutableBlock.release`) a
  mutable handle returns the block to the pool's Reset list.
* :class:`ImmutableBlock` — strong reference to a Registered block; while one exists the
  block is *active* and cannot be evicted.  Dropping the last one (or ``release()``)
  moves the block to the *inactive* set, where it stays matchable until evicted.
* :class:`WeakBlock` — does not keep the block alive; :meth:`WeakBlock.upgrade` returns a
  new strong handle only while the block still holds the same registered identity, never
  after it was evicted (even if the physical block was reused for the same hash).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec

from .errors import BlockMetaError, BlockStateError

if TYPE_CHECKING:
    from .pool import BlockPool


class BlockState(enum.Enum):
    """Lifecycle state of a physical block."""

    RESET = "reset"
    PARTIAL = "partial"
    COMPLETE = "complete"
    REGISTERED = "registered"


@dataclass(frozen=True, slots=True)
class BlockMeta:
    """Identity of a full block, the same at every tier.

    Attributes:
        sequence_hash: positional lineage hash (u64, docs/design.md §4).
        parent_hash: sequence hash of the previous block of the sequence, ``None`` for the first.
        prefix_hash: sequence hash of the first block of the sequence.
        salt: salt hash the local hash was seeded with.

    Raises:
        BlockMetaError: a hash is not an ``int`` in [0, 2**64) (``parent_hash`` may be
            ``None``).
        BlockStateError: ``parent_hash == sequence_hash``.
    """

    sequence_hash: int
    parent_hash: int | None
    prefix_hash: int
    salt: int

    def __post_init__(self) -> None:
        # Checked once here, where the identity is made: every Store / Remove event a pool
        # or transfer builds from it is then well-formed by construction (u64 hashes) and
        # goes to the publisher without being checked again (``publish_valid``).
        s, p, par = self.sequence_hash, self.prefix_hash, self.parent_hash
        if type(s) is not int or type(p) is not int or (s | p) >> 64 or (  # noqa: E721 - bool is not a hash
            par is not None and (type(par) is not int or par >> 64)  # noqa: E721
        ):
            raise BlockMetaError(
                "sequence_hash, prefix_hash and parent_hash must be ints in [0, 2**64) "
                f"(parent_hash may be None), got {s!r}, {p!r}, {par!r}"
            )
        if par is not None and par == s:
            raise BlockStateError(f"block {s:#x} cannot be its own parent")


# The block slot and the strong / mutable handles are extension types (compiled core of
# the pool, kvbm_runtime/_pool_core.pyx): C fields for the pool's hot loops, and handles whose
# "dropped while live" rule runs at deallocation in C instead of a Python ``__del__``.  The
# module imports BlockState and BlockMeta from here, so they are defined above this line.
from ._pool_core import Block, ImmutableBlock, MutableBlock  # noqa: E402


class WeakBlock(msgspec.Struct, eq=False):
    """Weak reference to a Registered block; never keeps it alive or resurrects it.

    Construct as ``WeakBlock(pool, block, generation, sequence_hash)`` (handles and pools do).
    Tracked by the cycle collector: it refers to its pool, and a cycle through the pool (a
    sink keeping weak handles of the pool it is the sink of) must be collectable.

    Attributes:
        sequence_hash: hash of the block it refers to.
    """

    _pool: BlockPool
    _block: Block
    _generation: int
    sequence_hash: int

    def upgrade(self) -> ImmutableBlock | None:
        """A new strong handle while the block is still registered with this identity
        (active or inactive), else ``None``."""
        return self._pool._upgrade(self._block, self._generation, self.sequence_hash)

    @property
    def alive(self) -> bool:
        """Whether :meth:`upgrade` would succeed now."""
        b = self._block
        return b.generation == self._generation and b.state is BlockState.REGISTERED

    def __repr__(self) -> str:
        return f"WeakBlock(tier={self._pool.tier}, hash={self.sequence_hash:#018x}, alive={self.alive})"


class PinnedBlocks:
    """References on many blocks of one pool, taken by
    :meth:`~kvbm_runtime.pool.BlockPool.pin_many` without a strong handle per block (the
    transfer paths pin their sources for the length of a copy).  While pinned, a block is
    active and cannot be evicted.  Give them back once, with
    :meth:`~kvbm_runtime.pool.BlockPool.unpin_many` or :meth:`release`; pins dropped
    without that are given back when the object is collected.

    Attributes:
        lost: indices (in the ``pin_many`` input) of the weak handles whose block was
            evicted or reused since; those were not pinned.
    """

    __slots__ = ("_pool", "_blocks", "_live", "lost")

    def __init__(self, pool: BlockPool, blocks: list[Block], lost: list[int]) -> None:
        self._pool = pool
        self._blocks = blocks
        self._live = True
        self.lost = lost

    def __len__(self) -> int:
        """Blocks pinned."""
        return len(self._blocks)

    @property
    def consumed(self) -> bool:
        """True once the pins were given back."""
        return not self._live

    def release(self) -> None:
        """Give the pins back (``pool.unpin_many(self)``).

        Raises:
            ConsumedHandleError: already given back.
        """
        self._pool.unpin_many(self)

    def __del__(self) -> None:
        try:
            if self._live:
                self._pool.unpin_many(self)
        except Exception:  # noqa: BLE001 - half-built, interpreter shutdown, pool gone
            pass

    def __repr__(self) -> str:
        state = "released" if not self._live else f"{len(self._blocks)} pinned, {len(self.lost)} lost"
        return f"PinnedBlocks(tier={self._pool.tier}, {state})"
