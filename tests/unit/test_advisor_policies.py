"""Policies and planner: expected plans, in order, with reasons."""

from __future__ import annotations

from dataclasses import dataclass

import pytest
from pydantic import ValidationError

from advisor.index.prefix_index import PrefixIndex
from advisor.policy.plan import PlanItem, PlanKind
from advisor.moves.planner import Planner
from advisor.policy.policies import (
    CompactionSettings,
    DemotionSettings,
    PlannerSettings,
    PolicyInput,
    PolicySettings,
    PromotionSettings,
    VolumeUsage,
    plan_all,
    plan_compactions,
    plan_demotions,
    plan_promotions,
)
from event_plane.schema import EventBatch, store
from storage_backends.types import BlockKey, Placement

BS = 1000
NS = "model-ns"


@dataclass
class Seg:
    segment_id: int
    volume_id: str
    size_bytes: int
    live_bytes: int
    live_blocks: int
    sealed: bool = True


class Log:
    def __init__(self) -> None:
        self.idx = PrefixIndex()
        self.seq: dict[str, int] = {}
        self.ts = 0

    def apply(self, source: str, *events) -> None:  # noqa: ANN002
        seq = self.seq.get(source, 0)
        self.seq[source] = seq + 1
        self.ts += 10
        self.idx.apply_batch(EventBatch(1, source, 1, seq, self.ts, list(events)))


def chain_events(hashes: list[int], loc: str) -> list:
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


def inp(**usage: VolumeUsage) -> PolicyInput:
    return PolicyInput("fast", ["slow"], "s3", usage=dict(usage))


def test_promotion_of_blocks_hit_twice_on_slow_ancestors_first() -> None:
    log = Log()
    log.apply("w0", *chain_events([1, 2, 3], "slow"))  # written by w0 (no g1 copy recorded): no hits
    # w1 and w2 onboard blocks 1-3; w3 onboards 1-2 again: 1,2 hit 3 times, 3 hit twice
    for w in ("w1", "w2"):
        log.apply(w, *chain_events([1, 2, 3], "g1"))
    log.apply("w3", *chain_events([1, 2], "g1"))
    log.apply("w1", store(9, 9, None, BS, "g1"), store(9, 9, None, BS, "slow"))  # offload: 0 hits
    items = plan_promotions(PromotionSettings(), inp(fast=VolumeUsage(100_000, 0, 0)), log.idx)
    assert [(i.kind, i.sequence_hash, i.src_volume, i.dst_volume) for i in items] == [
        (PlanKind.PROMOTE, 1, "slow", "fast"),
        (PlanKind.PROMOTE, 2, "slow", "fast"),
        (PlanKind.PROMOTE, 3, "slow", "fast"),
    ]
    assert items[0].reason.startswith("hits=3 >= min_hits=2 on slow volume 'slow'")
    assert items[2].reason.startswith("hits=2 >= min_hits=2")
    assert all(i.bytes == BS for i in items)
    # a child hotter than its parent still comes after it
    log.apply("w4", store(3, 1, 2, BS, "g1"), store(3, 1, 2, BS, "g1"))
    log.apply("w5", store(3, 1, 2, BS, "g1"))
    log.apply("w6", store(3, 1, 2, BS, "g1"))
    assert log.idx.block(3).hits == 5
    items = plan_promotions(PromotionSettings(), inp(fast=VolumeUsage(100_000, 0, 0)), log.idx)
    assert [i.sequence_hash for i in items] == [1, 2, 3]
    # the fast volume's fill limit caps the plan (80% of 3,500 = 2,800 bytes: two blocks)
    items = plan_promotions(PromotionSettings(max_fill=0.8), inp(fast=VolumeUsage(3_500, 0, 0)), log.idx)
    assert [i.sequence_hash for i in items] == [1, 2]
    # blocks already on fast are not promoted
    log.apply("advisor", store(1, 1, None, BS, "fast", {"moved_from": "slow"}))
    items = plan_promotions(PromotionSettings(min_hits=3), inp(fast=VolumeUsage(100_000, 0, 0)), log.idx)
    assert [i.sequence_hash for i in items] == [2, 3]


