"""Prometheus metrics of one cluster advisor (scaled mode, docs/design.md §8).

Read from the :class:`~advisor.cluster.node.ClusterNode` at scrape time (a custom collector in a
private ``CollectorRegistry``), so they never drift from what the advisor serves:

================================================== ======= =======================================
``kvadvisor_cluster_partitions_owned``              gauge   partitions this advisor serves (ready)
``kvadvisor_cluster_partition_position``            gauge   stream sequence each held partition
                                                            has folded, label ``partition``
``kvadvisor_cluster_partition_blocks``              gauge   blocks indexed per held partition
``kvadvisor_cluster_batches_applied_total``         counter batches folded per held partition
``kvadvisor_cluster_batches_refused_total``         counter batches refused per held partition
``kvadvisor_cluster_lookups_total``                 counter lookups answered per held partition
``kvadvisor_cluster_quota_refused_batches_total``   counter batches the state quotas refused whole
                                                            per held partition, label ``reason``
``kvadvisor_cluster_quota_refused_events_total``    counter events the state quotas refused per held
                                                            partition (a whole batch's too), ``reason``
``kvadvisor_cluster_mover_results_total``           counter plan items executed by this advisor's
                                                            mover, label ``result`` (``done``,
                                                            ``skipped``, ``failed``, ``compacted``)
``kvadvisor_cluster_mover_fenced_total``            counter rounds cut short because a newer lease
                                                            holder raised a partition's fence
``kvadvisor_cluster_mover_repairs_total``           counter index entries repaired from the catalog
                                                            after taking a partition
================================================== ======= =======================================

The ``mover`` series exist only for an advisor started with ``--storage``.

Every series carries ``advisor`` (this advisor's id); ``partition`` takes at most the
partition count's values (``0 .. partitions-1``), so the series are bounded.  Per-partition
counters restart at 0 when a partition changes owner (``rate()`` treats that as a reset).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry, start_http_server
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from advisor.cluster.parts import NodeParts

__all__ = ["ClusterCollector", "cluster_registry", "serve_cluster_metrics"]


class ClusterCollector(Collector):
    """Collects one :class:`ClusterNode`'s partitions on every scrape."""

    def __init__(self, node: NodeParts) -> None:
        self.node = node

    def collect(self) -> Iterator[Metric]:
        node = self.node
        adv = node.settings.advisor_id
        bound = node.settings.scheme.partitions
        owned = GaugeMetricFamily("kvadvisor_cluster_partitions_owned", "Partitions this advisor serves",
                                  labels=["advisor"])
        owned.add_metric([adv], len(node.owned()))
        yield owned
        position = GaugeMetricFamily("kvadvisor_cluster_partition_position",
                                     "Stream sequence folded per held partition", labels=["advisor", "partition"])
        blocks = GaugeMetricFamily("kvadvisor_cluster_partition_blocks", "Blocks indexed per held partition",
                                   labels=["advisor", "partition"])
        applied = CounterMetricFamily("kvadvisor_cluster_batches_applied", "Batches folded per held partition",
                                      labels=["advisor", "partition"])
        refused = CounterMetricFamily("kvadvisor_cluster_batches_refused", "Batches refused per held partition",
                                      labels=["advisor", "partition"])
        lookups = CounterMetricFamily("kvadvisor_cluster_lookups", "Lookups answered per held partition",
                                      labels=["advisor", "partition"])
        q_batches = CounterMetricFamily("kvadvisor_cluster_quota_refused_batches",
                                        "Batches the state quotas refused whole per held partition",
                                        labels=["advisor", "partition", "reason"])
        q_events = CounterMetricFamily("kvadvisor_cluster_quota_refused_events",
                                       "Events the state quotas refused per held partition",
                                       labels=["advisor", "partition", "reason"])
        for p, st in node.status()["partitions"].items():
            if not 0 <= int(p) < bound:  # never more series than partitions
                continue
            lab = [adv, str(p)]
            position.add_metric(lab, st["position"])
            blocks.add_metric(lab, st["blocks"])
            applied.add_metric(lab, st["applied"])
            refused.add_metric(lab, st["errors"])
            lookups.add_metric(lab, st.get("lookups", 0))
            for key, n in st.get("quotas", {}).items():  # reasons: the fixed QuotaReason set
                if key.startswith("quota_refused_batches_"):
                    q_batches.add_metric([*lab, key[len("quota_refused_batches_"):]], n)
                elif key.startswith("quota_refused_events_"):
                    q_events.add_metric([*lab, key[len("quota_refused_events_"):]], n)
        yield from (position, blocks, applied, refused, lookups, q_batches, q_events)
        if node.mover is not None:
            c = node.mover.status()["counters"]
            results = CounterMetricFamily("kvadvisor_cluster_mover_results", "Plan items executed by the mover",
                                          labels=["advisor", "result"])
            for name, key in (("done", "moves_done"), ("skipped", "moves_skipped"), ("failed", "moves_failed"),
                              ("compacted", "compactions")):
                results.add_metric([adv, name], c.get(key, 0))
            fenced = CounterMetricFamily("kvadvisor_cluster_mover_fenced", "Rounds cut short by a newer lease holder",
                                         labels=["advisor"])
            fenced.add_metric([adv], c.get("fenced", 0))
            repairs = CounterMetricFamily("kvadvisor_cluster_mover_repairs", "Index entries repaired from the catalog",
                                          labels=["advisor"])
            repairs.add_metric([adv], c.get("repair_events", 0))
            yield from (results, fenced, repairs)


def cluster_registry(node: NodeParts) -> CollectorRegistry:
    """A fresh registry holding a :class:`ClusterCollector` for ``node``."""
    registry = CollectorRegistry()
    registry.register(ClusterCollector(node))
    return registry


def serve_cluster_metrics(node: NodeParts, port: int, host: str = "127.0.0.1") -> str:
    """Serve ``node``'s metrics at ``http://host:port/metrics`` (prometheus-client's
    ``start_http_server``, a daemon thread); ``port=0`` picks a free port.

    The page has no authentication: keep ``host`` on loopback unless the port is reachable
    only from a private network (a compose network, where Prometheus scrapes it).

    Returns:
        The URL of the metrics page.

    Raises:
        OSError: the address cannot be bound.
    """
    server, _thread = start_http_server(port, addr=host, registry=cluster_registry(node))
    return f"http://{host}:{server.server_port}/metrics"
