"""Finish-aware prefix-LRU against a slow reference written from its documented rule.

The reference below re-derives the rule of :mod:`advisor.policy.eviction.finish_aware` in
plain Python on the trace's own block ids: no heaps, no dense ids, no eager state changes.
A leaf's state, age and place in its state's order are computed when they are needed from
the latest request that referenced it (in flight while the clock has not reached that
request's finish), and every eviction scans all cached leaves.  The compiled kernel must
give the same hits per request on small random traces where evictions are frequent.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np
import pytest

from advisor.policy.eviction import finish_aware, prefix_lru
from advisor.policy.eviction.compact import RequestFinishes, compact
from advisor.policy.eviction.finish_aware import IN_FLIGHT, MAX_TIME, MIN_GAPS, N_FINISH

BINS = 96
"""Log-spaced gap bins, 4 a doubling from 1 s (bin 0: under 1 s); the last one takes every
longer gap (it starts at about 2**23.75 s, beyond any gap in these traces)."""
TIE = 1e-9
"""Seconds added per position in the request: the tail of a request is newer than its head."""


def gap_bin(gap: float) -> int:
    """The bin of a gap (or of a leaf's age)."""
    if gap < 1.0:
        return 0
    return min(int(math.log2(gap) * 4.0) + 1, BINS - 1)


class Gaps:
    """Gaps observed after requests, by state (finish classes, then in flight), binned."""

    def __init__(self) -> None:
        self.count = [[0.0] * BINS for _ in range(N_FINISH + 1)]
        self.total = [[0.0] * BINS for _ in range(N_FINISH + 1)]

    def add(self, state: int, gap: float) -> None:
        k = gap_bin(gap)
        self.count[state][k] += 1.0
        self.total[state][k] += gap

    def residual(self, state: int, age: float) -> float:
        """Mean residual life ``E[G - age | G > age]`` from the gaps in the bins above the
        age's bin; ``MAX_TIME + age`` when fewer than ``MIN_GAPS`` gaps lie there."""
        n = 0.0
        s = 0.0
        for k in range(gap_bin(age) + 1, BINS):
            n += self.count[state][k]
            s += self.total[state][k]
        if n < MIN_GAPS:
            return MAX_TIME + age
        return (s - age * n) / n


def reference(requests: Sequence[Sequence[int]], finishes: RequestFinishes | None, capacity: int,
              stats: dict[str, int] | None = None) -> list[int]:
    """Hits per request of finish-aware prefix-LRU, the slow way.

    ``stats`` (when given) counts what the evictions exercised: ``evictions``, ``learned``
    (evictions where some candidate's residual life came from learned gaps),
    ``mixed`` (evictions with candidates from two states or more) and ``continued``
    (gaps recorded).
    """
    n = len(requests)
    if finishes is None:  # the request index is the clock, every request finishes at arrival
        arrival = [float(i) for i in range(n)]
        finish = list(arrival)
        reason = [0] * n
    else:
        t0 = float(finishes.arrival[0]) if n else 0.0  # the clock starts at the first arrival
        arrival = [float(t) - t0 for t in finishes.arrival]
        finish = [float(t) - t0 for t in finishes.finish]
        reason = [int(r) for r in finishes.reason]
    parent: dict[int, int | None] = {}  # the block before it in the first request that used it
    for req in requests:
        prev = None
        for x in req:
            parent.setdefault(x, prev)
            prev = x
    cached: set[int] = set()
    latest: dict[int, tuple[int, int]] = {}  # block -> (latest request referencing it, position there)
    continued: set[int] = set()
    gaps = Gaps()
    st = stats if stats is not None else {}
    for key in ("evictions", "learned", "mixed", "continued"):
        st.setdefault(key, 0)
    hits: list[int] = []

    for i, req in enumerate(requests):
        now = arrival[i]

        def view(x: int, now: float = now) -> tuple[int, float, float]:
            """(state, since, order key) of block x at the current clock."""
            r, pos = latest[x]
            if finish[r] <= now:  # finished as far as the clock knows
                return reason[r], finish[r], finish[r] + pos * TIE
            return IN_FLIGHT, arrival[r], arrival[r] + pos * TIE

        # hit: the longest cached prefix
        h = 0
        while h < len(req) and req[h] in cached:
            h += 1
        hits.append(h)

        # learning: the request continues the latest request referencing its deepest block seen before
        seen = [x for x in req if x in latest]
        if seen:
            r = latest[seen[-1]][0]
            if r not in continued and finish[r] <= now:
                continued.add(r)
                st["continued"] += 1
                gaps.add(reason[r], now - finish[r])
                if finish[r] > arrival[r]:  # it was in flight for a while
                    gaps.add(IN_FLIGHT, now - arrival[r])

        for pos, x in enumerate(req):
            latest[x] = (i, pos)
            cached.add(x)
            while len(cached) > capacity:
                has_child = {parent[y] for y in cached}
                leaves = [y for y in cached if y not in has_child]
                heads: dict[int, tuple[float, int, float]] = {}  # state -> (key, block, since) of its oldest leaf
                for y in leaves:
                    s, since, k = view(y)
                    if s not in heads or (k, y) < heads[s][:2]:
                        heads[s] = (k, y, since)
                best, best_mrl, victim, learned = -1, -1.0, -1, False
                for s in range(N_FINISH + 1):  # ascending: the lower state wins a tie
                    if s not in heads:
                        continue
                    age = max(now - heads[s][2], 0.0)
                    m = gaps.residual(s, age)
                    learned |= m != MAX_TIME + age
                    if best < 0 or m > best_mrl:
                        best, best_mrl, victim = s, m, heads[s][1]
                cached.remove(victim)
                st["evictions"] += 1
                st["learned"] += learned
                st["mixed"] += len(heads) > 1
    return hits


def random_trace(seed: int, n_req: int | None = None) -> tuple[list[list[int]], RequestFinishes, list[int]]:
    """Sessions of prefix-chained requests over a few shared system prompts, with random
    arrivals (ties included), finishes (some at arrival) and reasons; block ids scrambled
    so that the id order (the last tie-break) is not the order of first use; a few requests
    are empty.  Returns the requests, their finishes and capacities that make evictions
    frequent."""
    rng = np.random.default_rng(seed)
    next_id = iter(rng.permutation(1 << 20).tolist())
    systems = [[next(next_id) for _ in range(int(rng.integers(1, 4)))] for _ in range(int(rng.integers(1, 4)))]
    sessions = [list(systems[int(rng.integers(len(systems)))]) for _ in range(int(rng.integers(2, 9)))]
    n_req = int(rng.integers(40, 140)) if n_req is None else n_req
    integer_clock = seed % 3 != 2  # integer times: many equal keys and ages
    epoch = 1.7e9 + float(rng.integers(0, 1000)) if seed % 2 else float(rng.integers(0, 50))
    requests: list[list[int]] = []
    arrival, finish, reason = [], [], []
    t = epoch
    for _ in range(n_req):
        s = int(rng.integers(len(sessions)))
        hist = sessions[s]
        u = rng.random()
        if u < 0.12:  # a new conversation on a system prompt
            hist = list(systems[int(rng.integers(len(systems)))])
        elif u < 0.22 and len(hist) > 1:  # a retry / edit: a shorter prefix
            hist = hist[:int(rng.integers(1, len(hist)))]
        hist = hist + [next(next_id) for _ in range(int(rng.integers(0 if hist else 1, 4)))]
        sessions[s] = hist
        requests.append(list(hist) if rng.random() > 0.03 else [])
        t += float(rng.choice([0, 0, 1, 1, 2, 3, 5, 8, 20])) if integer_clock else float(rng.exponential(4.0))
        arrival.append(t)
        if rng.random() < 0.25:
            d = 0.0
        elif integer_clock:
            d = float(rng.choice([1, 2, 3, 5, 10, 30, 60]))
        else:
            d = float(rng.exponential(10.0))
        finish.append(t + d)
        reason.append(int(rng.integers(0, 4)))
    for req in requests:
        assert len(set(req)) == len(req)  # prefix chains: no block twice in a request
    fin = RequestFinishes(np.array(arrival), np.array(finish), np.array(reason, dtype=np.int8))
    working = len({x for r in requests for x in r})
    caps = sorted({1, 3, max(2, working // 8), max(3, working // 4), max(4, working // 2)})
    return requests, fin, caps


SEEDS = range(20)


@pytest.mark.parametrize("seed", SEEDS)
def test_the_kernel_gives_the_reference_hits(seed: int) -> None:
    reqs, fin, caps = random_trace(seed)
    trace = compact(reqs, fin)
    for cap in caps:
        want = reference(reqs, fin, cap)
        got = finish_aware.simulate(trace, cap).tolist()
        assert got == want, (seed, cap, [(i, g, w) for i, (g, w) in enumerate(zip(got, want)) if g != w][:5])


@pytest.mark.parametrize("seed", SEEDS)
def test_without_finishes_the_kernel_and_the_reference_are_prefix_lru(seed: int) -> None:
    reqs, _, caps = random_trace(seed)
    trace = compact(reqs)
    for cap in caps:
        lru = prefix_lru.simulate(trace, cap).tolist()
        assert reference(reqs, None, cap) == lru, (seed, cap)
        assert finish_aware.simulate(trace, cap).tolist() == lru, (seed, cap)


@pytest.mark.parametrize("seed", [100, 101])
def test_long_traces_agree_through_the_kernels_heap_rebuilds(seed: int) -> None:
    """Long enough that the kernel drops its stale heap entries and rebuilds (after
    4 x capacity + 1024 pushes)."""
    reqs, fin, _ = random_trace(seed, n_req=900)
    trace = compact(reqs, fin)
    for cap in (2, 12, 40):
        assert finish_aware.simulate(trace, cap).tolist() == reference(reqs, fin, cap), (seed, cap)


def test_the_random_traces_exercise_every_branch_of_the_rule() -> None:
    """The differential test means something: evictions choose between states, some
    on learned gaps, some on the past-every-gap rule, and hits are neither all nor none."""
    st: dict[str, int] = {}
    hit = refs = 0
    for seed in SEEDS:
        reqs, fin, caps = random_trace(seed)
        for cap in caps:
            h = reference(reqs, fin, cap, st)
            hit += sum(h)
            refs += sum(map(len, reqs))
    assert st["mixed"] > 0.3 * st["evictions"], st
    assert 0.1 * st["evictions"] < st["learned"] < st["evictions"], st
    assert st["continued"] > 1000, st
    assert 0.05 * refs < hit < 0.95 * refs, (hit, refs)


def test_the_reference_follows_the_documented_rule_on_a_hand_case() -> None:
    """Nothing learned: the leaf past every gap the longest (the oldest) goes first,
    whatever its state; here the in-flight one, which arrived first."""
    a, b, c = [1, 2], [3, 4], [5]
    fin = RequestFinishes(np.array([0.0, 1.0, 7.0, 8.0]), np.array([100.0, 2.0, 7.0, 8.0]),
                          np.array([1, 2, 0, 0], dtype=np.int8))
    # at t=7 the leaves are 2 (in flight since 0), 4 (ended its turn at 2) and 5 (just in)
    for last, hit in ((a, 1), (b, 2)):
        want = [0, 0, 0, hit]
        assert reference([a, b, c, last], fin, 4) == want
        assert finish_aware.simulate(compact([a, b, c, last], fin), 4).tolist() == want
