"""Block lifecycle states and the handles engines hold (DESIGN.md §5).

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
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

import msgspec
import numpy as np
import torch

from .errors import BlockMetaError, BlockStateError, ConsumedHandleError
from .hashing import chain_hash, local_hash

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
        sequence_hash: positional lineage hash (u64, DESIGN.md §4).
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


class Block:
    """A physical block slot of a pool; engines never hold it directly, only handles.

    A plain ``__slots__`` class (not a dataclass): the pool touches these attributes on
    every allocate / register / match / release, in batches, under its lock.

    Attributes:
        block_id: index in the pool's layout.
        state: lifecycle state.
        generation: +1 every time the block returns to Reset (invalidates weak handles).
        salt: salt hash of a Partial block (``init_sequence``); a Complete or Registered
            block's salt is ``meta.salt``.
        parent: metadata of the parent block (``None`` for the first block of a sequence).
        tokens: token ids appended while Partial (an empty tuple when none were).
        meta: identity once Complete / Registered.
        ref_count: live :class:`ImmutableBlock` handles (Registered only).
        frequency: uses since registration (register, dedup hit, match).
    """

    __slots__ = ("block_id", "state", "generation", "salt", "parent", "tokens", "meta", "ref_count", "frequency")

    def __init__(self, block_id: int) -> None:
        self.block_id = block_id
        self.state = BlockState.RESET
        self.generation = 0
        self.salt: int | None = None
        self.parent: BlockMeta | None = None
        self.tokens: list[int] | tuple[()] = ()
        self.meta: BlockMeta | None = None
        self.ref_count = 0
        self.frequency = 0

    def clear(self) -> None:
        """Back to Reset (the pool calls this; bumps the generation)."""
        self.state = BlockState.RESET
        self.generation += 1
        self.salt = None
        self.parent = None
        self.tokens = ()
        self.meta = None
        self.ref_count = 0
        self.frequency = 0

    def __repr__(self) -> str:
        return f"Block(id={self.block_id}, {self.state.value}, gen={self.generation}, refs={self.ref_count})"


class _Handle(msgspec.Struct, eq=False, gc=False):
    """Common part of the handles: the pool, the block and a live (not consumed) flag.

    A ``msgspec.Struct`` for its C-level constructor: the pool creates one handle per block
    on every allocate / register / match, so construction cost is the per-block cost.
    ``eq=False``: handles compare and hash by identity.  ``gc=False``: a handle refers to
    its pool and block only, never to itself or another handle, so it cannot be part of a
    reference cycle and the cycle collector need not track it.

    Construct as ``MutableBlock(pool, block)`` / ``ImmutableBlock(pool, block)`` (pools do).
    """

    _pool: BlockPool
    _block: Block
    _live: bool = True

    def _get(self) -> Block:
        if not self._live:
            raise ConsumedHandleError(f"{type(self).__name__} of block {self._block.block_id} was already consumed")
        return self._block

    def _consume(self) -> Block:
        block = self._get()
        self._live = False
        return block

    @property
    def consumed(self) -> bool:
        """True once a transition or release consumed this handle."""
        return not self._live

    @property
    def block_id(self) -> int:
        """Index of the block in its pool's layout."""
        return self._get().block_id

    @property
    def tier(self) -> str:
        """Tier name of the owning pool (``"g1"``, ``"g2"``)."""
        return self._pool.tier

    def view(self) -> torch.Tensor:
        """Typed ``[num_layers, outer_dim, page_size, inner_dim]`` view of the block's data."""
        return self._pool.layout.block_view(self._get().block_id)


