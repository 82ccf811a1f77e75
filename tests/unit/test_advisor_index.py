"""PrefixIndex: failure cases C2, C3, C5, C6, C8 (epoch rule), C11, lookup, hits."""

from __future__ import annotations

import random

import pytest

from advisor.index.prefix_index import PrefixIndex
from advisor.index.reference import PARENT_WALK_LIMIT, ReferencePrefixIndex
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch, cleared, remove, store

BS = 4096  # block size in bytes


class Feeder:
    """Builds batches with a correct per-source seq."""

    def __init__(self, source: str = "w0", epoch: int = 7) -> None:
        self.source = source
        self.epoch = epoch
        self.seq = 0
        self.ts = 1_000

    def batch(self, *events) -> EventBatch:  # noqa: ANN002
        b = EventBatch(1, self.source, self.epoch, self.seq, self.ts, list(events))
        self.seq += 1
        self.ts += 1_000
        return b

    def restart(self, epoch: int) -> None:
        self.epoch = epoch
        self.seq = 0


def chain(hashes: list[int], loc: str) -> list:
    out = []
    parent = None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


def test_orphans_are_kept_and_linked_when_the_parent_arrives() -> None:  # C2
    idx = PrefixIndex()
    f = Feeder()
    idx.apply_batch(f.batch(store(3, 1, 1, BS, "slow")))
    idx.apply_batch(f.batch(store(4, 1, 3, BS, "slow")))
    assert idx.counters.orphans == 1  # B3's parent unknown; B4's parent B3 is known
    assert idx.orphans() == {3}
    assert idx.block(3).orphan is True
    assert idx.lookup([1, 3, 4]) == {}
    idx.apply_batch(f.batch(store(1, 1, None, BS, "slow")))
    assert idx.orphans() == set()
    assert idx.counters.orphans_linked == 1
    assert idx.block(3).orphan is False
    assert idx.lookup([1, 3, 4]) == {"slow": 3}
    assert idx.children(1) == {3} and idx.children(3) == {4}


def test_duplicate_store_batch_keeps_counts() -> None:  # C3
    idx = PrefixIndex()
    f = Feeder()
    b = f.batch(*chain([10, 11, 12], "g1"), *chain([10, 11, 12], "fast"))
    idx.apply_batch(b)
    idx.apply_batch(b)
    st = idx.stats()
    assert st["blocks"] == 3
    assert st["blocks_per_location"] == {"fast": 3, "w0/g1": 3}
    assert idx.counters.duplicate_stores == 6
    assert idx.block(11).hits == 0  # a duplicate is not an access


def test_removes_out_of_order() -> None:  # C5
    idx = PrefixIndex()
    f = Feeder()
    idx.apply_batch(f.batch(*chain([0xA, 0xB, 0xC], "g1")))
    idx.apply_batch(f.batch(remove(0xA, 0xA, None, BS, "g1")))
    # descendants of a removed ancestor stay indexed, as orphans
    assert idx.block(0xB).orphan is True
    assert idx.lookup([0xB, 0xC]) == {"w0/g1": 2}
    idx.apply_batch(f.batch(remove(0xC, 0xA, 0xB, BS, "g1"), remove(0xB, 0xA, 0xA, BS, "g1")))
    idx.apply_batch(f.batch(remove(0x2, 0x2, None, BS, "g1")))  # Z, never stored
    assert len(idx) == 0
    assert idx.orphans() == set()
    assert idx.counters.unknown_removes == 1
    assert idx.stats()["blocks_per_location"] == {}
    idx.apply_batch(f.batch(*chain([0xA, 0xB], "g1")))
    assert idx.lookup([0xA, 0xB]) == {"w0/g1": 2}
    assert idx.orphans() == set()


def test_remove_at_one_tier_keeps_the_others() -> None:  # C6
    idx = PrefixIndex()
    f = Feeder()
    idx.apply_batch(f.batch(store(5, 5, None, BS, "g1"), store(5, 5, None, BS, "g2")))
    idx.apply_batch(f.batch(remove(5, 5, None, BS, "g1")))
    assert idx.block(5).locations == frozenset({"w0/g2"})
    assert idx.lookup([5]) == {"w0/g2": 1}
    idx.apply_batch(f.batch(remove(5, 5, None, BS, "g2")))
    assert idx.block(5) is None
    assert idx.lookup([5]) == {}


def test_remove_at_a_location_that_does_not_hold_the_block_is_counted() -> None:
    idx = PrefixIndex()
    f = Feeder()
    idx.apply_batch(f.batch(store(5, 5, None, BS, "g1")))
    idx.apply_batch(f.batch(remove(5, 5, None, BS, "slow")))
    other = Feeder("w1")
    idx.apply_batch(other.batch(remove(5, 5, None, BS, "g1")))  # w1/g1 never held it
    assert idx.counters.unknown_removes == 2
    assert idx.block(5).locations == frozenset({"w0/g1"})


