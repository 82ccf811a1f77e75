"""``kvadvisor demo --engine vllm``: real vLLM engines with the connector, the advisor, a
POSIX volume and S3 (moto), replaying the bundled trace; a few requests only (each engine
start costs about 25 s)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(1200)]

ROOT = Path(__file__).resolve().parents[2]
CLI = "from kvadvisor.cli import app; app()"


def test_engine_demo_exits_0_with_report_and_consistent_index(tmp_path: Path) -> None:
    out = tmp_path / "report.json"
    env = {**os.environ, "PYTHONPATH": str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""), "NIXL_LOG_LEVEL": "WARN"}
    proc = subprocess.run(
        [sys.executable, "-c", CLI, "demo", "--engine", "vllm", "--requests", "12", "--sample", "2",
         "--time-scale", "100", "--json", str(out)],
        capture_output=True, text=True, env=env, timeout=900, cwd=tmp_path,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "TTFT mean / p50 / p90 / p99" in proc.stdout and "index == catalog" in proc.stdout
    r = json.loads(out.read_text())
    assert r["measured"] == 12 and r["failed"] == 0
    assert 0 < r["ttft_s"]["p50"] <= r["ttft_s"]["p90"] <= r["ttft_s"]["p99"]
    assert r["prompt_tokens"] == r["prefill_computed"] + r["prefill_saved"] > 0
    # the connector offloaded to the shared volume, and the advisor's index says the same
    # as the placement catalog, block for block; vLLM's own G1 events reached both indexes
    cons = r["consistency"]
    assert cons["fast"]["equal"] and cons["fast"]["held"] > 0
    assert cons["archive"]["equal"]
    assert all(cons[f"vllm-{i}/g1"]["index"] > 0 and cons[f"vllm-{i}/g1"]["indexer"] > 0 for i in range(2))
    assert r["kvbm"]["kvbm_offload_blocks_h2d"] > 0 and r["kvbm"]["kvbm_onboard_errors"] == 0
    # the connector's own gauges and per-volume counters reach the report: G2 holds blocks
    # at the end on each engine, and every block read from a volume is counted at one
    assert "onboarded per volume (ours)" in proc.stdout and "G2 resident blocks (ours)" in proc.stdout
    assert all(r["kvbm"][f"kvbm_g2_resident_blocks{{engine-{i}}}"] > 0 for i in range(2))
    per_volume = {k: v for k, v in r["kvbm"].items() if k.startswith("kvbm_onboard_blocks_volume{")}
    assert set(per_volume) <= {"kvbm_onboard_blocks_volume{fast}", "kvbm_onboard_blocks_volume{archive}"}
    assert sum(per_volume.values()) == r["kvbm"]["kvbm_onboard_blocks_d2d"]
    assert r["outputs_checked"] == 2 and r["outputs_identical"] == 2
    assert sum(r["router_choices"]["per_engine"].values()) == 12
    # the trace's first 10 requests share one timestamp: they are routed and sent together
    # (one POST /query after the other would spread them by the queries' round trips)
    assert r["router_choices"]["largest_burst"] == 10 and r["router_choices"]["bursts"] == 2
    assert r["router_choices"]["route_ms_max"] >= r["router_choices"]["route_ms_mean"] >= 0
