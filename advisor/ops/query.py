"""AdvisorQuery: the read-only (plus "run a round now") interface the REST API uses.

Thread-safe: every read takes the advisor's state lock for as short as possible and
returns plain values (dataclasses, dicts), never live index objects.  Calls into the
storage agent and the subscriber happen outside the state lock.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from typing import TYPE_CHECKING, Any

from advisor.index.prefix_index import BlockInfo
from advisor.policy.eviction.experts import ANONYMOUS
from advisor.policy.plan import PlanResult

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from advisor.ops.operated import OperatedAdvisor


NAMESPACES_MAX_AGE_S = 5.0
"""How old the catalog's per-namespace counts in ``/v1/stats`` may be, seconds."""


@dataclass(frozen=True)
class LookupResult:
    """Longest cached prefix of a request.

    Attributes:
        requested: number of hashes asked about.
        per_location: ``{location: n}`` — the first ``n`` blocks are all at ``location``.
        any_location: leading blocks held somewhere (locations may differ per block).
    """

    requested: int
    per_location: dict[str, int]
    any_location: int
    prefix_locations: list[frozenset[str]] | None = None
    """The locations of each of the first ``any_location`` blocks (``None`` where the query
    does not know them cheaply: scaled mode), for :func:`api.hit_rates.served_per_tier`."""


@dataclass(frozen=True)
class VolumeView:
    """A registered volume with its role and usage (bytes).

    Attributes:
        id / kind / media / capacity_bytes: from the descriptor.
        role: ``"fast"``, ``"slow"``, ``"archive"`` or ``"none"``.
        stats: ``VolumeStats`` fields (used, live, dead bytes, segments, blocks...),
            empty when storage is not attached.
        indexed_blocks: blocks the index places on this volume.
        draining: a drain marked it (:mod:`advisor.ops.drain`): no policy move goes onto it.
    """

    id: str
    kind: str
    media: str
    capacity_bytes: int
    role: str
    stats: dict[str, Any]
    indexed_blocks: int
    draining: bool = False


