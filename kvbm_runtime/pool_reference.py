"""Executable specification of the pool's compiled core (``kvbm_runtime/_pool_core.pyx``).

The same :class:`InactiveSet` API and the same four per-block loops of the pool's batch
calls, in plain Python over ``OrderedDict`` levels; ``BlockPool`` runs on the compiled core
(:attr:`kvbm_runtime.pool.BlockPool._core`), a pool whose ``_core`` is this module runs the
same algorithm here (the same results; not the compiled core's atomicity: a finalizer
can run between two Python lines of a function here).
``tests/unit/test_runtime_pool_core_diff.py`` drives pools on both through the same random
operations and checks them equal.  The blocks and handles are the
compiled ones in both cases (``kvbm_runtime.block``).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING

from ._pool_core import new_immutable, new_mutable
from .block import Block, BlockMeta, BlockState, ImmutableBlock, MutableBlock, WeakBlock
from .errors import BlockStateError

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


def _unregister(pool: BlockPool, b: Block, h: int) -> bool:
    """Take registered block ``b`` (hash ``h``) out of the registry / its duplicate copies;
    True when it was the hash's last copy (a Remove is owed)."""
    extra = pool._dups.get(h) if pool._dups else None
    if pool._registry.get(h) is b:
        if not extra:
            del pool._registry[h]
            return True
        pool._registry[h] = extra.pop(0)
    else:
        if extra is None:
            raise RuntimeError(f"block {b.block_id} is registered under {h:#x} but the registry does not name it")
        extra.remove(b)
    if not extra:
        del pool._dups[h]
    return False


def _reset_one(pool: BlockPool, b: Block) -> None:
    """Back to Reset (generation + 1) and onto the Reset list."""
    b.clear()
    pool._reset.append(b.block_id)


def _take(pool: BlockPool, count: int, metas: tuple[BlockMeta, ...] | None) -> tuple[list[MutableBlock], list[BlockMeta] | None, int]:
    """``count`` blocks, Reset ones first (the list re-read per block), then evicted
    inactive ones (lowest level first), each given identity ``metas[i]`` as a Complete
    block or (``metas`` is ``None``) left Reset: ``(handles, Removes owed or None,
    evicted)``, no handle when the pool ran out part-way (the blocks taken back on the
    Reset list)."""
    reset = pool._reset
    if count > len(reset) + pool._inactive.level_len(0):
        pool._check_room(count)
    out: list[MutableBlock] = []
    removes: list[BlockMeta] | None = None
    evicted = 0
    for i in range(count):
        if reset:
            b = pool._blocks[reset.popleft()]
        else:
            b = pool._inactive.pop_victim()
            if b is None:
                for h in out:
                    h._live = False
                    _reset_one(pool, h._block)
                return [], removes, evicted
            old = b.meta
            if _unregister(pool, b, old.sequence_hash):  # type: ignore[union-attr]
                removes = removes if removes is not None else []
                removes.append(old)  # type: ignore[arg-type]
            evicted += 1
            b.clear()  # a new life: weak handles of the old one are dead
        if metas is not None:
            b.meta = metas[i]
            b.state = _COMPLETE
        out.append(new_mutable(pool, b))
    return out, removes, evicted


def allocate_complete(pool: BlockPool, metas: Iterable[BlockMeta]) -> tuple[list[MutableBlock], list[BlockMeta] | None, int]:
    """The per-block part of ``BlockPool.allocate_complete`` (lock held), room check
    included: ``(handles, identities of the Removes owed or None, blocks evicted)``."""
    ms = tuple(metas)  # any iterable, as the compiled core takes
    return _take(pool, len(ms), ms)


def allocate_reset(pool: BlockPool, count: int) -> tuple[list[MutableBlock], list[BlockMeta] | None, int]:
    """The body of ``BlockPool.allocate`` (lock held): Reset blocks."""
    return _take(pool, count, None)


def reset_block(pool: BlockPool, block: Block) -> None:
    """The body of ``BlockPool._reset_block`` (lock held)."""
    if block.state is not _REGISTERED:
        _reset_one(pool, block)


def evict_blocks(pool: BlockPool, count: int) -> tuple[list[BlockMeta], int]:
    """The body of ``BlockPool.evict`` (lock held; ``count < 0``: all): ``(Removes owed,
    blocks evicted)``."""
    removes: list[BlockMeta] = []
    n = 0
    while count < 0 or n < count:
        b = pool._inactive.pop_victim()
        if b is None:
            break
        old = b.meta
        if _unregister(pool, b, old.sequence_hash):  # type: ignore[union-attr]
            removes.append(old)  # type: ignore[arg-type]
        _reset_one(pool, b)
        n += 1
    return removes, n


def settle_existing(pool: BlockPool, handle: MutableBlock, existing: Block) -> Block:
    """The body of ``BlockPool._settle_existing`` (lock held)."""
    b = handle._block
    pool._dedup_hits += 1
    if pool.allow_duplicates:
        b.state = _REGISTERED
        b.ref_count = 1
        b.frequency = 1
        pool._dups.setdefault(existing.meta.sequence_hash, []).append(b)  # type: ignore[union-attr]
        return b
    acquire_one(pool, existing, True)
    _reset_one(pool, b)
    return existing


def acquire_one(pool: BlockPool, block: Block, touch: bool = True) -> None:
    """The body of ``BlockPool._acquire`` (lock held)."""
    if block.state is not _REGISTERED:
        raise BlockStateError(f"block {block.block_id} is {block.state.value}, not registered")
    if block.ref_count == 0:
        pool._inactive.discard(block)
    block.ref_count += 1
    if touch:
        block.frequency += 1


def unrelease(pool: BlockPool, handles: Sequence[ImmutableBlock]) -> None:
    """The body of ``BlockPool._unrelease`` (lock held)."""
    for h in reversed(list(handles)):
        h._live = True
        b = h._block
        if b.ref_count == 0 and b in pool._inactive:
            pool._inactive.discard(b)
        b.ref_count += 1


def counts(pool: BlockPool) -> tuple[int, int, int]:
    """``(reset, active, inactive)`` block counts (lock held)."""
    active = sum(1 for b in pool._blocks if b.state is _REGISTERED and b.ref_count > 0)
    return len(pool._reset), active, len(pool._inactive)


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
            b.ref_count = 1  # a strong handle's, or the batch's (the caller drops it)
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
