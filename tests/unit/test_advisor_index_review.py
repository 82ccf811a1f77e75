"""PrefixIndex regressions from the adversarial review.

* hit counts saturate at 2**64 - 1 (per block and globally), so snapshots always encode;
* Cleared of a shared volume from one source removes only what that source stored there
  (per-block storers), in agreement with ``event_plane.BlockTracker``;
* a late batch of a superseded epoch still applies its volume events, in order;
* location bits are given back when a location empties, so churning sources stay bounded;
* a ``storage_location`` that is empty, blank or contains ``/`` is rejected alone.
"""

from __future__ import annotations

import gc
import tracemalloc

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from advisor import AdvisorService, AdvisorSettings
from advisor.index.frequency import FrequencySketch
from advisor.index.prefix_index import U64_MAX, IndexStateError, PrefixIndex
from advisor.index.snapshot import decode_index, encode_index
from event_plane.codec import decode_batch, encode_batch
from event_plane.schema import EventBatch, cleared, remove, store
from event_plane.sdk import BlockTracker

BS = 4096


def B(src: str, epoch: int, seq: int, events: list, ts: int = 0) -> EventBatch:  # noqa: N802
    return EventBatch(1, src, epoch, seq, ts, events)


# ---------------------------------------------------------------- 1. hit saturation
def test_reported_hits_saturate_and_snapshots_still_encode() -> None:
    idx = PrefixIndex()
    poison = {"hits": U64_MAX}
    idx.apply_batch(decode_batch(encode_batch(B("w", 1, 0, [
        store(1, 1, None, BS, "g1", poison), store(1, 1, None, BS, "g2", poison)]))))
    assert idx.block(1).hits == U64_MAX and idx.counters.hits == U64_MAX
    # the inlined path (known block, new location, no metadata) saturates too
    idx.apply_batch(B("v", 1, 0, [store(1, 1, None, BS, "g1"), store(1, 1, None, BS, "fast")], ts=9))
    info = idx.block(1)
    assert info.hits == U64_MAX and info.last_access_ns == 9 and idx.counters.hits == U64_MAX
    again = decode_index(encode_index(idx))  # raised OverflowError before the fix
    assert again.dump() == idx.dump()


def test_hits_above_u64_from_direct_callers_are_clamped_and_feed_the_sketch() -> None:
    sketch = FrequencySketch()
    idx = PrefixIndex(frequency=sketch)
    idx.apply_batch(B("w", 1, 0, [store(1, 1, None, BS, "g1", {"hits": 1 << 70})]))
    idx.apply_batch(B("w", 1, 1, [store(1, 1, None, BS, "g2", {"hits": 1 << 70})]))
    assert idx.block(1).hits == U64_MAX and idx.counters.hits == U64_MAX
    assert sketch.estimate(1) == 256  # 255 saturated + doorkeeper; no numpy overflow
    encode_index(idx)


def test_service_keeps_snapshotting_after_a_poisoned_hit_count(tmp_path) -> None:  # noqa: ANN001
    # "w" may report hits without a cap (the default trusts no source: tests/security/test_forged_hits.py)
    s = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False, snapshot_every_batches=0,
                        snapshot_every_s=0, snapshot_on_stop=False, reported_hits_sources=["w"], reported_hits_cap=U64_MAX)
    svc = AdvisorService(s)
    svc.start()
    try:
        svc.ingest(B("w", 1, 0, [store(1, 1, None, BS, "g1", {"hits": U64_MAX}),
                                 store(1, 1, None, BS, "g2", {"hits": U64_MAX})]))
        assert svc.snapshot_now() == 1
        svc.ingest(B("w", 1, 1, [store(2, 1, 1, BS, "g1", {"hits": U64_MAX})]))
        assert svc.snapshot_now() == 2
        assert svc.index.block(1).hits == U64_MAX
    finally:
        svc.stop()


# ---------------------------------------------------------------- 2. Cleared of a shared volume
def test_cleared_volume_removes_only_what_that_source_stored() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("A", 1, 0, [store(1, 1, None, BS, "slow"), store(3, 3, None, BS, "slow")]))
    idx.apply_batch(B("B", 1, 0, [store(2, 2, None, BS, "slow"), store(3, 3, None, BS, "slow")]))
    idx.apply_batch(B("A", 1, 1, [cleared("slow")]))
    assert idx.blocks_at("slow") == {2, 3}  # B's block and the shared one stay
    assert idx.block(1) is None and idx.count_at("slow") == 2
    assert idx.dump()["storers"] == {"slow": {2: ("B",), 3: ("B",)}}
    idx.apply_batch(B("B", 1, 1, [cleared("slow")]))
    assert idx.blocks_at("slow") == set() and len(idx) == 0 and idx.counters.cleared == 2


