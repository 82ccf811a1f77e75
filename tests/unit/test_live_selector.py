"""The live advisor's default policy: the evaluator's expert selection, fed real events."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest

from advisor import AdvisorService, AdvisorSettings
from advisor.index.prefix_index import PrefixIndex
from advisor.policy.eviction import experts, prefix_value
from advisor.policy.eviction.compact import compact
from advisor.policy.live_selection import observe
from advisor.policy.policies import (
    DemotionSettings,
    PolicyInput,
    PolicySettings,
    PromotionSettings,
    SelectorLiveSettings,
    VolumeUsage,
    make_scorer,
    plan_demotions,
    plan_promotions,
)
from event_plane.schema import EventBatch, store
from kvadvisor.synthetic import loop
from storage_backends.types import BlockKey, Placement
from tests.unit.test_eviction_prefix_value import compactions

BLK = 4096  # bytes per block


def _chain(path: list[int], loc: str = "g1") -> list:
    out, parent = [], None
    for h in path:
        out.append(store(h, path[0], parent, BLK, loc))
        parent = h
    return out


@pytest.fixture
def loop_case() -> tuple[list[list[int]], int]:
    """40 objects read in a cycle, 12 cycles; a tier of 3/4 of the loop: S3-FIFO keeps part of
    the loop, prefix_value (recency-led) keeps almost nothing that is reused in time."""
    case = loop(0, n_objects=40, n_requests=480)
    reqs = [[b + 10**6 for b in r] for r in case.requests]  # apart from conversations()' ids
    footprint = len({b for r in reqs for b in r[:-1]})
    return reqs, (3 * footprint) // 4


def conversations(n_conv: int = 8, turns: int = 30) -> list[list[int]]:
    """Conversations taking turns in a shuffled round: each request reads its conversation's
    whole history and adds a 4-block turn (and a fresh block).  The blocks of a turn are next
    read one round later, after S3-FIFO's small queue has let them go: S3-FIFO loses."""
    rng = np.random.default_rng(1)
    nxt = iter(range(1, 10**6))
    paths = [[next(nxt), next(nxt)] for _ in range(n_conv)]
    reqs = []
    for _ in range(turns):
        for c in rng.permutation(n_conv):
            paths[c] = paths[c] + [next(nxt) for _ in range(4)]
            reqs.append(paths[c] + [next(nxt)])
    return reqs


def test_live_advisor_switches_expert_on_events_where_its_leader_loses(
        tmp_path: Path, loop_case: tuple[list[list[int]], int]) -> None:
    loop_reqs, cap = loop_case
    window = 8_000  # block references: the selector's memory of past phases
    settings = AdvisorSettings(
        journal_path=str(tmp_path / "journal.sqlite"), catalog_path=str(tmp_path / "catalog.sqlite"),
        subscribe_urls=[], api_enabled=False, policy_interval_s=0, snapshot_store="none",
        volumes=[{"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": cap * BLK,
                  "root": str(tmp_path / "fast")},
                 {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 1 << 30,
                  "root": str(tmp_path / "slow")}],
        fast_volume="fast", slow_volumes=["slow"],
        policy=PolicySettings(selector=SelectorLiveSettings(max_window_refs=window)))
    svc = AdvisorService(settings)
    svc.start()
    seq = 0

    def feed(reqs: list[list[int]]) -> None:
        nonlocal seq
        for r in reqs:
            assert svc.ingest(EventBatch(1, "w0", 7, seq, 1_000 * (seq + 1), _chain(r)))
            seq += 1

    def evaluator_leader() -> str:
        # the evaluator's selection on the requests the selector holds (one implementation)
        return experts.EXPERTS[experts.next_leader(compact([list(w.path) for w in svc.selector.window()]), cap)[0]]

    try:
        assert svc.policy_leader() == experts.SelectorSettings().initial == "s3fifo_tail"  # before any evidence
        conv = conversations()
        feed(conv)
        first = svc.policy_leader()
        assert first != "s3fifo_tail" and first == evaluator_leader()
        # the advisor's own moves (its source) are not requests
        assert observe(svc.selector, svc.index, EventBatch(1, settings.source, 1, 0, 1, _chain(loop_reqs[0])),
                       svc._is_own_move) == 0
        feed(loop_reqs)
        assert svc.selector.requests == len(conv) + len(loop_reqs)
        assert svc.selector.stats()["window_refs"] <= window
        # a loop: the evaluator on the same requests shows the leader of the first phase losing by far
        run = experts.run(compact(loop_reqs), cap)
        totals = dict(zip(experts.EXPERTS, run.expert_hits.sum(axis=1)))
        assert totals["s3fifo_tail"] > 2 * max(totals[first], totals["prefix_value"])
        assert svc.policy_leader() == evaluator_leader() == "s3fifo_tail"
        assert svc.selector.switches == 2
        stats = svc.query().stats()["policy"]
        assert stats["leader"] == "s3fifo_tail" and stats["switches"] == 2
        svc.run_policies_once()  # a round plans with the leader's order (nothing on fast: no moves)
    finally:
        svc.stop()


