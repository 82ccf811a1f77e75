"""Acceptance flood at full scale, over real ZMQ and a real advisor process: 2,000
registrations, 200,000 epochs, 50,000 source names and one 64 MB message, each in turn,
while a well-behaved publisher keeps publishing and polls the REST API for each of its
batches (bench/flood.py does the work; ``make flood`` prints the figures).

Every well-behaved batch is indexed, each within :data:`LATENCY_MARGIN_S`: the product
promises 1 s (docs/security.md, "Flood bounds"); the test allows three times that because
the suite runs on a loaded shared machine (the bench reports the strict figure). The
advisor's peak RSS stays under the documented bound, and what the floods made it hold is
set by the quotas.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

BENCH = Path(__file__).resolve().parents[2] / "bench" / "flood.py"
LATENCY_MARGIN_S = 3.0
"""Three times the 1 s the product promises (a shared, loaded CI machine); see module doc."""


def load_bench():  # type: ignore[no-untyped-def]
    spec = importlib.util.spec_from_file_location("flood_bench", BENCH)
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = mod  # (its dataclasses look their module up)
    spec.loader.exec_module(mod)
    return mod


def test_floods_in_turn_keep_a_well_behaved_publisher_indexed(tmp_path: Path) -> None:
    bench = load_bench()
    res = bench.run(1.0, tail_s=1.0, base_s=1.0, workdir=str(tmp_path), log=False)
    print(bench.table(res))
    assert [r.flood for r in res.rows] == ["registrations", "epochs", "sources", "message"]
    assert res.unindexed == 0, bench.table(res)
    for r in res.rows:
        assert r.samples > 0, r
        assert r.max_ms < LATENCY_MARGIN_S * 1000, bench.table(res)
    assert res.peak_rss_mib * (1 << 20) < bench.RSS_BOUND, bench.table(res)
    # what the floods could make it hold is the quotas' doing
    assert res.rows[0].note == '{"200": 256, "429": 1744}'  # KVADVISOR_API_MAX_REGISTRATIONS
    assert res.sources <= 10_000 + 3  # quota_max_sources, beside good, probe and churn