def test_cleared_volume_keeps_blocks_the_advisor_moved_there() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("w0", 1, 0, [store(1, 1, None, BS, "slow"), store(2, 1, 1, BS, "slow")]))
    idx.apply_batch(B("advisor", 1, 0, [store(1, 1, None, BS, "fast", {"moved_from": "slow"}),
                                        remove(1, 1, None, BS, "slow")]))
    idx.apply_batch(B("w0", 1, 1, [store(2, 1, 1, BS, "fast"), cleared("fast"), cleared("slow")]))
    assert idx.blocks_at("fast") == {1}  # stored by the advisor, not by w0
    assert idx.blocks_at("slow") == set()
    assert idx.block(2) is None


def test_a_remove_on_a_volume_ends_the_residency_whoever_stored_it() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("A", 1, 0, [store(1, 1, None, BS, "slow")]))
    idx.apply_batch(B("B", 1, 0, [store(1, 1, None, BS, "slow"), remove(1, 1, None, BS, "slow")]))
    assert idx.block(1) is None and idx.dump()["storers"] == {}


def test_storers_survive_a_snapshot_and_a_version_1_state_imports() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("A", 1, 0, [store(1, 1, None, BS, "slow"), store(2, 1, 1, BS, "slow")]))
    idx.apply_batch(B("B", 1, 0, [store(2, 1, 1, BS, "slow"), store(2, 1, 1, BS, "g1")]))
    again = PrefixIndex.from_state(idx.export_state())
    assert again.dump() == idx.dump()
    again.apply_batch(B("A", 1, 1, [cleared("slow")]))
    assert again.blocks_at("slow") == {2}
    # a version-1 state had no storers: its volume residency belongs to no source
    v1 = idx.export_state()[:6]
    v1[0] = 1
    old = PrefixIndex.from_state(v1)
    assert old.dump()["storers"] == {"slow": {1: ("",), 2: ("",)}}
    old.apply_batch(B("A", 1, 1, [cleared("slow")]))
    assert old.blocks_at("slow") == {1, 2}
    old.apply_batch(B("A", 1, 2, [remove(1, 1, None, BS, "slow")]))
    assert old.blocks_at("slow") == {2}
    bad = idx.export_state()
    bad[6] = {"slow": {"A": [1]}}  # block 2 is held at slow but has no storer
    with pytest.raises(IndexStateError):
        PrefixIndex.from_state(bad)


SOURCES = ["a", "b", "c"]
LOCS = ["g1", "g2", "fast", "slow"]
HS = [1, 2, 3, 4, 5]
ev = st.tuples(
    st.sampled_from(["store", "store", "store", "remove", "cleared"]),
    st.sampled_from(HS),
    st.sampled_from([None, *HS]),
    st.sampled_from(LOCS),
)
bt = st.tuples(st.sampled_from(SOURCES), st.booleans(), st.lists(ev, max_size=8))


@settings(max_examples=200, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.lists(bt, min_size=1, max_size=30))
def test_index_and_sdk_tracker_agree_on_residency(log: list[tuple]) -> None:
    """Without volume Removes (where the index drops the shared copy whoever stored it) the
    index and the SDK's BlockTracker agree on every (block, location) after every batch.
    A hash keeps the parent of its first Store (sequence hashes are positional, so a block's
    parent never changes): the two folds differ on a re-Store with another lineage (the index
    keeps the first, the tracker the latest), which would make them judge parent cycles
    differently; with one lineage per hash they reject the same cycle-closing Stores."""
    idx, tr = PrefixIndex(), BlockTracker()
    epochs = dict.fromkeys(SOURCES, 1)
    seqs = dict.fromkeys(SOURCES, 0)
    lineage: dict[int, int | None] = {}
    for src, restart, evs in log:
        if restart:
            epochs[src] += 1
            seqs[src] = 0
        out = []
        for kind, h, parent, loc in evs:
            if kind == "store":
                out.append(store(h, h, lineage.setdefault(h, parent), BS, loc))
            elif kind == "remove" and loc in ("g1", "g2"):
                out.append(remove(h, h, parent, BS, loc))
            elif kind == "cleared":
                out.append(cleared(loc))
        batch = B(src, epochs[src], seqs[src], out)
        seqs[src] += 1
        idx.apply_batch(batch)
        assert tr.apply_batch(batch)
        assert set(idx.hashes()) == {b.sequence_hash for b in tr}
        assert idx.counters.parent_cycle_rejected == tr.stats().parent_cycle
        for h in HS:
            want = set()
            for s, loc in tr.holders(h):
                want.add(f"{s}/{loc}" if loc in ("g1", "g2") else loc)
            info = idx.block(h)
            assert (set(info.locations) if info else set()) == want, h
            for vol in ("fast", "slow"):
                storers = idx.dump()["storers"].get(vol, {}).get(h, ())
                assert set(storers) == {s for s, loc in tr.holders(h) if loc == vol}, (h, vol)