def test_live_selector_is_the_evaluators_selection_on_a_window(loop_case: tuple[list[list[int]], int]) -> None:
    reqs, cap = loop_case
    sel = experts.LiveSelector(max_window_refs=10**6)
    idx = PrefixIndex()
    for seq, r in enumerate(reqs):
        b = EventBatch(1, "w0", 7, seq, seq + 1, _chain(r))
        idx.apply_batch(b)

        def parent_of(h: int) -> int | None:
            info = idx.block(h)
            return info.parent if info is not None else None
        sel.observe_batch(b, parent_of)
    assert sel.refresh(cap) == experts.EXPERTS[experts.next_leader(compact(reqs), cap)[0]] == "s3fifo_tail"
    # a worker that stores only a request's new blocks still references the whole prefix
    sel2 = experts.LiveSelector()
    tail = EventBatch(1, "w0", 7, 999, 1, [store(reqs[0][-1] + 10**6, reqs[0][0], reqs[0][-2], BLK, "g1")])
    sel2.observe_batch(tail, parent_of)
    assert list(sel2.window()[-1].path) == reqs[0][:-1] + [reqs[0][-1] + 10**6]
    # a hashed sample keeps whole prefixes and about its share of them; the window has a quota
    many = [[1_000 * (i % 300) + j for j in range(1, 6)] for i in range(900)]  # 300 roots, 3 visits each
    half = experts.LiveSelector(sample_rate=0.5, max_window_refs=2_000)
    for r in many:
        half.observe(r)
    st = half.stats()
    assert 1_000 <= st["window_refs"] <= 2_000 and st["requests"] == len(many)
    assert all(half.sampled(w.path[0]) and len(w.path) == 5 for w in half.window())
    roots = {r[0] for r in many}
    assert 0.35 < sum(half.sampled(x) for x in roots) / len(roots) < 0.65
    with pytest.raises(ValueError):
        experts.LiveSelector(sample_rate=0.0)
    # sequence hashes are u64: those above the int64 range are replayed too
    big = experts.LiveSelector()
    for _ in range(3):
        big.observe([(1 << 64) - 1, (1 << 63) + 5, 7])
    assert big.refresh(2) in experts.EXPERTS and big.stats()["window_refs"] == 9


def test_demotion_follows_the_leaders_order() -> None:
    # a block seen once (recent) and a block seen three times (older): recency-led experts
    # demote the older one, frequency-aware experts the one-hit block
    idx = PrefixIndex()
    idx.apply_batch(EventBatch(1, "w0", 1, 0, 1_000, _chain([1], "fast")))
    for k in range(1, 4):
        idx.apply_batch(EventBatch(1, "w0", 1, k, 1_000 + k, _chain([1], "g1")))
    idx.apply_batch(EventBatch(1, "w0", 1, 9, 5_000, _chain([2], "fast")))
    on_fast = [Placement(BlockKey("ns", h), "fast", 1, i * BLK, BLK, 0) for i, h in enumerate((1, 2))]
    pin = PolicyInput("fast", ["slow"], None, usage={"fast": VolumeUsage(2 * BLK, 2 * BLK, 2 * BLK)},
                      fast_placements=on_fast)
    s = DemotionSettings(high_watermark=0.8, low_watermark=0.5)
    first = {}
    for leader in ("lru_tail", "s3fifo_tail", "lfu_da_tail"):
        score = make_scorer(PolicySettings(demotion=s), idx, [1, 2], leader)
        items = plan_demotions(s, pin, idx, score=score)
        first[leader] = items[0].sequence_hash
        assert leader.replace("_", "-") in items[0].reason
    assert first == {"lru_tail": 1, "s3fifo_tail": 2, "lfu_da_tail": 2}
    with pytest.raises(ValueError):
        make_scorer(PolicySettings(demotion=s), idx, [1], "fifo")
    assert np.isfinite(make_scorer(PolicySettings(), idx, [1, 2])(1))


