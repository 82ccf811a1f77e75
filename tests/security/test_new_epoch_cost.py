"""A new epoch of a source drops its ``g1``/``g2`` residency by reading that source's own
membership, not the whole table (a publisher restarting in a loop cost a scan of every
indexed block per restart: ~7 ms at 1M blocks). Behavioural: ``PrefixIndex.private_visits``
counts the membership entries read; the result stays the reference index's."""

from __future__ import annotations

from advisor.index.prefix_index import PrefixIndex
from advisor.index.reference import ReferencePrefixIndex
from event_plane.schema import WIRE_VERSION, EventBatch, remove, store

BS = 64


def fold(batches: list[EventBatch]) -> tuple[PrefixIndex, ReferencePrefixIndex]:
    idx, ref = PrefixIndex(), ReferencePrefixIndex()
    for b in batches:
        idx.apply_batch(b)
        ref.apply_batch(b)
    return idx, ref


def world(bulk: int = 50_000) -> list[EventBatch]:
    out = []
    for k in range(0, bulk, 5000):
        out.append(EventBatch(WIRE_VERSION, "bulk", 1, k // 5000, 1, [
            store((1 << 40) + i, (1 << 40) + k, (1 << 40) + i - 1 if i > k else None, BS, "fast")
            for i in range(k, k + 5000)]))
    out.append(EventBatch(WIRE_VERSION, "w1", 1, 0, 2, [store(h, 1, h - 1 if h > 1 else None, BS, "g1")
                                                        for h in range(1, 11)]
                          + [store(h, 1, h - 1 if h > 1 else None, BS, "g2") for h in range(1, 6)]))
    out.append(EventBatch(WIRE_VERSION, "w2", 1, 0, 3, [store(h, 100, None, BS, "g1") for h in range(100, 120)]))
    return out


def test_new_epoch_reads_only_the_sources_own_blocks() -> None:
    idx, ref = fold(world())
    before = idx.private_visits
    restart = EventBatch(WIRE_VERSION, "w1", 2, 0, 4, [])
    idx.apply_batch(restart)
    ref.apply_batch(restart)
    assert idx.private_visits - before == 15  # w1's 10 g1 + 5 g2 entries, of 50,035 blocks
    assert idx.count_at("w1/g1") == idx.count_at("w1/g2") == 0
    assert idx.count_at("w2/g1") == 20 and idx.count_at("fast") == 50_000
    assert idx.dump() == ref.dump()


def test_churn_does_not_grow_the_membership_and_a_restart_still_reads_little() -> None:
    batches = world(5000)
    seq = 1
    for _ in range(2000):  # store and remove the same block over and over
        batches.append(EventBatch(WIRE_VERSION, "w1", 1, seq, 5, [store(500, 500, None, BS, "g1"),
                                                                  remove(500, 500, None, BS, "g1")]))
        seq += 1
    idx, ref = fold(batches)
    before = idx.private_visits
    restart = EventBatch(WIRE_VERSION, "w1", 2, 0, 6, [])
    idx.apply_batch(restart)
    ref.apply_batch(restart)
    assert idx.private_visits - before <= 2 * 15 + 8  # live entries plus at most one array of slack
    assert idx.dump() == ref.dump()


def test_membership_is_rebuilt_by_a_snapshot_import_and_follows_bit_reuse() -> None:
    idx, ref = fold(world(5000))
    again = PrefixIndex.from_state(idx.export_state())
    # w1 empties its g2 (its bit is given back), then w3's g2 takes that bit
    batches = [EventBatch(WIRE_VERSION, "w1", 1, 1, 7, [remove(h, 1, None, BS, "g2") for h in range(1, 6)]),
               EventBatch(WIRE_VERSION, "w3", 1, 0, 8, [store(h, 300, None, BS, "g2") for h in range(300, 303)])]
    for b in batches:
        again.apply_batch(b)
        ref.apply_batch(b)
    before = again.private_visits
    restart = EventBatch(WIRE_VERSION, "w1", 2, 0, 9, [])
    again.apply_batch(restart)
    ref.apply_batch(restart)
    assert again.private_visits - before == 10  # w1's g1 only; w3's g2 (the reused bit) untouched
    assert again.count_at("w3/g2") == 3 and again.blocks_at("w3/g2") == {300, 301, 302}
    assert again.dump() == ref.dump()