def placements(hashes: list[int], vol: str = "fast") -> list[Placement]:
    return [Placement(BlockKey(NS, h), vol, 1, i * BS, BS, 0) for i, h in enumerate(hashes)]


def test_demotion_moves_lru_leaves_first_until_the_low_watermark() -> None:
    log = Log()
    log.apply("w0", *chain_events([1, 2, 3], "fast"))  # chain A, oldest
    log.apply("w0", *chain_events([10, 11], "fast"))  # chain B
    log.apply("w1", *chain_events([10, 11], "g1"))  # chain B accessed again (newest)
    on_fast = placements([1, 2, 3, 10, 11, 77])  # 77: on the volume, unknown to the index
    usage = VolumeUsage(capacity_bytes=7_000, used_bytes=6_000, live_bytes=6_000)  # 85.7% > 80%
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": usage}, fast_placements=on_fast)
    items = plan_demotions(DemotionSettings(high_watermark=0.8, low_watermark=0.3, scoring="lru"), pin, log.idx)
    # need 6000 - 2100 = 3900 bytes -> 4 blocks: unknown 77 first, then chain A leaf to root;
    # one tier down: to the slow volume (its usage unknown: not known to be full)
    assert [i.sequence_hash for i in items] == [77, 3, 2, 1]
    assert all(i.kind is PlanKind.DEMOTE and i.src_volume == "fast" and i.dst_volume == "slow" for i in items)
    assert all(i.namespace == NS for i in items)
    assert "above" not in items[0].reason and "> high watermark 80.0%" in items[0].reason
    # under the high watermark: nothing
    pin.usage["fast"] = VolumeUsage(7_000, 5_000, 5_000)
    assert plan_demotions(DemotionSettings(), pin, log.idx) == []
    # over it only through dead bytes: compaction's job, not demotion's
    pin.usage["fast"] = VolumeUsage(7_000, 6_500, 1_000)
    assert plan_demotions(DemotionSettings(), pin, log.idx) == []


def test_demotion_evacuates_a_sparse_segment_when_compaction_has_no_room() -> None:
    log = Log()
    log.apply("w0", *chain_events([1, 2, 3], "fast"), *chain_events([20, 21], "fast"))
    # segment 1 holds 1,2,3 (of 8 slots: 37.5% live); segment 2 holds 20,21 (of 4 slots)
    on_fast = [Placement(BlockKey(NS, h), "fast", 1, i * BS, BS, 0) for i, h in enumerate([1, 2, 3])]
    on_fast += [Placement(BlockKey(NS, h), "fast", 2, i * BS, BS, 0) for i, h in enumerate([20, 21])]
    segs = {"fast": [Seg(1, "fast", 8 * BS, 3 * BS, 3), Seg(2, "fast", 4 * BS, 2 * BS, 2)]}
    # 12 of 13 blocks used (92%), 5 live (38% < low 60%): only dead space is in excess, and
    # 1 free block cannot hold either segment's live blocks -> evacuate segment 1, leaves first
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": VolumeUsage(13 * BS, 12 * BS, 5 * BS)},
                      fast_placements=on_fast, segments=segs)
    items = plan_demotions(DemotionSettings(scoring="lru"), pin, log.idx, compact_below=0.5)
    assert [(i.sequence_hash, i.dst_volume) for i in items] == [(3, "slow"), (2, "slow"), (1, "slow")]
    assert "no room to compact" in items[0].reason and "evacuating segment 1 (37.5% live)" in items[0].reason
    # with 3 free blocks, segment 1 (3 live, 37.5% < 55%) can be compacted: no demotion
    pin.usage["fast"] = VolumeUsage(15 * BS, 12 * BS, 5 * BS)
    assert plan_demotions(DemotionSettings(high_watermark=0.7), pin, log.idx, compact_below=0.55) == []