def test_live_ranking_puts_the_kernels_superseded_branches_first() -> None:
    # sequence hashes above the int64 range: the selector replays them signed and names them u64
    reqs, dead, new = compactions((1 << 63) + 7)
    sel = experts.LiveSelector()
    idx = PrefixIndex()
    for seq, r in enumerate(reqs):
        b = EventBatch(1, "w0", 7, seq, 1_000 * (seq + 1), _chain(r))
        idx.apply_batch(b)
        sel.observe_batch(b, lambda h: (i.parent if (i := idx.block(h)) is not None else None))
    assert sel.superseded == frozenset()  # before any replay
    sel.refresh(20)
    # the kernel's verdict on the same requests, read back as sequence hashes (one implementation)
    ct = compact([[h - (1 << 64) for h in r] for r in reqs])
    _, flags = prefix_value.superseded_first(ct, 20)
    assert ct.keys is not None
    assert sel.superseded == {int(k) & ((1 << 64) - 1) for k in ct.keys[flags]}
    assert set(dead[-1]) <= sel.superseded and not set(dead[0]) & sel.superseded
    assert sel.stats()["superseded_blocks"] == len(sel.superseded)
    # the fast volume holds the last dead branch and an older live branch: under prefix_value
    # the dead branch's leaves go first; without the verdict, or under another expert's
    # order, recency sends the older live branch first
    live = new[0][2:]
    on_fast = [Placement(BlockKey("ns", h), "fast", 1, i * BLK, BLK, 0) for i, h in enumerate(dead[-1] + live)]
    s = DemotionSettings(high_watermark=0.8, low_watermark=0.7)
    first = {}
    for leader, sup in (("prefix_value", sel.superseded), ("prefix_value", frozenset()), ("lru_tail", sel.superseded)):
        pin = PolicyInput("fast", ["slow"], None, usage={"fast": VolumeUsage(10 * BLK, 9 * BLK, 9 * BLK)},
                          fast_placements=on_fast, superseded=sup)
        score = make_scorer(PolicySettings(demotion=s), idx, dead[-1] + live, leader, pin.superseded)
        items = plan_demotions(s, pin, idx, score=score)
        first[(leader, bool(sup))] = [it.sequence_hash for it in items]
        if leader == "prefix_value" and sup:
            assert all("superseded branch" in it.reason for it in items)
            assert max(score(h) for h in dead[-1]) < min(score(h) for h in live)
    assert first[("prefix_value", True)] == dead[-1][::-1][:2]
    assert first[("prefix_value", False)] == first[("lru_tail", True)] == live[::-1][:2]
    # a hot block of a superseded branch on a slow volume is not promoted (it would go first)
    for w in ("w1", "w2"):
        idx.apply_batch(EventBatch(1, w, 7, 0, 10**9, _chain(dead[-1])))
    idx.apply_batch(EventBatch(1, "w0", 7, 10**6, 10**9 + 1, _chain(dead[-1], "slow")))
    promoted = {}
    for sup in (sel.superseded, frozenset()):
        pin = PolicyInput("fast", ["slow"], None, usage={"fast": VolumeUsage(100 * BLK, 0, 0)}, superseded=sup)
        score = make_scorer(PolicySettings(), idx, dead[-1], "prefix_value", pin.superseded)
        promoted[bool(sup)] = [it.sequence_hash for it in plan_promotions(PromotionSettings(), pin, idx, 1.0, score)]
    assert promoted == {True: [], False: dead[-1]}


def _advisor(tmp_path: Path, fast_bytes: int, demote: DemotionSettings) -> tuple:
    """An embedded advisor on a fast and a slow POSIX volume, and a worker's storage agent on
    the same catalog: ``(settings, service, catalog, worker)``; the caller closes them."""
    from storage_backends import SqliteCatalog, StorageAgent

    settings = AdvisorSettings(
        journal_path=str(tmp_path / "journal.sqlite"), catalog_path=str(tmp_path / "catalog.sqlite"),
        namespace="ns", subscribe_urls=[], api_enabled=False, policy_interval_s=0, snapshot_store="none",
        volumes=[{"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": fast_bytes,
                  "root": str(tmp_path / "fast")},
                 {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 1 << 30,
                  "root": str(tmp_path / "slow")}],
        fast_volume="fast", slow_volumes=["slow"], policy=PolicySettings(demotion=demote))
    svc = AdvisorService(settings)
    svc.start()
    catalog = SqliteCatalog(tmp_path / "catalog.sqlite")
    worker = StorageAgent(catalog, name="worker")
    for v in settings.volumes:
        worker.register_volume(v.to_descriptor())
    return settings, svc, catalog, worker