class MutableBlock(_Handle):
    """Exclusive handle on a Reset, Partial or Complete block (see module doc)."""

    @property
    def state(self) -> BlockState:
        """Current state of the block."""
        return self._get().state

    @property
    def tokens(self) -> tuple[int, ...]:
        """Token ids appended so far."""
        return tuple(self._get().tokens)

    @property
    def meta(self) -> BlockMeta | None:
        """Identity once Complete, else ``None``."""
        return self._get().meta

    @property
    def sequence_hash(self) -> int | None:
        """Sequence hash once Complete, else ``None``."""
        meta = self._get().meta
        return None if meta is None else meta.sequence_hash

    def _transition(self, block: Block) -> MutableBlock:
        self._live = False
        return MutableBlock(self._pool, block)

    def init_sequence(self, salt: int, parent: BlockMeta | None = None) -> MutableBlock:
        """Reset → Partial: start a block of a sequence under ``salt``.

        Args:
            salt: salt hash (``hashing.salt_hash``) seeding the local hash.
            parent: identity of the previous full block of the sequence; ``None`` for the
                first block.  Must have been produced under the same salt.

        Returns:
            The new (Partial) handle; this one is consumed.

        Raises:
            BlockStateError: the block is not Reset, or ``parent`` has another salt.
            ConsumedHandleError: this handle was consumed.
        """
        block = self._get()
        if block.state is not BlockState.RESET:
            raise BlockStateError(f"init_sequence needs a Reset block, block {block.block_id} is {block.state.value}")
        if parent is not None and parent.salt != salt:
            raise BlockStateError("parent block was hashed under another salt")
        block.salt = salt
        block.parent = parent
        block.tokens = []
        block.state = BlockState.PARTIAL
        return self._transition(block)

    def append_tokens(self, tokens: Sequence[int] | np.ndarray) -> int:
        """Append token ids to a Partial block (not a transition: the handle stays valid).

        Returns:
            Free token slots left.

        Raises:
            BlockStateError: the block is not Partial, or the tokens would overflow it
                (nothing is appended then).
        """
        block = self._get()
        if block.state is not BlockState.PARTIAL:
            raise BlockStateError(f"append_tokens needs a Partial block, block {block.block_id} is {block.state.value}")
        items = [int(t) for t in np.asarray(tokens).reshape(-1)]
        room = self._pool.page_size - len(block.tokens)
        if len(items) > room:
            raise BlockStateError(f"{len(items)} tokens do not fit: block {block.block_id} has room for {room}")
        toks = block.tokens
        assert isinstance(toks, list)  # init_sequence gave the Partial block a list
        toks.extend(items)
        return room - len(items)

    def commit(self) -> MutableBlock:
        """Partial → Complete: the block must be full; computes its sequence hash.

        Returns:
            The new (Complete) handle; this one is consumed.

        Raises:
            BlockStateError: not Partial, or fewer than ``page_size`` tokens (partial
                blocks are never registered, case C10).
        """
        block = self._get()
        if block.state is not BlockState.PARTIAL:
            raise BlockStateError(f"commit needs a Partial block, block {block.block_id} is {block.state.value}")
        if len(block.tokens) != self._pool.page_size:
            raise BlockStateError(
                f"commit needs a full block: {len(block.tokens)} of {self._pool.page_size} tokens"
            )
        assert block.salt is not None
        parent = block.parent
        seq = chain_hash(None if parent is None else parent.sequence_hash, local_hash(block.tokens, block.salt))
        block.meta = BlockMeta(
            sequence_hash=seq,
            parent_hash=None if parent is None else parent.sequence_hash,
            prefix_hash=seq if parent is None else parent.prefix_hash,
            salt=block.salt,
        )
        block.state = BlockState.COMPLETE
        return self._transition(block)

    def init_from(self, meta: BlockMeta) -> MutableBlock:
        """Reset → Complete with a known identity (the block is a copy of a block of
        another tier, e.g. onboarding G2 → G1 or offloading G1 → G2).

        The caller copies the data into :meth:`view` before registering.

        Raises:
            BlockStateError: the block is not Reset.
        """
        block = self._get()
        if block.state is not BlockState.RESET:
            raise BlockStateError(f"init_from needs a Reset block, block {block.block_id} is {block.state.value}")
        block.salt = meta.salt
        block.meta = meta
        block.state = BlockState.COMPLETE
        return self._transition(block)

    def release(self) -> None:
        """Give the block back to the pool's Reset list (consumes the handle)."""
        block = self._consume()
        self._pool._reset_block(block)

    def __del__(self) -> None:
        try:
            if not self._live:
                return
            self._live = False
            self._pool._reset_block(self._block)
        except Exception:  # noqa: BLE001 - half-built handle, interpreter shutdown, pool gone
            pass

    def __repr__(self) -> str:
        state = "consumed" if not self._live else self._block.state.value
        return f"MutableBlock(tier={self._pool.tier}, id={self._block.block_id}, {state})"


class ImmutableBlock(_Handle):
    """Strong reference to a Registered block (see module doc)."""

    @property
    def meta(self) -> BlockMeta:
        """Identity of the block."""
        meta = self._get().meta
        assert meta is not None
        return meta

    @property
    def sequence_hash(self) -> int:
        """Sequence hash of the block."""
        return self.meta.sequence_hash

    def clone(self) -> ImmutableBlock:
        """Another strong reference to the same block."""
        block = self._get()
        self._pool._acquire(block, touch=False)
        return ImmutableBlock(self._pool, block)

    def weak(self) -> WeakBlock:
        """A weak reference; this strong handle stays valid."""
        block = self._get()
        return WeakBlock(self._pool, block, block.generation, self.sequence_hash)

    def downgrade(self) -> WeakBlock:
        """Strong → weak: returns a weak handle and releases (consumes) this one."""
        weak = self.weak()
        self.release()
        return weak

    def release(self) -> None:
        """Drop this strong reference (consumes the handle); the last one makes the
        block inactive (still matchable, evictable).

        Raises:
            ConsumedHandleError: this handle was consumed.
        """
        if not self._live:
            raise ConsumedHandleError(f"ImmutableBlock of block {self._block.block_id} was already consumed")
        self._live = False
        self._pool._release(self._block)

    def __enter__(self) -> ImmutableBlock:
        return self

    def __exit__(self, *exc: object) -> None:
        if self._live:
            self.release()

    def __del__(self) -> None:
        try:
            if not self._live:
                return
            self._live = False
            self._pool._release(self._block)
        except Exception:  # noqa: BLE001 - half-built handle, interpreter shutdown, pool gone
            pass

    def __repr__(self) -> str:
        if not self._live:
            return f"ImmutableBlock(tier={self._pool.tier}, id={self._block.block_id}, consumed)"
        return f"ImmutableBlock(tier={self._pool.tier}, id={self._block.block_id}, hash={self.sequence_hash:#018x})"


class WeakBlock(msgspec.Struct, eq=False, gc=False):
    """Weak reference to a Registered block; never keeps it alive or resurrects it.

    Construct as ``WeakBlock(pool, block, generation, sequence_hash)`` (handles and pools do).

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
