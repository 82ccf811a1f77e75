"""Executable specification of the pool's compiled core (``kvbm_runtime/_pool_core.pyx``).

The same :class:`InactiveSet` API and the same four per-block loops of the pool's batch
calls, in plain Python over ``OrderedDict`` levels; ``BlockPool`` runs on the compiled core
(:attr:`kvbm_runtime.pool.BlockPool._core`), a pool whose ``_core`` is this module runs the
same algorithm here.  ``tests/unit/test_runtime_pool_core_diff.py`` drives pools on both
through the same random operations and checks them equal.  The blocks and handles are the
compiled ones in both cases (``kvbm_runtime.block``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ._pool_core import new_immutable, new_mutable
from .block import Block, BlockMeta, BlockState, ImmutableBlock, MutableBlock, WeakBlock

if TYPE_CHECKING:
    from .pool import BlockPool

_LEVELS = 4
_COMPLETE = BlockState.COMPLETE
_REGISTERED = BlockState.REGISTERED


def _level(frequency: int) -> int:
    """Frequency class: <= 1 → 0, 2–3 → 1, 4–7 → 2, >= 8 → 3."""
    return 0 if frequency < 2 else (1 if frequency < 4 else (2 if frequency < 8 else 3))


class InactiveSet:
    """Multi-level LRU of the inactive registered blocks of one pool (see the compiled
    ``InactiveSet``): ``levels[k]`` holds the blocks of frequency class ``k`` in recency
    order (keys, identity-hashed; values unused)."""

    __slots__ = ("blocks", "levels")

    def __init__(self, blocks: Iterable[Block]) -> None:
        self.blocks = tuple(blocks)
        self.levels: list[OrderedDict[Block, None]] = [OrderedDict() for _ in range(_LEVELS)]

    def _check(self, b: Block) -> None:
        i = b.block_id
        if not 0 <= i < len(self.blocks) or self.blocks[i] is not b:
            raise ValueError(f"block {i} is not a block of this pool")

    def add(self, b: Block) -> None:
        """Insert at the recent end of its frequency level (nothing changes if present)."""
        self._check(b)
        if b not in self:
            self.levels[_level(b.frequency)][b] = None

    def discard(self, b: Block) -> None:
        """Take an inactive block out (``KeyError`` if it is not in the set)."""
        self._check(b)
        for level in self.levels:
            if b in level:
                del level[b]
                return
        raise KeyError(b)

    def extend(self, blocks: Iterable[Block]) -> None:
        """:meth:`add` each block, in order."""
        for b in blocks:
            self.add(b)

    def __contains__(self, b: object) -> bool:
        return any(b in level for level in self.levels)

    def pop_victim(self) -> Block | None:
        """The least recently used block of the lowest non-empty level, taken out."""
        for level in self.levels:
            if level:
                return level.popitem(last=False)[0]
        return None

    def __len__(self) -> int:
        return sum(map(len, self.levels))

    def level_len(self, k: int) -> int:
        """Blocks in level ``k`` (0..3)."""
        if not 0 <= k < _LEVELS:
            raise IndexError(f"level {k} is not 0..{_LEVELS - 1}")
        return len(self.levels[k])

    def order(self) -> list[int]:
        """Block ids in eviction order."""
        return [b.block_id for level in self.levels for b in level]


def allocate_complete(pool: BlockPool, metas: Iterable[BlockMeta]) -> tuple[list[MutableBlock], list[BlockMeta] | None, int]:
    """The per-block part of ``BlockPool.allocate_complete`` (lock held), room check
    included: ``(handles, identities of the Removes owed or None, blocks evicted)``."""
    metas = tuple(metas)  # any iterable, as the compiled core takes
    count = len(metas)
    reset = pool._reset
    n_reset = len(reset)
    if count > n_reset + pool._inactive.level_len(0):
        pool._check_room(count)
    out: list[MutableBlock] = []
    k = min(count, n_reset)
    for meta in metas[:k]:
        b = pool._blocks[reset.popleft()]
        b.meta = meta
        b.state = _COMPLETE
        out.append(new_mutable(pool, b))
    if count <= n_reset:
        return out, None, 0
    removes: list[BlockMeta] = []
    for meta in metas[k:]:
        b = pool._inactive.pop_victim()
        if b is None:
            raise RuntimeError(f"{pool.tier}: no inactive block left to evict")
        old = b.meta
        h = old.sequence_hash  # type: ignore[union-attr]
        if pool._dups and h in pool._dups:
            pool._unregister_copy(b)
        else:
            del pool._registry[h]
            removes.append(old)  # type: ignore[arg-type]
        b.generation += 1  # a new life: weak handles of the old one are dead
        if b.tokens:
            b.parent = None
            b.tokens = ()
        b.meta = meta
        b.state = _COMPLETE
        out.append(new_mutable(pool, b))
    return out, removes, count - k


def register_blocks(
    pool: BlockPool, blocks: Sequence[MutableBlock], strong: bool = True
) -> tuple[
    list[ImmutableBlock | Block | None], list[BlockMeta], list[tuple[int, MutableBlock, Block]] | None, int, Exception | None
]:
    """The per-block part of ``BlockPool.register_blocks`` (``strong``) and of
    ``BlockPool.register_downgrade`` (lock held): ``(out, stores, deferred, bad, error)``,
    see the compiled ``register_blocks``."""
    out: list[ImmutableBlock | Block | None] = []
    stores: list[BlockMeta] = []
    deferred: list[tuple[int, MutableBlock, Block]] | None = None
    for i, handle in enumerate(list(blocks)):
        if type(handle) is not MutableBlock:
            return out, stores, deferred, i, None
        b = handle._block
        if not handle._live or handle._pool is not pool or b is None or b.state is not _COMPLETE:
            return out, stores, deferred, i, None
        meta = b.meta
        try:
            existing = pool._registry.setdefault(meta.sequence_hash, b)  # type: ignore[union-attr]
        except Exception as exc:  # noqa: BLE001 - handed to the caller, which undoes and raises it
            return out, stores, deferred, i, exc
        handle._live = False
        if existing is b:
            b.state = _REGISTERED
            b.frequency = 1
            stores.append(meta)  # type: ignore[arg-type]
            b.ref_count = 1 if strong else 0
            out.append(new_immutable(pool, b) if strong else b)
        else:
            if deferred is None:
                deferred = []
            deferred.append((i, handle, existing))
            out.append(None)
    return out, stores, deferred, -1, None


def release_blocks(pool: BlockPool, handles: Sequence[ImmutableBlock]) -> int:
    """The per-block part of ``BlockPool.release_blocks`` (lock held): the number of
    handles released before the first that is not a live handle of ``pool``."""
    hs = list(handles)
    for i, h in enumerate(hs):
        if type(h) is not ImmutableBlock or not h._live or h._pool is not pool or h._block is None:
            return i
        b = h._block
        h._live = False
        rc = b.ref_count - 1
        if rc > 0:
            b.ref_count = rc
        elif rc == 0:  # the last strong ref: inactive, at its frequency level
            b.ref_count = 0
            pool._inactive.add(b)
    return len(hs)


def release_one(pool: BlockPool, block: Block) -> None:
    """The body of ``BlockPool._release(block)`` (lock held)."""
    rc = block.ref_count - 1
    if rc > 0:
        block.ref_count = rc
    elif rc == 0 and block.state is _REGISTERED:
        block.ref_count = 0
        pool._inactive.add(block)


def _lookup(pool: BlockPool, sequence_hashes: Iterable[int], prefix: bool) -> list[ImmutableBlock | None]:
    out: list[ImmutableBlock | None] = []
    for h in sequence_hashes:
        b = pool._registry.get(h)
        if b is None:
            if prefix:
                break
            out.append(None)
            continue
        if b.ref_count == 0:  # inactive → active
            pool._inactive.discard(b)
        b.ref_count += 1
        if prefix:
            b.frequency += 1
        out.append(new_immutable(pool, b))
    return out


def match_blocks(pool: BlockPool, sequence_hashes: Iterable[int]) -> list[ImmutableBlock]:
    """The body of ``BlockPool.match_blocks`` (lock held): stops at the first miss, each
    hit counts a use."""
    return _lookup(pool, sequence_hashes, True)  # type: ignore[return-value]


def get_many(pool: BlockPool, sequence_hashes: Iterable[int]) -> list[ImmutableBlock | None]:
    """The body of ``BlockPool.get_many`` (lock held): ``None`` per miss, no use counted."""
    return _lookup(pool, sequence_hashes, False)


def upgrade_weaks(pool: BlockPool, weaks: Sequence[WeakBlock], strong: bool) -> tuple[list | None, list[int] | None, int]:
    """The body of ``BlockPool.upgrade_many`` (``strong``) and ``BlockPool.pin_many``
    (lock held): ``(out, lost, bad)``, see the compiled ``upgrade_weaks``."""
    ws = list(weaks)
    for i, w in enumerate(ws):
        if w._pool is not pool:
            return None, None, i
    out: list = []
    lost: list[int] = []
    blocks = pool._inactive.blocks
    for i, w in enumerate(ws):
        b = w._block
        if not (type(b) is Block and 0 <= b.block_id < len(blocks) and blocks[b.block_id] is b) or (
            b.generation != w._generation or b.state is not _REGISTERED or b.meta.sequence_hash != w.sequence_hash
        ):  # not a block of this pool (only fails to upgrade), or an older life
            lost.append(i)
            if strong:
                out.append(None)
            continue
        if b.ref_count == 0:
            pool._inactive.discard(b)
        b.ref_count += 1
        b.frequency += 1
        out.append(new_immutable(pool, b) if strong else b)
    return out, lost, -1


def unpin_blocks(pool: BlockPool, blocks: Sequence[Block]) -> None:
    """The body of ``BlockPool.unpin_many`` (lock held)."""
    for b in list(blocks):
        rc = b.ref_count - 1
        b.ref_count = rc
        if rc == 0:
            pool._inactive.add(b)
