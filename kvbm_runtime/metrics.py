"""KVBM metrics (prometheus-client), with the meanings of the KVBM guide.

=============================== ========= ================================================
``kvbm_matched_tokens``          counter   tokens of cached prefixes found beyond the device
                                           tier (G2/G3/G4), i.e. tokens not recomputed
``kvbm_offload_blocks_d2h``      counter   blocks offloaded device → host (G1 → G2)
``kvbm_offload_blocks_h2d``      counter   blocks offloaded host → disk (G2 → G3 volume)
``kvbm_offload_blocks_d2d``      counter   blocks offloaded device → disk (bypassing host)
``kvbm_onboard_blocks_h2d``      counter   blocks onboarded host → device (G2 → G1)
``kvbm_onboard_blocks_d2d``      counter   blocks onboarded disk → device (G3/G4 → G1)
``kvbm_host_cache_hit_rate``     gauge     host hits / blocks looked up beyond G1, over a
                                           sliding window of requests (0.0–1.0)
``kvbm_disk_cache_hit_rate``     gauge     disk (G3 + G4) hits / the same, same window
``kvbm_onboard_errors``          counter   failed storage reads while onboarding (case C17)
``kvbm_onboard_blocks_volume``   counter   blocks onboarded from storage into the engine, per
                                           ``volume`` (label): the volume each block was
                                           read from, at read time (after advisor moves)
``kvbm_onboard_storage_seconds`` histogram time of each storage read job (G3/G4 → G1, the
                                           reads and the copies into the engine's blocks)
``kvbm_g2_resident_blocks``      gauge     blocks the host pool (G2) holds now (registered
                                           under a sequence hash), read at scrape time
=============================== ========= ================================================

Each :class:`RuntimeMetrics` has its own ``CollectorRegistry`` so several workers can live
in one process; a label ``worker`` names the source.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, start_http_server


@dataclass(slots=True)
class _Window:
    looked_up: int
    host_hits: int
    disk_hits: int


class RuntimeMetrics:
    """Counters and gauges of one worker's runtime.

    Args:
        worker: value of the ``worker`` label.
        window: requests in the hit-rate sliding window.
        registry: registry to register into (a fresh one when ``None``).
    """

    def __init__(self, worker: str, window: int = 1000, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        self.worker = worker
        labels = ["worker"]

        def counter(name: str, doc: str) -> Counter:
            return Counter(name, doc, labels, registry=self.registry)

        def gauge(name: str, doc: str) -> Gauge:
            return Gauge(name, doc, labels, registry=self.registry)

        self.matched_tokens = counter("kvbm_matched_tokens", "Tokens of cached prefixes found in G2/G3/G4").labels(worker)
        self.offload_d2h = counter("kvbm_offload_blocks_d2h", "Blocks offloaded device to host").labels(worker)
        self.offload_h2d = counter("kvbm_offload_blocks_h2d", "Blocks offloaded host to disk").labels(worker)
        self.offload_d2d = counter("kvbm_offload_blocks_d2d", "Blocks offloaded device to disk").labels(worker)
        self.onboard_h2d = counter("kvbm_onboard_blocks_h2d", "Blocks onboarded host to device").labels(worker)
        self.onboard_d2d = counter("kvbm_onboard_blocks_d2d", "Blocks onboarded disk to device").labels(worker)
        self.onboard_errors = counter("kvbm_onboard_errors", "Failed storage reads while onboarding").labels(worker)
        self.host_hit_rate = gauge("kvbm_host_cache_hit_rate", "Host cache hit rate, sliding window").labels(worker)
        self.disk_hit_rate = gauge("kvbm_disk_cache_hit_rate", "Disk cache hit rate, sliding window").labels(worker)
        self.onboard_volume = Counter("kvbm_onboard_blocks_volume", "Blocks onboarded from storage, per volume read from",
                                      ["worker", "volume"], registry=self.registry)
        self.onboard_storage_seconds = Histogram(
            "kvbm_onboard_storage_seconds", "Time of each storage read job into the engine", labels, registry=self.registry,
            buckets=(0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0),
        ).labels(worker)
        self.g2_resident = gauge("kvbm_g2_resident_blocks", "Blocks held by the host pool (G2) now").labels(worker)
        self._onboarded: dict[str, int] = {}
        self._window: deque[_Window] = deque(maxlen=window)
        self._http: tuple[Any, Any] | None = None

    def serve_http(self, port: int = 6880, addr: str = "127.0.0.1") -> str:
        """Serve this registry at ``http://addr:port/metrics`` (prometheus-client's
        ``start_http_server``); ``port=0`` picks a free port.

        Returns:
            The URL of the metrics page.

        Raises:
            OSError: the port cannot be bound.
        """
        if self._http is None:
            self._http = start_http_server(port, addr=addr, registry=self.registry)
        server = self._http[0]
        return f"http://{addr}:{server.server_port}/metrics"

    def stop_http(self) -> None:
        """Stop the endpoint started by :meth:`serve_http` (idempotent)."""
        if self._http is not None:
            server, thread = self._http
            self._http = None
            server.shutdown()
            server.server_close()
            thread.join(timeout=5)

    def count_onboards(self, volumes: Iterable[str]) -> None:
        """Count blocks onboarded from storage: one volume id per block read."""
        counts: dict[str, int] = {}
        for v in volumes:
            counts[v] = counts.get(v, 0) + 1
        for v, n in counts.items():
            self.onboard_volume.labels(self.worker, v).inc(n)
            self._onboarded[v] = self._onboarded.get(v, 0) + n

    def onboarded_by_volume(self) -> dict[str, int]:
        """Blocks onboarded from storage since start, per volume (``{volume: blocks}``)."""
        return dict(self._onboarded)

    def track_g2(self, resident: Callable[[], int]) -> None:
        """Read ``kvbm_g2_resident_blocks`` from ``resident()`` at every scrape."""
        self.g2_resident.set_function(resident)

    def record_lookup(self, looked_up: int, host_hits: int, disk_hits: int) -> None:
        """Add one request's lookup beyond G1 to the window and refresh the gauges.

        Args:
            looked_up: blocks of the request not found in G1 (0 → only the window moves).
            host_hits: of those, blocks found in G2.
            disk_hits: of those, blocks found in G3 or G4.
        """
        self._window.append(_Window(looked_up, host_hits, disk_hits))
        total = sum(w.looked_up for w in self._window)
        if total:
            self.host_hit_rate.set(sum(w.host_hits for w in self._window) / total)
            self.disk_hit_rate.set(sum(w.disk_hits for w in self._window) / total)
        else:
            self.host_hit_rate.set(0.0)
            self.disk_hit_rate.set(0.0)

    def sample(self, name: str) -> float:
        """Current value of one metric for this worker (``_total`` suffix optional)."""
        for metric in self.registry.collect():
            for s in metric.samples:
                if s.name in (name, f"{name}_total") and s.labels.get("worker") == self.worker:
                    return float(s.value)
        raise KeyError(name)
