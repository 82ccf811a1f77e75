"""The default policy: follow the best expert online, the real tier mirroring the leader."""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
from typer.testing import CliRunner

from advisor.policy.eviction import experts
from advisor.policy.eviction.compact import compact
from advisor.policy.eviction.registry import BASELINES, DEFAULT_POLICY, POLICIES
from kvadvisor import synthetic
from kvadvisor.cli import app
from kvadvisor.evaluate import evaluate, load_trace
from kvadvisor.trace import bundled_trace

SLICE = compact(load_trace(bundled_trace(), limit=800))


@pytest.mark.parametrize("cap", [60, 400])
def test_a_fixed_leader_is_reproduced_exactly(cap: int) -> None:
    # the mirror evicts only what the leader evicted, so following one expert all along is that expert
    for e, name in enumerate(experts.EXPERTS):
        run = experts.run(SLICE, cap, leader=np.full(SLICE.requests, e, np.int8))
        assert run.fallbacks == 0 and run.switches == 0
        assert (run.hits == POLICIES[name](SLICE, cap, 0, True)).all(), name


def test_switches_lose_no_contents_and_converge_to_the_new_leader() -> None:
    rng = np.random.default_rng(3)
    lead = np.repeat(rng.integers(0, len(experts.EXPERTS), SLICE.requests // 40 + 1), 40)[:SLICE.requests]
    run = experts.run(SLICE, 300, leader=lead.astype(np.int8))
    assert run.switches > 5 and run.fallbacks == 0  # never evicted a block the leader holds
    # a long final spell: after the leader's pre-switch contents turn over, the tier is the leader
    lead2 = lead.copy()
    lead2[200:] = experts.EXPERTS.index("lru_tail")
    run2 = experts.run(SLICE, 300, leader=lead2.astype(np.int8))
    lru = POLICIES["lru_tail"](SLICE, 300, 0, True)
    assert (run2.hits[-200:] == lru[-200:]).all()
    assert (run2.hits[200:] >= 0).all() and run2.fallbacks == 0


def test_the_refill_cost_is_what_the_tier_missed_of_the_leaders_it_followed() -> None:
    case = synthetic.zipf(1.0, 2, n_objects=200, n_requests=2000)
    ct = compact(case.requests)
    cap = case.capacities[1]
    for e in range(len(experts.EXPERTS)):  # one leader all along: R is that leader, nothing to refill
        run = experts.run(ct, cap, leader=np.full(ct.requests, e, np.int8))
        assert (run.followed == run.hits).all()
    rng = np.random.default_rng(5)
    lead = np.repeat(rng.integers(0, len(experts.EXPERTS), ct.requests // 100 + 1), 100)[:ct.requests]
    run = experts.run(ct, cap, leader=lead.astype(np.int8))
    assert (run.followed == run.expert_hits[lead, np.arange(ct.requests)]).all()
    assert (run.followed - run.hits).sum() > 0  # the switches cost hits here
    # each switch's refill: at most one broken request prefix per block the new leader held and R did not
    longest = int(np.diff(ct.offsets).max())
    starts = [0, *np.flatnonzero(lead[1:] != lead[:-1]) + 1, ct.requests]
    for a, b in zip(starts, starts[1:]):
        assert (run.followed[a:b] - run.hits[a:b]).sum() <= cap * longest
    ev = evaluate(ct, [cap], [DEFAULT_POLICY])
    default = experts.run(ct, cap)
    refs = int(ct.offsets[-1])
    assert ev.results[0].refill[DEFAULT_POLICY] == pytest.approx((default.followed - default.hits).sum() / refs)
    assert ev.as_dict()["results"][0]["refill"] == ev.results[0].refill


def test_the_regret_bound_of_the_docstring_holds_with_undecayed_scores() -> None:
    # hits(R) >= max_e G_e - (S + 1)(theta_max + l_max) - S * C * l_max, and the followed
    # leaders' hits alone >= max_e G_e - (S + 1)(theta_max + l_max) (module docstring, "Regret")
    case = synthetic.shifting(3, phases=4, n_objects=100, per_phase=500)
    ct = compact(case.requests)
    settings = experts.SelectorSettings(half_life=float("inf"))
    longest = int(np.diff(ct.offsets).max())
    switched = 0
    for cap in case.capacities:
        run = experts.run(ct, cap, settings)
        g = run.expert_hits.astype(np.float64)
        d = g[:, None, :] - g[None, :, :]
        theta = settings.z * np.sqrt((d * d).sum(axis=2).max() + 1.0)  # V only grows when H is infinite
        s = run.switches
        switched += s
        assert run.fallbacks == 0
        assert run.followed.sum() >= g.sum(axis=1).max() - (s + 1) * (theta + longest)
        assert run.hits.sum() >= g.sum(axis=1).max() - (s + 1) * (theta + longest) - s * cap * longest
    assert switched > 0  # the phases make it switch: the bound is not only the static case


def test_schedule_switches_on_a_clear_lead_and_not_on_noise() -> None:
    n = 2000
    lengths = np.full(n, 10)
    same = np.tile(np.arange(n) % 7, (3, 1))
    start = experts.SelectorSettings(initial=experts.EXPERTS[0])  # rows 0..2 stand for the first 3 experts
    assert (experts.schedule(same, lengths, 100, start) == 0).all()  # identical experts: never switch
    assert (experts.schedule(same, lengths, 100) == experts.EXPERTS.index("s3fifo_tail")).all()  # the default start
    better = same.copy()
    better[2] += (np.arange(n) % 10 == 0)  # expert 2 hits one more block every 10 requests
    lead = experts.schedule(better, lengths, 100, start)
    first = int(np.argmax(lead == 2))
    assert lead[-1] == 2 and 0 < first < n // 2 and (lead[first:] == 2).all()
    with pytest.raises(ValueError):
        experts.SelectorSettings(half_life=0)
    with pytest.raises(ValueError):
        experts.SelectorSettings(initial="fifo")


def test_default_follows_the_best_expert_where_prefix_value_is_weak() -> None:
    # a loop larger than the tier: prefix_value and LRU keep nothing reused in time, S3-FIFO keeps a part
    case = synthetic.loop(5, n_objects=300, n_requests=6000)
    ct = compact(case.requests)
    cap = case.capacities[-1]
    ev = evaluate(ct, [cap], [DEFAULT_POLICY, "prefix_value"])
    r = ev.results[0]
    best_name, best = r.best_baseline()
    assert r.hit_rate["prefix_value"] < best - 0.05
    # it pays one turn of the loop for the switch (R did not hold S3-FIFO's blocks), 1/20 of the trace here
    assert r.hit_rate[DEFAULT_POLICY] > best - 0.02 and r.hit_rate[DEFAULT_POLICY] > r.hit_rate["prefix_value"] + 0.2
    run = experts.run(ct, cap)
    assert experts.EXPERTS[run.leader[-1]].removesuffix("_tail") in BASELINES  # a classic policy leads


def test_synthetic_suite_is_seeded_and_prefix_chained() -> None:
    a, b = synthetic.suite(0), synthetic.suite(0)
    assert [c.name for c in a] == ["zipf-0.6", "zipf-0.8", "zipf-1", "zipf-1.2", "scan+hot", "loop", "shifting",
                                   "one-hit-flood", "conv-tree-b2", "agent"]
    for x, y in zip(a, b):
        assert x.requests == y.requests and x.capacities == y.capacities and len(x.capacities) == 3
        assert (x.finishes is None) == (x.name != "agent")  # only the agent sessions record finishes
        if x.finishes is not None:
            assert x.finishes.arrival.shape == (len(x.requests),)
            assert np.array_equal(x.finishes.reason, y.finishes.reason)
        parent: dict[int, int] = {}
        for r in x.requests:  # a block always follows the same block: ids are prefix-chained
            for p, q in zip([-1, *r[:-1]], r):
                assert parent.setdefault(q, p) == p
    assert synthetic.suite(1)[0].requests != a[0].requests


def test_synthetic_variants_are_other_cases_seeded_and_prefix_chained() -> None:
    a, b = synthetic.variants(7), synthetic.variants(7)
    names = [c.name for c in a]
    assert len(set(names)) == len(synthetic.VARIANTS) and not set(names) & {c.name for c in synthetic.suite(7)}
    for x, y in zip(a, b):
        assert x.requests == y.requests and x.capacities == y.capacities and len(x.capacities) == 3
        parent: dict[int, int] = {}
        for r in x.requests:
            for p, q in zip([-1, *r[:-1]], r):
                assert parent.setdefault(q, p) == p
    assert synthetic.variants(8)[0].requests != a[0].requests


def test_cli_synthetic_prints_the_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = [lambda s: synthetic.zipf(1.0, s, n_objects=200, n_requests=800)]
    monkeypatch.setattr(synthetic, "CASES", tuple(small))
    res = CliRunner().invoke(app, ["evaluate", "--synthetic", "--json", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    assert "| zipf-1 |" in res.output and "vs best" in res.output and "refill cost" in res.output
    below = sum(float(row.split("|")[7]) < -0.002 for row in res.output.splitlines() if row.startswith("| zipf-1 |"))
    assert f"{below} of 3 rows below best" in res.output
    data = json.loads((tmp_path / "s.json").read_text())
    assert data[0]["trace"] == "zipf-1" and len(data[0]["results"]) == 3
    assert set(data[0]["results"][0]["refill"]) == {DEFAULT_POLICY}
    bad = CliRunner().invoke(app, ["evaluate", "--synthetic", "--capacity", "10"])
    assert bad.exit_code == 2 and "--synthetic" in bad.output
    other = [lambda s: synthetic.scan_hot(s, n_objects=60, n_requests=600)]
    monkeypatch.setattr(synthetic, "VARIANTS", tuple(other))
    res = CliRunner().invoke(app, ["evaluate", "--synthetic", "--variants", "--seed", "4"])
    assert res.exit_code == 0, res.output
    assert "| scan+hot |" in res.output and "| zipf-1 |" not in res.output
    bad = CliRunner().invoke(app, ["evaluate", "--variants"])
    assert bad.exit_code == 2 and "--synthetic" in bad.output


def test_evaluate_reports_the_selectors_switches() -> None:
    ev = evaluate(SLICE, [60], [DEFAULT_POLICY])
    r = ev.results[0]
    assert r.switches == {DEFAULT_POLICY: experts.run(SLICE, 60).switches}
    assert ev.as_dict()["results"][0]["switches"] == r.switches


@pytest.mark.parametrize("cap", [3, 7])
def test_a_tail_first_leader_is_reproduced_where_requests_outgrow_the_tier(cap: int) -> None:
    # requests longer than the tier evict their own blocks while being served; the mirror
    # must read a tail-first leader's eviction steps in that leader's order
    case = synthetic.conversation_tree(4, n_conv=30, n_requests=300)
    ct = compact(case.requests)
    assert int(np.diff(ct.offsets).max()) > cap
    for name in sorted(experts.TAIL_FIRST):
        run = experts.run(ct, cap, leader=np.full(ct.requests, experts.EXPERTS.index(name), np.int8))
        assert run.fallbacks == 0, name
        assert (run.hits == POLICIES[name](ct, cap, 0, True)).all(), name


def test_tail_first_keeps_a_prefix_head_that_block_order_loses() -> None:
    # two requests share a 3-block head; a 4-block tier: served block by block, the new
    # request's blocks push out the oldest, which is the shared head; tail first, the head
    # is the most recent and the tail leaves first, so the third request hits the head
    ct = compact([[1, 2, 3], [4, 5], [1, 2, 3]])
    for name in ("lru", "arc", "s3fifo", "lfu_da"):
        fwd = POLICIES[name](ct, 4, 0, True)
        tail = POLICIES[f"{name}_tail"](ct, 4, 0, True)
        assert tail[2] > fwd[2], (name, fwd, tail)


def test_refill_promotions_bring_back_what_a_switch_lost_within_their_budget() -> None:
    # a switch leaves the new leader's blocks the tier evicted on the tier below; promotions at
    # refill_rate blocks per block referenced bring them back, into room taken from orphans only
    case = synthetic.zipf(1.0, 2, n_objects=200, n_requests=2000)
    ct = compact(case.requests)
    cap = case.capacities[1]
    rng = np.random.default_rng(5)
    lead = np.repeat(rng.integers(0, len(experts.EXPERTS), ct.requests // 100 + 1), 100)[:ct.requests].astype(np.int8)
    none = experts.run(ct, cap, experts.SelectorSettings(refill_rate=0.0), leader=lead)
    assert none.promoted_at.size == 0 and (none.followed - none.hits).sum() > 0
    for rate in (0.25, 1.0, 1e9):
        run = experts.run(ct, cap, experts.SelectorSettings(refill_rate=rate), leader=lead)
        assert run.fallbacks == 0 and run.promoted_at.size > 0
        assert (run.followed - run.hits).sum() < (none.followed - none.hits).sum()
        assert (np.diff(run.promoted_at) >= 0).all()
        # within the budget: a spell's promotions before request i <= rate x blocks referenced since its switch
        starts = np.flatnonzero(np.r_[True, lead[1:] != lead[:-1]])
        spell = starts[np.searchsorted(starts, run.promoted_at, side="right") - 1]
        assert (spell > 0).all()  # no refill before the first switch
        for s in np.unique(spell):
            at = run.promoted_at[spell == s]
            budget = rate * (ct.offsets[at] - ct.offsets[s - 1])
            assert (np.arange(1, at.size + 1) <= budget + 1e-9).all()
        # each promoted block was referenced before (it is on a tier below) and is not promoted twice a spell
        first_ref = np.full(ct.n_blocks, ct.requests)
        for i in range(ct.requests - 1, -1, -1):
            first_ref[ct.flat[ct.offsets[i]:ct.offsets[i + 1]]] = i
        assert (first_ref[run.promoted_blocks] < run.promoted_at).all()
        assert len(set(zip(spell.tolist(), run.promoted_blocks.tolist()))) == run.promoted_at.size
    for bad in (-1.0, float("inf"), float("nan")):  # inf x an empty request's 0 blocks would stop the refill
        with pytest.raises(ValueError, match="refill_rate"):
            experts.SelectorSettings(refill_rate=bad)
    instant = experts.run(ct, cap, experts.SelectorSettings(refill_rate=1e9), leader=lead)
    slow = experts.run(ct, cap, experts.SelectorSettings(refill_rate=0.25), leader=lead)
    assert instant.hits.sum() >= slow.hits.sum() >= none.hits.sum()
