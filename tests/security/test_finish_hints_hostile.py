"""Hostile input to the finish-aware expert's live path: ``POST /v1/finished`` bodies, a
publisher's Stores carrying ``finish_reason`` and odd clocks, concurrent hints, and odd
times in :class:`RequestFinishes` and :class:`ReturnTimes`.

Tests whose docstring says "Found in review" failed on the first version of the feature
and state the behaviour that now holds; the others lock in hostile-input behaviour that
held from the start."""

from __future__ import annotations

import math
import threading
import time
from collections.abc import Iterator
from pathlib import Path

import httpx
import numpy as np
import pytest
from fastapi.testclient import TestClient

from advisor import AdvisorService, AdvisorSettings
from advisor.index.prefix_index import PrefixIndex
from advisor.policy.eviction import experts, finish_aware
from advisor.policy.eviction.compact import RequestFinishes, compact
from advisor.policy.eviction.finish_aware import FINISH_END_TURN, FINISH_TOOL_CALL, FINISH_UNKNOWN, N_FINISH
from advisor.policy.eviction.live_scoring import FinishView
from advisor.policy.live_selection import observe
from advisor.policy.policies import DemotionSettings, PolicySettings, SelectorLiveSettings, make_scorer
from api import create_app
from event_plane.codec import decode_batch, encode_batch
from event_plane.schema import U64_MAX, EventBatch, store
from tests.security.test_api_surface import ADMIN, READ, api  # noqa: F401  (api: the secured server fixture)
from tests.unit.test_eviction_finish_aware import agent_sessions
from tests.unit.test_live_selector import _agent_batches

BLK = 4096
MODEL = {"name": "m", "dtype": "float16", "layout": "FullyContiguous", "block_size": 16}


# ---------------------------------------------------------------- POST /v1/finished


@pytest.fixture
def hinted(tmp_path: Path) -> Iterator[tuple[AdvisorService, TestClient]]:
    svc = AdvisorService(AdvisorSettings(
        journal_path=str(tmp_path / "j.sqlite"), api_enabled=False, snapshot_store="none",
        policy=PolicySettings(selector=SelectorLiveSettings(max_finish_hints=4))))
    svc.start()
    try:
        yield svc, TestClient(create_app(svc.query()), base_url="http://127.0.0.1")
    finally:
        svc.stop()


REFUSED = [
    {"sequence_hashes": [1.0], "finish_reason": "stop"},
    {"sequence_hashes": [True], "finish_reason": "stop"},
    {"sequence_hashes": [None], "finish_reason": "stop"},
    {"sequence_hashes": [[1]], "finish_reason": "stop"},
    {"sequence_hashes": [1 << 64], "finish_reason": "stop"},
    {"sequence_hashes": [str(1 << 64)], "finish_reason": "stop"},
    {"sequence_hashes": ["0x1_0"], "finish_reason": "stop"},
    {"sequence_hashes": [-1], "finish_reason": "stop"},
    {"sequence_hashes": [10**400], "finish_reason": "stop"},
    {"sequence_hashes": list(range(100_001)), "finish_reason": "stop"},
    {"sequence_hashes": [1]},
    {"sequence_hashes": [1], "finish_reason": ""},
    {"sequence_hashes": [1], "finish_reason": "x" * 65},
    {"sequence_hashes": [1], "finish_reason": "\U0001F600" * 65},
    {"sequence_hashes": [1], "finish_reason": 1},
    {"sequence_hashes": [1], "finish_reason": None},
    {"sequence_hashes": [1], "finish_reason": ["stop"]},
    {"sequence_hashes": [1], "finish_reason": {"stop": 1}},
    {"sequence_hashes": [1], "token_ids": [1] * 16, "model": MODEL, "finish_reason": "stop"},
    {"token_ids": [1] * 16, "finish_reason": "stop"},
    {"token_ids": [-1] * 16, "model": MODEL, "finish_reason": "stop"},
    {"token_ids": [1 << 40] * 16, "model": MODEL, "finish_reason": "stop"},
    {"token_ids": [1 << 70] * 16, "model": MODEL, "finish_reason": "stop"},
    {"token_ids": [1.0] * 16, "model": MODEL, "finish_reason": "stop"},
    {"token_ids": [1] * 16, "model": {**MODEL, "block_size": 0}, "finish_reason": "stop"},
    {"token_ids": list(range(262_145)), "model": {**MODEL, "block_size": 1}, "finish_reason": "stop"},
    [1, 2],
]
RAW_REFUSED = [
    b'{"sequence_hashes": [NaN], "finish_reason": "stop"}',
    b'{"sequence_hashes": [Infinity], "finish_reason": "stop"}',
    b'{"sequence_hashes": [1e3], "finish_reason": "stop"}',
    b'{"sequence_hashes": [1], "finish_reason": "\\ud800"}',  # a lone surrogate
    b'{"sequence_hashes": [1',
    b'{"sequence_hashes": ' + b"[" * 50_000 + b"]" * 50_000 + b', "finish_reason": "stop"}',
]


