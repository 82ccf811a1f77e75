"""BlockTracker (vendor SDK): idempotent apply rules, in-process (transport tests live in
tests/integration/test_event_sdk_transports.py)."""

from __future__ import annotations

from event_plane import EventBatch, cleared, remove, store
from event_plane.sdk import BlockTracker, SourcedEvent, iter_events
from event_plane.schema import PARENT_WALK_LIMIT


def b(source: str, epoch: int, seq: int, *events: object) -> EventBatch:
    return EventBatch(1, source, epoch, seq, 0, list(events))  # type: ignore[arg-type]


def test_orphans_are_kept_counted_and_linked_when_parent_arrives() -> None:
    t = BlockTracker()
    t.apply_batch(b("w", 1, 0, store(3, 1, 1, 64, "g1"), store(4, 1, 3, 64, "g1")))
    st = t.stats()
    assert (st.blocks, st.orphans, st.orphan_stores, st.orphans_linked) == (2, 1, 1, 0)
    assert t.is_orphan(3) and not t.is_orphan(4)
    assert t.match([1, 3, 4]) == 0
    t.apply_batch(b("w", 1, 1, store(1, 1, None, 64, "g1")))
    st = t.stats()
    assert (st.blocks, st.orphans, st.orphans_linked) == (3, 0, 1)
    assert t.match([1, 3, 4]) == 3
    assert t.match([1, 3, 5]) == 2 and t.match([1, 4]) == 1  # 4's parent is 3, not 1


def test_duplicate_store_batch_and_events_are_idempotent() -> None:
    t = BlockTracker()
    batch = b("w", 1, 0, store(1, 1, None, 64, "g1"), store(2, 1, 1, 64, "g1"), store(3, 1, 2, 64, "g1"))
    assert t.apply_batch(batch) is True
    assert t.apply_batch(batch) is False  # same seq again: ignored
    t.apply_batch(b("w", 1, 1, *batch.events))  # same Stores re-sent under a new seq
    st = t.stats()
    assert t.count_at("g1") == 3 and st.blocks == 3
    assert (st.stores, st.duplicate_stores, st.duplicate_batches) == (3, 3, 1)
    assert t.holders(2) == frozenset({("w", "g1")})


def test_removes_out_of_order_and_unknown() -> None:
    t = BlockTracker()
    t.apply_batch(b("w", 1, 0, store(10, 10, None, 64, "g1"), store(11, 10, 10, 64, "g1"), store(12, 10, 11, 64, "g1")))
    t.apply_batch(
        b(
            "w", 1, 1,
            remove(10, 10, None, 64, "g1"),
            remove(12, 10, 11, 64, "g1"),
            remove(11, 10, 10, 64, "g1"),
            remove(99, 99, None, 64, "g1"),
        )
    )
    st = t.stats()
    assert (st.blocks, st.orphans, st.removes, st.unknown_removes) == (0, 0, 3, 1)
    assert len(t) == 0 and t.count_at("g1") == 0
    t.apply_batch(b("w", 1, 2, store(10, 10, None, 64, "g1"), store(11, 10, 10, 64, "g1")))
    assert t.match([10, 11]) == 2


def test_self_parent_rejected_alone() -> None:
    t = BlockTracker()
    t.apply_batch(b("w", 1, 0, store(1, 1, None, 64, "g1"), store(2, 1, 2, 64, "g1"), store(3, 1, 1, 64, "g1")))
    st = t.stats()
    assert st.self_parent == 1 and st.stores == 2
    assert 2 not in t and 1 in t and 3 in t  # never "clear everything"
    assert t.match([1, 3]) == 2


def test_remove_at_one_location_keeps_the_other_and_sources_are_separate() -> None:
    t = BlockTracker()
    t.apply_batch(b("a", 1, 0, store(7, 7, None, 64, "g1"), store(7, 7, None, 64, "g2")))
    t.apply_batch(b("b", 2, 0, store(7, 7, None, 64, "g1")))
    t.apply_batch(b("a", 1, 1, remove(7, 7, None, 64, "g1")))
    assert t.holders(7) == frozenset({("a", "g2"), ("b", "g1")})
    assert t.match([7], "g2") == 1 and t.count_at("g1", "a") == 0 and t.count_at("g1") == 1
    t.apply_batch(b("a", 1, 2, remove(7, 7, None, 64, "g1")))  # already gone there
    assert t.stats().unknown_removes == 1


def test_new_epoch_drops_volatile_tiers_only_and_stale_batches_are_ignored() -> None:
    t = BlockTracker()
    t.apply_batch(b("w", 1, 0, store(1, 1, None, 64, "g1"), store(2, 2, None, 64, "g2"), store(3, 3, None, 64, "vol-a")))
    t.apply_batch(b("x", 5, 0, store(1, 1, None, 64, "g1")))
    t.apply_batch(b("w", 2, 0, store(4, 4, None, 64, "g1")))  # restart of w; seq 0 again is new
    assert t.holders(1) == frozenset({("x", "g1")})
    assert 2 not in t and t.holders(3) == frozenset({("w", "vol-a")}) and t.holders(4) == frozenset({("w", "g1")})
    assert t.apply_batch(b("w", 1, 1, store(9, 9, None, 64, "g1"))) is False  # old epoch
    st = t.stats()
    assert (st.restarts, st.stale_batches) == (1, 1) and 9 not in t


