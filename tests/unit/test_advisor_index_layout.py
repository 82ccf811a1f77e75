"""PrefixIndex compact layout: derived views agree with the records, and memory per block.

The index keeps one record per block (children inside it), location bits with counts, and
held hashes (each with its storers) only for volumes; these tests check that every derived
view (``blocks_at``, ``count_at``, ``locations``, ``stats``, ``children``, ``orphans``,
``lookup``, the storers) equals what the block records themselves say, after any fold and
after a snapshot round trip.
"""

from __future__ import annotations

import gc
import tracemalloc

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advisor.index.prefix_index import PrefixIndex
from event_plane.codec import decode_batch, encode_batch
from event_plane.schema import EventBatch, cleared, remove, store

BS = 4096
HASHES = [1, 2, 3, 4, 5, 6, (1 << 64) - 1, (1 << 63) + 5]
LOCS = ["g1", "g2", "fast", "s3"]

event = st.tuples(
    st.sampled_from(["store", "store", "store", "remove", "cleared"]),
    st.sampled_from(HASHES),
    st.sampled_from([None, "same", *HASHES[:5]]),
    st.sampled_from(LOCS),
    st.sampled_from([None, None, {"hits": 2}, {"moved_from": "fast"}]),
)
batch = st.tuples(st.integers(0, 1), st.booleans(), st.lists(event, max_size=12))


def build(batches: list[tuple]) -> list[EventBatch]:
    """Batches of sources w0/w1; ``restart`` bumps the source's epoch (seq restarts at 0)."""
    epochs = {0: 1, 1: 1}
    seqs = {0: 0, 1: 0}
    out = []
    for i, (src, restart, events) in enumerate(batches):
        if restart:
            epochs[src] += 1
            seqs[src] = 0
        evs = []
        for kind, h, p, loc, extra in events:
            parent = h if p == "same" else p
            if kind == "store":
                evs.append(store(h, HASHES[0], parent, BS, loc, extra))
            elif kind == "remove":
                evs.append(remove(h, HASHES[0], parent, BS, loc))
            else:
                evs.append(cleared(loc))
        out.append(EventBatch(1, f"w{src}", epochs[src], seqs[src], 1_000 + i, evs))
        seqs[src] += 1
    return out


def check_views(idx: PrefixIndex) -> None:
    hs = set(idx.hashes())
    infos = {h: idx.block(h) for h in hs}
    per_loc: dict[str, set[int]] = {}
    for h, info in infos.items():
        assert info is not None and info.locations, h  # a block no location holds is forgotten
        for loc in info.locations:
            per_loc.setdefault(loc, set()).add(h)
    assert idx.locations() == sorted(per_loc)
    assert idx.stats()["blocks_per_location"] == {loc: len(s) for loc, s in sorted(per_loc.items())}
    storers = idx.dump()["storers"]
    for loc in ["w0/g1", "w0/g2", "w1/g1", "w1/g2", "fast", "s3"]:
        assert idx.blocks_at(loc) == per_loc.get(loc, set()), loc
        assert idx.count_at(loc) == len(per_loc.get(loc, ())), loc
        if "/" not in loc:  # a volume: every block there has at least one storer
            assert set(storers.get(loc, {})) == per_loc.get(loc, set()), loc
            assert all(srcs and set(srcs) <= {"w0", "w1"} for srcs in storers.get(loc, {}).values())
    for h in HASHES:
        assert idx.children(h) == {c for c, info in infos.items() if info.parent == h}, h
    assert idx.orphans() == {h for h, info in infos.items() if info.parent is not None and info.parent not in hs}
    assert all(info.orphan == (h in idx.orphans()) for h, info in infos.items())
    # lookup: for each location, the first n blocks are held there and block n+1 is not
    q = HASHES[:5]
    for loc, n in idx.lookup(q).items():
        assert n >= 1 and all(idx.holds(h, loc) for h in q[:n]), (loc, n)
        assert n == len(q) or not idx.holds(q[n], loc), (loc, n)
    for loc in per_loc:
        if loc not in idx.lookup(q):
            assert not idx.holds(q[0], loc)


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(batch, min_size=1, max_size=25))
def test_derived_views_match_the_block_records(batches: list[tuple]) -> None:
    idx = PrefixIndex()
    for b in build(batches):
        idx.apply_batch(b)
        check_views(idx)
    restored = PrefixIndex.from_state(idx.export_state())
    assert restored.dump() == idx.dump()
    check_views(restored)


