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

# The block slot and the strong / mutable handles are extension types (compiled core of
# the pool, kvbm_runtime/_pool_core.pyx): C fields for the pool's hot loops, and handles whose
# "dropped while live" rule runs at deallocation in C instead of a Python ``__del__``.
from ._pool_core import Block, ImmutableBlock, MutableBlock
from .block_state import BlockMeta, BlockState, HandlePool, WeakBlock

__all__ = ["Block", "BlockMeta", "BlockState", "ImmutableBlock", "MutableBlock", "PinnedBlocks", "WeakBlock"]


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

    def __init__(self, pool: HandlePool, blocks: list[Block], lost: list[int]) -> None:
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
