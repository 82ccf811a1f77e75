"""Hostile review of the pool's compiled core (``kvbm_runtime/_pool_core.pyx``): the ways a C
extension breaks.  Crash-prone probes run in a child interpreter with ``faulthandler`` on, so
a segfault is a failed test, not a dead pytest.  Tests marked ``xfail(strict=True)`` expose
real bugs (the reason says what happens and where); the others check what held.

Invariants checked after every hostile step (:func:`check_invariants`): every block is in
exactly one of Reset / active / inactive / held by a mutable handle, the Reset list has no
duplicate id, a registered block is inactive exactly when its ref count is 0, the registry
names registered blocks under their own hash, the counters agree.
"""

from __future__ import annotations

import copy
import gc
import os
import pickle
import random
import subprocess
import sys
import textwrap
import threading
import time
import traceback
import tracemalloc
import weakref

import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig, make_layout, pool_reference
from kvbm_runtime import _pool_core
from kvbm_runtime.block import BlockState, ImmutableBlock, MutableBlock, WeakBlock
from kvbm_runtime.errors import BlockStateError, ConsumedHandleError, PoolExhaustedError
from kvbm_runtime.layout import MemoryKind

# these tests gc.collect() after steps: only the test's own objects are scanned (conftest)
pytestmark = pytest.mark.usefixtures("young_heap")

CFG = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)
SALT = 0x5EED
ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


class RefPool(BlockPool):
    """A pool running the executable specification (``pool_reference``)."""

    _core = pool_reference


class Sink:
    """A plain event sink (``publish`` of ``KVEvent`` lists)."""

    def __init__(self) -> None:
        self.events: list[tuple[str, int]] = []

    def publish(self, events: list) -> None:
        self.events.extend((e.type.name, e.sequence_hash) for e in events)


class EncodedSink:
    """A sink taking encoded events (``publish_encoded``), as an ``EventPublisher`` does."""

    def __init__(self) -> None:
        self.count = 0

    def publish(self, events: list) -> None:
        self.count += len(events)

    def publish_encoded(self, body: bytes, count: int) -> None:
        self.count += count


def new_pool(n: int = 8, cls: type[BlockPool] = BlockPool, publisher: object = None, dups: bool = False) -> BlockPool:
    layout = make_layout("FullyContiguous", CFG, n, torch.device("cpu"), MemoryKind.SYSTEM)
    return cls("g2", layout, publisher, allow_duplicates=dups)  # type: ignore[arg-type]


def meta(h: int) -> BlockMeta:
    return BlockMeta(h, None, h, SALT)


