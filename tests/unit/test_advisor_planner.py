"""Planner limits: per round, bytes per second (token bucket), moves in flight; reasons kept."""

from __future__ import annotations

import threading

import pytest

from advisor.policy.plan import PlanItem, PlanKind
from advisor.moves.planner import Planner, TokenBucket
from advisor.policy.policies import PlannerSettings


class Clock:
    def __init__(self) -> None:
        self.t = 100.0

    def __call__(self) -> float:
        return self.t


def move(h: int, nbytes: int = 100) -> PlanItem:
    return PlanItem(PlanKind.PROMOTE, f"hits of {h}", "slow", "fast", h, None, None, nbytes)


def compact(seg: int, nbytes: int = 100) -> PlanItem:
    return PlanItem(PlanKind.COMPACT, f"segment {seg} sparse", "slow", segment_id=seg, bytes=nbytes)


def test_token_bucket_limits_bytes_per_second_across_rounds() -> None:
    clock = Clock()
    p = Planner(PlannerSettings(max_bytes_per_s=1000, burst_bytes=300), clock)
    plan = p.plan([move(h) for h in range(1, 6)])
    assert [it.sequence_hash for it in plan.items] == [1, 2, 3]  # burst: 300 bytes
    assert plan.deferred == 2 and plan.deferred_reasons == {"bytes_per_s": 2}
    assert [it.reason for it in plan.items] == ["hits of 1", "hits of 2", "hits of 3"]
    p.release(3)
    assert p.plan([move(4)]).items == []  # no time passed: empty bucket
    clock.t += 0.25  # 250 bytes refilled
    assert [it.sequence_hash for it in p.plan([move(4), move(5), move(6, 50)]).items] == [4, 5, 6]
    clock.t += 10  # capped at the burst
    assert len(p.plan([move(h) for h in range(10, 20)]).items) == 3


def test_item_larger_than_the_burst_goes_when_the_bucket_is_full() -> None:
    clock = Clock()
    b = TokenBucket(100, 100, clock)
    assert b.try_take(250)  # full bucket: the big item goes, the bucket goes negative
    assert not b.try_take(1)
    clock.t += 2.0  # -150 + 200 = 50
    assert b.available() == pytest.approx(50)
    assert not b.try_take(250)
    clock.t += 1.0
    assert b.try_take(250)
    with pytest.raises(ValueError):
        TokenBucket(0, 10)


def test_concurrent_moves_are_bounded_until_released() -> None:
    p = Planner(PlannerSettings(max_concurrent_moves=2))
    first = p.plan([move(1), move(2), move(3)])
    assert [it.sequence_hash for it in first.items] == [1, 2]
    assert first.deferred_reasons == {"concurrent_moves": 1}
    assert p.in_flight == 2
    assert p.plan([move(3), compact(7)]).items == []  # another round while the first runs
    p.release(1)
    assert [it.sequence_hash for it in p.plan([move(3), move(4)]).items] == [3]
    p.release(5)
    assert p.in_flight == 0


def test_concurrent_rounds_from_threads_never_exceed_the_limit() -> None:
    p = Planner(PlannerSettings(max_concurrent_moves=3))
    got: list[int] = []
    lock = threading.Lock()

    def round_(base: int) -> None:
        n = len(p.plan([move(base + i) for i in range(5)]).items)
        with lock:
            got.append(n)

    ts = [threading.Thread(target=round_, args=(100 * k,)) for k in range(8)]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert sum(got) == 3 and p.in_flight == 3


def test_round_limits_keep_order_and_name_the_limit() -> None:
    p = Planner(PlannerSettings(max_moves_per_round=2, max_compactions_per_round=1, max_bytes_per_round=350))
    plan = p.plan([move(1), move(1), compact(5), compact(6), move(2, 200), move(3), move(4, 10)])
    assert [(it.kind, it.sequence_hash, it.segment_id) for it in plan.items] == [
        (PlanKind.PROMOTE, 1, None), (PlanKind.COMPACT, None, 5), (PlanKind.PROMOTE, 3, None)]
    assert plan.duplicates == 1
    assert plan.deferred_reasons == {"compactions_per_round": 1, "bytes_per_round": 1, "moves_per_round": 1}
