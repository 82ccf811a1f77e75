"""Time model of the evaluator: tiers by recency, transfers on bandwidth-limited links."""

from __future__ import annotations

import math

import numpy as np
import pytest
from typer.testing import CliRunner

from advisor.policy.eviction import experts
from advisor.policy.eviction.compact import compact
from kvadvisor import synthetic, timemodel
from kvadvisor.cli import app
from kvadvisor.trace import bundled_trace

MiB = 2**20


def _model(bw_mib_s: float) -> timemodel.TimeModel:
    return timemodel.TimeModel(tiers=(timemodel.Tier("nvme", bw_mib_s * MiB, 0.0, math.inf),),
                               block_tokens=100, block_bytes=MiB, prefill_tokens_per_s=100.0)


def test_a_promotion_counts_only_when_its_transfer_is_done_in_time() -> None:
    ct = compact([[1, 2], [3], [1, 2]])
    hits = np.array([0, 0, 2])
    promoted = np.array([False, False, False, True, True])  # both blocks of the last request
    times = np.array([0.0, 1.0, 2.0])  # request 2 is visible from t = 1 (K = 1)
    fast = timemodel.replay(ct, times, hits, promoted, 1, _model(2.0))  # 0.5 s a block: done at 1.5 and 2.0
    assert fast.ready.tolist() == [0, 0, 2] and fast.prefetched == 2 and fast.late == 0
    slow = timemodel.replay(ct, times, hits, promoted, 1, _model(1 / 0.7))  # 0.7 s a block: 1.7 and 2.4
    assert slow.ready.tolist() == [0, 0, 1] and slow.late == 1
    assert slow.link_busy[0] == pytest.approx(1.4)
    # request 2's TTFT: its second block arrives 0.4 s late (reloading it is no sooner)
    assert slow.ttft[2] == pytest.approx(0.4)
    # without hints: load both blocks on demand (1 s) or recompute them (2 blocks x 1 s): load
    none = timemodel.replay(ct, times, np.array([0, 0, 0]), None, 0, _model(2.0))
    assert none.ready.tolist() == [0, 0, 0] and none.ttft[2] == pytest.approx(1.0)
    assert none.ttft[0] == pytest.approx(2.0)  # never seen: recompute both blocks


def test_tiers_hold_blocks_by_recency_and_parse() -> None:
    model = timemodel.TimeModel(tiers=(timemodel.Tier("a", 1e9, 0.0, 2), timemodel.Tier("b", 1e6, 0.0, math.inf)),
                                block_bytes=1e6, block_tokens=1, prefill_tokens_per_s=1e-3)
    ct = compact([[1], [2], [3], [1]])
    # block 1 is the third most recent when reused: past tier a (2 blocks), on tier b (1 s a block)
    r = timemodel.replay(ct, np.zeros(4), np.zeros(4, dtype=np.int64), None, 0, model)
    assert r.ttft[3] == pytest.approx(1.0)
    assert timemodel.parse_tiers("default") == timemodel.DEFAULT_TIERS
    assert timemodel.parse_tiers("dram=25:0.01:1000,s3=1:30:inf")[1].latency == pytest.approx(0.03)
    with pytest.raises(ValueError, match="name=GB/s"):
        timemodel.parse_tiers("nvme=7")


def test_cli_tiers_prints_ready_in_time_and_ttft() -> None:
    res = CliRunner().invoke(app, ["evaluate", "--trace", str(bundled_trace()), "--capacity", "200", "--limit", "400",
                                   "--lookahead", "0,4", "--tiers", "default"])
    assert res.exit_code == 0, res.output
    assert "ready in time" in res.output and "TTFT p90" in res.output and "| default K=4 |" in res.output
    bad = CliRunner().invoke(app, ["evaluate", "--trace", str(bundled_trace()), "--capacity", "200",
                                   "--tiers", "nvme=fast"])
    assert bad.exit_code == 2 and "GB/s" in bad.output


def test_background_promotions_go_on_the_links_and_a_hit_waits_for_its_transfer() -> None:
    # the default policy's refill promotions: transfers issued at a request's arrival, not tied to one
    ct = compact([[1, 2], [3], [4], [1, 2]])
    hits = np.array([0, 0, 0, 2])  # the tier had blocks 1 and 2 back for request 3
    times = np.array([0.0, 1.0, 2.0, 2.5])
    blocks = (np.array([1, 1]), np.array([0, 1]))  # dense ids of blocks 1 and 2, promoted at request 1 (t = 1)
    fast = timemodel.replay(ct, times, hits, model=_model(2.0), background=blocks)  # done at 1.5 and 2.0
    assert fast.ready.tolist() == [0, 0, 0, 2] and fast.prefetched == 2 and fast.late == 0
    assert fast.link_busy[0] == pytest.approx(1.0)
    slow = timemodel.replay(ct, times, hits, model=_model(1 / 0.8), background=blocks)  # 0.8 s: 1.8 and 2.6
    assert slow.ready.tolist() == [0, 0, 0, 1] and slow.late == 1
    assert slow.ttft[3] == pytest.approx(0.1)  # its second block arrives 0.1 s after the request
    # without charging them the hits would be free: the same hits, no transfers, ready at once
    free = timemodel.replay(ct, times, hits, model=_model(1 / 0.8))
    assert free.ready.tolist() == [0, 0, 0, 2] and free.link_busy[0] == 0.0
    with pytest.raises(ValueError, match="background"):
        timemodel.replay(ct, times, hits, background=(np.array([2, 1]), np.array([0, 1])))
    with pytest.raises(ValueError, match="background"):
        timemodel.replay(ct, times, hits, background=(np.array([1]), np.array([99])))
    with pytest.raises(ValueError, match="background"):  # not truncated to request 0
        timemodel.replay(ct, times, hits, background=(np.array([0.5]), np.array([0])))


def test_the_default_policys_refill_promotions_are_charged_in_the_timed_table() -> None:
    case = synthetic.shifting(3, phases=4, n_objects=100, per_phase=500)
    ct = compact(case.requests)
    times = np.arange(ct.requests, dtype=np.float64) * 0.01
    cap = case.capacities[1]
    rows = {r.policy: r for r in timemodel.evaluate_timed(ct, times, cap, [])}
    run = experts.run(ct, cap)
    assert run.promoted_at.size > 0  # the phases make it switch and refill
    assert rows["adaptive"].result.prefetched == run.promoted_at.size
    assert rows["adaptive"].hit_rate == pytest.approx(run.hits.sum() / ct.refs)
    assert sum(rows["adaptive"].result.link_busy) > 0