def test_hostile_finished_bodies_get_4xx_and_the_hint_map_keeps_its_quota(
        hinted: tuple[AdvisorService, TestClient]) -> None:
    svc, client = hinted
    for body in REFUSED:
        r = client.post("/v1/finished", json=body)
        assert 400 <= r.status_code < 500, (str(body)[:80], r.status_code, r.text[:200])
        assert r.json()["error"] in ("invalid_request", "http_error")
    for raw in RAW_REFUSED:
        r = client.post("/v1/finished", content=raw, headers={"content-type": "application/json"})
        assert 400 <= r.status_code < 500, (raw[:60], r.status_code, r.text[:200])
    assert svc.selector.stats()["finish_hints"] == 0  # nothing refused was taken
    # taken as given: odd but valid reasons count as unknown, never as a class they resemble
    for reason in ("\x00\x1b[31m\u202e", "STOP", " stop ", "tool_calls\x00", "\U0001F600" * 64, "abort"):
        r = client.post("/v1/finished", json={"sequence_hashes": [7], "finish_reason": reason})
        assert r.status_code == 200 and r.json() == {"taken": True, "finish_class": "unknown"}, reason
    # the documented limits are accepted whole (both prompt forms), and quick
    r = client.post("/v1/finished", json={"sequence_hashes": [f"0x{i:016x}" for i in range(100_000)],
                                          "finish_reason": "tool_calls"})
    assert r.status_code == 200 and r.json() == {"taken": True, "finish_class": "tool_call"}
    r = client.post("/v1/finished", json={"token_ids": list(range(262_144)), "model": {**MODEL, "block_size": 1},
                                          "finish_reason": "end_turn"})
    assert r.status_code == 200 and r.json() == {"taken": True, "finish_class": "end_turn"}
    # a prompt shorter than a block has no hash: not taken, not counted
    r = client.post("/v1/finished", json={"token_ids": [1] * 5, "model": MODEL, "finish_reason": "stop"})
    assert r.status_code == 200 and r.json()["taken"] is False
    # duplicate keys: the last one counts (standard JSON parsing), one hint
    r = client.post("/v1/finished", content=b'{"sequence_hashes": [8], "finish_reason": "stop", '
                                            b'"finish_reason": "tool_calls"}',
                    headers={"content-type": "application/json"})
    assert r.status_code == 200 and r.json()["finish_class"] == "tool_call"
    # unknown fields (a client trying to set the finish time) are ignored
    r = client.post("/v1/finished", json={"sequence_hashes": [9], "finish_reason": "stop", "at_s": 1e300})
    assert r.status_code == 200
    # a flood of distinct hints: the map never exceeds policy.selector.max_finish_hints
    for i in range(200):
        assert client.post("/v1/finished", json={"sequence_hashes": [1000 + i], "finish_reason": "stop"}).json()["taken"]
    stats = client.get("/v1/stats").json()["policy"]
    assert stats["finish_hints"] == 4
    distinct = 1 + 1 + 1 + 1 + 1 + 200  # 7, the 100,000-hash prompt, the token prompt, 8, 9, the flood
    assert stats["finish_hints_dropped"] == distinct - 4


