"""Prometheus export of volume stats (prometheus-client custom collector).

Metrics (label ``volume``; bytes unless stated), read from ``StorageAgent.stats()`` and the
agent's counters at scrape time, so every scrape sees the shared catalog's current state:

* gauges: ``kvadvisor_storage_capacity_bytes``, ``..._used_bytes`` (sum of segment sizes),
  ``..._live_bytes``, ``..._dead_bytes``, ``..._segments``, ``..._blocks``;
* counters of this process: ``kvadvisor_storage_blocks_read_total``,
  ``..._blocks_written_total``, ``..._bytes_read_total`` (of which
  ``..._bytes_read_cached_total`` were copied from the OS page cache without NIXL, POSIX),
  ``..._bytes_written_total``, ``..._segments_written_total``,
  ``..._segments_deleted_total``, and
  ``kvadvisor_storage_volume_events_total{volume, event}`` for the volume's other counters
  (``o_direct_fallbacks``, ``fallocate_fallbacks``, ``s3_retries``, ``ranged_gets``);
* ``kvadvisor_storage_agent_events_total{event}``: checksum mismatches, quarantined copies,
  read retries, deduplicated puts, move conflicts, segments dropped.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict
from typing import TYPE_CHECKING

from prometheus_client import CollectorRegistry
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

if TYPE_CHECKING:
    from .agent import StorageAgent

_GAUGES = ("capacity_bytes", "used_bytes", "live_bytes", "dead_bytes", "segments", "blocks")
_IO_COUNTERS = ("bytes_read", "bytes_read_cached", "bytes_written", "segments_written", "segments_deleted")


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
        for name in _IO_COUNTERS:
            c = CounterMetricFamily(f"kvadvisor_storage_{name}", f"{name.replace('_', ' ').capitalize()} by this process",
                                    labels=["volume"])
            for s in stats:
                c.add_metric([s.volume_id], float(s.extra.get(name, 0)))
            yield c
        ev = CounterMetricFamily("kvadvisor_storage_volume_events", "Other per-volume events of this process",
                                 labels=["volume", "event"])
        for s in stats:
            for k in sorted(s.extra):
                if k not in _IO_COUNTERS:
                    ev.add_metric([s.volume_id, k], float(s.extra[k]))
        yield ev
        ag = CounterMetricFamily("kvadvisor_storage_agent_events", "Storage agent events of this process",
                                 labels=["event"])
        for k, v in asdict(self.agent.counters).items():
            ag.add_metric([k], float(v))
        yield ag


def register_storage_metrics(agent: StorageAgent, registry: CollectorRegistry) -> StorageCollector:
    """Register a :class:`StorageCollector` for ``agent`` in ``registry`` and return it."""
    col = StorageCollector(agent)
    registry.register(col)
    return col
