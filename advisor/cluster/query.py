"""ClusterQuery: the REST API's read interface over a partitioned cluster (docs/scaling.md).

It offers what :class:`advisor.ops.query.AdvisorQuery` offers, answered by the cluster through
:class:`advisor.cluster.node.ClusterClient`, so ``api.app.create_app`` serves the same routes for
one advisor or for a whole cluster:

* ``lookup`` asks each piece's owner (exact longest prefix across partitions);
* ``finish_hint`` (``POST /v1/finished``) goes to the owner of the prompt's last piece,
  whose selector saw the request's Stores;
* ``blocks_at``, ``locations``, ``block``, ``stats`` and ``volumes`` fan out to every partition
  (the volumes are those the advisors' movers manage, ``python -m advisor.cluster --storage``);
* a partition without a serving owner (a take-over) raises
  :class:`~advisor.cluster.node.PartitionUnavailable`, which the API answers with 503 and
  ``Retry-After``, never a partial answer;
* what belongs to one advisor's storage and mover (plans, policy rounds, invalidation,
  volume administration) raises ``NotImplementedError`` (HTTP 501) in this mode;
* the indexer routes' worker registrations are kept in the cluster's JetStream KV
  (:class:`advisor.cluster.api_state.RegistrationBucket`, when given) and restored at start.

Counts summed over partitions count a trunk block once per partition (it is kept by all).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Sequence
from typing import Any

from prometheus_client import CollectorRegistry, Gauge

from advisor.cluster.node import ClusterClient
from advisor.cluster.parts import is_mover_source
from advisor.index.prefix_index import BlockInfo
from advisor.policy.plan import PlanResult
from advisor.ops.query import LookupResult, VolumeView, last_seen_fields

__all__ = ["ClusterQuery"]

_CLUSTER_ONLY = "not available on a partitioned cluster's API: {what} belongs to one advisor's storage and mover"


RATE_WINDOW_S = 10.0
"""Window of the cluster's ``events_per_s`` (as the embedded advisor's, seconds)."""


class ClusterQuery:
    """Read access to a partitioned cluster (module docstring).

    Args:
        client: a connected :class:`ClusterClient`.
        registrations: where the indexer routes' worker registrations are kept across
            restarts (``api.indexer_registry.RegistrationStore``); none: they last as long
            as the process.
    """

    def __init__(self, client: ClusterClient, registrations: Any = None) -> None:
        self._client = client
        self._registrations = registrations
        self._registrations_dropped = 0
        self._started = time.monotonic()
        self._registry = CollectorRegistry(auto_describe=False)
        self._partitions = Gauge("kvadvisor_cluster_partitions", "partitions of the cluster's index",
                                 registry=self._registry)
        self._partitions.set(client.scheme.partitions)
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic s, events applied), last RATE_WINDOW_S

    def block(self, sequence_hash: int) -> BlockInfo | None:
        """What the cluster knows of one block, ``None`` if unknown."""
        got = self._client.block(sequence_hash)
        if got is None:
            return None
        h, parent, prefix, size, locations, hits, last, orphan = got
        return BlockInfo(h, parent, prefix, size, frozenset(locations), hits, last, orphan)

    def children(self, sequence_hash: int) -> list[int]:
        """Children are not tracked across partitions: always ``[]`` here."""
        return []

    def blocks_at(self, location: str) -> list[int]:
        """Sequence hashes held at ``location`` in any partition, sorted."""
        return sorted(self._client.blocks_at(location))

    def locations(self) -> dict[str, int]:
        """Blocks per location, summed over partitions."""
        out: dict[str, int] = {}
        for part in self._client.locations():
            for loc, n in part.items():
                out[loc] = out.get(loc, 0) + int(n)
        return dict(sorted(out.items()))

    def lookup(self, hashes: Sequence[int]) -> LookupResult:
        """Longest cached prefix of ``hashes`` per location, across partitions."""
        per, any_n = self._client.lookup_full(list(hashes))
        return LookupResult(len(hashes), dict(sorted(per.items())), any_n)

    def finish_hint(self, hashes: Sequence[int], finish_reason: str, client: str | None = None) -> bool:
        """Hand a router's word that the request with prompt ``hashes`` finished to the
        partitions that saw it (:meth:`ClusterClient.finished`), with the ``client`` whose
        share of the hint quota it counts in; ``False`` when none took it.

        Raises:
            PartitionUnavailable: a partition it goes to has no owner serving now.
        """
        return self._client.finished(list(hashes), finish_reason, client)

    def volumes(self) -> list[VolumeView]:
        """The volumes the cluster advisors manage (``--storage``), with their role, usage
        (from the shared catalog) and the blocks the partitions place on each (each block
        once); ``[]`` when no advisor runs a mover.

        Raises:
            PartitionUnavailable: a partition has no owner serving now.
        """
        views, indexed = self._client.volumes()
        return [VolumeView(v["id"], v["kind"], v["media"], int(v["capacity_bytes"]), v["role"], dict(v["stats"]),
                           indexed.get(v["id"], 0)) for v in views]

    def stats(self) -> dict[str, Any]:
        """The shape of :meth:`advisor.ops.query.AdvisorQuery.stats`, summed over partitions (the
        moves: what each partition's current owner moved since it took the partition), except
        ``policy``: ``{"partitions": {"<p>": {"leader", "switches", "requests", "window_requests",
        "window_refs", "superseded_blocks"}}}``, each partition's expert selection (``{}`` for a partition whose owner
        runs no mover)."""
        status = self._client.status()
        per_loc = self.locations()
        sources: dict[str, dict[str, int]] = {}
        for st in status.values():
            figures = st.get("source_figures", {})  # absent from an older advisor: zeros
            for name, (epoch, last_seq) in st["sources"].items():
                cur = sources.setdefault(name, {"epoch": int(epoch), "last_seq": 0, "batches": 0, "events": 0,
                                                "last_ts_ns": 0})
                cur["last_seq"] = max(cur["last_seq"], int(last_seq))
                batches, events, last_ts = figures.get(name, (0, 0, 0))
                cur["batches"] += int(batches)  # a partitioned publisher sends each batch to one partition
                cur["events"] += int(events)
                cur["last_ts_ns"] = max(cur["last_ts_ns"], int(last_ts))
        for cur in sources.values():
            cur.update(last_seen_fields(cur["last_ts_ns"]))
        events_applied = sum(int(st.get("events", 0)) for st in status.values())
        rate = self._events_rate(events_applied)
        zero = {"promote": 0, "demote": 0, "compact": 0}
        moves: dict[str, dict[str, int]] = {k: dict(zero) for k in ("done", "skipped", "failed", "bytes_moved")}
        for st in status.values():  # the movers' results per partition, since its owner took it
            for field_name, table in moves.items():
                for kind, n in st.get("moves", {}).get(field_name, {}).items():
                    if kind in table:
                        table[kind] += int(n)
        done, nbytes = moves["done"], sum(moves["bytes_moved"].values())
        return {
            "blocks": sum(int(st["blocks"]) for st in status.values()),
            "blocks_per_location": per_loc,
            "orphans_pending": 0,
            "index_counters": {"batches": sum(int(st["applied"]) for st in status.values()),
                               "events": sum(int(st.get("events", 0)) for st in status.values())},
            "sources": dict(sorted(sources.items())),
            "journal_position": max((int(st["position"]) for st in status.values()), default=0),
            "batches_applied": sum(int(st["applied"]) for st in status.values()),
            "events_applied": events_applied,
            "events_per_s": rate,
            "ingest_events_per_busy_s": 0.0,
            "ingest": {"origin_refused": sum(int(st.get("origin_refused", 0)) for st in status.values()),
                       "errors": sum(int(st["errors"]) for st in status.values()),
                       "registrations_dropped": self._registrations_dropped,
                       # the state quotas of the partition folds, summed (per partition: /metrics)
                       **_summed_quotas(status)},
            # the cluster movers publish their moves under "<advisor id>-mover" (advisor.cluster.mover)
            "advisor_events": sum(v["events"] for k, v in sources.items() if is_mover_source(k)),
            "promotions": done["promote"], "demotions": done["demote"],
            "compactions": done["compact"], "bytes_moved": nbytes,
            "moves": {"promotions": done["promote"], "demotions": done["demote"], "compactions": done["compact"],
                      "bytes_moved": nbytes, "done": done, "skipped": moves["skipped"], "failed": moves["failed"],
                      "bytes_by_kind": moves["bytes_moved"], "blocks_by_kind": zero},
            "subscriber": {},
            "uptime_s": time.monotonic() - self._started,
            # each partition's owner ranks its moves by its own expert selection
            # (advisor.cluster.mover, "Ranking"): {"partitions": {p: {"leader", ...}}}
            "policy": {"partitions": {str(p): dict(st.get("policy", {})) for p, st in sorted(status.items())}},
        }

    def _events_rate(self, events_applied: int) -> float:
        """Events applied per second over the last :data:`RATE_WINDOW_S` seconds of calls (0.0
        on the first call: the rate needs two samples)."""
        now = time.monotonic()
        self._samples.append((now, events_applied))
        while len(self._samples) > 2 and self._samples[1][0] <= now - RATE_WINDOW_S:
            self._samples.popleft()
        t0, e0 = self._samples[0]
        return max(0, events_applied - e0) / (now - t0) if now > t0 else 0.0

    def plans(self, limit: int = 100) -> list[PlanResult]:
        """No plans are kept on the cluster's query face: ``[]``."""
        return []

    def run_policies(self) -> list[PlanResult]:
        raise NotImplementedError(_CLUSTER_ONLY.format(what="a policy round"))

    def invalidate(self, namespace: str) -> Any:
        raise NotImplementedError(_CLUSTER_ONLY.format(what="invalidation"))

    def segments(self, volume_id: str) -> list[Any] | None:
        """No volume is configured here: ``None`` (404)."""
        return None

    def drain(self, volume: str, to: str | None = None) -> Any:
        raise NotImplementedError(_CLUSTER_ONLY.format(what="draining a volume"))

    def undrain(self, volume: str) -> bool:
        raise NotImplementedError(_CLUSTER_ONLY.format(what="draining a volume"))

    def register_volume(self, volume: Any, role: str = "none") -> None:
        raise NotImplementedError(_CLUSTER_ONLY.format(what="volume administration"))

    def unregister_volume(self, volume_id: str) -> None:
        raise NotImplementedError(_CLUSTER_ONLY.format(what="volume administration"))

    def load_registrations(self) -> list[dict[str, Any]]:
        """The stored worker registrations of the indexer routes (``[]`` without a store)."""
        return [] if self._registrations is None else self._registrations.load_registrations()

    def save_registrations(self, registrations: list[dict[str, Any]]) -> None:
        """Replace the stored worker registrations (no-op without a store; errors raised)."""
        if self._registrations is not None:
            self._registrations.save_registrations(registrations)

    def count_registrations_dropped(self, n: int) -> None:
        """Count stored registrations refused at a restore (``registrations_dropped`` in
        :meth:`stats`, ``ingest``)."""
        self._registrations_dropped += n

    def metrics_registry(self) -> CollectorRegistry:
        """The query face's own registry (the advisors export theirs)."""
        return self._registry

    def health(self) -> dict[str, Any]:
        """``ok`` when every partition answers, ``degraded`` during a take-over."""
        from advisor.cluster.node import PartitionUnavailable

        try:
            status = self._client.status()
        except PartitionUnavailable:
            return {"status": "degraded", "journal_position": 0, "subscribed": True, "storage": False}
        return {"status": "ok", "journal_position": max(int(s["position"]) for s in status.values()),
                "subscribed": True, "storage": False}


def _summed_quotas(status: dict[Any, dict[str, Any]]) -> dict[str, int]:
    """The partitions' quota counters (``quota_refused_*``, ``retired_epochs_forgotten``:
    :meth:`advisor.ingest.quotas.QuotaGuard.as_dict`) summed; absent from an older advisor."""
    out: dict[str, int] = {}
    for st in status.values():
        for key, n in st.get("quotas", {}).items():
            if key.startswith("quota_refused_") or key == "retired_epochs_forgotten":
                out[key] = out.get(key, 0) + int(n)
    return out