def test_finish_hints_need_a_token_and_the_read_scope_suffices_as_documented(api: str) -> None:
    # docs/operations.md, REST table: POST /v1/finished is in the read scope
    body = {"sequence_hashes": [1, 2], "finish_reason": "tool_calls"}
    with httpx.Client(base_url=api, timeout=10) as c:
        assert c.post("/v1/finished", json=body).status_code == 401
        assert c.post("/v1/finished", json=body, headers={"Authorization": "Bearer " + "x" * 24}).status_code == 401
        for token in (READ, ADMIN):
            r = c.post("/v1/finished", json=body, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and r.json() == {"taken": True, "finish_class": "tool_call"}


def test_a_token_flooding_finish_hints_cannot_push_out_another_routers(tmp_path: Path) -> None:
    # the quota (4 hints) is shared by token: past it, the oldest hint of the token holding
    # the most goes, so the flooder only ever drops its own once the other router has a share
    from pydantic import SecretStr

    from api.auth import ApiSecuritySettings

    flood, router = "f" * 24, "g" * 24
    svc = AdvisorService(AdvisorSettings(
        journal_path=str(tmp_path / "j.sqlite"), api_enabled=False, snapshot_store="none",
        policy=PolicySettings(selector=SelectorLiveSettings(max_finish_hints=4))))
    svc.start()
    try:
        sec = ApiSecuritySettings(read_tokens=[SecretStr(flood), SecretStr(router)])
        client = TestClient(create_app(svc.query(), security=sec), base_url="http://127.0.0.1")

        def post(token: str, h: int) -> None:
            r = client.post("/v1/finished", json={"sequence_hashes": [h], "finish_reason": "tool_calls"},
                            headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 200 and r.json()["taken"] is True

        for h in (1, 2, 3, 4):
            post(flood, h)
        post(router, 100)  # the flooder holds the most: its oldest (1) goes
        post(router, 101)  # again (2)
        for h in range(5, 50):  # the flooder's own oldest go now, never the router's
            post(flood, h)
        assert set(svc.selector._hints) == {48, 49, 100, 101}  # noqa: SLF001 - the quota's state
        st = client.get("/v1/stats", headers={"Authorization": f"Bearer {router}"}).json()["policy"]
        assert (st["finish_hints"], st["finish_hint_clients"], st["finish_hints_dropped"]) == (4, 2, 47)
        # a hint on a hash another token hinted moves it to the later token's share
        post(flood, 100)
        post(router, 102)  # the flooder holds 3 (48, 49, 100): its oldest, 48, goes
        assert set(svc.selector._hints) == {49, 100, 101, 102}  # noqa: SLF001
    finally:
        svc.stop()


@pytest.mark.parametrize("skew_s", [0.0, 60.0])
def test_a_router_hint_is_timed_on_the_batches_clock(
        hinted: tuple[AdvisorService, TestClient], skew_s: float) -> None:
    """Found in review (clock domains).  A request's arrival is its batch's ``ts_ns`` (the
    publisher's clock) and the ranking's "now" is the latest arrival, but ``POST
    /v1/finished`` carries no time and the hint is stamped with the advisor host's
    ``time.time()``.  With a publisher clock behind the host's by more than a session's
    gap (here 60 s; the tool-call gaps are ~10 s), every hinted request looks unfinished
    when the session's next request arrives: the gap after the tool call is never learned
    and the router's hints do nothing.  Expected: the hint is placed on the batches' clock
    (e.g. not later than the selector's latest arrival when it is taken), so the gap is
    learned as it is when the clocks agree (``skew_s = 0``, which passes)."""
    svc, client = hinted
    a = [1000, 1001, 1002]
    now = time.time()
    svc.ingest(EventBatch(1, "w0", 1, 0, int((now - skew_s) * 1e9), [
        store(a[0], a[0], None, BLK, "g1"), store(a[1], a[0], a[0], BLK, "g1"), store(a[2], a[0], a[1], BLK, "g1")]))
    r = client.post("/v1/finished", json={"sequence_hashes": a, "finish_reason": "tool_calls"})
    assert r.json() == {"taken": True, "finish_class": "tool_call"}
    # the session's next request, 5 s later on the publisher's clock, continues the prompt
    svc.ingest(EventBatch(1, "w0", 1, 1, int((now - skew_s + 5.0) * 1e9), [store(1003, a[0], a[2], BLK, "g1")]))
    svc.selector.refresh(100)
    returns = svc.selector.returns
    assert returns is not None
    learned = int(returns.count[FINISH_TOOL_CALL, 0])
    assert learned == 1, f"publisher clock {skew_s:.0f} s behind the host's: {learned} tool-call gaps learned"


def test_a_hint_applies_to_the_request_it_reported_not_to_a_later_one() -> None:
    """Found in review (Low: stale hints).  Hints are kept until the quota drops them and, at each
    replay, every window request whose Store run holds a hinted hash takes the hint.  A
    block stored again later (re-onboarded to G1 after an eviction, a new request) gets the
    old hint: that request "finished at its arrival with a tool call", a reason nobody
    reported for it.  Expected (class docstring: the hint is matched to *the* window
    request whose run holds the deepest prompt hash): the later request keeps the unknown
    state."""
    sel = experts.LiveSelector()
    sel.observe([1, 2, 3], arrival_s=10.0)
    assert sel.finished([1, 2, 3], "tool_calls", at_s=12.0)
    sel.observe([1, 2, 3, 4, 5], arrival_s=20.0, run_start=3)  # the session goes on
    sel.observe([1, 2, 3], arrival_s=500.0, run_start=2)  # block 3 Stored again, much later
    fin = sel._finishes(sel.window(), dict(sel._hints))
    assert fin.reason.tolist()[:2] == [FINISH_TOOL_CALL, FINISH_UNKNOWN] and fin.finish[0] == 12.0
    assert fin.reason[2] == FINISH_UNKNOWN, "the 500 s request took the hint posted for the 10 s one"


# ---------------------------------------------------------------- a publisher's clock


def _honest_feed(base: float, hostile: dict[int, EventBatch] | None = None, max_hints: int = 1 << 16
                 ) -> tuple[PrefixIndex, experts.LiveSelector, list[list[int]], RequestFinishes, int]:
    """The agent sessions as a worker's batches at ``base`` + their arrival, each request's
    finish reported by a router at ``base`` + its finish; ``hostile[k]``: a batch taken
    before request ``k``."""
    reqs, fin, cap = agent_sessions(0, steps=900)
    index = PrefixIndex()
    sel = experts.LiveSelector(max_hints=max_hints)
    reasons = {1: "tool_calls", 2: "stop"}
    for k, (r, b, f, c) in enumerate(zip(reqs, _agent_batches(reqs, base + fin.arrival), fin.finish, fin.reason)):
        if hostile and k in hostile:
            index.apply_batch(hostile[k])
            observe(sel, index, hostile[k])
        index.apply_batch(b)
        observe(sel, index, b)
        assert sel.finished(r, reasons[int(c)], at_s=base + f)
    return index, sel, reqs, fin, cap


def _evil(ts_ns: int) -> EventBatch:
    """Another source's batch: one Store of a block of its own, stamped ``ts_ns``."""
    return EventBatch(1, "evil", 9, 0, ts_ns, [store(999_999_999_999, 999_999_999_999, None, BLK, "g1")])


def _far_future(base: float) -> int:
    return U64_MAX


def _an_hour_ahead(base: float) -> int:
    return int((time.time() + 3600.0) * 1e9)


@pytest.mark.parametrize("stamp", [_far_future, _an_hour_ahead])
def test_one_source_clock_ahead_does_not_reorder_the_other_sessions(stamp) -> None:  # noqa: ANN001
    """Found in review (Medium: one publisher moves every block's age).  ``LiveSelector.latest_s`` is
    the max of every batch's ``ts_ns`` and never comes back; the planner ranks with it as
    "now" (``FinishView.now_s``).  One batch stamped in the future (a hostile publisher, or an
    honest one whose clock runs an hour fast) makes every other block look that much
    older: past every learned gap, all blocks fall to ``MAX_TIME + age`` and the order is
    oldest-first, so a session waiting on a tool call (finished earlier) is demoted before
    one that ended its turn (finished later), the opposite of the honest ranking.
    Expected: one source's timestamp cannot move the ranking's clock for the others (e.g.
    an arrival far ahead of the others' is not taken as "now"); the honest order holds."""
    base = time.time() - 1900.0  # the batches' clock: the trace ends about now
    index, sel, reqs, fin, cap = _honest_feed(base)
    assert sel.refresh(cap) == "finish_aware"
    latest = {r[4]: k for k, r in enumerate(reqs)}  # a session's first own block -> its latest request
    done = [k for k in latest.values() if fin.finish[k] <= fin.arrival[-1]]
    turn = max((k for k in done if fin.reason[k] == FINISH_END_TURN), key=lambda k: fin.finish[k])
    tool = max((k for k in done if fin.reason[k] == FINISH_TOOL_CALL and fin.finish[k] < fin.finish[turn]),
               key=lambda k: fin.finish[k])
    a, b = reqs[tool][-1], reqs[turn][-1]
    settings = PolicySettings(demotion=DemotionSettings(scoring="experts"))

    def order() -> tuple[float, float]:
        view = FinishView(sel.finish_states(), sel.returns, sel.latest_s)
        score = make_scorer(settings, index, [a, b], "finish_aware", finish=view)
        return score(a), score(b)

    tool_score, turn_score = order()
    assert turn_score < tool_score  # honest: the session that ended its turn is demoted first
    honest_now = sel.latest_s
    evil = _evil(stamp(base))
    index.apply_batch(evil)
    observe(sel, index, evil)
    sel.refresh(cap)
    tool_score, turn_score = order()
    assert turn_score < tool_score, (
        f"one batch at ts_ns={evil.ts_ns} moved the ranking clock from {honest_now:.0f} s to {sel.latest_s:.0f} s: "
        f"the tool-call session now ranks {tool_score:.1f}, below the ended turn's {turn_score:.1f}")


def test_a_future_stamped_batch_does_not_erase_the_gaps_learned_from_other_sources() -> None:
    """Found in review (Medium: one batch blinds the window).  ``LiveSelector._finishes`` makes the
    window's arrivals non-decreasing with ``np.maximum.accumulate``, so every request after
    one future-stamped batch (any source) arrives at that future instant: the gaps between
    the honest requests that follow become 0 and are lost (tool-call gaps beyond 1 s:
    587 -> 302 with the batch in the middle of this window), and it lasts until that
    request leaves the window (``max_window_refs``, 2**20 references by default).
    Expected: the gaps learned from the honest requests are those learned without the
    hostile batch (its own request continues nothing and nothing continues it)."""
    base = time.time() - 1900.0
    _, clean, _, _, cap = _honest_feed(base)
    _, dirty, _, _, _ = _honest_feed(base, {450: _evil(U64_MAX)})
    clean.refresh(cap)
    dirty.refresh(cap)
    assert clean.returns is not None and dirty.returns is not None
    for state in (FINISH_TOOL_CALL, FINISH_END_TURN):
        assert np.array_equal(dirty.returns.count[state], clean.returns.count[state]), (
            f"state {state}: gaps beyond each bin {dirty.returns.count[state, :4].tolist()} with the hostile "
            f"batch, {clean.returns.count[state, :4].tolist()} without")


def test_hostile_stores_over_the_wire_never_break_the_selector(tmp_path: Path) -> None:
    """Odd ``finish_reason`` values, clocks and runs from one publisher: ``observe_batch`` and
    ``refresh`` never raise, the window keeps its quota, and only an exact known reason
    string gives a class (a long one is cut to 64 characters first), and only from a
    publisher trusted with finish reasons (``finish_sources``)."""
    window = 5_000
    sel = experts.LiveSelector(max_window_refs=window, max_path=4096, finish_sources={"evil"})
    index = PrefixIndex()
    weird: list[object] = [1, 1.5, True, None, [], ["tool_calls"], {"reason": "tool_calls"}, b"tool_calls",
                           "x" * 200_000, "tool_calls" + "x" * 100, "tool_calls\x00", "\U0001F600" * 64,
                           "TOOL_CALLS", "tool_calls", "stop", {"a": [{"b": [1] * 10}] * 10}]
    expect = [FINISH_UNKNOWN] * 13 + [FINISH_TOOL_CALL, FINISH_END_TURN, FINISH_UNKNOWN]
    clocks = [0, 1, U64_MAX, 5 * 10**18, 4 * 10**18, 1]  # none, tiny, the max, backwards
    seq = 0
    for k, why in enumerate(weird):
        root = 10_000 * (k + 1)
        meta = {"finish_reason": why, "nested": [[[[{"deep": 1}]]]]}
        evs = [store(root, root, None, BLK, "g1"), store(root + 1, root, root, BLK, "g1", meta)]
        wire = encode_batch(EventBatch(1, "evil", 1, seq, clocks[k % len(clocks)], evs))
        b = decode_batch(wire)
        index.apply_batch(b)
        assert observe(sel, index, b) == 1
        assert sel.window()[-1].reason == expect[k], repr(why)[:60]
        seq += 1
    # a huge run: one chain of 20,000 Stores in one batch (the path is cut at max_path)
    run = [store(7_000_000, 7_000_000, None, BLK, "g2")]
    run += [store(7_000_000 + i, 7_000_000, 7_000_000 + i - 1, BLK, "g2") for i in range(1, 20_000)]
    b = decode_batch(encode_batch(EventBatch(1, "evil", 1, seq, 0, run)))
    index.apply_batch(b)
    assert observe(sel, index, b) == 1
    # and many small requests
    for i in range(3_000):
        r = 50_000_000 + i
        observe(sel, index, EventBatch(1, "evil", 1, seq + 1 + i, i % 7, [store(r, r, None, BLK, "g1")]))
    stats = sel.stats()
    assert stats["window_refs"] <= window and stats["window_requests"] == len(sel.window())
    assert sum(len(w.path) for w in sel.window()) == stats["window_refs"]
    for cap in (1, 10, 1_000, 10**7):
        assert sel.refresh(cap) in experts.EXPERTS
        sel.observe([1, 2], arrival_s=1.0)  # a new reference: the next refresh replays again
    assert all(isinstance(s, int) and isinstance(t, float) for s, t in sel.finish_states().values())


# ---------------------------------------------------------------- concurrency


def test_hints_and_reads_while_the_selector_replays() -> None:
    """``finished()`` from 8 threads while another thread observes, replays (with
    ``finish_aware`` leading at first) and reads ``finish_states()`` / ``stats()``: nothing
    raises, the states read are well formed, the map stays within its quota and every
    distinct hint is either kept or counted as dropped."""
    quota, per_thread = 4_096, 3_000
    base = time.time() - 1900.0
    _, sel, reqs, _, cap = _honest_feed(base, max_hints=quota)
    assert sel.refresh(cap) == "finish_aware" and sel.finish_states()
    end = sel.latest_s
    errors: list[BaseException] = []
    stop, replaying = threading.Event(), threading.Event()
    replays, states_seen = [0], [0]

    def hint(t: int) -> None:
        try:
            replaying.wait(60)
            for i in range(per_thread):
                sel.finished([t, (t << 32) | i], ("tool_calls", "stop", "length", "???")[i % 4], at_s=end + i)
                assert sel.stats()["finish_hints"] <= quota
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def replay() -> None:
        try:
            k = 0
            while not stop.is_set() or k < 5:
                sel.observe(reqs[k % len(reqs)], arrival_s=end + k)
                assert sel.refresh(cap) in experts.EXPERTS
                states = sel.finish_states()
                states_seen[0] += len(states)
                for s, since in states.values():
                    assert 0 <= s <= N_FINISH and math.isfinite(since)
                k += 1
                replays[0] = k
                replaying.set()
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    threads = [threading.Thread(target=hint, args=(t + 1,)) for t in range(8)]
    rep = threading.Thread(target=replay)
    rep.start()
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    stop.set()
    rep.join(60)
    assert not errors, errors[:3]
    assert replays[0] >= 5 and states_seen[0] > 0, (replays, states_seen)
    s = sel.stats()
    assert s["finish_hints"] == quota
    assert s["finish_hints_dropped"] == len({h for r in reqs for h in r[-1:]}) + 8 * per_thread - quota


# ---------------------------------------------------------------- odd times


def test_request_finishes_refuse_times_that_are_not_numbers() -> None:
    """Found in review (Low).  :class:`RequestFinishes` checks ``finish >= arrival`` and ordered
    arrivals with comparisons that NaN passes, so NaN times are accepted; a NaN arrival
    then makes the finish-aware kernel raise ``IndexError: pop from empty list`` (its heap
    entries never validate, ``key != key``) and ``LiveSelector.refresh`` raise with it
    after one ``observe(..., arrival_s=nan)``.  Expected: NaN arrival or finish and a
    non-finite arrival are refused with ``ValueError``, and the selector never keeps a
    NaN arrival (its refresh does not raise)."""
    n = 6
    arrival, finish, reason = np.arange(n, dtype=float), np.arange(n, dtype=float) + 0.5, np.ones(n, dtype=np.int8)
    for bad_arrival, bad_finish in ((np.nan, None), (None, np.nan), (np.inf, None), (-np.inf, None)):
        a, f = arrival.copy(), finish.copy()
        if bad_arrival is not None:
            a[3:] = bad_arrival
            f[3:] = bad_arrival if bad_arrival > 0 else f[3:]
        if bad_finish is not None:
            f[3] = bad_finish
        with pytest.raises(ValueError):
            RequestFinishes(a, f, reason)
    sel = experts.LiveSelector()
    for i in range(40):
        sel.observe([1, 2, 10 + i % 5, 100 + i], arrival_s=float(i))
    sel.observe([1, 2, 3], arrival_s=float("nan"))
    for i in range(40):
        sel.observe([1, 2, 10 + i % 5, 200 + i], arrival_s=50.0 + i)
    assert sel.refresh(4) in experts.EXPERTS


def test_residual_life_of_an_unbounded_age_is_past_every_gap() -> None:
    """Found in review (Low: out-of-bounds read in a numba kernel).  ``_bin`` maps ``inf`` and NaN
    to ``int(inf)`` = -2**63 + 1, and ``_residual`` then reads ``count[state, k]`` at that
    index (numba does not check bounds): ``ReturnTimes.residual_life(0, inf)`` reads
    another state's bin and answers -inf (a block of infinite age would be kept first),
    NaN gives NaN.  Expected: an infinite age is past every gap (``MAX_TIME + age`` =
    inf, the docstring's rule), and a NaN age is refused (``ValueError``) or ranked as
    past every gap, never NaN."""
    reqs, fin, cap = agent_sessions(0, steps=900)
    _, returns = finish_aware.learn(compact(reqs, fin), cap)
    for state in range(N_FINISH + 1):
        assert returns.residual_life(state, math.inf) == math.inf, state
        try:
            r = returns.residual_life(state, math.nan)
        except ValueError:
            continue
        assert not math.isnan(r), state


def test_a_one_byte_block_size_does_not_make_the_selector_replay_a_tier_of_a_trillion_blocks() -> None:
    # Found in review: the selector converts the fast tier's bytes to blocks with the latest
    # Store's block_size, any publisher's; block_size = 1 turned a 1 TB tier into 10^12
    # blocks and the replay's allocations failed (MemoryError), taking the policy round down
    from advisor.policy.live_selection import leader_for

    sel = experts.LiveSelector()
    index = PrefixIndex()
    for k in range(50):
        r = 1_000 + 10 * k
        b = EventBatch(1, "evil", 1, k, 10**9 + k, [store(r, r, None, 1, "g1"), store(r + 1, r, r, 1, "g1")])
        index.apply_batch(b)
        observe(sel, index, b)
    assert sel.block_bytes == 1
    assert leader_for(sel, 1 << 40) in experts.EXPERTS  # a tier of 2^40 blocks, replayed as the window's 100