def test_self_parent_store_is_rejected_alone() -> None:  # C11
    idx = PrefixIndex()
    f = Feeder()
    idx.apply_batch(f.batch(*chain([1, 2, 3], "g1")))
    idx.apply_batch(f.batch(store(9, 9, 9, BS, "g1"), store(4, 1, 3, BS, "g1")))
    assert idx.counters.self_parent_rejected == 1
    assert idx.block(9) is None
    assert len(idx) == 4
    assert idx.lookup([1, 2, 3, 4]) == {"w0/g1": 4}


def _fold(idx, batch: EventBatch, wire: bool) -> None:
    if wire:
        idx.apply_payload(encode_batch(batch))
    else:
        idx.apply_batch(batch)


FOLDS = [(PrefixIndex, False), (PrefixIndex, True), (ReferencePrefixIndex, False)]


@pytest.mark.parametrize("cls,wire", FOLDS, ids=["core", "core-wire", "reference"])
@pytest.mark.parametrize("length", [2, 3, 50, PARENT_WALK_LIMIT])
@pytest.mark.parametrize("one_batch", [False, True])
def test_store_closing_a_parent_cycle_is_rejected_alone(cls, wire: bool, length: int, one_batch: bool) -> None:
    """h1 -> h2 -> ... -> hN (each stored as an orphan of the next), then a Store of hN with
    parent h1 closes the cycle: it is rejected and counted like a self-parent, the rest of
    its batch applies, and the other members form an ordinary chain under an orphan root."""
    idx = cls()
    f = Feeder()
    hs = list(range(100, 100 + length))
    orphans = [store(h, hs[0], nxt, BS, "g1") for h, nxt in zip(hs, hs[1:])]
    closing = store(hs[-1], hs[0], hs[0], BS, "g1")
    if one_batch:
        _fold(idx, f.batch(*orphans, closing, *chain([7, 8], "g1")), wire)
    else:
        _fold(idx, f.batch(*orphans), wire)
        _fold(idx, f.batch(closing, *chain([7, 8], "g1")), wire)
    assert idx.counters.parent_cycle_rejected == 1
    assert idx.block(hs[-1]) is None
    assert idx.block(7) is not None and idx.block(8).parent == 7  # the rest of the batch applied
    assert [h for h in hs[:-1] if idx.block(h).orphan] == [hs[-2]]  # waiting for hs[-1]
    # every member can still leave: a Remove of each forgets it, nothing is kept by a cycle
    _fold(idx, f.batch(*[remove(h, hs[0], None, BS, "g1") for h in hs[:-1]]), wire)
    assert sorted(idx.hashes()) == [7, 8]
    # and the same hash stored with an honest parent later enters
    _fold(idx, f.batch(store(hs[-1], hs[0], 8, BS, "g1")), wire)
    assert idx.block(hs[-1]).parent == 8


@pytest.mark.parametrize("cls,wire", FOLDS, ids=["core", "core-wire", "reference"])
def test_parent_awaited_by_orphans_with_honest_parent_is_linked(cls, wire: bool) -> None:
    """The cycle check must not reject an honest out-of-order arrival: a block that orphans
    wait for, stored under a deep chain that does not contain it, is linked."""
    idx = cls()
    f = Feeder()
    deep = list(range(1, PARENT_WALK_LIMIT + 10))
    _fold(idx, f.batch(*chain(deep, "g1")), wire)
    _fold(idx, f.batch(store(50_001, 1, 50_000, BS, "g1")), wire)  # waits for 50_000
    _fold(idx, f.batch(store(50_000, 1, deep[-1], BS, "g1")), wire)
    assert getattr(idx.counters, "parent_cycle_rejected", 0) == 0
    assert not idx.block(50_001).orphan and idx.block(50_000).parent == deep[-1]


def test_new_epoch_drops_private_tiers_and_indexes_new_stores() -> None:  # C8
    idx = PrefixIndex()
    f = Feeder("w0", epoch=1)
    idx.apply_batch(f.batch(*chain([1, 2], "g1"), *chain([1, 2], "g2"), *chain([1, 2], "slow")))
    old = f.batch(store(3, 1, 2, BS, "g1"))  # seq 1 of epoch 1, delivered late
    f.restart(epoch=2)
    idx.apply_batch(f.batch(store(7, 7, None, BS, "g1")))  # seq 0 of the new epoch
    assert idx.counters.restarts == 1
    assert idx.blocks_at("w0/g1") == {7}
    assert idx.blocks_at("w0/g2") == set()
    assert idx.blocks_at("slow") == {1, 2}  # volumes are global and persistent
    assert idx.sources()["w0"].epoch == 2 and idx.sources()["w0"].last_seq == 0
    idx.apply_batch(old)
    assert idx.counters.stale_batches == 1
    assert idx.block(3) is None


