"""Prefetcher rules on a real PrefixIndex with a stepped clock: the bandwidth budget, the
hint quota, where a prefix walk stops, held-back items, and the used / wasted verdicts.
(The real mover path is in tests/integration/test_advisor_prefetch.py.)"""

from __future__ import annotations

from collections.abc import Sequence

from advisor import PlanItem, PlanKind, PlanResult, PlanStatus, PrefixIndex
from advisor.moves.prefetch import PrefetchSettings, Prefetcher
from event_plane.schema import EventBatch, remove, store

BLK = 1000


class Rig:
    """A PrefixIndex fed with batches, and an ``execute`` that moves blocks in it."""

    def __init__(self, room: int | None = None, **settings: object) -> None:
        self.index = PrefixIndex()
        self.t = 0.0
        self.seq = 0
        self.moved: list[list[int]] = []
        self.items: list[PlanItem] = []
        self.hold = False
        self.p = Prefetcher(PrefetchSettings(**settings), "fast", ["slow", "s3"],
                            lambda hs: [self.index.block(h) for h in hs], self.execute, clock=lambda: self.t,
                            room=None if room is None else (lambda: self.room))
        self.room = room or 0

    def events(self, source: str, *evs) -> None:  # noqa: ANN002
        self.seq += 1
        self.index.apply_batch(EventBatch(1, source, 1, self.seq, self.seq * 1000, list(evs)))

    def chain(self, hashes: list[int], loc: str, source: str = "w0") -> None:
        parent = None
        evs = []
        for h in hashes:
            evs.append(store(h, hashes[0], parent, BLK, loc))
            parent = h
        self.events(source, *evs)

    def execute(self, items: Sequence[PlanItem]) -> list[PlanResult]:
        if self.hold:
            return []
        self.moved.append([it.sequence_hash for it in items])
        self.items.extend(items)
        for it in items:
            info = self.index.block(it.sequence_hash)
            self.events("advisor", store(it.sequence_hash, info.prefix_hash, info.parent, BLK, "fast"),
                        remove(it.sequence_hash, info.prefix_hash, info.parent, BLK, it.src_volume))
        return [PlanResult(it, PlanStatus.DONE, bytes_moved=it.bytes, blocks_moved=1) for it in items]


def test_prefetch_stays_within_its_bandwidth_budget() -> None:
    r = Rig(bytes_per_s=2 * BLK)  # burst = one second
    r.chain([1, 2, 3, 4, 5], "s3")
    assert r.p.hint([1, 2, 3, 4, 5])
    r.p.step()
    r.p.step()  # no time passed: nothing more
    assert r.moved == [[1, 2]]
    r.t = 1.0
    r.p.step()
    r.t = 2.0
    r.p.step()
    assert r.moved == [[1, 2], [3, 4], [5]]
    st = r.p.stats()
    assert (st["queued"], st["issued"], st["bytes"], st["pending"]) == (5, 5, 5 * BLK, 0)
    assert all(r.index.block(h).locations == {"fast"} for h in [1, 2, 3, 4, 5])