def test_the_embedded_advisor_demotes_superseded_branches_first(tmp_path: Path) -> None:
    # the service end to end on real volumes: its policy round hands the selector's verdict
    # to the planner, so the fast volume's first demotions are the dead branch's leaves,
    # though the live branch beside it was accessed earlier
    import torch

    reqs, dead, new = compactions(5_000)
    live = new[0][2:]
    demote = DemotionSettings(scoring="prefix_value", high_watermark=0.8, low_watermark=0.7)
    settings, svc, catalog, worker = _advisor(tmp_path, 10 * BLK, demote)
    try:
        seq = 0

        def batch(events: list) -> None:
            nonlocal seq
            assert svc.ingest(EventBatch(1, "w0", 7, seq, 1_000 * (seq + 1), events))
            seq += 1
        for r in reqs:
            batch(_chain(r))
        for branch in (live, dead[-1]):  # offloaded to fast: the live branch first
            worker.put([(BlockKey("ns", h), torch.full((BLK,), h % 251, dtype=torch.uint8)) for h in branch], "fast")
            batch(_chain(branch, "fast"))
        results = svc.run_policies_once()
        assert set(dead[-1]) <= svc.selector.superseded
        demoted = [r.item.sequence_hash for r in results if r.item.src_volume == "fast"]
        assert demoted == dead[-1][::-1][:2], [r.item.reason for r in results]
        assert all("superseded branch" in r.item.reason for r in results if r.item.src_volume == "fast")
    finally:
        svc.stop()
        worker.close()
        catalog.close()


def _agent_batches(reqs: list[list[int]], arrival: np.ndarray) -> list[EventBatch]:
    """Each request as a worker's batch at its arrival: its new blocks, chained to its prefix."""
    seen: set[int] = set()
    out = []
    for seq, (r, t) in enumerate(zip(reqs, arrival)):
        new = [h for h in r if h not in seen]
        seen.update(new)
        parent = r[len(r) - len(new) - 1] if len(new) < len(r) else None
        evs = []
        for h in new:
            evs.append(store(h, r[0], parent, BLK, "g1"))
            parent = h
        out.append(EventBatch(1, "w0", 7, seq, int(t * 1e9) + 1, evs))
    return out


def test_routers_finish_hints_make_the_live_selector_the_evaluators_finish_aware_one() -> None:
    from advisor.policy.eviction.compact import RequestFinishes
    from advisor.policy.eviction.live_scoring import FinishView
    from tests.unit.test_eviction_finish_aware import agent_sessions

    reqs, fin, cap = agent_sessions(0, steps=900)
    index = PrefixIndex()
    sel = experts.LiveSelector()
    reasons = {1: "tool_calls", 2: "stop"}
    for r, b, f, c in zip(reqs, _agent_batches(reqs, fin.arrival), fin.finish, fin.reason):
        index.apply_batch(b)
        observe(sel, index, b)
        assert sel.finished(r, reasons[int(c)], at_s=f)  # the router, once the answer is out
    assert sel.refresh(cap) == "finish_aware"
    # the evaluator's selection on the same requests, arrivals (the batches' clock) and finishes
    arr = np.array([b.ts_ns / 1e9 for b in _agent_batches(reqs, fin.arrival)])
    expect = experts.next_leader(compact(reqs, RequestFinishes(arr, np.maximum(fin.finish, arr), fin.reason)), cap)
    assert experts.EXPERTS[expect[0]] == sel.leader
    # the ranking: of two leaves idle as long, the one whose session ended its turn goes first
    states = sel.finish_states()
    latest = {h: k for k, r in enumerate(reqs) for h in r}  # block -> the latest request that read it
    done = {int(fin.reason[k]): h for h, k in latest.items() if fin.finish[k] <= arr[-1]}  # finished by the end
    flying = [h for h, k in latest.items() if fin.finish[k] > arr[-1]]
    tool, turn = done[1], done[2]
    assert states[tool] == (1, fin.finish[latest[tool]]) and states[turn] == (2, fin.finish[latest[turn]])
    assert flying and all(states[h][0] == 4 for h in flying)  # in flight
    view = FinishView({tool: (1, 100.0), turn: (2, 100.0)}, sel.returns, now_s=110.0)
    assert view.residual_s(turn, 0, 110.0) > view.residual_s(tool, 0, 110.0)
    settings = PolicySettings(demotion=DemotionSettings(scoring="experts"))
    score = make_scorer(settings, index, [tool, turn], "finish_aware", finish=view)
    assert score(turn) < score(tool)  # lower = demoted first