def test_cleared_empties_one_location_of_one_source() -> None:
    t = BlockTracker()
    t.apply_batch(b("w", 1, 0, store(1, 1, None, 64, "g1"), store(2, 1, 1, 64, "g1"), store(2, 1, 1, 64, "g2")))
    t.apply_batch(b("v", 1, 0, store(1, 1, None, 64, "g1")))
    t.apply_batch(b("w", 1, 1, cleared("g1")))
    assert t.holders(1) == frozenset({("v", "g1")}) and t.holders(2) == frozenset({("w", "g2")})
    assert t.stats().clears == 1
    assert t.forget_source("w") == 1 and 2 not in t


class _ListSub:
    def __init__(self, batches: list[EventBatch]) -> None:
        self.batches = batches

    def get(self, timeout: float | None = None) -> EventBatch | None:
        return self.batches.pop(0) if self.batches else None


def test_iter_events_yields_typed_events_in_order() -> None:
    e1, e2, e3 = store(1, 1, None, 1, "g1"), store(2, 1, 1, 1, "g1"), remove(1, 1, None, 1, "g1")
    got = list(iter_events(_ListSub([b("w", 3, 0, e1, e2), b("w", 3, 1, e3)]), timeout=0.01))  # type: ignore[arg-type]
    assert got == [SourcedEvent("w", 3, 0, 0, e1), SourcedEvent("w", 3, 0, 1, e2), SourcedEvent("w", 3, 1, 0, e3)]


def test_store_closing_a_parent_cycle_is_rejected_alone() -> None:
    """A -> B stored (an orphan), then B -> A: B would close a cycle, so it is rejected and
    counted like a self-parent; the rest of the batch applies. Also a longer cycle."""
    from event_plane.schema import EventBatch

    tr = BlockTracker()
    tr.apply_batch(EventBatch(1, "w", 1, 0, 0, [store(10, 10, 11, 4096, "g1"), store(20, 20, 21, 4096, "g1"),
                                                  store(21, 20, 22, 4096, "g1")]))
    tr.apply_batch(EventBatch(1, "w", 1, 1, 0, [store(11, 10, 10, 4096, "g1"), store(22, 20, 20, 4096, "g1"),
                                                  store(30, 30, None, 4096, "g1")]))
    st = tr.stats()
    assert st.parent_cycle == 2 and 11 not in tr and 22 not in tr and 30 in tr
    assert tr.is_orphan(10) and tr.is_orphan(21)


def _batch(source: str, seq: int, events: list) -> EventBatch:
    return EventBatch(1, source, 1, seq, 0, events)


def test_cycle_check_of_re_stored_blocks_with_children_is_amortized_o1() -> None:
    """Stores of new blocks whose children are held (re-stored after eviction) under the
    end of a 1,000-block chain: the first walks the chain, the next ones take the
    shortcut it left (the walk cost 1,000 links per Store before)."""
    tr = BlockTracker()
    chain = [store(h, 1, h - 1 if h > 1 else None, 64, "g1") for h in range(1, 1001)]
    tr.apply_batch(_batch("w", 0, chain))
    seq = 1
    for i in range(200):
        w, kid = 10_000 + 2 * i, 10_001 + 2 * i
        tr.apply_batch(_batch("w", seq, [store(kid, 1, w, 64, "g1"), store(w, 1, 1000, 64, "g1")]))
        seq += 1
        assert tr.match(list(range(1, 1001)) + [w, kid]) == 1002
    assert tr.cycle_walk_steps < 1000 + 200 * 2, tr.cycle_walk_steps
    assert tr.stats().parent_cycle == 0
    # a cycle through the shortcuts is still found: the chain's first block gets a parent
    # (an orphan-to-be) that is then stored under the chain's end
    tr.apply_batch(_batch("w", seq, [remove(1, 1, None, 64, "g1"), store(1, 1, 5000, 64, "g1"),
                                     store(5000, 1, 1000, 64, "g1")]))
    assert tr.stats().parent_cycle == 1 and 5000 not in tr


def test_cycle_check_agrees_with_a_one_link_at_a_time_walk_on_random_streams() -> None:
    """Shortcuts change the cost, never the answer: the same random stream of Stores and
    Removes over a few hashes (cuts and re-Stores included) rejects the same Stores as a
    tracker whose check walks one link at a time."""
    import random

    class Walking(BlockTracker):
        def _closes_cycle(self, h: int, parent: int) -> bool:
            x = parent
            for _ in range(PARENT_WALK_LIMIT):
                b = self._blocks.get(x)
                if b is None or b.parent_hash is None:
                    return False
                x = b.parent_hash
                if x == h:
                    return True
            return False

    # one lineage per hash: chains 1..10, 11..20, 21..30 where 1 hangs from 25, 11 from 5
    # and 21 from 15, so the three chains close one 30-block cycle when all are held
    lineage = {1: 25, 11: 5, 21: 15}
    seen = {"cycles": 0, "cuts": 0, "shortcut_hits": 0}
    for seed in range(30):
        rng = random.Random(seed)
        a, b = BlockTracker(), Walking()
        removes = (0.1, 0.2, 0.35)[seed % 3]
        for seq in range(300):
            evs = []
            for _ in range(rng.randrange(1, 6)):
                h = rng.randrange(1, 31)
                loc = rng.choice(["g1", "g2"])
                evs.append(remove(h, 1, None, 64, loc) if rng.random() < removes
                           else store(h, 1, lineage.get(h, h - 1), 64, loc))
            batch = _batch("w", seq, evs)
            a.apply_batch(batch)
            b.apply_batch(batch)
            assert a.stats() == b.stats(), (seed, seq)
            seen["shortcut_hits"] += bool(a._up)
        assert sorted(blk.sequence_hash for blk in a) == sorted(blk.sequence_hash for blk in b)
        seen["cycles"] += a.stats().parent_cycle
        seen["cuts"] += a._cut_gen
    assert all(n > 50 for n in seen.values()), seen  # the streams do exercise all three