def test_a_prefetch_never_fills_the_fast_volume_past_its_room() -> None:
    # room for two blocks: the rest is dropped as held (no move tried, none failed), and a later
    # lookup brings them back once there is room again
    r = Rig(room=2 * BLK + BLK // 2)
    r.chain([1, 2, 3, 4], "s3")
    assert r.p.hint([1, 2, 3, 4])
    r.p.step()
    assert r.moved == [[1, 2]]
    st = r.p.stats()
    assert (st["issued"], st["held"], st["failed"], st["pending"]) == (2, 2, 0, 0)
    r.room = 10 * BLK
    assert r.p.hint([1, 2, 3, 4])
    r.t = 10.0
    r.p.step()
    assert r.moved == [[1, 2], [3, 4]]


def test_prefix_walk_skips_fast_and_worker_only_blocks_and_stops_at_an_unknown_one() -> None:
    r = Rig()
    r.chain([1, 2, 3, 4, 5], "g1")  # all in w0's G1
    r.chain([1], "fast")
    r.chain([1, 2], "slow")
    r.chain([1, 2, 3], "s3")
    r.events("w0", store(5, 1, 4, BLK, "s3"), store(7, 1, 6, BLK, "s3"))
    # 1 on fast, 2 on slow and s3, 3 on s3, 4 only in G1, 5 on s3; 99 unknown: 7 is past the prefix
    r.p.hint([1, 2, 3, 4, 5, 99, 7])
    r.p.step()
    assert [(it.sequence_hash, it.src_volume, it.dst_volume) for it in r.items] == [
        (2, "slow", "fast"), (3, "s3", "fast"), (5, "s3", "fast")]
    assert r.index.block(7).locations == {"s3"}
    assert r.p.stats()["queued"] == 3


def test_a_hint_over_the_queue_quota_is_refused_and_counted() -> None:
    r = Rig(max_pending_blocks=4, bytes_per_s=BLK)
    r.chain([1, 2, 3, 4, 5, 6], "s3")
    assert not r.p.hint([1, 2, 3, 4, 5])  # 5 blocks > 4
    assert r.p.hint([1, 2, 3])
    assert not r.p.hint([4, 5])  # 3 pending + 2 > 4
    r.p.step()  # 1 moved, 2 still queued
    assert r.p.hint([6])
    assert r.p.stats()["pending"] == 3
    st = r.p.stats()
    assert (st["hints"], st["refused"]) == (4, 2)


def test_held_back_items_are_counted_and_a_later_hint_brings_them_again() -> None:
    r = Rig()
    r.chain([1, 2], "slow")
    r.hold = True
    r.p.hint([1, 2])
    r.p.step()
    assert (r.p.stats()["held"], r.p.stats()["issued"], r.p.stats()["pending"]) == (2, 0, 0)
    r.hold = False
    r.p.hint([1, 2])
    r.p.step()
    assert r.moved == [[1, 2]] and r.p.stats()["issued"] == 2


def test_used_wasted_verdicts() -> None:
    r = Rig(used_window_s=60)
    r.chain([1, 2, 3], "s3")
    r.p.hint([1, 2, 3])
    r.p.step()
    assert r.p.stats()["tracked"] == 3
    r.chain([1], "g1", "w1")  # w1 onboards block 1: a hit
    r.events("advisor", remove(2, 1, 1, BLK, "fast"), store(2, 1, 1, BLK, "s3"))  # 2 demoted before any hit
    r.p.sweep()
    st = r.p.stats()
    assert (st["used"], st["wasted"], st["tracked"]) == (1, 1, 1)
    r.t = 59.0
    r.p.sweep()
    assert r.p.stats()["wasted"] == 1
    r.t = 61.0  # 3 never hit within the window
    r.p.sweep()
    st = r.p.stats()
    assert (st["used"], st["wasted"], st["tracked"], st["issued"]) == (1, 2, 0, 3)


def test_a_flooding_client_gives_way_to_another_down_to_an_equal_share() -> None:
    # longest queue drop: the flooder's newest blocks make room for the other client's hint,
    # while the flooder still holds more than the newcomer will; beyond that, refused
    r = Rig(max_pending_blocks=8, bytes_per_s=2 * BLK)
    r.chain(list(range(1, 13)), "s3")
    r.chain(list(range(101, 110)), "s3")
    assert r.p.hint(list(range(1, 9)), client="flood")
    assert not r.p.hint([9, 10], client="flood")  # full, and nobody holds more than it
    assert r.p.hint([101, 102, 103], client="router")  # 3 of the flooder's newest go
    assert not r.p.hint([104, 105], client="router")  # it would hold 5 against the flooder's 5
    assert r.p.hint([104], client="router")  # 4 and 4: an equal share
    st = r.p.stats()
    assert (st["pending"], st["clients"], st["displaced"], st["refused"]) == (8, 2, 4, 2)
    # served in turns, one item of each client per turn: the router's first block goes in
    # the first batch although the flooder hinted first
    r.p.step()
    assert r.moved == [[1, 101]]
    r.t = 10.0  # the budget refills (burst: two blocks)
    r.p.step()
    assert r.moved == [[1, 101], [2, 102]]
    r.t = 20.0
    r.p.step()
    r.t = 30.0
    r.p.step()
    # the flooder's hint kept its first blocks (its tail was displaced), the router's whole
    assert sorted(h for b in r.moved for h in b) == [1, 2, 3, 4, 101, 102, 103, 104]
    assert r.p.stats()["pending"] == 0 and r.p.stats()["clients"] == 0


def test_an_equal_share_is_never_refused_whatever_the_others_hinted() -> None:
    # property: with n clients holding blocks, a hint that leaves its client at or below
    # max_pending / n is taken, and the total never passes the quota
    from hypothesis import given, settings
    from hypothesis import strategies as st

    cap = 24

    @settings(max_examples=200, deadline=None)
    @given(st.lists(st.tuples(st.integers(0, 3), st.integers(1, 12)), max_size=40))
    def run(hints: list[tuple[int, int]]) -> None:
        r = Rig(max_pending_blocks=cap)
        next_h = 1
        for c, n in hints:
            block = list(range(next_h, next_h + n))
            next_h += n
            before = {k: q.pending() for k, q in r.p._clients.items()}  # noqa: SLF001 - the invariant's input
            mine = before.get(f"c{c}", 0) + n
            clients = len(before.keys() | {f"c{c}"})
            taken = r.p.hint(block, client=f"c{c}")
            if mine * clients <= cap:
                assert taken, (before, c, n)
            assert r.p.stats()["pending"] <= cap
            assert r.p.stats()["pending"] == sum(q.pending() for q in r.p._clients.values())  # noqa: SLF001

    run()


def test_turns_carry_over_between_passes_when_the_budget_allows_one_block_each() -> None:
    # a budget of one block per pass: the client served last goes to the back, so the two
    # clients alternate pass by pass instead of the first hinter taking every pass
    r = Rig(bytes_per_s=BLK)
    r.chain(list(range(1, 7)), "s3")
    r.chain([101, 102, 103], "s3")
    assert r.p.hint(list(range(1, 7)), client="flood")
    assert r.p.hint([101, 102, 103], client="router")
    for k in range(6):
        r.t = float(k)
        r.p.step()
    assert r.moved == [[1], [101], [2], [102], [3], [103]]