def test_finish_hints_have_a_quota_and_stores_can_carry_the_reason() -> None:
    sel = experts.LiveSelector(max_hints=2)
    for h in (1, 2, 3):
        assert sel.finished([h], "tool_calls", at_s=1.0)
    assert sel.stats()["finish_hints"] == 2 and sel.hints_dropped == 1
    assert not sel.finished([], "stop") and not experts.LiveSelector(max_hints=0).finished([1], "stop")
    # a worker that knows how a request ended says so on its Stores; only a publisher
    # trusted with finish reasons is heard (another could keep its own prefixes that way)
    sel = experts.LiveSelector(finish_sources={"w0"})
    index = PrefixIndex()
    for source, root, expect in (("w0", 10, 1), ("w1", 20, 0)):
        evs = _chain([root, root + 1, root + 2])
        evs[-1] = store(root + 2, root, root + 1, BLK, "g1", {"finish_reason": "tool_calls"})
        b = EventBatch(1, source, 7, 0, 5 * 10**9, evs)
        index.apply_batch(b)
        observe(sel, index, b)
        last = sel.window()[-1]
        assert (last.arrival_s, last.run_start, last.finish_s, last.reason) == (5.0, 0, 5.0 if expect else -1.0, expect)


def test_the_embedded_advisor_demotes_the_session_that_ended_its_turn_first(tmp_path: Path) -> None:
    # the service end to end: routers' finish hints reach its selector, the selector leads with
    # finish_aware, and the policy round demotes from the fast volume the blocks of a session
    # that ended its turn before those of a session waiting on a tool call that finished earlier
    import torch

    from advisor.policy.eviction.live_scoring import FinishView
    from tests.unit.test_eviction_finish_aware import agent_sessions

    reqs, fin, _ = agent_sessions(0, steps=900)
    base = 1.7e9  # the batches' clock; the ranking's "now" is the latest batch, not the host's clock
    latest = {r[4]: k for k, r in enumerate(reqs)}  # a session's first own block -> its latest request
    done = [k for k in latest.values() if fin.finish[k] <= fin.arrival[-1]]
    turn = max((k for k in done if fin.reason[k] == 2), key=lambda k: fin.finish[k])
    tool = max((k for k in done if fin.reason[k] == 1 and fin.finish[k] < fin.finish[turn]), key=lambda k: fin.finish[k])
    # seed 0: they finished 18.5 s and 2.9 s before the last arrival
    a, b = reqs[tool], reqs[turn]  # A waits on a tool call (finished earlier), B ended its turn (later)
    n_fast = len(set(a) | set(b))
    demote = DemotionSettings(scoring="experts", high_watermark=0.8, low_watermark=0.6)
    settings, svc, catalog, worker = _advisor(tmp_path, int(n_fast / 0.9) * BLK, demote)
    try:
        batches = _agent_batches(reqs, base + fin.arrival)
        for r, bt, f, c in zip(reqs, batches, fin.finish, fin.reason):
            assert svc.ingest(bt)
            assert svc.selector.finished(r, {1: "tool_calls", 2: "end_turn"}[int(c)], at_s=base + f)
        blocks = list(dict.fromkeys(a + b))
        worker.put([(BlockKey("ns", h), torch.full((BLK,), h % 251, dtype=torch.uint8)) for h in blocks], "fast")
        assert svc.ingest(EventBatch(1, "w0", 7, len(batches), int((base + fin.arrival[-1]) * 1e9), _chain(blocks, "fast")))
        results = svc.run_policies_once()
        assert svc.selector.leader == "finish_aware"
        view = FinishView(svc.selector.finish_states(), svc.selector.returns)
        now = svc.selector.latest_s
        assert view.residual_s(b[-1], 0, now) > view.residual_s(a[-1], 0, now)
        demoted = [r.item.sequence_hash for r in results if r.item.src_volume == "fast"]
        assert demoted and set(demoted) <= set(b) - set(a), [r.item.reason for r in results]
    finally:
        svc.stop()
        worker.close()
        catalog.close()
