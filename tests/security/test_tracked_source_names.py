"""Source names the advisor never admitted are not kept without bound in the subscriber.

Over real ZMQ, a hostile publisher sends one batch under each of many new source names,
past ``quota_max_sources``: the advisor refuses them, but the subscriber's ordering
tracker (positions and retired epochs) and its resync marks are kept per source name
before any quota decides. Names not bound to an origin (never admitted) are kept at most
``MAX_UNKEPT_SOURCES`` at a time, the least recently seen forgotten beyond
(``sources_forgotten`` in the subscriber's counters, /v1/stats and /metrics); admitted
(bound) sources are never forgotten, so their order and gap detection go on.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import BS, RawPub, settings, wait_for

from event_plane.ordering import MAX_UNKEPT_SOURCES
from event_plane.schema import WIRE_VERSION, EventBatch, store


def batch(source: str, seq: int, h: int, epoch: int = 1) -> EventBatch:
    return EventBatch(WIRE_VERSION, source, epoch, seq, 1_000 + seq, [store(h, h, None, BS, "g1")])


def test_names_never_admitted_are_tracked_within_a_bound(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(settings(tmp_path, [pub.url], quota_max_sources=20))
        pub.join(svc)
        claims = MAX_UNKEPT_SOURCES
        n = claims + 2_000
        for s in range(n):
            # seq 3 of a new source: a gap no one can fill (no replay endpoint), so each
            # name also gets a resync mark
            pub.send(batch(f"squat-{s}", 3, 10_000 + s))
        wait_for(lambda: svc.subscriber.stats().batches >= n + 1, what="every squatting batch delivered")
        wait_for(lambda: svc.counters["quota_refused_batches_sources"] >= n - 19, what="every squatting batch refused")
        sub = svc.subscriber
        bound = svc.origins.count()
        assert bound == 20
        assert len(sub._tracker._current) <= bound + claims
        assert len(sub.resync_needed) <= bound + claims
        forgotten = sub.stats().sources_forgotten
        assert forgotten >= n + 1 - claims - bound  # the probe and n names, less those kept
        assert svc.subscriber_stats()["sources_forgotten"] == forgotten
        sample = svc.metrics.registry.get_sample_value("kvadvisor_subscriber_total", {"kind": "sources_forgotten"})
        assert sample == forgotten
        # an admitted source keeps its position: its next batch is in order, not a gap
        admitted = next(s for s in svc.index.sources() if s.startswith("squat-"))
        gaps = sub.stats().gaps
        pub.send(batch(admitted, 4, 90_000))
        wait_for(lambda: svc.index.holds(90_000, f"{admitted}/g1"), what="an admitted source's next batch")
        assert sub.stats().gaps == gaps
    finally:
        pub.close()