class AdvisorQuery:
    """Read access to one advisor (an :class:`~advisor.embedded.service.AdvisorService`, through
    :class:`~advisor.ops.operated.OperatedAdvisor`)."""

    def __init__(self, service: OperatedAdvisor) -> None:
        self._svc = service

    def block(self, sequence_hash: int) -> BlockInfo | None:
        """Index info of one block, ``None`` if unknown."""
        with self._svc.lock:
            return self._svc.index.block(sequence_hash)

    def children(self, sequence_hash: int) -> list[int]:
        """Indexed children of a block, sorted."""
        with self._svc.lock:
            return sorted(self._svc.index.children(sequence_hash))

    def blocks_at(self, location: str) -> list[int]:
        """Sequence hashes the index places at ``location`` (volume id or ``"<source>/g1"``), sorted."""
        with self._svc.lock:
            return sorted(self._svc.index.blocks_at(location))

    def locations(self) -> dict[str, int]:
        """Blocks per location (locations holding at least one block)."""
        with self._svc.lock:
            return dict(self._svc.index.stats()["blocks_per_location"])

    def lookup(self, hashes: Sequence[int]) -> LookupResult:
        """Longest cached prefix of ``hashes`` per location (see ``PrefixIndex.lookup``)."""
        with self._svc.lock:
            per = self._svc.index.lookup(hashes)
            anyn = self._svc.index.lookup_any(hashes)
            where = []
            for h in hashes[:anyn]:
                info = self._svc.index.block(h)
                where.append(frozenset(info.locations) if info is not None else frozenset())
        return LookupResult(len(hashes), dict(sorted(per.items())), anyn, where)

    def prefetch_hint(self, hashes: Sequence[int], client: str | None = None) -> bool:
        """Take a router's lookup as a prefetch hint (:meth:`advisor.moves.prefetch.Prefetcher.hint`)
        from ``client`` (its fair share of the queue; ``None``: the anonymous client);
        ``False`` when refused by the quota or when the advisor does not prefetch."""
        p = self._svc.prefetcher
        return p.hint(hashes, client or ANONYMOUS) if p is not None else False

    def finish_hint(self, hashes: Sequence[int], finish_reason: str, client: str | None = None) -> bool:
        """Take a router's word that the request with prompt ``hashes`` finished
        (:meth:`advisor.policy.eviction.experts.LiveSelector.finished`) from ``client`` (its
        share of the hint quota; ``None``: the anonymous client); ``False`` for an empty
        prompt or with hints off (``policy.selector.max_finish_hints = 0``)."""
        if client is None:
            return self._svc.selector.finished(hashes, finish_reason)
        return self._svc.selector.finished(hashes, finish_reason, client=client)

    def volumes(self) -> list[VolumeView]:
        """Configured volumes with role, storage usage and indexed block count."""
        s = self._svc.settings
        roles = {v: "slow" for v in s.slow_volumes}
        if s.fast_volume:
            roles[s.fast_volume] = "fast"
        if s.archive_volume:
            roles[s.archive_volume] = "archive"
        stats: dict[str, dict[str, Any]] = {}
        if self._svc.agent is not None:
            for st in self._svc.agent.stats():
                stats[st.volume_id] = asdict(st)
        out = []
        with self._svc.lock:
            for v in s.volumes:
                out.append(VolumeView(v.id, v.kind, v.media, v.capacity_bytes, roles.get(v.id, "none"),
                                      stats.get(v.id, {}), self._svc.index.count_at(v.id), v.id in self._svc.draining))
        return out

    def namespaces(self, max_age_s: float = NAMESPACES_MAX_AGE_S) -> dict[str, Any]:
        """The key namespaces this advisor manages, and those the catalog places blocks in.

        Returns:
            ``{"managed": [namespace, ...], "seen": {namespace: {volume id: blocks}},
            "left": {namespace: blocks}}``: ``managed`` the configured ones then those followed
            from the catalog (``follow_catalog_namespaces``, up to ``max_namespaces``);
            ``left`` the seen ones not managed; ``seen`` is empty without storage, and at most
            ``max_age_s`` seconds old (one grouped catalog scan per period,
            :meth:`storage_backends.SqliteCatalog.namespace_counts`).
        """
        svc = self._svc
        managed = svc.managed_namespaces(max_age_s)
        return {"managed": managed, "seen": dict(svc.namespace_counts), "left": dict(svc.namespaces_left)}

    def stats(self) -> dict[str, Any]:
        """Index, ingest, per-source, mover and subscriber figures.

        Returns:
            ``{"blocks", "blocks_per_location", "orphans_pending", "index_counters",
            "sources": {source: {"epoch", "last_seq", "batches", "events", "last_ts_ns" (the
            last batch's timestamp, the publisher's clock, ns since the epoch), "last_seen_s"
            (the same in seconds), "last_seen" (the same, ISO 8601 UTC)}},
            "journal_position", "batches_applied", "events_applied", "events_per_s" (arrival rate,
            last 10 s), "ingest_events_per_busy_s" (journal + apply capacity: events per
            second of ingest work, idle time excluded),
            "ingest": {...counters}, "advisor_events" (events the advisor published),
            "promotions", "demotions", "compactions", "bytes_moved",
            "moves": {"promotions", "demotions", "compactions", "bytes_moved", "done",
            "skipped", "failed", "bytes_by_kind", "blocks_by_kind", "routes" (completed moves per
            ``"<kind> <src>-><dst>"``, e.g. ``"demote slow->s3"``)},
            "subscriber": {...}, "namespaces": :meth:`namespaces`, "uptime_s", "prefetch": {...counters
            of advisor.moves.prefetch.Prefetcher.stats, empty when the advisor does not prefetch}}``.
        """
        svc = self._svc
        sub = svc.subscriber_stats()
        moves = svc.mover_summary()
        own_events = svc.publisher.stats().events if svc.publisher is not None else 0
        totals = {
            "promotions": moves["done"]["promote"],
            "demotions": moves["done"]["demote"],
            "compactions": moves["done"]["compact"],
            "bytes_moved": sum(moves["bytes_moved"].values()),
        }
        with svc.lock:
            st = svc.index.stats()
            sources = {
                name: {"epoch": s.epoch, "last_seq": s.last_seq, "batches": s.batches, "events": s.events,
                       "last_ts_ns": s.last_ts_ns, **last_seen_fields(s.last_ts_ns)}
                for name, s in sorted(svc.index.sources().items())
            }
            ingest = dict(svc.counters)
            position = svc.position
            rate = svc.rate.rate()
            capacity = svc.rate.busy_rate()
        return {
            "blocks": st["blocks"],
            "blocks_per_location": st["blocks_per_location"],
            "orphans_pending": st["orphans_pending"],
            "index_counters": st["counters"],
            "sources": sources,
            "journal_position": position,
            "batches_applied": st["counters"]["batches"],
            "events_applied": st["counters"]["events"],
            "events_per_s": rate,
            "ingest_events_per_busy_s": capacity,
            "ingest": ingest,
            "advisor_events": own_events,
            **totals,
            "moves": {
                **totals,
                "done": moves["done"],
                "skipped": moves["skipped"],
                "failed": moves["failed"],
                "bytes_by_kind": moves["bytes_moved"],
                "blocks_by_kind": moves["blocks_moved"],
                "routes": dict(sorted(moves.get("routes", {}).items())),
            },
            "subscriber": sub,
            "namespaces": self.namespaces(),
            "uptime_s": time.monotonic() - svc.started_at if svc.started_at else 0.0,
            "prefetch": svc.prefetcher.stats() if svc.prefetcher is not None else {},
            "policy": svc.selector.stats(),
        }

    def plans(self, limit: int = 100) -> list[PlanResult]:
        """The most recent executed plan items, newest last."""
        with self._svc.lock:
            recent = list(self._svc.plans)
        return recent[-limit:] if limit > 0 else []

    def run_policies(self) -> list[PlanResult]:
        """Run one policy round synchronously and return its results."""
        return self._svc.run_policies_once()

    def invalidate(self, namespace: str) -> Any:
        """Delete a namespace's blocks on every volume and publish their Removes
        (:func:`advisor.ops.invalidate.invalidate_namespace`; its errors)."""
        from advisor.ops.invalidate import invalidate_namespace

        return invalidate_namespace(self._svc, namespace)

    def segments(self, volume_id: str) -> list[Any] | None:
        """Segments of one configured volume (``storage_backends.SegmentInfo``, by id); ``[]``
        without storage; ``None`` when the volume is not configured."""
        if not any(v.id == volume_id for v in self._svc.settings.volumes):
            return None
        agent = self._svc.agent
        if agent is None:
            return []
        return sorted(agent.segments(volume_id), key=lambda s: s.segment_id)

    def drain(self, volume: str, to: str | None = None) -> Any:
        """Move every managed block off ``volume`` (:func:`advisor.ops.drain.drain_volume`; its errors)."""
        from advisor.ops.drain import drain_volume

        return drain_volume(self._svc, volume, to)

    def undrain(self, volume: str) -> bool:
        """Cancel a drain (:func:`advisor.ops.drain.undrain_volume`): whether it was draining."""
        from advisor.ops.drain import undrain_volume

        return undrain_volume(self._svc, volume)

    def register_volume(self, volume: Any, role: str = "none") -> None:
        """Add a volume at run time (:func:`advisor.ops.volume_admin.register_volume`; its errors)."""
        from advisor.ops.volume_admin import register_volume

        register_volume(self._svc, volume, role, self._svc.settings.volume_probe_timeout_s)  # type: ignore[arg-type]

    def unregister_volume(self, volume_id: str) -> None:
        """Remove an empty volume (:func:`advisor.ops.volume_admin.unregister_volume`; its errors)."""
        from advisor.ops.volume_admin import unregister_volume

        unregister_volume(self._svc, volume_id)

    def load_registrations(self) -> list[dict[str, Any]]:
        """The indexer API's stored worker registrations (``api.indexer_registry.RegistrationStore``)."""
        return self._svc.saved_registrations()

    def save_registrations(self, registrations: list[dict[str, Any]]) -> None:
        """Store the indexer API's worker registrations in the run state (errors raised)."""
        self._svc.save_registrations(registrations)

    def count_registrations_dropped(self, n: int) -> None:
        """Count stored registrations refused at a restore (``registrations_dropped``)."""
        with self._svc.lock:
            self._svc.counters["registrations_dropped"] += n

    def metrics_registry(self) -> CollectorRegistry:
        """The advisor's Prometheus registry."""
        return self._svc.metrics.registry

    def plain_zmq_allowed(self) -> bool:
        """Whether plain (non-CURVE) ZMQ publishers may be subscribed to: not when
        ``zmq_allowed_publishers`` is set (``POST /register`` is then closed)."""
        return self._svc.settings.zmq_allowed_publishers is None

    def health(self) -> dict[str, Any]:
        """``{"status": "ok" | "unhealthy", "journal_position": n, "subscribed": bool,
        "storage": bool, "reason": str | None}``: unhealthy while journal appends fail or
        subscribed batches are not ingested (:meth:`AdvisorService.ingest_problem`)."""
        with self._svc.lock:
            pos = self._svc.position
            reason = self._svc.journal_error
        if reason is None:
            reason = self._svc.ingest_problem()
        return {
            "status": "ok" if reason is None else "unhealthy",
            "reason": reason,
            "journal_position": pos,
            "subscribed": self._svc.subscriber is not None,
            "storage": self._svc.agent is not None,
        }


def last_seen_fields(ts_ns: int) -> dict[str, Any]:
    """A source's last-seen time (its last batch's ``ts_ns``) in seconds and ISO 8601 UTC."""
    import datetime as _dt

    secs = ts_ns / 1e9
    try:
        iso = _dt.datetime.fromtimestamp(secs, _dt.timezone.utc).isoformat(timespec="milliseconds")
    except (OverflowError, OSError, ValueError):
        iso = ""
    return {"last_seen_s": secs, "last_seen": iso}
