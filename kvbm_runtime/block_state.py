"""The parts of a block that the compiled pool core and the pool both need: its lifecycle
state, its identity (:class:`BlockMeta`) and the weak handle (docs/design.md §5).

:mod:`kvbm_runtime.block` re-exports all of them with the compiled slot and handles; import
them from there.  They live here so that the compiled core (``kvbm_runtime/_pool_core.pyx``)
imports them without importing :mod:`kvbm_runtime.block`, which imports the core.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any, Protocol

import msgspec

from .errors import BlockMetaError, BlockStateError


class HandlePool(Protocol):
    """What a handle calls on the pool it came from (:class:`~kvbm_runtime.pool.BlockPool`)."""

    tier: Any

    def _upgrade(self, block: Any, generation: int, sequence_hash: int) -> Any:
        """A strong handle on ``block`` while it still holds this identity, else ``None``."""

    def unpin_many(self, pinned: Any) -> None:
        """Give back the pins of ``pinned`` (a :class:`~kvbm_runtime.block.PinnedBlocks`)."""


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


class WeakBlock(msgspec.Struct, eq=False):
    """Weak reference to a Registered block; never keeps it alive or resurrects it.

    Construct as ``WeakBlock(pool, block, generation, sequence_hash)`` (handles and pools do).
    Tracked by the cycle collector: it refers to its pool, and a cycle through the pool (a
    sink keeping weak handles of the pool it is the sink of) must be collectable.

    Attributes:
        sequence_hash: hash of the block it refers to.
    """

    _pool: HandlePool
    _block: Any  # the compiled slot, kvbm_runtime._pool_core.Block
    _generation: int
    sequence_hash: int

    def upgrade(self) -> Any:
        """A new strong handle while the block is still registered with this identity
        (active or inactive), else ``None`` (an ``ImmutableBlock``)."""
        return self._pool._upgrade(self._block, self._generation, self.sequence_hash)

    @property
    def alive(self) -> bool:
        """Whether :meth:`upgrade` would succeed now."""
        b = self._block
        return b.generation == self._generation and b.state is BlockState.REGISTERED

    def __repr__(self) -> str:
        return f"WeakBlock(tier={self._pool.tier}, hash={self.sequence_hash:#018x}, alive={self.alive})"