def check_invariants(pool: BlockPool, quiescent: bool = False) -> None:
    """The pool's structural invariants; ``quiescent``: no handle is live, so every block is
    Reset or inactive.

    Read with the cycle collector off: a collection between two reads (3.12+ runs it at
    any Python call) would run finalizers that give blocks back, and the reads would
    disagree with each other, not with the pool."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        _check_invariants(pool, quiescent)
    finally:
        if enabled:
            gc.enable()


def _check_invariants(pool: BlockPool, quiescent: bool) -> None:
    reset = list(pool._reset)
    assert len(set(reset)) == len(reset), f"duplicate ids on the Reset list: {reset}"
    assert all(0 <= i < pool.num_blocks for i in reset)
    order = pool._inactive.order()
    assert len(set(order)) == len(order) == len(pool._inactive)
    reset_set, inactive_set = set(reset), set(order)
    assert not reset_set & inactive_set
    registered = 0
    for b in pool._blocks:
        assert b.ref_count >= 0, b
        if b.block_id in reset_set:
            assert b.state is BlockState.RESET and b.ref_count == 0, b
        if b.block_id in inactive_set:
            assert b.state is BlockState.REGISTERED and b.ref_count == 0, b
        if b.state is BlockState.REGISTERED:
            registered += 1
            assert (b.ref_count == 0) == (b.block_id in inactive_set), b
            h = b.meta.sequence_hash
            assert pool._registry.get(h) is b or b in pool._dups.get(h, ()), b
    for h, b in pool._registry.items():
        assert b.state is BlockState.REGISTERED and b.meta.sequence_hash == h
    assert registered == len(pool._registry) + sum(map(len, pool._dups.values()))
    st_ = pool.stats()
    assert st_.reset == len(reset) and st_.inactive == len(order)
    if quiescent:
        assert len(reset) + len(order) == pool.num_blocks, (reset, order, [repr(b) for b in pool._blocks])
        assert st_.active == 0


def run_child(body: str, timeout: float = 120) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh interpreter with faulthandler on (a crash is an exit status,
    not a dead pytest)."""
    prelude = textwrap.dedent(
        """
        import faulthandler, sys
        faulthandler.enable()
        import torch
        from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig, make_layout
        from kvbm_runtime.block import ImmutableBlock, MutableBlock, WeakBlock
        from kvbm_runtime.layout import MemoryKind
        CFG = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)
        def new_pool(n=8):
            return BlockPool("g2", make_layout("FullyContiguous", CFG, n, torch.device("cpu"), MemoryKind.SYSTEM))
        def meta(h):
            return BlockMeta(h, None, h, 1)
        """
    )
    return subprocess.run(
        [sys.executable, "-X", "faulthandler", "-X", "dev", "-c", prelude + textwrap.dedent(body)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def assert_child_ok(proc: subprocess.CompletedProcess) -> None:
    assert proc.returncode == 0, f"child exited {proc.returncode}\n{proc.stdout[-2000:]}\n{proc.stderr[-4000:]}"


# ----------------------------------------------------------------------------- crashes


NONE_BLOCK_PROBES = {
    # a handle built on None (the public constructors take ``Block block`` without ``not None``)
    "mutable_state": "h = MutableBlock(new_pool(), None)\nh.state",
    "mutable_repr": "h = MutableBlock(new_pool(), None)\nrepr(h)",
    "mutable_init_sequence": "h = MutableBlock(new_pool(), None)\nh.init_sequence(1)",
    "immutable_weak": "h = ImmutableBlock(new_pool(), None)\nh.weak()",
    "immutable_meta": "h = ImmutableBlock(new_pool(), None)\nh.meta",
    # ``_block`` is a writable public attribute: a live strong handle whose block was set to None
    "immutable_release_after_setattr": (
        "p = new_pool()\n[s] = p.register_blocks(p.allocate_complete([meta(5)]))\ns._block = None\ns.release()"
    ),
}


@pytest.mark.parametrize("probe", sorted(NONE_BLOCK_PROBES))
def test_handle_on_none_block_raises_instead_of_crashing(probe: str) -> None:
    """Regression (hostile review; fixed in d9aaee9): _Handle.__init__(pool, Block block) accepts
    None and _block is a writable 'cdef public Block'; _get() returns None and the methods read
    (and ImmutableBlock.release -> _release_one writes) C fields of Py_None: segfault or silent
    out-of-bounds write. Fix: `Block block not None` in _Handle.__init__, `cdef readonly Block
    _block` (or a None check in _get and before _release_one)."""
    # the child must see a Python exception (TypeError / AttributeError / ...), never a crash
    # nor silence (the release case "succeeds" today after writing past Py_None)
    body = "try:\n" + textwrap.indent(NONE_BLOCK_PROBES[probe], "    ") + (
        "\nexcept Exception as e:\n    print('raised', type(e).__name__)\n    sys.exit(0)\n"
        "print('no error: fields of None were read or written')\nsys.exit(3)\n"
    )
    assert_child_ok(run_child(body))


def test_handles_alive_at_interpreter_exit_do_not_crash() -> None:
    """Live handles of every kind in module globals, in a reference cycle, a pool deleted
    while its handles live, pins and weak handles, a thread still holding handles: the
    interpreter exits cleanly (no crash, no 'Exception ignored')."""
    proc = run_child(
        """
        import threading, gc
        p = new_pool(16)
        muts = p.allocate(3)
        partial = p.allocate(1)[0].init_sequence(1)
        strong = p.register_blocks(p.allocate_complete([meta(h) for h in (1, 2, 3)]))
        weaks = p.register_downgrade(p.allocate_complete([meta(h) for h in (4, 5)]))
        pins = p.pin_many(weaks)
        class Cycle:
            pass
        c = Cycle(); c.me = c; c.handles = [strong[0].clone(), p.allocate(1)[0]]
        q = new_pool(4)
        orphan = q.register_blocks(q.allocate_complete([meta(9)]))
        del q  # the pool only lives through its handles now
        gc.disable()  # leave the cycle to interpreter shutdown
        ev = threading.Event()
        def hold():
            hs = p.match_blocks([1, 2])
            ev.wait()
        t = threading.Thread(target=hold, daemon=True); t.start()
        print("exiting")
        """
    )
    assert_child_ok(proc)
    assert "Exception ignored" not in proc.stderr, proc.stderr


def test_pool_collected_once_its_last_handle_is_dropped() -> None:
    """Handles keep their pool alive (no use-after-free); dropping them gives every block
    back and the pool is then freed (no cycle through the compiled objects)."""
    pool = new_pool(8)
    ref = weakref.ref(pool)
    strong = pool.register_blocks(pool.allocate_complete([meta(h) for h in (1, 2, 3)]))
    muts = pool.allocate(2)
    weaks = [s.weak() for s in strong]
    pins = pool.pin_many(weaks)
    blocks = pool._blocks
    del pool
    gc.collect()
    assert ref() is not None  # held by the handles
    p = ref()
    check_invariants(p)
    del p
    del strong, muts, pins
    gc.collect()
    assert ref() is not None  # the weak handles still name the pool
    assert all(b.ref_count == 0 for b in blocks)
    assert [w.alive for w in weaks] == [True, True, True]
    del weaks
    gc.collect()
    assert ref() is None


# ----------------------------------------------------------------------------- copies, pickles, subclasses


def one_handle(pool: BlockPool, kind: str) -> MutableBlock | ImmutableBlock:
    """A Reset mutable handle or a strong handle on a freshly registered block."""
    if kind == "mutable":
        return pool.allocate(1)[0]
    return pool.register_blocks(pool.allocate_complete([meta(5)]))[0]


@pytest.mark.parametrize("kind", ["mutable", "strong"])
def test_copying_a_handle_is_refused(kind: str) -> None:
    """Regression (hostile review; fixed in d9aaee9): Cython auto-generates
    __reduce_cython__/__setstate_cython__ for _Handle/MutableBlock/ImmutableBlock, so
    copy.copy(handle) builds a second LIVE handle on the same block: a mutable one puts the
    block on the Reset list twice (two later allocations share one block), a strong one releases
    a reference it never took. Fix: @cython.auto_pickle(False) on the handle classes plus
    __copy__/__deepcopy__/__reduce__ raising TypeError (kvbm_runtime/_pool_core.pyx, _Handle)."""
    pool = new_pool(4)
    h = one_handle(pool, kind)
    with pytest.raises(TypeError):
        copy.copy(h)


@pytest.mark.parametrize("kind", ["mutable", "strong"])
def test_copied_handle_cannot_corrupt_the_pool(kind: str) -> None:
    """Regression (hostile review; fixed in d9aaee9) (consequence of the auto-pickle copy):
    copy.copy(MutableBlock) -> both handles give the block back when dropped, its id lands on
    the Reset list twice; copy.copy(ImmutableBlock) -> a live 'strong' handle the ref count does
    not know about (ref count stays 1)."""
    pool = new_pool(4)
    h = one_handle(pool, kind)
    try:
        h2 = copy.copy(h)
    except TypeError:
        h2 = None
    if kind == "strong" and h2 is not None and h2._live:
        assert h._block.ref_count == 2, "a live strong copy the block does not count"
    del h, h2
    gc.collect()
    check_invariants(pool, quiescent=True)


def test_deepcopy_and_pickle_of_handles_fail_cleanly() -> None:
    """deepcopy / pickle have to copy the pool, whose lock cannot be: TypeError, nothing changes."""
    pool = new_pool(4)
    (m,) = pool.allocate(1)
    (s,) = pool.register_blocks(pool.allocate_complete([meta(5)]))
    for h in (m, s):
        with pytest.raises(TypeError):
            copy.deepcopy(h)
        with pytest.raises(TypeError):
            pickle.dumps(h)
    assert m._live and s._live and s._block.ref_count == 1
    del m, s, h
    check_invariants(pool, quiescent=True)


def test_handle_and_block_types_cannot_be_subclassed() -> None:
    for cls in (MutableBlock, ImmutableBlock, _pool_core.Block, _pool_core.InactiveSet):
        with pytest.raises(TypeError):
            type("Sub", (cls,), {})


# ----------------------------------------------------------------------------- lifecycle rules


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_consumed_double_released_and_foreign_handles(cls: type[BlockPool]) -> None:
    pool, other = new_pool(8, cls), new_pool(8, cls)
    strong = pool.register_blocks(pool.allocate_complete([meta(h) for h in (1, 2, 3)]))
    foreign = other.register_blocks(other.allocate_complete([meta(7)]))
    # double release of one handle
    strong[0].release()
    with pytest.raises(ConsumedHandleError):
        strong[0].release()
    with pytest.raises(ConsumedHandleError):
        strong[0].meta  # noqa: B018
    # a batch with a consumed handle / another pool's handle / the same handle twice: nothing changes
    before = [(b.ref_count, b.block_id in pool._inactive) for b in pool._blocks]
    for batch, err in (
        ([strong[1], strong[0]], ConsumedHandleError),
        ([strong[1], foreign[0]], BlockStateError),
        ([strong[1], strong[2], strong[1]], BlockStateError),
    ):
        with pytest.raises(err):
            pool.release_blocks(batch)
        assert [(b.ref_count, b.block_id in pool._inactive) for b in pool._blocks] == before
        assert strong[1]._live and strong[2]._live and foreign[0]._live
        check_invariants(pool)
    # register: a mutable handle twice, one of another pool, a consumed one
    mbs = pool.allocate_complete([meta(h) for h in (10, 11)])
    (om,) = other.allocate_complete([meta(12)])
    for batch in ([mbs[0], mbs[1], mbs[0]], [mbs[0], om]):
        with pytest.raises(BlockStateError):
            pool.register_blocks(batch)
        assert all(m._live and m._block.state is BlockState.COMPLETE for m in (*mbs, om))
        assert 10 not in pool._registry and 11 not in pool._registry
        check_invariants(pool)
    # a mutable handle used after a transition
    (r,) = pool.allocate(1)
    p = r.init_sequence(SALT)
    with pytest.raises(ConsumedHandleError):
        r.init_sequence(SALT)
    with pytest.raises(ConsumedHandleError):
        pool.register_blocks([r])
    del p, r, mbs, om, strong, foreign, batch
    gc.collect()
    check_invariants(pool, quiescent=True)
    check_invariants(other, quiescent=True)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_weak_handles_never_resurrect_an_evicted_block(cls: type[BlockPool]) -> None:
    pool = new_pool(2, cls)
    weaks = pool.register_downgrade(pool.allocate_complete([meta(1), meta(2)]))
    assert pool.evict() == 2
    # the same physical blocks reused for the same hashes: a new life, not the old one
    again = pool.register_downgrade(pool.allocate_complete([meta(1), meta(2)]))
    assert {w._block.block_id for w in again} == {w._block.block_id for w in weaks}
    assert [w.upgrade() for w in weaks] == [None, None]
    assert pool.upgrade_many(weaks) == [None, None]
    pins = pool.pin_many(weaks)
    assert len(pins) == 0 and pins.lost == [0, 1]
    pins.release()
    with pytest.raises(ConsumedHandleError):
        pins.release()
    # evicted through allocate_complete (the core's eviction loop) too
    pool.allocate_complete([meta(3), meta(4)])
    assert [w.alive for w in again] == [False, False]
    assert pool.upgrade_many(again) == [None, None]
    gc.collect()
    check_invariants(pool, quiescent=True)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_empty_batches_change_nothing(cls: type[BlockPool]) -> None:
    pool = new_pool(4, cls, Sink())
    assert pool.allocate(0) == []
    assert pool.allocate_complete([]) == []
    assert pool.register_blocks([]) == []
    assert pool.register_downgrade([]) == []
    pool.release_blocks([])
    assert pool.match_blocks([]) == [] and pool.get_many([]) == [] and pool.upgrade_many([]) == []
    pins = pool.pin_many([])
    assert len(pins) == 0
    pool.unpin_many(pins)
    assert pool.downgrade_many([]) == []
    assert pool.evict(0) == 0 and pool.evict() == 0
    assert pool.stats().stores_published == 0 and pool._publisher.events == []
    check_invariants(pool, quiescent=True)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_register_downgrade_empty_batch_with_empty_weaks(cls: type[BlockPool]) -> None:
    """Regression (hostile review; fixed in d9aaee9) (kvbm_runtime/pool.py,
    BlockPool.register_downgrade, the `weaks is not None ... and _names(weaks[0], targets[0])`
    test): an empty batch with an empty caller weaks list raises IndexError (len(weaks) == n ==
    0, then weaks[0]). Fix: add `and n` to that condition."""
    pool = new_pool(4, cls)
    assert pool.register_downgrade([], []) == []
    check_invariants(pool, quiescent=True)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_release_blocks_refuses_a_mutable_handle(cls: type[BlockPool]) -> None:
    """Regression (hostile review; fixed in d9aaee9) (both cores): release_blocks([mutable_handle])
    is accepted: _pool_core.release_blocks (and pool_reference) take any live _Handle of the
    pool, consume it and drop a reference the Complete/Reset block never had (rc -1: nothing),
    so the block is neither Reset nor registered and no live handle names it: leaked for the
    pool's life, silently. Fix: in release_blocks' loop accept only ImmutableBlock (type(obj) is
    ImmutableBlock) so BlockPool._bad_handle raises BlockStateError with nothing changed."""
    pool = new_pool(4, cls)
    (m,) = pool.allocate_complete([meta(5)])
    try:
        with pytest.raises(BlockStateError):
            pool.release_blocks([m])
        assert m._live
    finally:
        del m
        gc.collect()
        check_invariants(pool, quiescent=True)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_pool_exhausted_mid_batch_leaves_the_pool_unchanged(cls: type[BlockPool]) -> None:
    pool = new_pool(6, cls, Sink())
    held = pool.register_blocks(pool.allocate_complete([meta(h) for h in (1, 2)]))
    pool.register_downgrade(pool.allocate_complete([meta(h) for h in (3, 4)]))
    pool.match_blocks([3])  # 3 goes active with frequency 2 then back at level 1
    pool.release_blocks(pool.match_blocks([3]))
    (mut,) = pool.allocate(1)

    def state() -> tuple:
        return (
            [(b.state, b.generation, b.ref_count, b.frequency, b.meta) for b in pool._blocks],
            list(pool._reset),
            pool.eviction_order(),
            sorted(pool._registry),
            pool.stats(),
            list(pool._publisher.events),
        )

    before = state()
    for n in (4, 5, 10**6, 2**62):  # 1 reset + 2 inactive = 3 available
        with pytest.raises(PoolExhaustedError):
            pool.allocate(n)
        with pytest.raises(PoolExhaustedError):
            pool.allocate_complete([meta(100 + i) for i in range(min(n, 8))])
        assert state() == before
    with pytest.raises(ValueError):
        pool.allocate(-1)
    assert state() == before
    del held, mut
    gc.collect()
    check_invariants(pool, quiescent=True)


# ----------------------------------------------------------------------------- odd inputs


ODD_KEYS = [True, False, 5.0, -1, 2**64, 2**64 + 5, 2**200, "5", b"5", None, (5,), 0]


class IntSub(int):
    pass


class WeirdHash(int):
    """Equal to its int value but hashing elsewhere (never found in the registry)."""

    def __hash__(self) -> int:
        return 12345


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_match_and_get_many_take_odd_keys_like_the_reference(cls: type[BlockPool]) -> None:
    pool = new_pool(8, cls)
    pool.register_downgrade(pool.allocate_complete([meta(h) for h in (0, 1, 5)]))
    keys = [*ODD_KEYS, IntSub(5), WeirdHash(5)]
    got = [(k, [h._block.block_id for h in pool.match_blocks([k])]) for k in keys]
    # dict semantics: True == 1, 5.0 == 5, an int subclass hashing like its value matches
    expect = {True: [pool._registry[1].block_id], 5.0: [pool._registry[5].block_id], 0: [pool._registry[0].block_id]}
    for k, found in got:
        if type(k) is IntSub:
            assert found == [pool._registry[5].block_id]
        elif type(k) is WeirdHash:
            assert found == []
        elif type(k) in (bool, float, int) and k in expect:
            assert found == expect[k], k
        else:
            assert found == [], k
    assert [None if h is None else h.sequence_hash for h in pool.get_many(ODD_KEYS)] == [
        1, 0, 5, None, None, None, None, None, None, None, None, 0,
    ]
    gc.collect()
    check_invariants(pool, quiescent=True)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_unhashable_key_mid_match_gives_the_references_back(cls: type[BlockPool]) -> None:
    pool = new_pool(8, cls)
    pool.register_downgrade(pool.allocate_complete([meta(h) for h in (1, 2, 3)]))
    for call in (pool.match_blocks, pool.get_many):
        with pytest.raises(TypeError):
            call([1, 2, [3]])
        gc.collect()
        check_invariants(pool, quiescent=True)


def test_block_meta_refuses_hashes_outside_u64() -> None:
    from kvbm_runtime.errors import BlockMetaError

    for bad in (-1, 2**64, True, 5.0, "5", IntSub(5), None):
        with pytest.raises(BlockMetaError):
            BlockMeta(bad, None, 1, SALT)  # type: ignore[arg-type]
    BlockMeta(2**64 - 1, None, 0, SALT)


def test_inactive_set_rejects_foreign_and_out_of_range_blocks() -> None:
    pool, other = new_pool(4), new_pool(4)
    inactive = pool._inactive
    b = other._blocks[0]
    with pytest.raises(ValueError):
        inactive.add(b)
    with pytest.raises(TypeError):
        inactive.add(None)
    with pytest.raises(TypeError):
        inactive.add("x")
    assert b not in inactive and "x" not in inactive and None not in inactive
    for k in (-1, 4, 2**40):
        with pytest.raises((IndexError, OverflowError)):
            inactive.level_len(k)
    own = pool._blocks[1]
    own.block_id = 10**9  # a writable field: the id is checked before any C array is indexed
    try:
        with pytest.raises(ValueError):
            inactive.add(own)
        assert own not in inactive
    finally:
        own.block_id = 1
    own.block_id = 2  # another block's id: refused too
    try:
        with pytest.raises(ValueError):
            inactive.add(own)
    finally:
        own.block_id = 1
    with pytest.raises(OverflowError):
        own.frequency = 2**64
    with pytest.raises(ValueError):
        _pool_core.InactiveSet([_pool_core.Block(1)])
    with pytest.raises(ValueError):
        _pool_core.InactiveSet([None])
    empty = _pool_core.InactiveSet([])
    assert len(empty) == 0 and empty.pop_victim() is None and empty.order() == []
    check_invariants(pool, quiescent=True)


def test_core_loops_refuse_foreign_objects_without_crashing() -> None:
    """The core's loops called directly with wrong objects raise instead of reading C fields
    of the wrong type (probed in a child: a crash must not kill pytest)."""
    proc = run_child(
        """
        from kvbm_runtime import _pool_core as c
        p = new_pool(4)
        bad = [None, 1, "x", object(), [1], p._blocks[0]]
        for x in bad:  # refused at index 0, nothing consumed
            assert c.release_blocks(p, [x]) == 0, x
            r = c.register_blocks(p, [x])
            assert r[:4] == ([], [], None, 0), (x, r)
        for x in bad[:-1]:
            try:
                c.unpin_blocks(p, [x])
            except TypeError:
                pass
            else:
                raise SystemExit(f"unpin_blocks took {x!r}")
            try:
                c.release_one(p, x)
            except TypeError:
                pass
            else:
                raise SystemExit(f"release_one took {x!r}")
        for x in (None, 1, object()):
            try:
                c.upgrade_weaks(p, [x], True)
            except (TypeError, AttributeError):
                pass
            else:
                raise SystemExit(f"upgrade_weaks took {x!r}")
        w = WeakBlock(p, None, 0, 1)
        try:
            r = c.upgrade_weaks(p, [w], True)
        except TypeError:
            pass
        else:  # or, not a block of this pool: only fails to upgrade
            if r != ([None], [0], -1):
                raise SystemExit(f"upgrade_weaks took a weak handle on None: {r!r}")
        class NotAPool:
            _inactive = None
        for fn in (c.release_blocks, c.match_blocks, c.get_many):
            try:
                fn(NotAPool(), [1])
            except (TypeError, AttributeError):
                pass
        p._reset.append(10**6)  # a corrupt Reset list: refused, not indexed past the blocks
        try:
            p.allocate_complete([meta(h) for h in range(5)])
        except RuntimeError:
            pass
        else:
            raise SystemExit("a Reset list id past the blocks was taken")
        print("ok")
        """
    )
    assert_child_ok(proc)


# ----------------------------------------------------------------------------- errors mid-batch


class NoHash:
    """An identity without a ``sequence_hash`` (``allocate_complete`` / ``init_from`` take
    any object; ``register_blocks`` documents AttributeError for it)."""

    salt = SALT


class Unhashable:
    salt = SALT
    sequence_hash = [1]  # noqa: RUF012


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_register_bad_identity_changes_nothing(cls: type[BlockPool]) -> None:
    """Regression (hostile review; fixed in d9aaee9) (both cores): register_blocks documents
    'TypeError, OverflowError, AttributeError: (a publisher taking encoded events) an input's
    identity is not a checked BlockMeta ... nothing changed: the inputs stay live and Complete',
    but an identity without sequence_hash raises inside the core loop
    (_pool_core.register_blocks reads meta.sequence_hash after handle._live = False;
    pool_reference likewise): the earlier inputs stay Registered with no Store published and the
    failing input's handle is consumed on a Complete block nobody can free (leaked). Fix: in
    _pool_core.register_blocks (and pool_reference) take meta.sequence_hash and insert before
    consuming the handle, and on any exception return/raise with the index so
    BlockPool._register_loop undoes blocks[:i] (_unregister_batch)."""
    pool = new_pool(4, cls, EncodedSink())
    hs = pool.allocate_complete([meta(5), NoHash()])  # type: ignore[list-item]
    with pytest.raises(AttributeError):
        pool.register_blocks(hs)
    assert [(h._live, h._block.state) for h in hs] == [(True, BlockState.COMPLETE)] * 2
    assert 5 not in pool._registry
    del hs
    gc.collect()
    check_invariants(pool, quiescent=True)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_register_downgrade_unhashable_identity_leaves_a_usable_pool(cls: type[BlockPool]) -> None:
    """Regression (hostile review; fixed in d9aaee9) (both cores): register_downgrade with an
    unhashable identity after a good one raises TypeError from the core loop with the good block
    left Registered, ref count 0 and NOT in the inactive set (unevictable forever;
    match_blocks/get_many of its hash then raise KeyError from InactiveSet.discard on every
    call), the bad input consumed and leaked. Fix as for
    test_register_bad_identity_changes_nothing (undo on any exception in the register loop)."""
    pool = new_pool(4, cls)
    hs = pool.allocate_complete([meta(5), Unhashable()])  # type: ignore[list-item]
    with pytest.raises(TypeError):
        pool.register_downgrade(hs)
    del hs
    gc.collect()
    try:
        pool.release_blocks(pool.match_blocks([5]))
    finally:
        check_invariants(pool, quiescent=True)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_pin_many_with_a_foreign_block_weak_takes_no_reference(cls: type[BlockPool]) -> None:
    """Regression (hostile review; fixed in d9aaee9) (both cores): register_downgrade's caller
    weaks are only checked at their ends ('a weak handle naming another block or life only fails
    to upgrade'), but a middle one naming an inactive block of ANOTHER pool makes pin_many raise
    ValueError from InactiveSet.discard after the earlier blocks were pinned: those references
    leak (blocks active forever, never evictable); an active foreign block gets its ref count
    changed under the wrong pool's lock. Fix: _pool_core.upgrade_weaks (and pool_reference)
    check in its first pass that w._block is this pool's block (blocks[b.block_id] is b) and
    count a foreign one as lost (or refuse the batch before changing anything)."""
    pool, other = new_pool(4, cls), new_pool(4, cls)
    (x,) = other.register_downgrade(other.allocate_complete([meta(99)]))
    hs = pool.allocate_complete([meta(h) for h in (1, 2, 3)])
    weaks = [WeakBlock(pool, h._block, h._block.generation, h._block.meta.sequence_hash) for h in hs]
    weaks[1] = WeakBlock(pool, x._block, x._block.generation, 99)
    out = pool.register_downgrade(hs, weaks)
    try:
        pins = pool.pin_many(out)
    except (ValueError, BlockStateError):
        pass
    else:
        assert pins.lost == [1]
        pins.release()
    gc.collect()
    check_invariants(pool, quiescent=True)
    check_invariants(other, quiescent=True)


# ----------------------------------------------------------------------------- re-entrancy


class ReentrantSink:
    """A sink that calls back into its pool from ``publish`` (match, allocate, release,
    evict, register) and mutates the list it is given; optionally raises afterwards."""

    def __init__(self, raise_after: bool = False) -> None:
        self.pool: BlockPool | None = None
        self.depth = 0
        self.raise_after = raise_after
        self.seen: list[tuple[str, int]] = []

    def publish(self, events: list) -> None:
        self.seen.extend((e.type.name, e.sequence_hash) for e in events)
        events.clear()  # mutating what the pool handed over
        if self.pool is not None and self.depth == 0:
            self.depth += 1
            try:
                pool = self.pool
                got = pool.match_blocks(sorted(pool.resident())[:2])
                pool.release_blocks(got)
                pool.evict(1)
                if pool.available():
                    (m,) = pool.allocate_complete([meta(1000 + len(self.seen))])
                    pool.register(m).release()
            finally:
                self.depth -= 1
        if self.raise_after:
            raise RuntimeError("sink failed")


@pytest.mark.parametrize("raise_after", [False, True])
@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_reentrant_and_raising_sink_keeps_the_pool_consistent(cls: type[BlockPool], raise_after: bool) -> None:
    sink = ReentrantSink(raise_after)
    pool = new_pool(6, cls, sink)
    sink.pool = pool
    rng = random.Random(7)
    for step in range(60):
        hashes = rng.sample(range(1, 12), rng.randint(1, 3))
        try:
            if step % 3 == 0:
                out = pool.register_blocks(pool.allocate_complete([meta(h) for h in hashes]))
                pool.release_blocks(out)
            elif step % 3 == 1:
                pool.register_downgrade(pool.allocate_complete([meta(h) for h in hashes]))
            else:
                pool.evict(rng.randint(0, 3))
        except (RuntimeError, PoolExhaustedError):
            pass
        gc.collect()
        check_invariants(pool, quiescent=True)


class CallbackKey(int):
    """An int key whose ``__eq__`` (run by the registry lookup inside the core's loop) calls
    back into the pool."""

    action = None

    def __hash__(self) -> int:
        return int.__hash__(self)

    def __eq__(self, other: object) -> bool:
        if CallbackKey.action is not None:
            act, CallbackKey.action = CallbackKey.action, None
            act()
        return int.__eq__(self, other)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_key_eq_calling_back_into_the_pool_during_match(cls: type[BlockPool]) -> None:
    pool = new_pool(4, cls)
    ws = pool.register_downgrade(pool.allocate_complete([meta(h) for h in (1, 2, 3, 4)]))

    def evict_all() -> None:
        pool.evict()

    def churn() -> None:
        pool.release_blocks(pool.match_blocks([1]))
        pool.allocate_complete([meta(50)])  # evicts the LRU block and drops the handle

    hashes_list = [1, CallbackKey(2), 3]
    for act in (evict_all, churn):
        pool.evict()
        ws = pool.register_downgrade(pool.allocate_complete([meta(h) for h in (1, 2, 3, 4)]))
        CallbackKey.action = act
        got = pool.match_blocks(hashes_list)  # the key's __eq__ runs inside the registry lookup
        assert all(h._live and h._block.state is BlockState.REGISTERED for h in got)
        assert [h.sequence_hash for h in got] == [1, 2, 3][: len(got)]
        check_invariants(pool)
        del got
        gc.collect()
        check_invariants(pool, quiescent=True)
    del ws


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_input_iterable_calling_back_into_the_pool(cls: type[BlockPool]) -> None:
    """A generator of hashes that evicts / allocates between items, and a list mutated while
    the core iterates it."""
    pool = new_pool(6, cls)
    pool.register_downgrade(pool.allocate_complete([meta(h) for h in range(1, 7)]))

    def gen():
        yield 1
        pool.evict(2)
        yield 2
        pool.allocate(1)  # dropped at once: back to Reset
        yield 3
        yield 4

    got = pool.match_blocks(gen())
    check_invariants(pool)
    del got
    gc.collect()
    check_invariants(pool, quiescent=True)

    class Mutating(int):
        def __hash__(self) -> int:
            keys.clear()
            return int.__hash__(self)

        def __eq__(self, other: object) -> bool:
            return int.__eq__(self, other)

    keys: list = [Mutating(5), 6, 5, 6]
    got = pool.get_many(keys)
    check_invariants(pool)
    del got
    gc.collect()
    check_invariants(pool, quiescent=True)


def test_pins_and_handles_freed_by_the_cycle_collector_inside_a_batch_call() -> None:
    """Finalizers (pins dropped in a reference cycle, handles in a cycle) that run while the
    core loops hold the lock and iterate: forced by a tiny gc threshold."""
    pool = new_pool(32)
    old = gc.get_threshold()
    gc.set_threshold(1, 1, 1)
    try:
        rng = random.Random(3)
        for _ in range(150):
            ws = pool.register_downgrade(pool.allocate_complete([meta(rng.randint(1, 40)) for _ in range(rng.randint(1, 4))]))
            pins = pool.pin_many(ws)
            box: list = [pins, pool.match_blocks([w.sequence_hash for w in ws[:2]]), pool.allocate(1)]
            box.append(box)  # a cycle: freed by the collector, inside some later core loop
            del box, pins
            pool.release_blocks(pool.match_blocks([rng.randint(1, 40) for _ in range(3)]))
            pool.upgrade_many(ws)
            check_invariants(pool)
    finally:
        gc.set_threshold(*old)
    gc.collect()
    check_invariants(pool, quiescent=True)


# ----------------------------------------------------------------------------- finalizers at every allocation

# The pool under finalizers that run at every allocation (Python 3.11 runs the cycle
# collector inside an allocation, 3.12+ at the next eval-breaker check: either way a
# collection, and the finalizers it runs, can land inside a batch call of the pool while it
# holds its (re-entrant) lock).
#
# Forced here on any version: a gc threshold of 1 (a collection at nearly every allocation
# of a tracked object), a ``gc.callbacks`` hook that audits the pool at the start of every
# collection and re-enters it (match, release, upgrade), and objects in reference cycles
# whose ``__del__`` re-enters the pool (gives handles and pins back, matches, allocates).
# Every audit checks what must hold at *any* point a Python line can run: counters and
# lists agree, each registered block is inactive exactly when nobody references it, the
# registry names registered blocks only (``check_invariants``).


class Reenter:
    """Holds handles and pins in a reference cycle; its ``__del__`` (run by the collector,
    wherever the next collection lands) gives them back and re-enters the pool."""

    def __init__(self, pool: BlockPool, strong: list, pins: object, muts: list, weaks: list, errors: list) -> None:
        self.pool, self.strong, self.pins, self.muts, self.weaks, self.errors = pool, strong, pins, muts, weaks, errors
        self.me = self

    def __del__(self) -> None:
        try:
            pool = self.pool
            check_invariants(pool)
            pool.release_blocks(self.strong)
            if not self.pins.consumed:  # (its own finalizer may have run first: same cycle)
                self.pins.release()
            up = pool.upgrade_many(self.weaks)
            check_invariants(pool)
            pool.release_blocks([h for h in up if h is not None])
            try:
                pool.allocate(1)  # dropped at once: back to Reset
            except PoolExhaustedError:
                pass
            del self.muts[:]  # live mutable handles dropped
            check_invariants(pool)
        except BaseException:  # noqa: BLE001 - a finalizer cannot raise: recorded for the test
            self.errors.append(traceback.format_exc())


@pytest.mark.timeout(240)
@pytest.mark.parametrize("publisher", [None, Sink])
def test_finalizers_at_every_allocation_keep_counters_and_lists_together(publisher: type | None) -> None:
    """The compiled core only: its transitions are atomic for finalizers (the reference,
    plain Python, specifies results, not atomicity)."""
    pool = new_pool(24, BlockPool, publisher() if publisher else None, dups=publisher is not None)
    errors: list[str] = []
    rng = random.Random(11)
    audits = [0]
    busy = [False]

    def audit(phase: str, info: dict) -> None:
        if phase != "start" or busy[0]:
            return
        busy[0] = True
        try:
            audits[0] += 1
            check_invariants(pool)
            got = pool.match_blocks(sorted(pool.resident())[:2])
            pool.release_blocks(got)
            check_invariants(pool)
        except BaseException:  # noqa: BLE001 - a gc callback cannot raise: recorded
            errors.append(traceback.format_exc())
        finally:
            busy[0] = False

    old = gc.get_threshold()
    gc.callbacks.append(audit)
    gc.set_threshold(1, 1, 1)
    try:
        for step in range(120):
            hs = [rng.randint(1, 30) for _ in range(rng.randint(1, 4))]
            try:
                ws = pool.register_downgrade(pool.allocate_complete([meta(h) for h in hs]))
                strong = pool.register_blocks(pool.allocate_complete([meta(h + 100) for h in hs[:2]]))
                pins = pool.pin_many(ws)
                Reenter(pool, strong + pool.match_blocks([w.sequence_hash for w in ws[:2]]), pins, pool.allocate(1), ws, errors)
                pool.release_blocks(pool.match_blocks([rng.randint(1, 30) for _ in range(3)]))
                pool.release_blocks([h for h in pool.upgrade_many(ws) if h is not None])
                if step % 7 == 0:
                    pool.evict(rng.randint(1, 4))
            except PoolExhaustedError:
                pass
            if errors:
                break
    finally:
        gc.set_threshold(*old)
        gc.callbacks.remove(audit)
    gc.collect()
    assert not errors, f"{len(errors)} failures inside finalizers / gc callbacks; the first:\n{errors[0]}"
    assert audits[0] > 100  # the hook did run inside the calls
    check_invariants(pool, quiescent=True)


# ----------------------------------------------------------------------------- threads


def _worker(pool: BlockPool, seed: int, steps: int, errors: list) -> None:
    rng = random.Random(seed)
    strong: list[ImmutableBlock] = []
    weaks: list[WeakBlock] = []
    pins: list = []
    try:
        for _ in range(steps):
            op = rng.randrange(10)
            hs = [rng.randint(1, 40) for _ in range(rng.randint(1, 4))]
            try:
                if op == 0:
                    strong.extend(pool.register_blocks(pool.allocate_complete([meta(h) for h in hs])))
                elif op == 1:
                    weaks.extend(pool.register_downgrade(pool.allocate_complete([meta(h) for h in hs])))
                elif op == 2:
                    strong.extend(pool.match_blocks(hs))
                elif op == 3 and strong:
                    k = rng.randint(1, len(strong))
                    batch, strong[:] = strong[:k], strong[k:]
                    pool.release_blocks(batch)
                elif op == 4 and strong:
                    strong.pop(rng.randrange(len(strong))).release()
                elif op == 5:
                    pool.evict(rng.randint(0, 3))
                elif op == 6 and weaks:
                    pins.append(pool.pin_many(rng.sample(weaks, min(len(weaks), 4))))
                elif op == 7 and pins:
                    pool.unpin_many(pins.pop(0))
                elif op == 8 and weaks:
                    strong.extend(h for h in pool.upgrade_many(rng.sample(weaks, min(len(weaks), 4))) if h is not None)
                elif op == 9:
                    muts = pool.allocate(rng.randint(0, 2))
                    if muts and rng.random() < 0.5:
                        muts[0].release()
                    del muts  # dropped live: back to Reset (possibly from a dealloc)
                if len(weaks) > 64:
                    del weaks[:32]
                if len(strong) > 12:
                    strong.pop(0)  # dropped live
            except PoolExhaustedError:
                strong[: len(strong) // 2] = []
    except BaseException as exc:  # noqa: BLE001 - reported by the test
        errors.append(exc)
    finally:
        del strong, pins


@pytest.mark.timeout(240)
@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_threads_hammering_one_pool_keep_the_invariants(cls: type[BlockPool]) -> None:
    sink = Sink()
    pool = new_pool(24, cls, sink)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)
    errors: list = []
    try:
        threads = [threading.Thread(target=_worker, args=(pool, seed, 2500, errors)) for seed in range(4)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(200)
        assert not any(t.is_alive() for t in threads), "deadlock"
    finally:
        sys.setswitchinterval(old)
    assert not errors, errors
    gc.collect()
    check_invariants(pool, quiescent=True)
    st_ = pool.stats()
    assert st_.stores_published - st_.removes_published == st_.registered_hashes
    stores = [h for k, h in sink.events if k == "STORE"]
    removes = [h for k, h in sink.events if k == "REMOVE"]
    assert len(stores) == st_.stores_published and len(removes) == st_.removes_published
    # per hash the events alternate Store, Remove, Store, ... (never two Stores in a row)
    last: dict[int, str] = {}
    for k, h in sink.events:
        assert last.get(h, "REMOVE") != k, (k, h)
        last[h] = k
    assert {h for h, k in last.items() if k == "STORE"} == set(pool._registry)


# ----------------------------------------------------------------------------- leaks


def _cycle(pool: BlockPool, rng: random.Random) -> None:
    hs = [rng.randint(1, 60) for _ in range(6)]
    strong = pool.register_blocks(pool.allocate_complete([meta(h) for h in hs[:3]]))
    weaks = pool.register_downgrade(pool.allocate_complete([meta(h) for h in hs[3:]]))
    pins = pool.pin_many(weaks)
    m = pool.match_blocks(hs)
    g = pool.get_many(hs)
    up = pool.upgrade_many(weaks)
    pool.release_blocks(strong[:1])
    strong[1].clone().downgrade()
    pool.downgrade_many(m)
    part = pool.allocate(1)[0].init_sequence(SALT)
    part.append_tokens([1, 2, 3, 4])
    pool.register(part.commit())  # dropped live at once
    for bad in ([strong[2], strong[2]], [strong[0]]):
        try:
            pool.release_blocks(bad)
        except (BlockStateError, ConsumedHandleError):
            pass
    try:
        pool.allocate(10**6)
    except PoolExhaustedError:
        pass
    pool.evict(2)
    del strong, weaks, pins, g, up, part  # dropped live


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_no_leak_over_many_cycles(cls: type[BlockPool]) -> None:
    pool = new_pool(64, cls, Sink())
    rng = random.Random(11)
    for _ in range(200):  # warm up (caches, freelists, dict growth)
        _cycle(pool, rng)
    pool._publisher.events.clear()
    pool.evict()  # no registry reference to any block at either measure point
    gc.collect()
    check_invariants(pool, quiescent=True)
    pool_refs = sys.getrefcount(pool)
    block_refs = [sys.getrefcount(b) for b in pool._blocks]
    tracemalloc.start()
    try:
        gc.collect()
        base = tracemalloc.get_traced_memory()[0]
        for i in range(1500):
            _cycle(pool, rng)
            if i % 100 == 0:
                pool._publisher.events.clear()
        pool._publisher.events.clear()
        for _ in range(50):
            _cycle(pool, rng)
        pool._publisher.events.clear()
        pool.evict()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    check_invariants(pool, quiescent=True)
    assert sys.getrefcount(pool) == pool_refs, "a handle or weak handle of the pool leaked"
    assert [sys.getrefcount(b) for b in pool._blocks] == block_refs
    assert grown < 64 * 1024, f"{grown} bytes kept after 1500 cycles"


def test_handle_freelist_reuse_keeps_types_and_state_apart() -> None:
    """Both handle types share one freelist: objects recycled across types must come back
    fully reinitialized (type, live flag, pool, block)."""
    pool = new_pool(8)
    for i in range(300):
        m = pool.allocate(2)
        s = pool.register_blocks(pool.allocate_complete([meta(i + 1)]))
        del m
        (r,) = pool.allocate(1)
        assert type(r) is MutableBlock and r._live and r._pool is pool and r.state is BlockState.RESET
        c = s[0].clone()
        assert type(c) is ImmutableBlock and c._live and c.sequence_hash == i + 1
        del r, s, c
        pool.evict()
    gc.collect()
    check_invariants(pool, quiescent=True)


# ----------------------------------------------------------------------------- eviction order vs the reference


OPS = st.lists(
    st.one_of(
        st.tuples(st.just("reg"), st.lists(st.integers(1, 24), min_size=1, max_size=5)),
        st.tuples(st.just("down"), st.lists(st.integers(1, 24), min_size=1, max_size=5)),
        st.tuples(st.just("match"), st.lists(st.integers(1, 24), min_size=1, max_size=5)),
        st.tuples(st.just("release"), st.integers(0, 8)),
        st.tuples(st.just("evict"), st.integers(0, 3)),
        st.tuples(st.just("pin"), st.integers(0, 8)),
    ),
    min_size=1,
    max_size=40,
)


@settings(max_examples=40, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(ops=OPS, dups=st.booleans())
def test_frequency_level_eviction_order_matches_the_reference(ops: list, dups: bool) -> None:
    pools = [new_pool(10, BlockPool, dups=dups), new_pool(10, RefPool, dups=dups)]
    held: list[list] = [[], []]
    weak: list[list] = [[], []]
    for op, arg in ops:
        results = []
        for k, pool in enumerate(pools):
            try:
                if op == "reg":
                    out = pool.register_blocks(pool.allocate_complete([meta(h) for h in arg]))
                    held[k].extend(out)
                    r = [h._block.block_id for h in out]
                elif op == "down":
                    w = pool.register_downgrade(pool.allocate_complete([meta(h) for h in arg]))
                    weak[k].extend(w)
                    r = [x._block.block_id for x in w]
                elif op == "match":
                    out = pool.match_blocks(arg)
                    held[k].extend(out)
                    r = [h._block.block_id for h in out]
                elif op == "release":
                    batch, held[k][:] = held[k][:arg], held[k][arg:]
                    pool.release_blocks(batch)
                    r = len(batch)
                elif op == "evict":
                    r = pool.evict(arg)
                else:
                    ws = weak[k][-arg:] if arg else []
                    pins = pool.pin_many(ws)
                    r = pins.lost
                    pins.release()
                results.append(("ok", r))
            except Exception as exc:  # noqa: BLE001 - compared
                results.append(("err", type(exc).__name__))
        assert results[0] == results[1], (op, arg)
        a, b = pools
        assert a.eviction_order() == b.eviction_order()
        assert [a._inactive.level_len(i) for i in range(4)] == [b._inactive.level_len(i) for i in range(4)]
        assert [(x.ref_count, x.frequency, x.generation, x.state) for x in a._blocks] == [
            (x.ref_count, x.frequency, x.generation, x.state) for x in b._blocks
        ]
    for k in range(2):  # released in the same order on both (not left to deallocation order)
        pools[k].release_blocks(held[k])
    out = batch = pins = None  # the last op's (already released) handles
    gc.collect()
    victims = []
    for pool in pools:
        check_invariants(pool, quiescent=True)
        order = []
        while (v := pool._inactive.pop_victim()) is not None:
            order.append((v.block_id, v.frequency))
        victims.append(order)
    assert victims[0] == victims[1]
    # the victims come level by level: frequency class never decreases along the order
    levels = [0 if f < 2 else 1 if f < 4 else 2 if f < 8 else 3 for _, f in victims[0]]
    assert levels == sorted(levels)


# ----------------------------------------------------------------------------- hand-built handles, core vs spec


def bug(reason: str) -> pytest.MarkDecorator:
    """A strict xfail for a real bug (an XPASS fails: drop the marker with the fix)."""
    return pytest.mark.xfail(strict=True, reason=reason)


ON_RESET_LIST = (  # the finding, fixed in 8fd24a9
    "MutableBlock(pool, block) is a public constructor and a mutable handle dropped live always "
    "appends its block to the Reset list (BlockPool._reset_block): a handle built on a block that is "
    "already on the Reset list (or a second one on an allocated block) puts the id there twice, and two "
    "later allocations share one physical block - the copy.copy bug of d9aaee9 by another door. Fix: "
    "a C flag on Block ('on the Reset list'), set where pool.py / _pool_core append an id and cleared "
    "where they pop one, checked by _reset_block (or make the handle constructors private: pools use "
    "_new_mutable / _new_immutable)."
)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_mutable_handle_built_on_a_reset_block_cannot_double_free_it(cls: type[BlockPool]) -> None:
    """Regression (hostile review; fixed in 8fd24a9: only pools make handles): ON_RESET_LIST."""
    pool = new_pool(4, cls)
    try:
        h = MutableBlock(pool, pool._blocks[0])  # block 0 is on the Reset list
    except (TypeError, BlockStateError):
        h = None
    del h
    gc.collect()
    check_invariants(pool, quiescent=True)


REGISTER_ANY_HANDLE = (  # the finding, fixed in 8fd24a9
    "register_blocks takes any live _Handle of the pool on a Complete block "
    "(isinstance(obj, _Handle) in _pool_core.register_blocks; pool_reference takes "
    "(MutableBlock, ImmutableBlock)): an ImmutableBlock built on a Complete block, a raw _Handle or a Python subclass of "
    "_Handle (the base class is neither final nor abstract) registers the block while its real "
    "MutableBlock stays live. release_blocks was made type-exact in d9aaee9; register_blocks should be "
    "too: type(obj) is MutableBlock (and _Handle made non-instantiable)."
)


@pytest.mark.parametrize("kind", ["immutable", "raw", "subclass"])
@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_register_blocks_takes_only_mutable_handles(cls: type[BlockPool], kind: str) -> None:
    """Regression (hostile review; fixed in 8fd24a9): REGISTER_ANY_HANDLE.  Refusing to build
    the hand-made handle at all (TypeError) closes it too."""
    pool = new_pool(4, cls)
    (m,) = pool.allocate_complete([meta(5)])
    make = {
        "immutable": ImmutableBlock,
        "raw": _pool_core._Handle,
        "subclass": type("Sub", (_pool_core._Handle,), {}),
    }[kind]
    try:
        h = make(pool, m._block)
    except TypeError:
        return
    with pytest.raises(BlockStateError):
        pool.register_blocks([h])
    assert m._live and m._block.state is BlockState.COMPLETE and 5 not in pool._registry


DEAD_HANDLE_ERROR = (  # the finding, fixed in 619f18d
    "BUG (error contract, both cores): a handle made through __new__ is a dead handle (consumed, no "
    "block; 8fd24a9), but a batch call given one raises AttributeError ('NoneType' object has no "
    "attribute 'block_id') from BlockPool._bad_handle, which formats b.block_id, instead of the "
    "documented ConsumedHandleError (register_blocks, release_blocks, downgrade_many). Fix: "
    "kvbm_runtime/pool.py _bad_handle: check `not h._live` before touching the block and name it "
    "'?' when h._block is None (as the handles' __repr__ does)."
)


@pytest.mark.parametrize("call", ["register_blocks", "release_blocks", "downgrade_many", "register_downgrade"])
@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_dead_handle_in_a_batch_raises_consumed_handle_error(cls: type[BlockPool], call: str) -> None:
    pool = new_pool(4, cls)
    t = ImmutableBlock if call in ("release_blocks", "downgrade_many") else MutableBlock
    dead = t.__new__(t)
    assert dead.consumed
    with pytest.raises(ConsumedHandleError):
        getattr(pool, call)([dead])
    check_invariants(pool, quiescent=True)


def test_allocate_complete_takes_an_iterator_on_both_cores() -> None:
    """Regression (hostile review; fixed in 8fd24a9): allocate_complete of a generator worked on
    the compiled core (tuple snapshot) but raised TypeError on pool_reference (len, slicing)."""
    out = []
    for cls in (BlockPool, RefPool):
        pool = new_pool(4, cls)
        try:
            hs = pool.allocate_complete(meta(h) for h in (1, 2))
            out.append(("ok", [h._block.block_id for h in hs]))
        except TypeError as exc:
            out.append(("err", str(exc)))
    assert out[0] == out[1]


def test_raw_and_subclassed_base_handles_in_cycles_do_not_crash() -> None:
    """A Python subclass of the (not final) handle base with a __dict__ is a GC type around a
    no_gc base: instances in reference cycles, collected, must not crash (child)."""
    proc = run_child(
        """
        import gc
        from kvbm_runtime import _pool_core as c
        gc.freeze()  # collect only what the loop makes (torch's heap made each collect slow)
        p = new_pool(8)
        Sub = type("Sub", (c._Handle,), {})
        for i in range(200):
            (s,) = p.register_blocks(p.allocate_complete([meta(i + 1)]))
            try:
                x = Sub(p, s._block)
            except TypeError:  # only pools make handles: a dead one through __new__
                x = Sub.__new__(Sub)
            x.me = x
            x.other = c._Handle.__new__(c._Handle)
            del x
            gc.collect()
            s.release()
            p.evict()
        print("ok")
        """
    )
    assert_child_ok(proc)


CYCLE_THROUGH_POOL = (  # the finding, fixed in 3780938
    "(memory leak) the handles are @cython.no_gc and WeakBlock is a msgspec Struct with gc=False, so "
    "the cycle collector never sees their reference to the pool. A reference cycle that goes through the "
    "pool - its event sink (or an on_flush / publisher callback) being an object that also keeps handles "
    "of that pool, e.g. an engine-side manager - is never collected: the pool, its layout (the KV "
    "memory) and the sink leak for the life of the process. The module docstring's 'a handle refers to "
    "its pool and block only ... cannot be part of a reference cycle' misses cycles through the pool. "
    "Fix: let _Handle traverse _pool (drop @cython.no_gc; keep the C __dealloc__), and gc=True on "
    "WeakBlock (kvbm_runtime/_pool_core.pyx _Handle, kvbm_runtime/block.py WeakBlock); or have handles "
    "refer to a pool-state object that never references user objects."
)


class HandleKeepingSink:
    """The pool's event sink that also keeps handles of that pool (an engine-side object)."""

    def __init__(self, kind: str) -> None:
        self.pool = new_pool(4, BlockPool, self)
        pool = self.pool
        self.held = {
            "strong": lambda: pool.register_blocks(pool.allocate_complete([meta(5)])),
            "mutable": lambda: pool.allocate(1),
            "weak": lambda: pool.register_downgrade(pool.allocate_complete([meta(5)])),
            "none": list,
        }[kind]()

    def publish(self, events: list) -> None:
        pass


@pytest.mark.parametrize("kind", ["none", "strong", "mutable", "weak"])
def test_pool_in_a_cycle_through_its_sink_is_collected(kind: str) -> None:
    """Regression (hostile review; fixed in 3780938): CYCLE_THROUGH_POOL."""
    sink = HandleKeepingSink(kind)
    ref = weakref.ref(sink.pool)
    del sink
    gc.collect()
    assert ref() is None, "pool (and its layout) kept alive by an uncollectable cycle"


@pytest.mark.timeout(120)
@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_threads_racing_to_release_the_same_handles(cls: type[BlockPool]) -> None:
    """Several threads release the same strong handles at once (one by one, in batches,
    through downgrade_many, by dropping their lists): each reference is given back exactly
    once, every loser gets ConsumedHandleError / BlockStateError, nothing else."""
    pool = new_pool(16, cls)
    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    try:
        for round_ in range(40):
            base = pool.register_blocks(pool.allocate_complete([meta(h) for h in range(1, 9)]))
            clones = [h.clone() for h in base for _ in range(3)]
            handles = base + clones
            random.Random(round_).shuffle(handles)
            wrong: list = []
            start = threading.Barrier(4)

            def racer(k: int, handles: list = handles, wrong: list = wrong, start: threading.Barrier = start) -> None:
                rng = random.Random(k)
                mine = list(handles)
                rng.shuffle(mine)
                start.wait()
                for i in range(0, len(mine), 3):
                    batch = mine[i : i + 3]
                    if k == 0:  # one by one: every handle is tried, so all end consumed
                        for h in batch:
                            try:
                                h.release()
                            except ConsumedHandleError:
                                pass
                        continue
                    try:
                        if k == 1:
                            pool.release_blocks(batch)
                        elif k == 2:
                            pool.downgrade_many(batch)
                        else:
                            del batch  # dropping a consumed or live reference: never a second release
                    except (ConsumedHandleError, BlockStateError):
                        pass
                    except BaseException as exc:  # noqa: BLE001 - reported
                        wrong.append(exc)

            threads = [threading.Thread(target=racer, args=(k,)) for k in range(4)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            assert not wrong, wrong
            del handles, base, clones
            gc.collect()
            check_invariants(pool, quiescent=True)
            assert all(b.ref_count == 0 for b in pool._blocks)
            pool.evict()
    finally:
        sys.setswitchinterval(old)


@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_a_release_during_a_failed_batchs_undo_waits_and_gives_the_reference_back(cls: type[BlockPool]) -> None:
    """A batch release that fails part-way makes its handles live again (under the pool's
    lock); a ``release()`` of one of them in that window must wait for the undo and then
    give its reference back, not see it consumed, raise, and leave it live for ever."""
    in_window = threading.Event()

    class SlowUndo(cls):  # type: ignore[valid-type, misc]
        def _unrelease(self, done: list) -> None:
            in_window.set()
            time.sleep(0.3)  # the lock is held: a release racing it shows the in-between state
            super()._unrelease(done)

    pool = new_pool(4, SlowUndo)
    (h,) = pool.register_blocks(pool.allocate_complete([meta(1)]))
    dead = h.clone()
    dead.release()
    batch_error: list = []
    t = threading.Thread(target=lambda: batch_error.append(pytest.raises(ConsumedHandleError, pool.release_blocks, [h, dead])))
    t.start()
    assert in_window.wait(10)
    h.release()  # consumed by the failed batch only for a moment: this release counts
    t.join(10)
    assert batch_error, "the batch with a consumed handle did not raise"
    with pytest.raises(ConsumedHandleError):
        h.release()
    block = next(b for b in pool._blocks if b.state is BlockState.REGISTERED)
    assert block.ref_count == 0
    del h, dead
    gc.collect()
    check_invariants(pool, quiescent=True)


def test_many_pools_created_and_dropped_give_their_memory_back() -> None:
    """The InactiveSet's C arrays (PyMem), the blocks and the handles of dropped pools are
    freed (tracemalloc sees PyMem allocations)."""

    def once() -> None:
        pool = new_pool(2048)
        hs = pool.register_downgrade(pool.allocate_complete([meta(h) for h in range(1, 1025)]))
        strong = pool.match_blocks([w.sequence_hash for w in hs[:512]])
        pins = pool.pin_many(hs[512:])
        del strong, pins, hs

    for _ in range(3):
        once()
    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        for _ in range(30):
            once()
        gc.collect()
        grown = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert grown < 256 * 1024, f"{grown} bytes kept after 30 pools of 2048 blocks"


ON_FLUSH_DEADLOCK = (  # the finding, fixed: EventPublisher runs on_flush outside its lock (_deliver)
    "BUG (deadlock, lock order): a pool hands its events to the publisher under the pool lock "
    "(BlockPool._emit_stores / _emit_removes -> publish_encoded, which takes the publisher's lock), while "
    "the publisher's timer thread calls on_flush under the publisher's lock (event_plane/publisher.py "
    "_timer_loop -> _flush_locked). An on_flush that reads the pool (pool.stats(), contains(), ...) takes "
    "the locks in the other order: both threads wait forever (seen within 1-3 s at 1 ms flushes). Fix: "
    "run on_flush after the publisher's lock is released (publisher.py), or publish the pool's events "
    "after its lock is released with their order kept (pool.py); at least document that on_flush must "
    "not call a pool publishing to this publisher."
)


def test_thread_holding_the_pool_lock_at_interpreter_exit_does_not_hang() -> None:
    """Daemon threads frozen by interpreter shutdown while holding the pool lock; live
    handles in globals given back during teardown: the process still exits."""
    proc = run_child(
        """
        import threading, time
        p = new_pool(64)
        held = p.register_blocks(p.allocate_complete([meta(h) for h in range(1000, 1010)]))
        muts = p.allocate(3)
        def spin():
            i = 0
            while True:
                i += 1
                with p._lock:
                    for _ in range(2000):
                        pass
                p.register_downgrade(p.allocate_complete([meta(i % 40 + 1)]))
        for _ in range(2):
            threading.Thread(target=spin, daemon=True).start()
        time.sleep(0.3)
        print("exiting")
        """,
        timeout=60,
    )
    assert_child_ok(proc)


def test_on_flush_reading_the_pool_does_not_deadlock() -> None:
    """The finding ON_FLUSH_DEADLOCK, fixed: on_flush runs outside the publisher's lock."""
    proc = run_child(
        """
        import time
        from event_plane.config import PublisherConfig
        from event_plane.urls import make_publisher
        faulthandler.dump_traceback_later(10, exit=True)  # a deadlock exits 1 with the stacks (imports done)
        pool = None
        flushes = [0]
        def on_flush(batch, payload):
            flushes[0] += 1
            pool.stats()
        cfg = PublisherConfig(max_events=100000, max_delay_s=0.001, min_delay_s=0.0005, adaptive_delay=False)
        pub = make_publisher("null://", "w1", config=cfg, on_flush=on_flush)
        pool = BlockPool("g2", make_layout("FullyContiguous", CFG, 64, torch.device("cpu"), MemoryKind.SYSTEM), pub)
        t0, i = time.time(), 0
        while time.time() - t0 < 5:
            i += 1
            pool.register_downgrade(pool.allocate_complete([meta(h) for h in range(i % 50 + 1, i % 50 + 9)]))
        pub.close()
        faulthandler.cancel_dump_traceback_later()
        assert flushes[0] > 0
        print("ok", i, flushes[0])
        """,
        timeout=60,
    )
    assert_child_ok(proc)


REGISTER_ITERATOR = (  # the finding, fixed in 619f18d
    "BUG (both cores; documented type Sequence, but the failure is silent corruption, not a clean "
    "error): register_blocks / register_downgrade given an iterator (a generator of handles): the core "
    "snapshots it (tuple), then BlockPool._register_loop indexes the consumed iterator - with a bad input "
    "`blocks[:bad]` raises TypeError before the undo (earlier inputs stay Registered with no Store, their "
    "handles consumed), and register_downgrade's `list(blocks)` is empty so a dedup raises IndexError "
    "with fresh blocks left Registered, ref 0, outside the inactive set. Fix (kvbm_runtime/pool.py): "
    "`blocks = blocks if isinstance(blocks, (list, tuple)) else list(blocks)` at the top of "
    "register_blocks / register_downgrade (allocate_complete already takes any iterable since 8fd24a9)."
)


@pytest.mark.parametrize(
    ("call", "case"),
    [
        pytest.param(call, case)
        for call in ("register_blocks", "register_downgrade")
        for case in ("bad_input", "dedup")
    ],
)
@pytest.mark.parametrize("cls", [BlockPool, RefPool])
def test_register_given_an_iterator_works_or_changes_nothing(cls: type[BlockPool], call: str, case: str) -> None:
    pool = new_pool(4, cls, Sink())
    if case == "dedup":
        pool.register_downgrade(pool.allocate_complete([meta(1)]))
    hs = pool.allocate_complete([meta(1), meta(2)] if case == "dedup" else [meta(3), meta(4)])
    if case == "bad_input":
        hs[1].release()
        with pytest.raises((ConsumedHandleError, TypeError)):
            getattr(pool, call)(h for h in hs)
        assert hs[0]._live and hs[0]._block.state is BlockState.COMPLETE and 3 not in pool._registry
    else:
        out = getattr(pool, call)(h for h in hs)
        assert len(out) == 2
        del out
    del hs
    gc.collect()
    check_invariants(pool, quiescent=True)
    st_ = pool.stats()
    assert st_.stores_published == len(pool._registry)


def test_collected_cycle_with_pool_inactive_set_and_many_handles_does_not_crash() -> None:
    """Since 3780938 the collector frees cycles through a pool; its handles (no_gc_clear) give
    back while the other members (the pool's dict, the blocks, the InactiveSet) may already be
    cleared: no crash under -X dev, every pool collected (child)."""
    proc = run_child(
        """
        import gc, weakref
        gc.freeze()  # collect only what the loop makes (torch's heap made each collect slow)
        class Sink:
            def publish(self, events):
                pass
        alive = 0
        for rnd in range(100):
            s = Sink()
            s.pool = new_pool(64)
            s.pool._publisher = s
            s.strong = s.pool.register_blocks(s.pool.allocate_complete([meta(h) for h in range(1, 33)]))
            s.clones = [h.clone() for h in s.strong]
            s.muts = s.pool.allocate(8)
            s.weaks = [h.weak() for h in s.strong]
            s.inactive, s.blocks = s.pool._inactive, list(s.pool._blocks)
            if rnd % 2:
                s.order = [s.inactive, s.blocks, s.strong]  # another clear order
            ref = weakref.ref(s.pool)
            del s
            gc.collect()
            alive += ref() is not None
        assert alive == 0, alive
        print("ok")
        """
    )
    assert_child_ok(proc)
