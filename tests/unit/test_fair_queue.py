"""The subscriber's delivery queue is fair between lanes (origins) and between sources
(surplus round robin at both levels): exact service order, per-source order kept, bounds in
all, per lane and per source."""

from __future__ import annotations

import queue
import threading

import pytest

from event_plane.errors import ConfigError
from event_plane.fair_queue import FairQueue
from event_plane.schema import WIRE_VERSION, EventBatch, store


def batch(source: str, seq: int, events: int = 0) -> EventBatch:
    return EventBatch(WIRE_VERSION, source, 1, seq, 0, [store(seq * 100 + i, 1, None, 16, "g1") for i in range(events)])


class Clock:
    """The queue's clock, moved by the consumer's 'work' on each batch."""

    def __init__(self) -> None:
        self.t = 0.0

    def __call__(self) -> float:
        return self.t


def fair(capacity: int = 100, **kw: object) -> tuple[FairQueue, Clock]:
    """A queue with quantum 4 s and no least cost, on a clock of its own."""
    clock = Clock()
    kw = {"quantum_s": 4.0, "min_cost_s": 0.0, **kw}
    return FairQueue(capacity, clock=clock, **kw), clock  # type: ignore[arg-type]


def drain(q: FairQueue, clock: Clock | None = None) -> list[str]:
    """Take every batch; the consumer spends 1 + (its events) seconds on each."""
    out = []
    while True:
        try:
            b = q.get_nowait()
        except queue.Empty:
            return out
        if clock is not None:
            clock.t += 1 + len(b.events)
        out.append(f"{b.source}{b.seq}")


def test_deficit_round_robin_order_is_exact() -> None:
    # quantum 4 s, a batch takes the consumer 1 s + 1 s per event; A: five empty batches (1 s),
    # B: one of 6 events (7 s) then an empty one (1 s), C: two of 2 events (3 s each); A first
    q, clock = fair(source_capacity=5)
    for s in range(5):
        q.put_nowait(batch("a", s))
    with pytest.raises(queue.Full):
        q.put_nowait(batch("a", 5))  # past A's own bound; the others still have room
    q.put_nowait(batch("b", 0, events=6))
    q.put_nowait(batch("b", 1))
    q.put_nowait(batch("c", 0, events=2))
    q.put_nowait(batch("c", 1, events=2))
    assert q.sources() == {"a": 5, "b": 2, "c": 2}
    # each source is its own lane here. Turn 1: A (credit 4) takes a0..a3 (4 - 4 = 0); B
    # (4) takes b0 and owes 3; C (4) takes c0 and c1 (4 - 6 < 0) and leaves, empty.
    # Turn 2: A takes a4 and leaves; B (-3 + 4 = 1) takes b1
    assert drain(q, clock) == ["a0", "a1", "a2", "a3", "b0", "c0", "c1", "a4", "b1"]
    assert q.qsize() == 0 and q.empty() and q.sources() == {}


def test_a_backlog_of_one_source_delays_another_by_one_turn_at_most() -> None:
    q, clock = fair(100_000, source_capacity=50_000, quantum_s=1.0)
    for s in range(20_000):
        q.put_nowait(batch("churn", s))
    q.put_nowait(batch("good", 0, events=1))
    order = []
    for _ in range(20):  # the consumer takes 1/8 s a batch: a turn of 1 s is 8 of churn's
        order.append(q.get_nowait().source)
        clock.t += 0.125
    assert order.index("good") == 8
    # the churn source keeps its own order
    rest = [q.get_nowait().seq for _ in range(100)]
    assert rest == list(range(19, 119))  # 19 of the first 20 were churn's


def test_a_dear_batch_is_paid_back_and_an_idle_source_keeps_no_credit() -> None:
    q, clock = fair()
    q.put_nowait(batch("a", 0))  # a gets 4, spends 1, leaves: its 3 left are forgotten
    assert drain(q, clock) == ["a0"]
    q.put_nowait(batch("a", 1, events=5))  # 6 s
    q.put_nowait(batch("a", 2))
    for s in range(3):
        q.put_nowait(batch("b", s))
    # a (4) takes a1 and owes 2; b (4) takes b0..b2; a (-2 + 4) takes a2. Plain round robin
    # would interleave a2 before b1
    assert drain(q, clock) == ["a1", "b0", "b1", "b2", "a2"]
    q.put_nowait(batch("a", 3, events=9))  # 10 s: a owes 6
    q.put_nowait(batch("a", 4))
    q.put_nowait(batch("b", 3))
    # once b has left, a is alone: served at once though still in debt (nobody else waits)
    assert drain(q, clock) == ["a3", "b3", "a4"]


def test_a_lane_with_many_source_names_gets_one_turn() -> None:
    # lane "bad" (one origin) carries sources x, y, z; lane "good" carries g. Per source
    # alone, g would wait for turns of x, y and z; per lane it waits for one turn of "bad"
    q, clock = fair()
    for s in range(4):
        for src in "xyz":
            q.put_nowait(batch(src, s), lane="bad")
    q.put_nowait(batch("g", 0), lane="good")
    q.put_nowait(batch("g", 1), lane="good")
    assert drain(q, clock) == ["x0", "x1", "x2", "x3", "g0", "g1", "y0", "y1", "y2", "y3", "z0", "z1", "z2", "z3"]


def test_a_source_stays_in_its_lane_while_queued() -> None:
    q, clock = fair(quantum_s=2.0)
    q.put_nowait(batch("t", 0), lane="two")
    q.put_nowait(batch("s", 0), lane="one")
    q.put_nowait(batch("s", 1), lane="two")  # the same source from elsewhere: behind s0, in lane "one"
    # in lane "two" it would be served in two's turn, before s0
    assert drain(q, clock) == ["t0", "s0", "s1"]


def test_bounds_and_full() -> None:
    q = FairQueue(3, source_capacity=2)
    q.put_nowait(batch("a", 0))
    assert not q.full()
    q.put_nowait(batch("a", 1))
    assert q.full()  # a is at its bound: a durable transport waits
    q.put_nowait(batch("b", 0))
    with pytest.raises(queue.Full):
        q.put_nowait(batch("c", 0))  # 3 in all
    q.get_nowait()
    q.get_nowait()
    assert not q.full()
    with pytest.raises(queue.Empty):
        FairQueue(1).get(timeout=0.01)
    lanes = FairQueue(10, lane_capacity=2)
    lanes.put_nowait(batch("a", 0), lane="l")
    lanes.put_nowait(batch("b", 0), lane="l")
    assert lanes.full()
    with pytest.raises(queue.Full):
        lanes.put_nowait(batch("c", 0), lane="l")  # the lane is full, whatever the source
    lanes.put_nowait(batch("c", 0), lane="m")
    assert lanes.qsize() == 3
    for bad in ({"capacity": 0}, {"capacity": 2, "source_capacity": 0}, {"capacity": 2, "quantum_s": 0},
                {"capacity": 2, "lane_capacity": 0}, {"capacity": True}):
        with pytest.raises(ConfigError):
            FairQueue(**bad)  # type: ignore[arg-type]


def test_a_waiting_get_wakes_on_put() -> None:
    q = FairQueue(10)
    got: list[EventBatch] = []
    t = threading.Thread(target=lambda: got.append(q.get(timeout=30)))
    t.start()
    q.put_nowait(batch("a", 7))
    t.join(timeout=30)
    assert [b.seq for b in got] == [7]