def test_compaction_of_sparse_segments_sparsest_first() -> None:
    segs = {
        "slow": [Seg(1, "slow", 1000, 900, 9), Seg(2, "slow", 1000, 100, 1), Seg(3, "slow", 1000, 0, 0)],
        "s3": [Seg(7, "s3", 1000, 400, 4)],
    }
    pin = PolicyInput("fast", ["slow"], "s3", segments=segs)
    items = plan_compactions(CompactionSettings(live_fraction=0.5), pin)
    assert [(i.src_volume, i.segment_id, i.bytes) for i in items] == [("slow", 2, 100), ("s3", 7, 400)]
    assert items[0].reason == "segment 2 of 'slow' is 10.0% live < 50.0% (1 live blocks, 900 dead bytes)"
    assert plan_compactions(CompactionSettings(live_fraction=0.05), pin) == []
    assert plan_compactions(CompactionSettings(min_dead_bytes=700), pin)[0].segment_id == 2
    assert len(plan_compactions(CompactionSettings(min_dead_bytes=700), pin)) == 1


def test_compaction_waits_for_room_to_rewrite_live_blocks() -> None:
    segs = {"fast": [Seg(1, "fast", 500, 200, 2), Seg(2, "fast", 400, 100, 1), Seg(3, "fast", 1000, 300, 3),
                     Seg(4, "fast", 100, 90, 1, sealed=False)]}
    # sparsest first: 2 (25%), 3 (30%), 1 (40%); 1,900 of 2,000 bytes used leaves room for
    # segment 2's 100 live bytes only; rewriting it frees 300, enough for segment 3 (300 live),
    # which frees 700, enough for segment 1; the unsealed segment 4 is never planned
    pin = PolicyInput("fast", [], None, usage={"fast": VolumeUsage(2_000, 1_900, 600)}, segments=segs)
    assert [i.segment_id for i in plan_compactions(CompactionSettings(), pin)] == [2, 3, 1]
    pin.usage["fast"] = VolumeUsage(2_000, 1_950, 600)
    assert [i.segment_id for i in plan_compactions(CompactionSettings(), pin)] == []


def test_planner_rate_limits_and_dedup() -> None:
    def move(h: int, b: int = 100) -> PlanItem:
        return PlanItem(PlanKind.PROMOTE, "r", "slow", "fast", sequence_hash=h, bytes=b)

    def comp(seg: int, b: int = 100) -> PlanItem:
        return PlanItem(PlanKind.COMPACT, "r", "slow", None, segment_id=seg, bytes=b)

    p = Planner(PlannerSettings(max_moves_per_round=2, max_bytes_per_round=10_000, max_compactions_per_round=1))
    plan = p.plan([move(1), move(1), move(2), move(3), comp(5), comp(6)])
    assert [(i.kind, i.sequence_hash, i.segment_id) for i in plan.items] == [
        (PlanKind.PROMOTE, 1, None), (PlanKind.PROMOTE, 2, None), (PlanKind.COMPACT, None, 5)]
    assert plan.duplicates == 1 and plan.deferred == 2
    p = Planner(PlannerSettings(max_bytes_per_round=250))
    plan = p.plan([move(1), move(2, 200), move(3, 50), comp(1, 101)])
    assert [i.sequence_hash for i in plan.items] == [1, 3]  # 100 + 50; the 200-byte one waits
    assert plan.deferred == 2


def test_promotions_and_swaps_plan_only_movable_blocks() -> None:
    """PolicyInput.movable: a block another planner moves (scaled mode: a trunk block of
    another partition's, held in every partition's index) is never planned, and takes no
    promotion budget."""
    log = Log()
    log.apply("w0", *chain_events([1, 2, 3], "slow"))
    for w in ("w1", "w2"):
        log.apply(w, *chain_events([1, 2, 3], "g1"))
    full = plan_promotions(PromotionSettings(), inp(fast=VolumeUsage(100_000, 0, 0)), log.idx)
    assert [i.sequence_hash for i in full] == [1, 2, 3]
    pin = inp(fast=VolumeUsage(2_500, 0, 0))  # room for two blocks: both go to movable ones
    pin.movable = lambda h: h != 1
    items = plan_promotions(PromotionSettings(max_fill=1.0), pin, log.idx)
    assert [i.sequence_hash for i in items] == [2, 3]
    # swaps (the case of test_advisor_stable_moves): a full fast volume whose cold leaf would
    # make room for the hot block 7, which is not ours to move
    log = Log()
    log.apply("w0", *chain_events([1], "fast"), *chain_events([2], "fast"))
    log.apply("w0", *chain_events([7], "slow"))
    for w in ("w1", "w2", "w3"):
        log.apply(w, *chain_events([7], "g1"))
    st = PolicySettings()
    st.demotion.scoring = "lru"
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": VolumeUsage(10 * BS, 7 * BS, 2 * BS)},
                      fast_placements=placements([1, 2]))
    assert 7 in {i.sequence_hash for i in plan_all(st, pin, log.idx)}
    pin.movable = lambda h: h != 7
    assert 7 not in {i.sequence_hash for i in plan_all(st, pin, log.idx)}
    pin.usage["fast"] = VolumeUsage(4 * BS, 3 * BS, 2 * BS)  # no room: the cold leaf 1 makes way for 7
    pin.movable = None
    assert [(i.sequence_hash, i.reason.startswith("swap")) for i in plan_all(st, pin, log.idx)] == [(1, True)]
    pin.movable = lambda h: h != 7  # 7 is not ours: no swap for it
    assert plan_all(st, pin, log.idx) == []


