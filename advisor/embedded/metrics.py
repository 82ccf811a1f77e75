"""Prometheus metrics of one advisor (a private ``CollectorRegistry`` per service).

Counters are updated where things happen (ingest, mover); gauges that mirror state
(index blocks per location, subscriber counters) are read at scrape time through a
custom collector, so they can never drift from the index.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Iterator
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from advisor.policy.plan import PlanResult


OTHER_LOCATIONS = "_other"
"""``location`` label of the sum over the locations past ``max_locations``."""

MAX_LOCATIONS = 64
"""Default number of ``location`` label values of ``kvadvisor_index_blocks``."""


def bounded_locations(per_location: dict[str, int], max_locations: int, keep: Collection[str] = ()) -> dict[str, int]:
    """At most ``max_locations`` + 1 label values for a per-location count.

    Locations come from events, which any publisher can forge (one series per forged name
    would grow the scrape without bound): the ``keep`` locations (the configured volumes)
    and then the largest others (ties by name) are shown up to ``max_locations``; all the
    rest are summed under :data:`OTHER_LOCATIONS`, which is present only when something
    was folded into it (a location spelled like it is always folded).
    """
    shown: dict[str, int] = {}
    rest = 0
    ranked = sorted(per_location.items(), key=lambda kv: (kv[0] not in keep, -kv[1], kv[0]))
    for loc, n in ranked:
        if len(shown) < max_locations and loc != OTHER_LOCATIONS:
            shown[loc] = n
        else:
            rest += n
    if len(shown) < len(per_location):
        shown[OTHER_LOCATIONS] = rest
    return shown


class _StateCollector(Collector):
    """Reads a snapshot dict at scrape time (see :meth:`AdvisorMetrics.__init__`)."""

    def __init__(self, snapshot: Callable[[], dict[str, Any]], max_locations: int, keep: Collection[str]) -> None:
        self._snapshot = snapshot
        self._max_locations = max_locations
        self._keep = frozenset(keep)

    def collect(self) -> Iterator[Metric]:
        snap = self._snapshot()
        blocks = GaugeMetricFamily(
            "kvadvisor_index_blocks",
            f"Blocks indexed per location (at most {self._max_locations} locations, the rest summed as "
            f"location={OTHER_LOCATIONS!r})",
            labels=["location"],
        )
        per_location = bounded_locations(snap.get("blocks_per_location", {}), self._max_locations, self._keep)
        for loc, n in per_location.items():
            blocks.add_metric([loc], n)
        yield blocks
        yield GaugeMetricFamily("kvadvisor_index_blocks_total", "Distinct blocks indexed", value=snap.get("blocks", 0))
        yield GaugeMetricFamily(
            "kvadvisor_index_orphans", "Indexed blocks whose parent is not indexed", value=snap.get("orphans_pending", 0)
        )
        idx = CounterMetricFamily("kvadvisor_index_events", "Index counters by kind", labels=["kind"])
        for name, n in snap.get("index_counters", {}).items():
            idx.add_metric([name], n)
        yield idx
        sub = CounterMetricFamily("kvadvisor_subscriber", "Subscriber counters (gaps, replayed, ...)", labels=["kind"])
        for name, n in snap.get("subscriber", {}).items():
            sub.add_metric([name], n)
        yield sub
        replay = CounterMetricFamily(
            "kvadvisor_publisher_replay",
            "Replay requests to the advisor's own ZMQ publisher, by outcome (served, refused_*, stalled, ...)",
            labels=["kind"],
        )
        for name, n in snap.get("replay", {}).items():
            replay.add_metric([name], n)
        yield replay
        yield CounterMetricFamily(
            "kvadvisor_subscriber_gaps", "Gaps detected in source seq numbers", value=snap.get("subscriber", {}).get("gaps", 0)
        )
        yield GaugeMetricFamily(
            "kvadvisor_events_per_second", "Events applied per second (recent window)", value=snap.get("events_per_s", 0.0)
        )


class AdvisorMetrics:
    """The advisor's metrics.

    Args:
        snapshot: returns ``{"blocks_per_location": {loc: n}, "blocks": n,
            "orphans_pending": n, "index_counters": {...}, "subscriber": {...},
            "replay": {...}, "events_per_s": float}``; called at every scrape.
        max_locations: ``location`` label values of ``kvadvisor_index_blocks`` besides
            :data:`OTHER_LOCATIONS` (see :func:`bounded_locations`).
        keep_locations: locations always shown first (the configured volume ids).
    """

    def __init__(
        self,
        snapshot: Callable[[], dict[str, Any]],
        *,
        max_locations: int = MAX_LOCATIONS,
        keep_locations: Collection[str] = (),
    ) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.events_applied = Counter("kvadvisor_events_applied", "Events applied to the index", registry=r)
        self.batches_applied = Counter("kvadvisor_batches_applied", "Batches journaled and applied", registry=r)
        self.duplicate_batches = Counter(
            "kvadvisor_duplicate_batches", "Batches already journaled (not applied again)", registry=r
        )
        self.bad_batches = Counter("kvadvisor_bad_batches", "Batches refused by the journal", registry=r)
        self.journal_skipped = Counter(
            "kvadvisor_journal_skipped", "Journal entries skipped at replay (not a valid KVEvent v1 batch)", registry=r
        )
        self.journal_failures = Counter(
            "kvadvisor_journal_failures", "Journal appends that failed (disk full, I/O error); the batch is retried",
            registry=r,
        )
        self.moves = Counter("kvadvisor_moves", "Plan items executed", ["kind", "status"], registry=r)
        self.bytes_moved = Counter("kvadvisor_bytes_moved", "Bytes written by moves and compactions", ["kind"], registry=r)
        self.policy_rounds = Counter("kvadvisor_policy_rounds", "Policy rounds run", registry=r)
        self.origin_refused = Counter(
            "kvadvisor_origin_refused", "Batches refused: their source is bound to another origin (transport: "
            "zmq | nats | other)", ["transport"], registry=r,
        )
        self.journal_position = Gauge("kvadvisor_journal_position", "Last journal position applied", registry=r)
        from advisor.ingest.quotas import BATCH_REASONS, QuotaReason

        self.quota_refused_batches = Counter(
            "kvadvisor_quota_refused_batches", "Subscribed batches refused whole by a quota, by reason",
            ["reason"], registry=r)
        self.quota_refused_events = Counter(
            "kvadvisor_quota_refused_events",
            "Events refused by a quota, by reason (those of refused batches included)", ["reason"], registry=r)
        for reason in QuotaReason:  # every series exists from the start, at 0; no other label value ever does
            if reason in BATCH_REASONS:
                self.quota_refused_batches.labels(reason=reason.value)
            self.quota_refused_events.labels(reason=reason.value)
        self.reported_hits_capped = Counter(
            "kvadvisor_reported_hits_capped", "Publisher-reported hits removed by reported_hits_cap", registry=r)
        self.reported_hits_untrusted = Counter(
            "kvadvisor_reported_hits_untrusted",
            "Events whose reported hits were removed (source not in reported_hits_sources)", registry=r)
        r.register(_StateCollector(snapshot, max_locations, keep_locations))

    def record_results(self, results: list[PlanResult]) -> None:
        """Count executed plan items and bytes moved."""
        for res in results:
            kind = res.item.kind.value
            self.moves.labels(kind=kind, status=res.status.value).inc()
            if res.bytes_moved:
                self.bytes_moved.labels(kind=kind).inc(res.bytes_moved)
