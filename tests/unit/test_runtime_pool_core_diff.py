"""The pool's compiled core (``kvbm_runtime/_pool_core.pyx``) against its executable
specification (``kvbm_runtime/pool_reference.py``): pools on either core driven through the
same random operations (batch and one-by-one calls, dedup, duplicates, eviction, matching,
bad handles) end in the same state after every step (blocks, eviction order, stats,
registry, events in order, results and errors); the two ``InactiveSet`` implementations
agree operation for operation."""

from __future__ import annotations

import gc
import random

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from event_plane import KVEvent
from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig, make_layout, pool_reference
from kvbm_runtime import _pool_core
from kvbm_runtime.block import Block, WeakBlock
from kvbm_runtime.layout import MemoryKind

# these tests gc.collect() after steps: only the test's own objects are scanned (conftest)
pytestmark = pytest.mark.usefixtures("young_heap")

CFG = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)
SALT = 0x5EED


class RefPool(BlockPool):
    """A pool running the executable specification instead of the compiled core."""

    _core = pool_reference


class Sink:
    def __init__(self) -> None:
        self.events: list[tuple[str, int, int | None]] = []

    def publish(self, events: list[KVEvent]) -> None:
        self.events.extend((e.type.name, e.sequence_hash, e.parent_hash) for e in events)


def new_pool(cls: type[BlockPool], n: int, dups: bool) -> tuple[BlockPool, Sink]:
    sink = Sink()
    layout = make_layout("FullyContiguous", CFG, n, torch.device("cpu"), MemoryKind.SYSTEM)
    return cls("g2", layout, sink, allow_duplicates=dups), sink  # type: ignore[arg-type]


def meta(h: int) -> BlockMeta:
    return BlockMeta(h, h - 1 if h % 4 else None, h - h % 4, SALT)


def snapshot(pool: BlockPool, sink: Sink) -> tuple:
    blocks = [
        (b.block_id, b.state.value, b.generation, b.ref_count, b.frequency, None if b.meta is None else b.meta.sequence_hash)
        for b in pool._blocks
    ]
    reg = sorted((h, b.block_id) for h, b in pool._registry.items())
    dups = sorted((h, [b.block_id for b in bs]) for h, bs in pool._dups.items())
    return (blocks, pool.eviction_order(), pool.stats(), list(pool._reset), reg, dups, list(sink.events), pool.available())


def ids(handles: list) -> list:
    return [None if h is None else (type(h).__name__, h._block.block_id, h._live) for h in handles]


class Held(list):
    """Strong handles held (the list), weak handles (``weak``) and pins (``pins``) of one pool."""

    def __init__(self) -> None:
        super().__init__()
        self.weak: list = []
        self.pins: list = []


class Twin:
    """The same operation on a compiled-core pool and a reference pool, results compared."""

    def __init__(self, n: int, dups: bool) -> None:
        self.pools = [new_pool(BlockPool, n, dups), new_pool(RefPool, n, dups)]
        self.held = [Held(), Held()]  # per pool

    def run(self, op) -> None:  # noqa: ANN001
        outs = []
        for k, (pool, _) in enumerate(self.pools):
            try:
                res = op(pool, self.held[k])
                outs.append(("ok", res))
            except Exception as exc:  # noqa: BLE001 - compared between the two
                outs.append(("err", type(exc).__name__, str(exc)))
        assert outs[0] == outs[1]
        a, b = (snapshot(p, s) for p, s in self.pools)
        assert a == b
        assert ids(self.held[0]) == ids(self.held[1])
        w0, w1 = ([(w._block.block_id, w._generation, w.sequence_hash, w.alive) for w in h.weak] for h in self.held)
        assert w0 == w1
        assert [(len(p), p.lost, p.consumed) for p in self.held[0].pins] == [(len(p), p.lost, p.consumed) for p in self.held[1].pins]


