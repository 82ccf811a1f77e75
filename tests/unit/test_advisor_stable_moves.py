"""Stable moves: promotion under the demotion watermark, one tier down, move guard, one policy rule."""

from __future__ import annotations

import numpy as np

from advisor.policy.eviction.live_scoring import BlockFacts, LiveScorer
from advisor.policy.eviction.prefix_value import PrefixValueSettings, priority, reuse_class
from advisor.moves.move_guard import MoveGuard
from advisor.policy.plan import PlanItem, PlanKind, PlanResult, PlanStatus
from advisor.policy.policies import DemotionSettings, PolicyInput, PolicySettings, VolumeUsage, plan_all, plan_demotions
from event_plane.schema import store
from tests.unit.test_advisor_policies import BS, Log, chain_events, placements


def test_promotion_stops_at_the_demotion_high_watermark_so_the_next_round_demotes_nothing() -> None:
    log = Log()
    hot = list(range(1, 21))
    for h in hot:
        log.apply("w0", *chain_events([h], "slow"))
        log.apply("w1", *chain_events([h], "g1"))
        log.apply("w2", *chain_events([h], "g1"))
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": VolumeUsage(10 * BS, 0, 0)})
    s = PolicySettings()
    s.promotion.max_fill = 1.0  # the watermark (0.8) still caps it
    items = plan_all(s, pin, log.idx)
    promoted = [i.sequence_hash for i in items if i.kind is PlanKind.PROMOTE]
    assert len(promoted) == 8  # 80 % of 10 blocks
    # the fast volume after those promotions is at its watermark, not above: no demotion,
    # and the blocks left on slow rank below those on fast: no swap either
    for h in promoted:
        log.apply("advisor", store(h, h, None, BS, "fast", {"moved_from": "slow"}))
    pin2 = PolicyInput("fast", ["slow"], "s3", usage={"fast": VolumeUsage(10 * BS, 8 * BS, 8 * BS)},
                       fast_placements=placements(promoted))
    assert [i for i in plan_all(s, pin2, log.idx) if i.kind is not PlanKind.COMPACT] == []


def test_demotion_goes_one_tier_down_and_to_the_archive_only_when_slow_is_full() -> None:
    log = Log()
    log.apply("w0", *chain_events([1, 2], "fast"), *chain_events([30, 31], "slow"))
    fast_full = VolumeUsage(2 * BS, 2 * BS, 2 * BS)
    s = DemotionSettings(high_watermark=0.8, low_watermark=0.3, scoring="lru")
    pin = PolicyInput("fast", ["slow"], "s3", fast_placements=placements([1, 2]),
                      usage={"fast": fast_full, "slow": VolumeUsage(100 * BS, 10 * BS, 10 * BS)})
    assert {i.dst_volume for i in plan_demotions(s, pin, log.idx)} == {"slow"}
    # slow above its watermark: fast demotes to the archive, slow demotes its own leaves there
    pin.usage["slow"] = VolumeUsage(2 * BS, 2 * BS, 2 * BS)
    pin.placements["slow"] = placements([30, 31], "slow")
    got = [(i.src_volume, i.dst_volume, i.sequence_hash) for i in plan_demotions(s, pin, log.idx)]
    assert got == [("fast", "s3", 2), ("fast", "s3", 1), ("slow", "s3", 31), ("slow", "s3", 30)]


def test_hot_blocks_are_demoted_only_down_to_the_high_watermark() -> None:
    log = Log()
    log.apply("w0", *chain_events([1], "fast"), *chain_events([2], "fast"), *chain_events([3], "fast"))
    for w in ("w1", "w2"):
        log.apply(w, *chain_events([2], "g1"), *chain_events([3], "g1"))  # 2 and 3 hot (hits 2)
    s = DemotionSettings(high_watermark=0.6, low_watermark=0.1, scoring="lru")
    pin = PolicyInput("fast", ["slow"], "s3", fast_placements=placements([1, 2, 3]),
                      usage={"fast": VolumeUsage(4 * BS, 4 * BS, 3 * BS)})
    # down to 10 %: 3 blocks; hot ones only while live > 60 % (2.4 blocks): after the cold
    # block 1, live is 2 blocks, so the hot ones stay
    got = [i.sequence_hash for i in plan_demotions(s, pin, log.idx, hot_hits=2)]
    assert got == [1]
    assert [i.sequence_hash for i in plan_demotions(s, pin, log.idx)] == [1, 2, 3]


