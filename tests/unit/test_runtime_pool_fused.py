"""Fused pool operations of the offload path: ``register_downgrade`` and
``pin_many`` / ``unpin_many`` (docs/design.md §5): the same blocks, states, eviction order and
events as the strong-handle calls they replace, with no handle per block."""

from __future__ import annotations

import gc

import pytest
import torch

from event_plane import KVEvent, NullPublisher
from kvbm_runtime import (
    BlockMeta,
    BlockPool,
    BlockStateError,
    ConsumedHandleError,
    FullyContiguous,
    LayoutConfig,
    ModelFingerprint,
    salt_hash,
    sequence_hashes,
)
from kvbm_runtime.block import PinnedBlocks

CFG = LayoutConfig(num_layers=2, outer_dim=2, page_size=4, inner_dim=8, dtype=torch.float16)
SALT = salt_hash(ModelFingerprint("test/model", "float16", "FullyContiguous", 4))


class Capture:
    """A real NullPublisher whose flushed batches are collected in order."""

    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []
        self.publisher = NullPublisher("fused", on_flush=lambda batch, payload: self.batches.append(list(batch.events)))

    def events(self) -> list[tuple[str, int]]:
        self.publisher.flush()
        return [(e.type.name, e.sequence_hash) for b in self.batches for e in b]


def metas(n: int, start: int = 0) -> list[BlockMeta]:
    """A chain of ``n`` identities (tokens start, start+1, ...)."""
    hashes = sequence_hashes(list(range(start, start + 4 * n)), 4, SALT)
    return [
        BlockMeta(sequence_hash=h, parent_hash=None if i == 0 else hashes[i - 1], prefix_hash=hashes[0], salt=SALT)
        for i, h in enumerate(hashes)
    ]


def snapshot(pool: BlockPool) -> tuple:
    st = pool.stats()
    states = [(b.block_id, b.state.value, b.generation, b.ref_count, b.frequency) for b in pool._blocks]
    return (pool.eviction_order(), st, states, pool.resident(), [pool.copies(h) for h in sorted(pool.resident())])


def scenario(fused: bool, allow_duplicates: bool) -> tuple:
    """The same inputs through register_downgrade or register_blocks + downgrade_many:
    a hash registered earlier and inactive, one registered earlier and active, one
    twice in the batch, fresh ones."""
    cap = Capture()
    pool = BlockPool("g2", FullyContiguous(CFG, 12), cap.publisher, allow_duplicates=allow_duplicates)
    ms = metas(6)
    old_inactive, old_active = pool.register_blocks(pool.allocate_complete([ms[1], ms[4]]))
    old_inactive.release()
    pool.match_blocks([ms[1].sequence_hash])[0].release()  # frequency 2: level 1
    batch = [ms[0], ms[1], ms[2], ms[0], ms[4], ms[3], ms[5]]
    inputs = pool.allocate_complete(batch)
    if fused:
        weaks = pool.register_downgrade(inputs)
    else:
        weaks = pool.downgrade_many(pool.register_blocks(inputs))
    assert all(h.consumed for h in inputs)
    names = [(w._block.block_id, w._generation, w.sequence_hash) for w in weaks]
    after = snapshot(pool)
    old_active.release()
    final = snapshot(pool)
    events = cap.events()
    cap.publisher.close()
    return names, after, final, events


@pytest.mark.parametrize("allow_duplicates", [False, True])
def test_register_downgrade_is_register_then_downgrade(allow_duplicates: bool) -> None:
    fused = scenario(True, allow_duplicates)
    plain = scenario(False, allow_duplicates)
    assert fused == plain
    names, after, _, events = fused
    ms = metas(6)
    # one Store per hash, first copies only, in input order (ms[1] and ms[4] were earlier)
    assert events == [("STORE", ms[1].sequence_hash), ("STORE", ms[4].sequence_hash)] + [
        ("STORE", ms[i].sequence_hash) for i in (0, 2, 3, 5)
    ]
    assert [n[2] for n in names] == [ms[i].sequence_hash for i in (0, 1, 2, 0, 4, 3, 5)]
    order = after[0]
    if not allow_duplicates:
        # dedups name the existing blocks; ms[0] and ms[1] are used 2 and 3 times (level 1,
        # in the order their last reference went: ms[1] at input 1, ms[0] at input 3); ms[4]
        # is still held by the earlier strong handle (not inactive)
        assert names[3][0] == names[0][0]
        assert order == [ms[i].sequence_hash for i in (2, 3, 5)] + [ms[1].sequence_hash, ms[0].sequence_hash]
        assert after[1].dedup_hits == 3 and after[1].reset == 12 - 6
    else:
        assert len({n[0] for n in names}) == 7
        assert after[1].dedup_hits == 3 and after[1].reset == 12 - 9


def test_register_downgrade_weak_handles_upgrade_and_die_on_eviction() -> None:
    cap = Capture()
    pool = BlockPool("g2", FullyContiguous(CFG, 3), cap.publisher)
    ms = metas(3)
    weaks = pool.register_downgrade(pool.allocate_complete(ms))
    assert pool.stats().inactive == 3 and pool.eviction_order() == [m.sequence_hash for m in ms]
    h = weaks[1].upgrade()
    assert h is not None and h.sequence_hash == ms[1].sequence_hash
    h.release()
    assert pool.evict() == 3
    # evicted, then the same hash registered again in the same physical block: never resurrected
    again = pool.register_downgrade(pool.allocate_complete([ms[0]]))
    assert again[0]._block is weaks[0]._block and again[0].sequence_hash == weaks[0].sequence_hash
    assert weaks[0].upgrade() is None and not weaks[0].alive and again[0].alive
    # the upgrade counted a use of ms[1] (level 1): evicted last
    assert cap.events() == [("STORE", m.sequence_hash) for m in ms] + [
        ("REMOVE", ms[i].sequence_hash) for i in (0, 2, 1)
    ] + [("STORE", ms[0].sequence_hash)]
    cap.publisher.close()