def test_cleared_empties_only_that_sources_location() -> None:
    idx = PrefixIndex()
    a, b = Feeder("a"), Feeder("b")
    idx.apply_batch(a.batch(*chain([1, 2], "g1"), *chain([1, 2], "fast")))
    idx.apply_batch(b.batch(*chain([1, 2, 3], "g1")))
    idx.apply_batch(a.batch(cleared("g1")))
    assert idx.blocks_at("a/g1") == set()
    assert idx.blocks_at("b/g1") == {1, 2, 3}
    assert idx.blocks_at("fast") == {1, 2}
    assert idx.counters.cleared == 1


def test_lookup_longest_prefix_per_location() -> None:
    idx = PrefixIndex()
    f = Feeder()
    hs = [100, 101, 102, 103, 104]
    idx.apply_batch(f.batch(*chain(hs[:5], "g1")))
    idx.apply_batch(f.batch(*chain(hs[:3], "g2")))
    idx.apply_batch(f.batch(store(100, 100, None, BS, "slow"), store(102, 100, 101, BS, "slow")))
    assert idx.lookup(hs) == {"w0/g1": 5, "w0/g2": 3, "slow": 1}
    assert idx.lookup(hs[:2]) == {"w0/g1": 2, "w0/g2": 2, "slow": 1}
    assert idx.lookup([999] + hs) == {}
    assert idx.lookup([]) == {}
    assert idx.lookup_any(hs + [999, 100]) == 5


def test_parent_is_the_sequence_predecessor_not_the_last_written() -> None:  # C1 (index side)
    idx = PrefixIndex()
    f = Feeder()
    h = [0x10, 0x11, 0x12, 0x13, 0x14, 0x15]
    idx.apply_batch(f.batch(store(h[0], h[0], None, BS, "fast"), store(h[1], h[0], h[0], BS, "fast"),
                            store(h[3], h[0], h[2], BS, "fast")))
    idx.apply_batch(f.batch(store(h[2], h[0], h[1], BS, "fast"), store(h[4], h[0], h[3], BS, "fast"),
                            store(h[5], h[0], h[4], BS, "fast")))
    assert idx.lookup(h) == {"fast": 6}
    assert idx.orphans() == set()
    assert [idx.block(x).parent for x in h] == [None, h[0], h[1], h[2], h[3], h[4]]


def test_hits_count_reuse_not_offload_or_moves() -> None:
    idx = PrefixIndex()
    w0, w1, adv = Feeder("w0"), Feeder("w1"), Feeder("advisor")
    w1.ts = adv.ts = 50_000  # later than w0's batches
    # w0 computes, writes through to g2 and to the slow volume: no hit
    idx.apply_batch(w0.batch(store(1, 1, None, BS, "g1"), store(1, 1, None, BS, "g2"), store(1, 1, None, BS, "slow")))
    assert idx.block(1).hits == 0
    first_access = idx.block(1).last_access_ns
    # w1 onboards it from the slow volume: a hit
    idx.apply_batch(w1.batch(store(1, 1, None, BS, "g1")))
    assert idx.block(1).hits == 1
    assert idx.block(1).last_access_ns > first_access
    # the advisor moves it: no hit, last access unchanged
    t = idx.block(1).last_access_ns
    idx.apply_batch(adv.batch(store(1, 1, None, BS, "fast", {"moved_from": "slow"}), remove(1, 1, None, BS, "slow")))
    assert idx.block(1).hits == 1 and idx.block(1).last_access_ns == t
    # reported hits from a partner
    idx.apply_batch(w1.batch(store(1, 1, None, BS, "s3", {"hits": 3})))
    assert idx.block(1).hits == 4
    assert idx.counters.hits == 4


def test_same_log_twice_gives_the_same_state() -> None:
    rng = random.Random(5)
    batches = []
    feeders = [Feeder(f"w{i}", epoch=i + 1) for i in range(3)]
    for n in range(300):
        f = rng.choice(feeders)
        if rng.random() < 0.02:
            f.restart(rng.getrandbits(64))
        evs = []
        for _ in range(rng.randint(1, 8)):
            h = rng.randint(1, 60)
            parent = h - 1 if h > 1 and rng.random() < 0.9 else None
            loc = rng.choice(["g1", "g2", "fast", "slow", "s3"])
            kind = rng.random()
            if kind < 0.6:
                evs.append(store(h, 1, parent, BS, loc))
            elif kind < 0.97:
                evs.append(remove(h, 1, parent, BS, loc))
            else:
                evs.append(cleared(loc))
        batches.append(f.batch(*evs))
    a, b = PrefixIndex(), PrefixIndex()
    for batch in batches:
        a.apply_batch(batch)
    for batch in batches:
        b.apply_batch(batch)
    assert a.dump() == b.dump()
    assert a.dump()["blocks"]  # the log left something to compare
    # every pending orphan really has an unindexed parent, and no linked block is marked orphan
    for h in a.hashes():
        info = a.block(h)
        assert info.orphan == (info.parent is not None and info.parent not in a)
