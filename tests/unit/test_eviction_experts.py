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
    lead2[200:] = experts.EXPERTS.index("lru")
    run2 = experts.run(SLICE, 300, leader=lead2.astype(np.int8))
    lru = POLICIES["lru"](SLICE, 300, 0, True)
    assert (run2.hits[-200:] == lru[-200:]).all()
    assert (run2.hits[200:] >= 0).all() and run2.fallbacks == 0


def test_schedule_switches_on_a_clear_lead_and_not_on_noise() -> None:
    n = 2000
    lengths = np.full(n, 10)
    same = np.tile(np.arange(n) % 7, (3, 1))
    start = experts.SelectorSettings(initial=experts.EXPERTS[0])  # rows 0..2 stand for the first 3 experts
    assert (experts.schedule(same, lengths, 100, start) == 0).all()  # identical experts: never switch
    assert (experts.schedule(same, lengths, 100) == experts.EXPERTS.index("s3fifo")).all()  # the default start
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
    assert experts.EXPERTS[run.leader[-1]] in BASELINES


def test_synthetic_suite_is_seeded_and_prefix_chained() -> None:
    a, b = synthetic.suite(0), synthetic.suite(0)
    assert [c.name for c in a] == ["zipf-0.6", "zipf-0.8", "zipf-1", "zipf-1.2", "scan+hot", "loop", "shifting",
                                   "one-hit-flood", "conv-tree-b2"]
    for x, y in zip(a, b):
        assert x.requests == y.requests and x.capacities == y.capacities and len(x.capacities) == 3
        parent: dict[int, int] = {}
        for r in x.requests:  # a block always follows the same block: ids are prefix-chained
            for p, q in zip([-1, *r[:-1]], r):
                assert parent.setdefault(q, p) == p
    assert synthetic.suite(1)[0].requests != a[0].requests


def test_cli_synthetic_prints_the_summary(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    small = [lambda s: synthetic.zipf(1.0, s, n_objects=200, n_requests=800)]
    monkeypatch.setattr(synthetic, "CASES", tuple(small))
    res = CliRunner().invoke(app, ["evaluate", "--synthetic", "--json", str(tmp_path / "s.json")])
    assert res.exit_code == 0, res.output
    assert "| zipf-1 |" in res.output and "vs best" in res.output
    data = json.loads((tmp_path / "s.json").read_text())
    assert data[0]["trace"] == "zipf-1" and len(data[0]["results"]) == 3
    bad = CliRunner().invoke(app, ["evaluate", "--synthetic", "--capacity", "10"])
    assert bad.exit_code == 2 and "--synthetic" in bad.output


def test_evaluate_reports_the_selectors_switches() -> None:
    ev = evaluate(SLICE, [60], [DEFAULT_POLICY])
    r = ev.results[0]
    assert r.switches == {DEFAULT_POLICY: experts.run(SLICE, 60).switches}
    assert ev.as_dict()["results"][0]["switches"] == r.switches