# ---------------------------------------------------------------- 3. late batch of an old epoch
def test_late_batch_of_a_superseded_epoch_applies_its_volume_events_in_order() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("A", 1, 0, [store(1, 1, None, BS, "g1"), store(9, 9, None, BS, "slow")]))
    idx.apply_batch(B("A", 2, 0, [store(5, 5, None, BS, "g1")]))
    late = B("A", 1, 1, [
        store(1, 1, None, BS, "slow"),   # applied
        store(2, 1, 1, BS, "g1"),        # that epoch's g1 is gone: ignored
        remove(5, 5, None, BS, "g1"),    # ignored (would hit the new epoch's g1)
        store(3, 3, None, BS, "fast"), remove(3, 3, None, BS, "fast"),  # in order: gone
        remove(4, 4, None, BS, "fast"), store(4, 4, None, BS, "fast"),  # in order: held
        remove(9, 9, None, BS, "slow"),
    ], ts=50)
    idx.apply_batch(late)
    assert idx.holds(1, "slow") and not idx.holds(1, "A/g1")
    assert idx.block(2) is None and idx.holds(5, "A/g1")
    assert idx.block(3) is None and idx.holds(4, "fast") and idx.block(9) is None
    c = idx.counters
    assert (c.stale_batches, c.stale_volume_events, c.restarts) == (1, 6, 1)
    assert idx.sources()["A"].epoch == 2 and idx.sources()["A"].last_seq == 0
    # a later epoch's batch and another late one of epoch 2
    idx.apply_batch(B("A", 3, 0, [store(6, 6, None, BS, "g1")]))
    idx.apply_batch(B("A", 2, 1, [store(7, 7, None, BS, "slow"), store(5, 5, None, BS, "g2")]))
    assert idx.holds(7, "slow") and idx.block(5) is None and idx.blocks_at("A/g1") == {6}


def test_stale_volume_stores_are_placement_only() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("A", 1, 0, [store(1, 1, None, BS, "slow")], ts=10))
    idx.apply_batch(B("A", 2, 0, [store(8, 8, None, BS, "g1")], ts=20))
    idx.apply_batch(B("A", 1, 1, [store(1, 1, None, BS, "fast"), cleared("slow"), cleared("g1")], ts=30))
    info = idx.block(1)
    assert info.locations == {"fast"} and info.hits == 0 and info.last_access_ns == 10
    assert idx.blocks_at("A/g1") == {8}  # the stale Cleared of g1 was ignored


# ---------------------------------------------------------------- 4. location bits reclaimed
def _max_mask_bits(idx: PrefixIndex) -> int:
    state = idx.export_state()
    flat = state[2]
    return max((m.bit_length() if isinstance(m, int) else max(m) + 1) for m in flat[4::7]) if flat else 0


@pytest.mark.parametrize("churn", ["cleared", "restart"])
def test_ten_thousand_churning_sources_keep_locations_and_masks_bounded(churn: str) -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("steady", 1, 0, [store(h, 100, None, BS, "g1") for h in range(100, 200)]))

    def pod(k: int) -> None:
        src = f"pod-{k}"
        idx.apply_batch(B(src, 1, 0, [store(5, 5, None, BS, "g1"), store(5, 5, None, BS, "g2"),
                                      store(6, 6, None, BS, "fast")]))
        if churn == "cleared":
            idx.apply_batch(B(src, 1, 1, [cleared("g1"), cleared("g2"), cleared("fast")]))
        else:  # a restart drops g1/g2; its volume block goes with a Remove
            idx.apply_batch(B(src, 2, 0, [remove(6, 6, None, BS, "fast")]))

    for k in range(200):  # warm up the allocator before measuring
        pod(k)
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for k in range(200, 10_200):
        pod(k)
    gc.collect()
    grown = tracemalloc.get_traced_memory()[0] - before
    tracemalloc.stop()
    assert len(idx.export_state()[1]) <= 4  # steady/g1 plus the bits the pods reuse
    assert _max_mask_bits(idx) <= 1
    assert idx.locations() == ["steady/g1"] and len(idx) == 100
    # what stays per departed source is its epoch record (SourceState), not location bits
    assert grown / 10_000 < 1_000, grown
    idx.apply_batch(B("late", 1, 0, [store(100, 100, None, BS, "g2")]))
    assert idx.block(100).locations == {"steady/g1", "late/g2"}
    assert _max_mask_bits(idx) <= 2


