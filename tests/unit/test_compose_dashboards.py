"""Every metric a provisioned Grafana dashboard (compose/grafana/dashboards) queries is one
the code registers: the advisor's (advisor/embedded/metrics.py), the cluster advisors'
(advisor/cluster/metrics.py) and the workers' (kvbm_runtime/metrics.py), read from their
prometheus_client registries, so a renamed metric fails here instead of showing an empty
panel."""

from __future__ import annotations

import json
import re
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from advisor.cluster.node import ClusterNode, ClusterSettings
from advisor.cluster.metrics import cluster_registry
from advisor.embedded.metrics import AdvisorMetrics
from api.hit_rates import HitRateCollector, HitRates
from event_plane.partition import PartitionScheme
from kvbm_runtime.metrics import RuntimeMetrics

DASHBOARDS = Path(__file__).resolve().parents[2] / "compose" / "grafana" / "dashboards"
_SUFFIXES = {"counter": ("_total",), "gauge": ("",), "histogram": ("_bucket", "_sum", "_count"),
             "summary": ("", "_sum", "_count"), "info": ("_info",)}
_KEYWORDS = {"by", "without", "on", "ignoring", "group_left", "group_right", "and", "or", "unless", "bool", "offset"}


def series_names(registry: CollectorRegistry) -> set[str]:
    """Names a Prometheus query can use for ``registry``'s metrics (a counter family
    ``x`` is queried as ``x_total``), including families that have no sample yet."""
    out: set[str] = set()
    for fam in registry.collect():
        out.update(fam.name + s for s in _SUFFIXES.get(fam.type, ("",)))
        out.update(s.name for s in fam.samples)
    return out


def metric_names(expr: str) -> set[str]:
    """Metric names in a PromQL expression: identifiers that are not functions (followed by
    ``(``), keywords, label names or values (``{...}``, ``by (...)``) or durations (``[...]``).

    >>> sorted(metric_names('sum by (kind) (rate(a_total{kind="x"}[1m])) / b'))
    ['a_total', 'b']
    """
    e = re.sub(r'"(?:[^"\\]|\\.)*"', "", expr)
    e = re.sub(r"\{[^}]*\}", "", e)
    e = re.sub(r"\[[^\]]*\]", "", e)
    e = re.sub(r"\b(?:by|without|on|ignoring|group_left|group_right)\s*\([^)]*\)", "", e)
    names = set()
    for m in re.finditer(r"[A-Za-z_:][A-Za-z0-9_:]*", e):
        rest = e[m.end():].lstrip()
        if rest.startswith("(") or m.group() in _KEYWORDS:
            continue
        names.add(m.group())
    return names


def registered() -> set[str]:
    advisor = AdvisorMetrics(lambda: {})
    node = ClusterNode(ClusterSettings(nats_url="nats://127.0.0.1:1", redis_url="redis://127.0.0.1:1/0",
                                       advisor_id="a", scheme=PartitionScheme(8, 1, 64)))  # never started
    api = CollectorRegistry(auto_describe=False)  # the API's hit-rate windows (api/hit_rates.py)
    api.register(HitRateCollector([HitRates("lookup"), HitRates("query")]))
    return (series_names(advisor.registry) | series_names(cluster_registry(node))
            | series_names(RuntimeMetrics("w").registry) | series_names(api))


def _panels() -> list[tuple[str, dict]]:
    return [(p.name, panel) for p in sorted(DASHBOARDS.glob("*.json")) for panel in json.loads(p.read_text())["panels"]]


def test_metric_names_are_extracted_from_promql() -> None:
    assert metric_names('sum by (kind, status) (rate(kvadvisor_moves_total{kind=~"a|b"}[5m]))') == {
        "kvadvisor_moves_total"}
    assert metric_names("kvadvisor_cluster_partitions_owned") == {"kvadvisor_cluster_partitions_owned"}
    assert metric_names("rate(x_total[1m]) / on (w) group_left y") == {"x_total", "y"}


@pytest.mark.parametrize(("dashboard", "panel"), _panels(), ids=lambda v: v if isinstance(v, str) else v["title"])
def test_every_panel_queries_registered_metrics(dashboard: str, panel: dict) -> None:
    known = registered()
    assert panel["datasource"] == {"type": "prometheus", "uid": "prometheus"}  # the provisioned one
    assert panel["targets"], panel["title"]
    for t in panel["targets"]:
        used = metric_names(t["expr"])
        assert used, (dashboard, panel["title"], t["expr"])
        assert used <= known, (dashboard, panel["title"], sorted(used - known))


def test_a_renamed_metric_would_be_caught() -> None:
    assert "kvbm_matched_tokens_total" in registered()
    assert "kvbm_matched_tokens" not in registered() and "kvadvisor_lookups_total" not in registered()


def test_dashboards_have_the_panels_operators_look_for() -> None:
    used: dict[str, set[str]] = {}
    for name, panel in _panels():
        for t in panel["targets"]:
            used.setdefault(name, set()).update(metric_names(t["expr"]))
    assert {"kvadvisor_events_applied_total", "kvadvisor_batches_applied_total", "kvadvisor_subscriber_gaps_total",
            "kvadvisor_subscriber_total", "kvadvisor_index_blocks", "kvadvisor_moves_total",
            "kvadvisor_cluster_lookups_total", "kvadvisor_origin_refused_total",
            "kvadvisor_cluster_partitions_owned", "kvadvisor_cluster_batches_applied_total"} <= used["advisor.json"]
    assert {"kvbm_matched_tokens_total", "kvbm_offload_blocks_d2h_total", "kvbm_offload_blocks_h2d_total",
            "kvbm_offload_blocks_d2d_total", "kvbm_onboard_blocks_h2d_total", "kvbm_onboard_blocks_d2d_total",
            "kvbm_host_cache_hit_rate", "kvbm_disk_cache_hit_rate"} <= used["kvbm.json"]
    for path in DASHBOARDS.glob("*.json"):
        d = json.loads(path.read_text())
        assert d["uid"] and len({p["id"] for p in d["panels"]}) == len(d["panels"]), path.name
