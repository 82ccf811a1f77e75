"""Prometheus export of volume stats (prometheus-client custom collector).

Metrics (label ``volume``; bytes unless stated):
``kvadvisor_storage_capacity_bytes``, ``..._used_bytes``, ``..._live_bytes``,
``..._dead_bytes``, ``..._segments``, ``..._blocks`` (gauges) and
``kvadvisor_storage_blocks_read_total`` / ``..._blocks_written_total`` (counters, this
process).  Values are read from ``StorageAgent.stats()`` at scrape time.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .agent import StorageAgent

_GAUGES = ("capacity_bytes", "used_bytes", "live_bytes", "dead_bytes", "segments", "blocks")


class StorageCollector(Collector):
    """Collects one agent's :class:`~storage_backends.types.VolumeStats` on every scrape."""

    def __init__(self, agent: StorageAgent) -> None:
        self.agent = agent

    def collect(self) -> Iterator[GaugeMetricFamily | CounterMetricFamily]:
        stats = self.agent.stats()
        for name in _GAUGES:
            g = GaugeMetricFamily(f"kvadvisor_storage_{name}", f"Volume {name.replace('_', ' ')}", labels=["volume"])
            for s in stats:
                g.add_metric([s.volume_id], float(getattr(s, name)))
            yield g
        for name, attr in (("blocks_read", "reads"), ("blocks_written", "writes")):
            c = CounterMetricFamily(f"kvadvisor_storage_{name}", f"Blocks {name.split('_')[1]} by this process",
                                    labels=["volume"])
            for s in stats:
                c.add_metric([s.volume_id], float(getattr(s, attr)))
            yield c


def register_storage_metrics(agent: StorageAgent, registry: CollectorRegistry) -> StorageCollector:
    """Register a :class:`StorageCollector` for ``agent`` in ``registry`` and return it."""
    col = StorageCollector(agent)
    registry.register(col)
    return col
