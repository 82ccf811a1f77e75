"""Hit rates per tier and per worker: totals, 1-minute and 1-hour windows, in /v1/stats and /metrics."""

from __future__ import annotations

import pytest
from fastapi.testclient import TestClient

from advisor import AdvisorService, AdvisorSettings
from api import create_app
from api.hit_rates import HitRates
from event_plane.schema import EventBatch, store


def test_windows_forget_old_lookups_and_totals_do_not() -> None:
    now = [1000.0]
    h = HitRates("lookup", clock=lambda: now[0])
    h.record({"G1": 3, "G3": 1}, {"w0": 3}, 16)
    now[0] += 30
    h.record({"G1": 0}, {}, None)  # a miss everywhere
    now[0] += 70  # the first two are now older than a minute
    h.record({"G2": 2}, {"w1": 2}, None)  # tokens unknown: 0
    s = h.snapshot()
    assert s["total"]["lookups"] == 3 and s["1h"]["lookups"] == 3 and s["1m"]["lookups"] == 1
    assert s["total"]["tiers"]["G1"] == {"hits": 1, "blocks": 3, "tokens": 48, "hit_rate": 1 / 3}
    assert s["1m"]["tiers"] == {"G2": {"hits": 1, "blocks": 2, "tokens": 0, "hit_rate": 1.0}}
    assert s["1m"]["workers"] == {"w1": {"hits": 1, "blocks": 2, "tokens": 0, "hit_rate": 1.0}}
    now[0] += 3600
    s = h.snapshot()
    assert s["1h"]["lookups"] == 0 and s["1h"]["tiers"] == {} and s["total"]["lookups"] == 3


def test_stats_and_metrics_show_lookup_hit_rates(tmp_path) -> None:  # noqa: ANN001
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False))
    svc.start()
    try:
        evs, parent = [], None
        for h in (5, 6, 7):
            evs.append(store(h, 5, parent, 2048, "g1"))
            parent = h
        svc.ingest(EventBatch(1, "w0", 5, 0, 100, evs))
        c = TestClient(create_app(svc.query()), base_url="http://127.0.0.1")
        assert c.post("/v1/lookup", json={"sequence_hashes": [5, 6, 99]}).json()["per_tier"] == {"G1": 2}
        c.post("/v1/lookup", json={"sequence_hashes": [42]})
        hr = c.get("/v1/stats").json()["hit_rates"]["lookup"]
        for window in ("total", "1m", "1h"):
            assert hr[window]["lookups"] == 2
            assert hr[window]["tiers"] == {"G1": {"hits": 1, "blocks": 2, "tokens": 0, "hit_rate": 0.5}}
            assert hr[window]["workers"] == {"w0": {"hits": 1, "blocks": 2, "tokens": 0, "hit_rate": 0.5}}
        text = c.get("/metrics").text
        assert 'kvadvisor_api_lookups_total{kind="lookup"} 2.0' in text
        assert 'kvadvisor_api_lookup_blocks_total{key="G1",kind="lookup",scope="tier"} 2.0' in text
        assert 'kvadvisor_api_hit_rate{key="w0",kind="lookup",scope="worker",window="1m"} 0.5' in text
        assert "kvadvisor_events_applied_total 3.0" in text  # the advisor's own metrics are still there
    finally:
        svc.stop()


def test_worker_churn_is_folded_into_other_and_loses_no_count() -> None:
    """Worker names come from peers: 5,000 one-off workers must not grow a tally past its cap,
    and the folded figures still add up (every hit, block and token is counted once)."""
    now = [1000.0]
    h = HitRates("lookup", clock=lambda: now[0], max_worker_keys=64)
    for i in range(30):  # two workers that keep hitting
        h.record({"G1": 2}, {"steady-a": 2, "steady-b": 1}, 16)
    for i in range(5000):
        h.record({"G1": 1}, {f"churn-{i}": 1}, 16)
        if i % 100 == 0:
            now[0] += 1
    s = h.snapshot()
    for window in ("total", "1m", "1h"):
        workers = s[window]["workers"]
        assert len(workers) <= 64 + 1
        assert "(other)" in workers
    total = s["total"]["workers"]
    assert {"steady-a", "steady-b"} <= total.keys()  # the busiest are kept
    assert sum(v["hits"] for v in total.values()) == 30 * 2 + 5000
    assert sum(v["blocks"] for v in total.values()) == 30 * 3 + 5000
    assert sum(v["tokens"] for v in total.values()) == (30 * 3 + 5000) * 16
    assert s["total"]["tiers"]["G1"]["hits"] == 5030  # tiers are never folded


def test_a_worker_cap_below_two_is_refused() -> None:
    with pytest.raises(ValueError, match="max_worker_keys"):
        HitRates("lookup", max_worker_keys=1)
