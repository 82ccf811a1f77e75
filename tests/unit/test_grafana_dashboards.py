"""The provisioned Grafana dashboards query only metrics the advisor and the workers really
expose (read from their live registries), through the provisioned datasource."""

from __future__ import annotations

import json
import re
from pathlib import Path

import yaml
from fastapi.testclient import TestClient
from prometheus_client import generate_latest

from advisor import AdvisorService, AdvisorSettings
from api import create_app
from event_plane.schema import EventBatch, store
from kvbm_runtime.metrics import RuntimeMetrics

PROV = Path(__file__).resolve().parents[2] / "compose" / "grafana" / "provisioning"
NAME = re.compile(r"\b((?:kvadvisor|kvbm)_[a-z0-9_]+)")


def _exposed(text: str) -> set[str]:
    """Sample names, plus the declared families (a labelled counter has no sample before its first use)."""
    out = {line.split("{")[0].split(" ")[0] for line in text.splitlines() if line and not line.startswith("#")}
    for line in text.splitlines():
        if line.startswith("# TYPE "):
            _, _, name, kind = line.split(" ", 3)
            out.add(name + "_total" if kind == "counter" and not name.endswith("_total") else name)
    return out


def test_dashboards_query_real_metrics(tmp_path) -> None:  # noqa: ANN001
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False))
    svc.start()
    try:
        svc.ingest(EventBatch(1, "w0", 5, 0, 100, [store(5, 5, None, 2048, "g1")]))
        c = TestClient(create_app(svc.query()), base_url="http://127.0.0.1")
        c.post("/v1/lookup", json={"sequence_hashes": [5]})
        names = _exposed(c.get("/metrics").text)
    finally:
        svc.stop()
    names |= _exposed(generate_latest(RuntimeMetrics("w0").registry).decode())
    uid = yaml.safe_load((PROV / "datasources" / "prometheus.yml").read_text())["datasources"][0]["uid"]
    provider = yaml.safe_load((PROV / "dashboards" / "provider.yml").read_text())
    assert provider["providers"][0]["options"]["path"] == "/etc/grafana/provisioning/dashboards"
    seen: dict[str, set[str]] = {}
    for path in sorted((PROV / "dashboards").glob("*.json")):
        d = json.loads(path.read_text())
        assert d["uid"] and d["panels"], path
        for p in d["panels"]:
            assert p["datasource"]["uid"] == uid
            for t in p["targets"]:
                used = set(NAME.findall(t["expr"]))
                assert used and used <= names, (path.name, p["title"], used - names)
                seen.setdefault(path.name, set()).update(used)
    # the panels a KVBM user knows, and the advisor's hit rates
    assert {"kvbm_matched_tokens_total", "kvbm_offload_blocks_d2h_total", "kvbm_onboard_blocks_h2d_total",
            "kvbm_host_cache_hit_rate", "kvbm_disk_cache_hit_rate"} <= seen["kvbm.json"]
    assert {"kvadvisor_api_hit_rate", "kvadvisor_index_blocks", "kvadvisor_moves_total"} <= seen["advisor.json"]