def test_register_downgrade_bad_input_changes_nothing() -> None:
    cap = Capture()
    pool = BlockPool("g2", FullyContiguous(CFG, 4), cap.publisher)
    ms = metas(3)
    a, b, c = pool.allocate_complete(ms)
    c.release()
    before = snapshot(pool)
    with pytest.raises(ConsumedHandleError):
        pool.register_downgrade([a, b, c])
    with pytest.raises(BlockStateError, match="twice"):
        pool.register_downgrade([a, b, a])
    assert not a.consumed and not b.consumed and snapshot(pool) == before and cap.events() == []
    weaks = pool.register_downgrade([a, b])
    assert [w.sequence_hash for w in weaks] == [ms[0].sequence_hash, ms[1].sequence_hash]
    assert cap.events() == [("STORE", ms[0].sequence_hash), ("STORE", ms[1].sequence_hash)]
    cap.publisher.close()


def pinned_pool() -> tuple[Capture, BlockPool, list[BlockMeta], list]:
    cap = Capture()
    pool = BlockPool("g1", FullyContiguous(CFG, 4), cap.publisher)
    ms = metas(4)
    weaks = pool.register_downgrade(pool.allocate_complete(ms))
    return cap, pool, ms, weaks


def test_pin_many_is_upgrade_many_then_release_blocks() -> None:
    """Same ref counts, frequencies, lost blocks and eviction order as the strong handles."""
    runs = []
    for fused in (True, False):
        cap, pool, ms, weaks = pinned_pool()
        pool.match_blocks([ms[2].sequence_hash])[0].release()  # frequency 2
        (mb,) = pool.allocate(1)  # evicts ms[0] (LRU of level 0): Remove
        mb.release()
        order = [weaks[3], weaks[0], weaks[2], weaks[1]]
        if fused:
            pins = pool.pin_many(order)
            lost = pins.lost
            during = snapshot(pool)
            pool.unpin_many(pins)
        else:
            got = pool.upgrade_many(order)
            lost = [k for k, h in enumerate(got) if h is None]
            during = snapshot(pool)
            pool.release_blocks([h for h in got if h is not None])
        runs.append((lost, during, snapshot(pool), cap.events()))
        cap.publisher.close()
    assert runs[0] == runs[1]
    lost, during, after, events = runs[0]
    assert lost == [1]  # weaks[0]'s block was evicted: never resurrected
    assert during[0] == [] and during[1].active == 3  # pinned: none evictable
    # each pin counted a use (all at level 1 now), inactive again in the order given back
    assert after[0] == [ms[3].sequence_hash, ms[2].sequence_hash, ms[1].sequence_hash]
    assert events[-1] == ("REMOVE", ms[0].sequence_hash)


def test_pinned_blocks_cannot_be_evicted_and_are_given_back_once() -> None:
    cap, pool, ms, weaks = pinned_pool()
    pins = pool.pin_many(weaks[:2])
    assert isinstance(pins, PinnedBlocks) and len(pins) == 2 and pins.lost == []
    assert pool.evict() == 2  # only the two unpinned ones
    assert pool.resident() == {ms[0].sequence_hash, ms[1].sequence_hash}
    assert pool.available() == 2
    pins.release()
    assert pins.consumed and pool.available() == 4
    with pytest.raises(ConsumedHandleError):
        pool.unpin_many(pins)
    assert pool.stats().inactive == 2  # the second give-back changed nothing
    other = BlockPool("g2", FullyContiguous(CFG, 2))
    with pytest.raises(BlockStateError):
        other.pin_many(weaks[:1])
    pins2 = pool.pin_many(weaks[:1])
    with pytest.raises(BlockStateError):
        other.unpin_many(pins2)
    assert not pins2.consumed and pool.stats().active == 1
    # dropped without being given back: released when collected
    del pins2
    gc.collect()
    assert pool.stats().active == 0 and pool.stats().inactive == 2
    cap.publisher.close()


def test_register_downgrade_returns_the_callers_weak_handles_only_when_they_name_the_blocks() -> None:
    from kvbm_runtime.block import WeakBlock

    cap = Capture()
    pool = BlockPool("g2", FullyContiguous(CFG, 8), cap.publisher)
    ms = metas(4)

    def pre(handles: list) -> list[WeakBlock]:
        return [WeakBlock(pool, h._block, h._block.generation, h.sequence_hash) for h in handles]

    hs = pool.allocate_complete(ms[:2])
    given = pre(hs)
    out = pool.register_downgrade(hs, given)
    assert out is given and all(w.alive for w in out)
    # a dedup (ms[1] is registered): new handles, the dedup'd one on the existing block
    hs = pool.allocate_complete([ms[2], ms[1]])
    given = pre(hs)
    out = pool.register_downgrade(hs, given)
    assert out is not given and out[1]._block is not given[1]._block
    assert out[1].upgrade() is not None and not given[1].alive  # the reserved block went back to Reset
    assert out[0]._block is given[0]._block
    # a list of another length: new handles
    hs = pool.allocate_complete([ms[3]])
    given = pre(hs) * 2
    out = pool.register_downgrade(hs, given)
    assert out is not given and len(out) == 1 and out[0].sequence_hash == ms[3].sequence_hash
    assert cap.events() == [("STORE", m.sequence_hash) for m in (ms[0], ms[1], ms[2], ms[3])]
    cap.publisher.close()