def op_churn(hashes: list[int]):  # noqa: ANN201
    def op(pool: BlockPool, held: list) -> list:
        mbs = pool.allocate_complete([meta(h) for h in hashes])
        out = pool.register_blocks(mbs)
        held.extend(out)
        return ids(out)

    return op


def op_single(h: int):  # noqa: ANN201
    def op(pool: BlockPool, held: list) -> list:
        (mb,) = pool.allocate_complete([meta(h)])
        ib = pool.register(mb)
        held.append(ib)
        return ids([ib])

    return op


def op_release(picks: list[int], one_by_one: bool, bad: int | None):  # noqa: ANN201
    def op(pool: BlockPool, held: list) -> int:
        if not held:
            return 0
        chosen = [held[i % len(held)] for i in picks]
        uniq = list({id(h): h for h in chosen}.values())
        if bad is not None and uniq:
            uniq.insert(bad % (len(uniq) + 1), uniq[0])  # the same handle twice
        if one_by_one:
            for h in uniq:
                h.release()
        else:
            pool.release_blocks(uniq)
        held[:] = [h for h in held if h._live]
        return len(uniq)

    return op


def op_match(picks: list[int], drop: bool):  # noqa: ANN201
    def op(pool: BlockPool, held: list) -> list:
        resident = sorted(pool.resident())  # the same in both pools
        hashes = [resident[i % len(resident)] if resident and i >= 0 else 99 for i in picks]  # -1: a miss
        out = pool.match_blocks(hashes)
        if drop:
            del out[:]  # dropped handles give their references back
            gc.collect()
            return []
        held.extend(out)
        return ids(out)

    return op


def op_evict(n: int | None):  # noqa: ANN201
    return lambda pool, held: pool.evict(n)


def op_allocate_drop(n: int):  # noqa: ANN201
    def op(pool: BlockPool, held: list) -> int:
        mbs = pool.allocate(n)
        k = len(mbs)
        del mbs  # dropped mutable handles go back to the Reset list
        return k

    return op


def op_register_bad(hashes: list[int], where: int):  # noqa: ANN201
    def op(pool: BlockPool, held: list) -> list:
        mbs = pool.allocate_complete([meta(h) for h in hashes])
        bad = mbs[where % len(mbs)]
        bad.release()  # consumed: register_blocks must refuse the batch and undo
        try:
            out = pool.register_blocks(mbs)
        finally:
            for mb in mbs:
                if mb._live:
                    mb.release()
        held.extend(out)
        return ids(out)

    return op


def op_get_many(hashes: list[int]):  # noqa: ANN201
    def op(pool: BlockPool, held: list) -> list:
        out = pool.get_many(hashes)
        held.extend(h for h in out if h is not None)
        return ids(out)

    return op


def op_register_downgrade(hashes: list[int], caller_weaks: bool):  # noqa: ANN201
    def op(pool: BlockPool, held: Held) -> int:
        mbs = pool.allocate_complete([meta(h) for h in hashes])
        pre = [WeakBlock(pool, m._block, m._block.generation, m._block.meta.sequence_hash) for m in mbs] if caller_weaks else None
        out = pool.register_downgrade(mbs, pre)
        held.weak.extend(out)
        return len(out)

    return op


def op_pin(picks: list[int], keep: bool):  # noqa: ANN201
    def op(pool: BlockPool, held: Held) -> list:
        if not held.weak:
            return []
        pins = pool.pin_many([held.weak[i % len(held.weak)] for i in picks])
        if keep:
            held.pins.append(pins)
        else:
            pool.unpin_many(pins)
        return pins.lost

    return op


def op_unpin(which: int):  # noqa: ANN201
    def op(pool: BlockPool, held: Held) -> None:
        if held.pins:
            pool.unpin_many(held.pins.pop(which % len(held.pins)))

    return op


def op_upgrade(picks: list[int]):  # noqa: ANN201
    def op(pool: BlockPool, held: Held) -> list:
        if not held.weak:
            return []
        out = pool.upgrade_many([held.weak[i % len(held.weak)] for i in picks])
        held.extend(h for h in out if h is not None)
        return ids(out)

    return op