def test_move_guard_holds_a_recent_move_unless_the_block_was_accessed_since() -> None:
    now = [0.0]
    access = {7: 100, 8: 100}
    g = MoveGuard(600.0, access.get, clock=lambda: now[0])
    item = PlanItem(PlanKind.DEMOTE, "r", "fast", "slow", sequence_hash=7)
    other = PlanItem(PlanKind.PROMOTE, "r", "slow", "fast", sequence_hash=8)
    g.record([PlanResult(item, PlanStatus.DONE), PlanResult(other, PlanStatus.FAILED)])
    back = PlanItem(PlanKind.PROMOTE, "r", "slow", "fast", sequence_hash=7)
    now[0] = 599.0
    assert g.filter([back, other]) == ([other], 1)  # 8 failed: not a move
    access[7] = 200  # a new event touched block 7
    assert g.filter([back]) == ([back], 0)
    g.record([PlanResult(back, PlanStatus.DONE)])
    now[0] = 599.0 + 600.0
    assert g.filter([item]) == ([item], 0)  # the interval passed
    assert MoveGuard(0.0, access.get).filter([item, item]) == ([item, item], 0)


def test_live_scorer_uses_the_evaluators_priority_and_classes() -> None:
    ps = PrefixValueSettings()
    sc = LiveScorer(ps, horizon_s=10.0)
    facts = [BlockFacts(1_000, 0, True, True), BlockFacts(2_000, 3, True, True), BlockFacts(3_000, 9, False, False)]
    sc.learn(facts)
    for f in facts:
        c = reuse_class(f.hits, 0 if f.leaf else 1, int(f.has_parent), ps.max_seen, ps.max_from_end)
        want = f.last_access_ns + 10e9 * (sc.reuses[c] + ps.prior_weight * ps.prior_reuse) / (sc.inserts[c] + ps.prior_weight)
        assert sc.score(f) == priority(float(f.last_access_ns), 10e9, sc.reuses[c], sc.inserts[c],
                                       ps.prior_reuse, ps.prior_weight, 0)
        assert np.isclose(sc.score(f), want)
    # a block with hits 9 (cap 4) put 6 references and 5 reuses into its capped class
    c = reuse_class(4, 1, 0, ps.max_seen, ps.max_from_end)
    assert (sc.inserts[c], sc.reuses[c]) == (6.0, 5.0)
    # class 0 (leaf, continuation) saw 2 references and 1 reuse: P = (1 + 0.3) / (2 + 1)
    assert np.isclose(sc.p_reuse(BlockFacts(0, 0, True, True)), 1.3 / 3)