def test_plan_all_orders_demote_promote_compact() -> None:
    log = Log()
    log.apply("w0", *chain_events([1], "slow"))
    log.apply("w1", *chain_events([1], "g1"))
    log.apply("w2", *chain_events([1], "g1"))
    log.apply("w0", *chain_events([5], "fast"))
    pin = PolicyInput(
        "fast", ["slow"], "s3",
        usage={"fast": VolumeUsage(1_100, 1_000, 1_000)},
        fast_placements=placements([5]),
        segments={"slow": [Seg(4, "slow", 4000, 1000, 1)]},
    )
    s = PolicySettings(promotion=PromotionSettings(max_fill=1.0))
    kinds = [(i.kind, i.sequence_hash or i.segment_id) for i in plan_all(s, pin, log.idx)]
    assert kinds == [(PlanKind.DEMOTE, 5), (PlanKind.COMPACT, 4)]  # fast full: no room to promote
    pin.usage["fast"] = VolumeUsage(10_000, 1_000, 1_000)
    kinds = [(i.kind, i.sequence_hash or i.segment_id) for i in plan_all(s, pin, log.idx)]
    assert kinds == [(PlanKind.PROMOTE, 1), (PlanKind.COMPACT, 4)]


def test_bad_policy_settings_are_refused() -> None:
    with pytest.raises(ValidationError, match="low_watermark"):
        DemotionSettings(high_watermark=0.5, low_watermark=0.6)
    with pytest.raises(ValidationError):
        PromotionSettings(min_hits=0)
    with pytest.raises(ValidationError):
        CompactionSettings(live_fraction=1.5)


def test_demotion_prefix_value_scoring_keeps_leaves_first_and_explains() -> None:
    log = Log()
    log.apply("w0", *chain_events([1, 2, 3], "fast"))
    log.apply("w0", *chain_events([10, 11], "fast"))
    log.apply("w1", *chain_events([10, 11], "g1"))
    # evidence on slow: blocks seen twice were seen again (class seen=1 is reused), blocks
    # seen once mostly were not
    for c in range(4):
        hs = [100 + 10 * c, 101 + 10 * c]
        log.apply("w2", *chain_events(hs, "slow"))
        for w in ("w3", "w4"):
            log.apply(w, *chain_events(hs, "g1"))
    log.apply("w2", *chain_events([500, 501, 502, 503], "slow"))
    on_fast = placements([1, 2, 3, 10, 11])
    usage = VolumeUsage(capacity_bytes=5_000, used_bytes=5_000, live_bytes=5_000)
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": usage}, fast_placements=on_fast,
                      placements={"slow": placements([100, 101, 110, 111, 120, 121, 130, 131, 500, 501, 502, 503], "slow")})
    s = DemotionSettings(high_watermark=0.8, low_watermark=0.3, scoring="prefix_value")
    items = plan_demotions(s, pin, log.idx, hot_hits=None)
    # 3,500 bytes -> 4 blocks; chain A (never re-used) leaf to root, then B's leaf
    assert [i.sequence_hash for i in items] == [3, 2, 1, 11]
    assert all("prefix-value leaf" in i.reason and i.dst_volume == "slow" for i in items)
    with pytest.raises(ValidationError):
        DemotionSettings(scoring="fifo")