hash_lists = st.lists(st.integers(100, 160), min_size=1, max_size=12)
ops = st.one_of(
    hash_lists.map(op_churn),
    st.integers(100, 160).map(op_single),
    st.builds(op_release, st.lists(st.integers(0, 40), max_size=10), st.booleans(), st.none() | st.integers(0, 10)),
    st.builds(op_match, st.lists(st.integers(-1, 30), min_size=1, max_size=12), st.booleans()),
    st.builds(op_evict, st.none() | st.integers(0, 6)),
    st.integers(0, 6).map(op_allocate_drop),
    st.builds(op_register_bad, hash_lists, st.integers(0, 20)),
    st.builds(op_get_many, hash_lists),
    st.builds(op_register_downgrade, hash_lists, st.booleans()),
    st.builds(op_pin, st.lists(st.integers(0, 40), max_size=10), st.booleans()),
    st.integers(0, 5).map(op_unpin),
    st.builds(op_upgrade, st.lists(st.integers(0, 40), max_size=10)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(ops, min_size=1, max_size=25), st.booleans(), st.integers(8, 24))
def test_compiled_core_matches_the_reference(steps: list, dups: bool, n: int) -> None:
    twin = Twin(n, dups)
    for op in steps:
        twin.run(op)
    for k in (0, 1):
        twin.held[k].clear()
        for pins in twin.held[k].pins:
            twin.pools[k][0].unpin_many(pins)
        twin.held[k].pins.clear()
    gc.collect()
    twin.run(op_evict(None))


def test_long_random_churn_matches_the_reference() -> None:
    """A long churn of the bench's shape (requests of 16, 7/8 of the allocations evict,
    prefixes matched again) with frequencies spread over all four levels."""
    rng = random.Random(7)
    twin = Twin(64, False)
    for r in range(300):
        base = 1000 + (r % 37) * 16
        twin.run(op_churn(list(range(base, base + rng.randint(1, 16)))))
        twin.run(op_release(list(range(40)), rng.random() < 0.3, None))
        if r % 3 == 0:
            twin.run(op_match([rng.randrange(64) for _ in range(8)], rng.random() < 0.5))
            twin.run(op_release(list(range(40)), False, None))


@pytest.mark.parametrize("seed", range(5))
def test_inactive_sets_agree(seed: int) -> None:
    rng = random.Random(seed)
    blocks = [Block(i) for i in range(32)]
    sets = [_pool_core.InactiveSet(blocks), pool_reference.InactiveSet(blocks)]
    for _ in range(2000):
        b = rng.choice(blocks)
        what = rng.randrange(6)
        res = []
        if what == 0 and b not in sets[0]:
            b.frequency = rng.choice((0, 1, 2, 3, 5, 9))  # a block's level is fixed while it is in
        for s in sets:
            try:
                if what == 0:
                    res.append(s.add(b))
                elif what == 1:
                    res.append(s.discard(b))
                elif what == 2:
                    v = s.pop_victim()
                    res.append(None if v is None else v.block_id)
                elif what == 3:
                    res.append(b in s)
                elif what == 4:
                    res.append([s.level_len(k) for k in range(4)])
                else:
                    res.append(len(s))
            except KeyError:
                res.append("KeyError")
        assert res[0] == res[1]
        assert sets[0].order() == sets[1].order()


def test_inactive_set_refuses_foreign_blocks() -> None:
    blocks = [Block(i) for i in range(4)]
    for cls in (_pool_core.InactiveSet, pool_reference.InactiveSet):
        s = cls(blocks)
        for alien in (Block(2), Block(99), Block(-1)):
            with pytest.raises(ValueError):
                s.add(alien)
            with pytest.raises(ValueError):
                s.discard(alien)
            assert alien not in s
        with pytest.raises(IndexError):
            s.level_len(4)
    with pytest.raises(ValueError):
        _pool_core.InactiveSet([Block(1)])


def test_compiled_core_refuses_corrupt_state_instead_of_reading_out_of_bounds() -> None:
    """The C loops index their own snapshots with checked ids: a pool whose internals were
    tampered with raises instead of reading past an array."""
    pool, _ = new_pool(BlockPool, 4, False)
    pool._reset.appendleft(10**6)
    with pytest.raises(RuntimeError, match="not a block of this pool"):
        pool.allocate_complete([meta(100)])
    pool, _ = new_pool(BlockPool, 4, False)
    pool._registry[5] = object()
    with pytest.raises(TypeError):
        pool.match_blocks([5])
    pool, _ = new_pool(BlockPool, 4, False)
    pool._blocks.clear()  # the inactive set keeps its own snapshot of the blocks
    (h,) = pool.register_blocks(pool.allocate_complete([meta(100)]))
    h.release()
    assert len(pool._inactive) == 1 and pool._inactive.pop_victim().block_id == 0


def test_handles_give_back_when_dropped_live_even_from_a_collected_cycle() -> None:
    """The dropped-while-live rule runs at deallocation, on either core, also for handles
    freed by the cycle collector (it never clears a handle: it still has its pool and block
    when it is freed); a pool in a cycle through handles its sink keeps is collected."""
    import weakref

    for cls in (BlockPool, RefPool):
        pool, sink = new_pool(cls, 4, False)
        (mb,) = pool.allocate_complete([meta(100)])
        assert gc.is_tracked(mb)
        box: list = [mb, pool.allocate(1)]
        box.append(box)
        del mb, box
        gc.collect()  # the cycle's handles give their blocks back
        assert pool.stats().reset == 4
        (ib,) = pool.register_blocks(pool.allocate_complete([meta(100)]))
        assert gc.is_tracked(ib) and pool.stats().active == 1
        del ib  # the last live strong handle: the block is inactive, still matchable
        st = pool.stats()
        assert (st.active, st.inactive) == (0, 1) and pool.contains(100)
        assert [e[0] for e in sink.events] == ["STORE"]
        # the sink keeps strong, mutable and weak handles of its own pool: a cycle
        sink.held = [pool.register_blocks(pool.allocate_complete([meta(101)])), pool.allocate(1)]
        sink.held.append(pool.register_downgrade(pool.allocate_complete([meta(102)])))
        ref = weakref.ref(pool)
        del pool, sink, st
        gc.collect()
        assert ref() is None, "the pool was kept alive by a cycle through its handles"


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_review_fixes(cls: type[BlockPool]) -> None:
    """Found by the hostile review of the core: handles cannot be copied or built on no
    block; a bad identity in a register batch changes nothing; a mutable handle is not a
    reference release_blocks can drop; a weak handle naming another pool's block only
    fails to upgrade; an empty register_downgrade with empty caller weaks is a no-op."""
    import copy
    import pickle

    from kvbm_runtime import BlockStateError
    from kvbm_runtime.block import ImmutableBlock, MutableBlock

    pool, sink = new_pool(cls, 6, False)
    (mb,) = pool.allocate_complete([meta(100)])
    for fn in (copy.copy, copy.deepcopy, pickle.dumps):
        with pytest.raises(TypeError):
            fn(mb)
    with pytest.raises(TypeError):
        MutableBlock(pool, None)
    with pytest.raises(TypeError):
        ImmutableBlock(pool, None)
    with pytest.raises(AttributeError):
        mb._block = None  # read-only: the core reads its C fields
    # a bad identity after a good one: nothing registered, both inputs live and Complete
    bad = pool.allocate_complete([meta(101)])[0]
    bad._block.meta = object()  # no sequence_hash
    with pytest.raises(AttributeError):
        pool.register_blocks([mb, bad])
    assert mb._live and bad._live and pool.resident() == set() and sink.events == []
    bad._block.meta = meta(101)
    with pytest.raises(BlockStateError, match="needs a Registered block"):
        pool.release_blocks([mb])  # a mutable handle holds no reference
    assert mb._live
    ib, ib2 = pool.register_blocks([mb, bad])
    with pytest.raises(BlockStateError):
        pool.release_blocks([ib, pool.allocate(1)[0]])
    assert ib._live and ib._block.ref_count == 1  # the batch was undone
    # a weak handle on another pool's block, in the middle of a batch: lost, nothing leaks
    other, _ = new_pool(cls, 6, False)
    (oh,) = other.register_blocks(other.allocate_complete([meta(200)]))
    oh.release()
    forged = WeakBlock(pool, oh._block, oh._block.generation, 200)
    weaks = [ib.weak(), forged, ib2.weak()]
    pins = pool.pin_many(weaks)
    assert pins.lost == [1] and len(pins) == 2
    assert oh._block.ref_count == 0 and oh._block in other._inactive
    pool.unpin_many(pins)
    assert pool.upgrade_many([forged]) == [None]
    assert pool.register_downgrade([], []) == []


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_only_pools_make_handles(cls: type[BlockPool]) -> None:
    """A hand-built handle would give back a block or a reference the pool never handed
    out (a block on the Reset list twice): the handle classes cannot be called; an instance
    made through ``__new__`` is a dead handle; register_blocks takes mutable handles only;
    allocate_complete takes any iterable of identities on both cores."""
    from kvbm_runtime import BlockStateError, ConsumedHandleError
    from kvbm_runtime.block import ImmutableBlock, MutableBlock

    pool, _ = new_pool(cls, 4, False)
    for k in (MutableBlock, ImmutableBlock, _pool_core._Handle):
        with pytest.raises(TypeError, match="made by their pool"):
            k(pool, pool._blocks[0])
        raw = k.__new__(k)
        assert raw.consumed and "consumed" in repr(raw) or k is _pool_core._Handle
        with pytest.raises(ConsumedHandleError):
            raw.block_id
        del raw
    assert sorted(pool._reset) == [0, 1, 2, 3]
    hs = pool.allocate_complete(meta(h) for h in (1, 2))
    assert [h._block.block_id for h in hs] == [0, 1]
    (ib,) = pool.register_blocks(hs[:1])
    with pytest.raises(BlockStateError):
        pool.register_blocks([hs[1], ib])  # a strong handle is not a Complete block's handle
    assert hs[1]._live and pool.resident() == {1}


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_dead_handles_and_iterators_in_batch_calls(cls: type[BlockPool]) -> None:
    """A dead handle (made through ``__new__``) in a batch is a consumed handle; the
    register calls take an iterator of handles like a list (and undo on a bad input)."""
    from kvbm_runtime import ConsumedHandleError
    from kvbm_runtime.block import ImmutableBlock, MutableBlock

    pool, sink = new_pool(cls, 6, False)
    for call, dead in (
        (pool.register_blocks, MutableBlock.__new__(MutableBlock)),
        (pool.register_downgrade, MutableBlock.__new__(MutableBlock)),
        (pool.release_blocks, ImmutableBlock.__new__(ImmutableBlock)),
        (pool.downgrade_many, ImmutableBlock.__new__(ImmutableBlock)),
    ):
        with pytest.raises(ConsumedHandleError):
            call([dead])
    a, b = pool.allocate_complete([meta(1), meta(2)])
    b.release()
    with pytest.raises(ConsumedHandleError):
        pool.register_blocks(h for h in (a, b))
    assert a._live and pool.resident() == set()
    (c,) = pool.allocate_complete([meta(2)])
    out = pool.register_downgrade(h for h in (a, c))
    assert [w.sequence_hash for w in out] == [1, 2] and pool.resident() == {1, 2}
    assert [e[0] for e in sink.events] == ["STORE", "STORE"]
