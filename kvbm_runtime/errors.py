"""Errors the runtime raises on purpose (one class per kind of misuse or failure)."""

from __future__ import annotations


class KvbmError(RuntimeError):
    """Base class of every error ``kvbm_runtime`` raises on purpose."""


class BlockStateError(KvbmError):
    """An operation is not allowed in the block's current lifecycle state (docs/design.md §5).

    Examples: ``commit()`` on a Reset block or on a Partial block that is not full,
    ``register()`` of a Partial block, ``init_sequence()`` on a Partial block.
    """


class ConsumedHandleError(BlockStateError):
    """A handle was used after a transition consumed it, or after it was released."""


class BlockMetaError(KvbmError, ValueError):
    """A block identity (``BlockMeta``) has a hash that is not an ``int`` in [0, 2**64)."""


class PoolExhaustedError(KvbmError):
    """Not enough Reset or evictable (inactive) blocks to satisfy an allocation.

    Nothing is allocated when this is raised (allocations are all-or-nothing).
    """


class LayoutConfigError(KvbmError, ValueError):
    """A layout description is invalid (non-positive dims, alignment not a power of two...)."""


class CapacityConfigError(KvbmError, ValueError):
    """Tier capacities shrink from G1 to G2 (or G2 to G3); refused at start-up."""


class StorageTierError(KvbmError):
    """The G3/G4 storage tier is used but no storage agent / volume was configured."""