def test_cleared_then_store_at_the_same_volume_in_one_batch() -> None:
    """The batch loop keeps the current location's hash set; Cleared must empty that same set."""
    idx = PrefixIndex()
    idx.apply_batch(EventBatch(1, "w0", 1, 0, 10, [store(1, 1, None, BS, "fast"), store(2, 1, 1, BS, "fast")]))
    idx.apply_batch(EventBatch(1, "w0", 1, 1, 20, [
        store(3, 3, None, BS, "fast"), cleared("fast"), store(4, 4, None, BS, "fast"), store(5, 4, 4, BS, "g1"),
    ]))
    assert idx.blocks_at("fast") == {4} and idx.count_at("fast") == 1
    assert sorted(idx.hashes()) == [4, 5] and idx.blocks_at("w0/g1") == {5}
    assert idx.stats()["blocks_per_location"] == {"fast": 1, "w0/g1": 1}
    assert idx.children(4) == {5} and idx.lookup([4, 5]) == {"fast": 1}
    assert idx.counters.forgotten == 3 and idx.counters.cleared == 1


def test_u64_parent_and_prefix_survive_the_c_records() -> None:
    """The compiled records keep u64 hashes >= 2**63 exactly (parent, prefix, key), off the wire."""
    big = [(1 << 64) - 1 - i for i in range(4)]
    idx = PrefixIndex()
    evs = [store(big[0], big[0], None, BS, "g1")] + [store(big[i], big[0], big[i - 1], BS, "g1") for i in range(1, 4)]
    idx.apply_batch(decode_batch(encode_batch(EventBatch(1, "w0", 1, 0, 10, evs))))
    assert sorted(idx.hashes()) == sorted(big)
    for i in range(1, 4):
        info = idx.block(big[i])
        assert info is not None and info.parent == big[i - 1] and info.prefix_hash == big[0]
        assert idx.children(big[i - 1]) == {big[i]}
    assert idx.lookup(big) == {"w0/g1": 4}
    assert idx.block(-1) is None and idx.block(1 << 64) is None and not idx.holds(1 << 64, "w0/g1")


def test_memory_per_block_is_at_most_200_bytes() -> None:
    """tracemalloc of everything the index keeps after folding 120k u64 blocks from 4 workers.

    Chains of 24 blocks share their first 4 blocks in groups of 8 requests; every request is
    stored by one worker and a quarter of them again by another (known block, new location).
    The batches are freed, so the count includes every int the index keeps.
    """
    m64 = (1 << 64) - 1

    def h64(i: int) -> int:
        return (i * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & m64

    def payload_batches():  # noqa: ANN202 - generator of EventBatch
        seq = {w: 0 for w in range(4)}
        nid = 0
        for r in range(6_000):
            shared = [h64(10_000_000 + (r // 8) * 4 + j) for j in range(4)]
            own = []
            for _ in range(20):
                own.append(h64(nid))
                nid += 1
            chain_ = shared + own
            for w in [r % 4] + ([(r + 1) % 4] if r % 4 == 0 else []):
                evs = [store(h, chain_[0], chain_[i - 1] if i else None, BS, "g1") for i, h in enumerate(chain_)]
                yield EventBatch(1, f"w{w}", 1, seq[w], 1_000 + r, evs)
                seq[w] += 1

    gc.collect()
    tracemalloc.start()
    try:
        base = tracemalloc.get_traced_memory()[0]
        idx = PrefixIndex()
        for b in payload_batches():
            idx.apply_batch(b)
        del b
        gc.collect()
        used = tracemalloc.get_traced_memory()[0] - base
    finally:
        tracemalloc.stop()
    assert len(idx) == 6_000 * 20 + 750 * 4
    per_block = used / len(idx)
    assert per_block <= 200, per_block