def test_freed_bits_survive_a_snapshot_and_are_reused() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("a", 1, 0, [store(1, 1, None, BS, "g1")]))
    idx.apply_batch(B("b", 1, 0, [store(2, 2, None, BS, "g1"), store(2, 2, None, BS, "fast")]))
    idx.apply_batch(B("a", 1, 1, [cleared("g1")]))
    state = idx.export_state()
    assert state[1] == ["", "b/g1", "fast"]
    again = PrefixIndex.from_state(state)
    assert again.dump() == idx.dump()
    for x in (idx, again):
        x.apply_batch(B("c", 1, 0, [store(2, 2, None, BS, "g2")]))
        assert x.export_state()[1] == ["c/g2", "b/g1", "fast"]
        assert x.lookup([2]) == {"b/g1": 1, "fast": 1, "c/g2": 1}
    assert again.dump() == idx.dump()
    bad = idx.export_state()
    bad[1] = ["", "b/g1", "fast"]  # block 2 uses bit 0, which this state says is free
    with pytest.raises(IndexStateError):
        PrefixIndex.from_state(bad)


def test_a_location_emptied_and_refilled_in_one_batch_keeps_its_bit() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("a", 1, 0, [store(1, 1, None, BS, "g1"), store(2, 2, None, BS, "fast")]))
    idx.apply_batch(B("a", 1, 1, [remove(1, 1, None, BS, "g1"), store(3, 3, None, BS, "g1"),
                                  cleared("fast"), store(4, 4, None, BS, "fast")]))
    assert idx.blocks_at("a/g1") == {3} and idx.blocks_at("fast") == {4}
    assert idx.export_state()[1] == ["a/g1", "fast"]


# ---------------------------------------------------------------- 5. location names
@pytest.mark.parametrize("bad", ["w/g1", "/", "x/", "", " ", "\t"])
def test_invalid_storage_locations_are_rejected_alone(bad: str) -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("w", 1, 0, [store(1, 1, None, BS, "g1")]))
    idx.apply_batch(B("x", 1, 0, [store(2, 2, None, BS, bad), store(3, 3, None, BS, "fast"),
                                  remove(1, 1, None, BS, bad), cleared(bad), store(4, 3, 3, BS, bad)]))
    assert idx.holds(1, "w/g1") and idx.block(2) is None and idx.block(4) is None
    assert idx.blocks_at("fast") == {3}
    assert idx.counters.invalid_locations == 4 and idx.counters.unknown_removes == 0
    idx.apply_batch(B("w", 2, 0, []))  # restart of w: its g1 goes, x's nothing
    idx.apply_batch(B("w", 1, 1, [store(5, 5, None, BS, bad), store(6, 6, None, BS, "fast")]))  # stale
    assert idx.block(1) is None and idx.block(5) is None and idx.blocks_at("fast") == {3, 6}
    assert idx.counters.invalid_locations == 5
    assert idx.locations() == ["fast"]


def test_volume_named_like_a_private_tier_cannot_alias_it() -> None:
    idx = PrefixIndex()
    idx.apply_batch(B("w", 1, 0, [store(1, 1, None, BS, "g1")]))
    idx.apply_batch(B("x", 1, 0, [cleared("w/g1"), remove(1, 1, None, BS, "w/g1")]))
    assert idx.holds(1, "w/g1") and idx.counters.cleared == 0
    with pytest.raises(ValueError):
        PrefixIndex.qualify("x", "w/g1")
    with pytest.raises(ValueError):
        PrefixIndex.qualify("x", " ")
    assert PrefixIndex.qualify("w", "g1") == "w/g1" and PrefixIndex.qualify("w", "fast") == "fast"
