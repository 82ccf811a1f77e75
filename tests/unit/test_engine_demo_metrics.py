"""The engine demo reads the connector's Prometheus page: per-volume onboard counters and
the G2 residency gauge come through :func:`parse_prometheus` and into the report row."""

from __future__ import annotations

from prometheus_client import generate_latest

from kvadvisor.engine_demo.cli import onboard_row
from kvadvisor.engine_demo.engines import parse_prometheus
from kvbm_runtime.metrics import RuntimeMetrics


def test_per_volume_onboards_and_the_g2_gauge_are_read_from_the_page() -> None:
    m = RuntimeMetrics("kvbm-0")
    m.count_onboards(["fast", "fast", "archive", "fast"])
    m.onboard_storage_seconds.observe(0.004)
    m.onboard_storage_seconds.observe(0.006)
    resident = [7]
    m.track_g2(lambda: resident[0])
    page = parse_prometheus(generate_latest(m.registry).decode())
    assert page["kvbm_onboard_blocks_volume{fast}"] == 3 and page["kvbm_onboard_blocks_volume{archive}"] == 1
    assert page["kvbm_onboard_blocks_volume"] == 4
    assert page["kvbm_g2_resident_blocks"] == 7
    resident[0] = 9  # read at scrape time
    assert parse_prometheus(generate_latest(m.registry).decode())["kvbm_g2_resident_blocks"] == 9
    assert m.onboarded_by_volume() == {"fast": 3, "archive": 1}
    row = onboard_row({k: v for k, v in page.items() if k.startswith("kvbm_onboard")})
    assert row == "archive 1 · fast 3; 2 reads, 5.0 ms each on average"
    assert onboard_row({}) == "-"