def test_a_full_fast_volume_swaps_its_coldest_leaf_for_a_hotter_block_once() -> None:
    log = Log()
    log.apply("w0", *chain_events([1], "fast"), *chain_events([2], "fast"))  # on fast, never hit
    log.apply("w0", *chain_events([7], "slow"))
    for w in ("w1", "w2", "w3"):
        log.apply(w, *chain_events([7], "g1"))  # 7: hits 3, on slow, newest
    s = PolicySettings()
    s.demotion.scoring = "lru"
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": VolumeUsage(2 * BS, 2 * BS * 8 // 10, 2 * BS * 8 // 10)},
                      fast_placements=placements([1, 2]))
    items = [(i.kind, i.sequence_hash, i.src_volume, i.dst_volume) for i in plan_all(s, pin, log.idx)]
    # at its limit, the fast volume has no used bytes to spare: the cold leaf goes now, the
    # hot block waits for the room (compaction of the dead bytes) ...
    assert items == [(PlanKind.DEMOTE, 1, "fast", "slow")]
    # ... and with room for one block (but no promotion budget left by plan_promotions'
    # candidates), both moves are planned together
    pin.usage["fast"] = VolumeUsage(4 * BS, 3 * BS, 2 * BS)  # 75 %: 0.2 blocks of room
    assert plan_all(s, pin, log.idx)[0].kind is PlanKind.DEMOTE
    pin.usage["fast"] = VolumeUsage(10 * BS, 7 * BS, 2 * BS)
    items = [(i.kind, i.sequence_hash, i.src_volume, i.dst_volume) for i in plan_all(s, pin, log.idx)]
    assert items[0] == (PlanKind.PROMOTE, 7, "slow", "fast")  # room: a plain promotion, no swap
    pin.usage["fast"] = VolumeUsage(2 * BS, 2 * BS * 8 // 10, 2 * BS * 8 // 10)
    # after the swap: 7 on fast, 1 on slow (never hit): nothing more to do
    log.apply("advisor", store(7, 7, None, BS, "fast", {"moved_from": "slow"}),
              store(1, 1, None, BS, "slow", {"moved_from": "fast"}))
    pin.fast_placements = placements([7, 2])
    assert [i for i in plan_all(s, pin, log.idx) if i.kind is not PlanKind.COMPACT] == []
    s.promotion.max_swaps = 0
    pin.fast_placements = placements([1, 2])
    assert plan_all(s, pin, log.idx) == []


def test_a_slow_volume_demoting_to_the_archive_does_not_stop_the_fast_volumes_swaps() -> None:
    """Fast at its promotion limit (below its demotion watermark) while slow is above its
    own watermark and demotes to the archive: the hot block on slow still displaces the
    cold leaf on fast (no dead band where nothing moves onto fast)."""
    log = Log()
    log.apply("w0", *chain_events([1], "fast"), *chain_events([2], "fast"))  # on fast, never hit
    log.apply("w0", *chain_events([30], "slow"), *chain_events([31], "slow"))  # cold on slow
    log.apply("w0", *chain_events([7], "slow"))
    for w in ("w1", "w2", "w3"):
        log.apply(w, *chain_events([7], "g1"))  # 7: hits 3, on slow, newest
    s = PolicySettings()
    s.demotion.scoring = "lru"
    pin = PolicyInput("fast", ["slow"], "s3", fast_placements=placements([1, 2]),
                      usage={"fast": VolumeUsage(2 * BS, 2 * BS * 8 // 10, 2 * BS * 8 // 10),
                             "slow": VolumeUsage(3 * BS, 3 * BS, 3 * BS)},
                      placements={"slow": placements([30, 31, 7], "slow")})
    items = [(i.kind, i.sequence_hash, i.src_volume, i.dst_volume) for i in plan_all(s, pin, log.idx)]
    assert (PlanKind.DEMOTE, 30, "slow", "s3") in items  # slow's own demotions go on
    # the cold fast leaf goes one tier down (slow is over its watermark: the archive); the
    # hot block follows once compaction made the room
    assert (PlanKind.DEMOTE, 1, "fast", "s3") in items, items
    assert all(h != 7 for _, h, _, _ in items)  # hot: neither demoted nor swapped twice


def test_a_slow_volume_full_of_cold_blocks_below_its_watermark_swaps_for_the_archives_hot_ones() -> None:
    """Slow at its promotion limit (below its demotion watermark) holding only never-hit
    blocks, a hot block on the archive: a cold slow leaf goes to the archive to make room
    (one level lower, the same swap as fast's)."""
    log = Log()
    log.apply("w0", *chain_events([40], "slow"), *chain_events([41], "slow"))  # on slow, never hit
    log.apply("w0", *chain_events([9], "s3"))
    for w in ("w1", "w2", "w3"):
        log.apply(w, *chain_events([9], "g1"))  # 9: hits 3, on the archive, newest
    s = PolicySettings()
    s.demotion.scoring = "lru"
    pin = PolicyInput("fast", ["slow"], "s3", fast_placements=[],
                      usage={"fast": VolumeUsage(10 * BS, 0, 0), "slow": VolumeUsage(2 * BS, 2 * BS * 8 // 10,
                                                                                      2 * BS * 8 // 10)},
                      placements={"slow": placements([40, 41], "slow")})
    items = [(i.kind, i.sequence_hash, i.src_volume, i.dst_volume) for i in plan_all(s, pin, log.idx)]
    assert items == [(PlanKind.DEMOTE, 40, "slow", "s3")], items
    s.promotion.max_swaps = 0
    assert plan_all(s, pin, log.idx) == []


def test_move_guard_memory_survives_a_restart_through_the_run_state(tmp_path) -> None:  # noqa: ANN001
    from advisor.embedded.run_state import RunStateStore

    big = (1 << 64) - 5  # a u64 above SQLite's signed range
    access = {big: 1 << 63, 9: None}
    now = [1000.0]
    g = MoveGuard(600.0, access.get, clock=lambda: now[0])
    g.record([PlanResult(PlanItem(PlanKind.DEMOTE, "r", "fast", "slow", sequence_hash=big), PlanStatus.DONE),
              PlanResult(PlanItem(PlanKind.DEMOTE, "r", "fast", "slow", sequence_hash=9), PlanStatus.DONE)])
    now[0] = 1100.0  # 100 s after the moves
    store = RunStateStore(tmp_path / "journal.sqlite")
    store.save({}, [], g.export(wall_now=50_000.0))
    store.close()
    # a new process: another monotonic clock, 200 s of wall time later
    store = RunStateStore(tmp_path / "journal.sqlite")
    saved = store.moves()
    store.close()
    assert sorted(saved) == [(9, 49_900.0, None), (big, 49_900.0, 1 << 63)]
    now2 = [7.0]
    g2 = MoveGuard(600.0, access.get, clock=lambda: now2[0])
    assert g2.restore(saved, wall_now=50_200.0) == 2
    back = PlanItem(PlanKind.PROMOTE, "r", "slow", "fast", sequence_hash=big)
    assert g2.filter([back]) == ([], 1)  # 300 s since the move: still held
    now2[0] = 7.0 + 300.0  # 600 s since the move
    assert g2.filter([back]) == ([back], 0)
    assert MoveGuard(600.0, access.get).restore(saved, wall_now=49_900.0 + 601.0) == 0  # too old


def _guard_after(moves: list[PlanItem], log: Log) -> MoveGuard:
    """A move guard (600 s) that just recorded ``moves`` as done, reading ``log``'s index."""
    now = [1_000.0]

    def last(h: int) -> int | None:
        b = log.idx.block(h)
        return b.last_access_ns if b is not None else None

    g = MoveGuard(600.0, last, clock=lambda: now[0])
    g.record([PlanResult(m, PlanStatus.DONE) for m in moves])
    now[0] += 60.0  # a minute later: every one of them is still within the interval
    return g


def test_a_round_whose_best_moves_are_guarded_plans_the_next_best_ones() -> None:
    """The policies see the move guard (``PolicyInput.held``): a round plans none of the
    moves the guard would refuse and takes the next best blocks instead, so a round whose
    top candidates were moved a minute ago still promotes, demotes and swaps."""
    s = PolicySettings()
    s.demotion.scoring = "lru"
    # swaps: fast at its limit holds leaves 1, 2 (coldest, both promoted a minute ago,
    # untouched since) and 3; slow holds the hot 7 and 8
    log = Log()
    log.apply("w0", *chain_events([1], "fast"), *chain_events([2], "fast"), *chain_events([3], "fast"))
    log.apply("w0", *chain_events([7], "slow"), *chain_events([8], "slow"))
    for w in ("w1", "w2", "w3"):
        log.apply(w, *chain_events([7], "g1"), *chain_events([8], "g1"))
    guard = _guard_after([PlanItem(PlanKind.PROMOTE, "r", "slow", "fast", sequence_hash=h) for h in (1, 2)], log)
    full = VolumeUsage(3 * BS, 3 * BS * 8 // 10, 3 * BS * 8 // 10)
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": full}, fast_placements=placements([1, 2, 3]),
                      held=guard.view())
    planned = plan_all(s, pin, log.idx)
    kept, held = guard.filter(planned)
    assert held == 0, planned  # nothing planned that the guard refuses ...
    assert [(i.kind, i.sequence_hash, i.src_volume) for i in kept] == [(PlanKind.DEMOTE, 3, "fast")]  # ... the next leaf
    # without the guard's view the round plans the two coldest leaves, which the guard then drops: nothing moves
    pin.held = None
    assert guard.filter(plan_all(s, pin, log.idx)) == ([], 2)

    # demotions: fast over its watermark, its coldest leaf 1 demoted a minute ago: 2 goes instead
    log = Log()
    log.apply("w0", *chain_events([1], "fast"), *chain_events([2], "fast"), *chain_events([3], "fast"))
    guard = _guard_after([PlanItem(PlanKind.PROMOTE, "r", "slow", "fast", sequence_hash=1)], log)
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": VolumeUsage(3 * BS, 3 * BS, 3 * BS)},
                      fast_placements=placements([1, 2, 3]), held=guard.view())
    s.demotion = DemotionSettings(high_watermark=0.8, low_watermark=0.5, scoring="lru")
    kept, held = guard.filter(plan_all(s, pin, log.idx))
    assert held == 0
    assert [(i.kind, i.sequence_hash) for i in kept if i.kind is not PlanKind.COMPACT] == [(PlanKind.DEMOTE, 2),
                                                                                           (PlanKind.DEMOTE, 3)]
    # a guarded leaf keeps its prefix: with chain 4 -> 5 on fast and 5 guarded, 4 is not demoted either
    log.apply("w0", *chain_events([4, 5], "fast"))
    guard = _guard_after([PlanItem(PlanKind.PROMOTE, "r", "slow", "fast", sequence_hash=h) for h in (1, 5)], log)
    pin.fast_placements, pin.held = placements([4, 5, 1]), guard.view()
    kept, held = guard.filter(plan_all(s, pin, log.idx))
    assert held == 0 and [i.sequence_hash for i in kept if i.kind is PlanKind.DEMOTE] == []

    # promotions: room for one block on fast; the hottest block 7 was demoted a minute ago
    # (no access since), so 8, the next hottest, is promoted
    log = Log()
    log.apply("w0", *chain_events([7], "slow"), *chain_events([8], "slow"))
    for w in ("w1", "w2", "w3"):
        log.apply(w, *chain_events([8], "g1"), *chain_events([7], "g1"))  # 7 accessed last: the hottest
    guard = _guard_after([PlanItem(PlanKind.DEMOTE, "r", "fast", "slow", sequence_hash=7)], log)
    pin = PolicyInput("fast", ["slow"], "s3", usage={"fast": VolumeUsage(10 * BS, 7 * BS, 7 * BS)}, held=guard.view())
    s = PolicySettings()
    s.demotion.scoring = "lru"
    kept, held = guard.filter(plan_all(s, pin, log.idx))
    assert held == 0
    assert [(i.kind, i.sequence_hash) for i in kept] == [(PlanKind.PROMOTE, 8)]
    pin.held = None
    assert guard.filter(plan_all(s, pin, log.idx)) == ([], 1)
    # a new access of 7 releases it: the guard's view follows the index
    log.apply("w4", *chain_events([7], "g1"))
    pin.held = guard.view()
    assert [i.sequence_hash for i in plan_all(s, pin, log.idx)] == [7]


def test_move_guard_memory_holds_only_the_moves_within_the_interval() -> None:
    """The guard forgets moves older than the interval as it records new ones, so its memory
    is bounded by the blocks moved within ``interval_s`` (not every block ever moved)."""
    now = [0.0]
    g = MoveGuard(600.0, lambda h: None, clock=lambda: now[0])

    def moved(*hs: int) -> None:
        g.record([PlanResult(PlanItem(PlanKind.DEMOTE, "r", "fast", "slow", sequence_hash=h), PlanStatus.DONE)
                  for h in hs])

    moved(*range(1000))
    now[0] = 300.0
    moved(1, 2000)  # 1 moved again: remembered from now on
    assert len(g) == 1001
    now[0] = 700.0  # the first moves are past the interval, the second ones are not
    moved(3000)
    assert len(g) == 3 and g.view()(1) and g.view()(2000) and not g.view()(5)
