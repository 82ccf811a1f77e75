"""A publisher that routes each event to its index partition (scaled mode, docs/design.md §8).

In scaled mode the advisors split the prefix index into partitions
(:mod:`event_plane.partition`).  Partition ``k`` of namespace ``NS`` is the namespace
``NS-p<k>`` (:func:`partition_namespace`): on JetStream its subjects are
``kvadvisor.events.NS-p<k>.<source>``, read by whichever advisor holds that partition's
lease.  :class:`PartitionedPublisher` keeps one inner publisher per partition, all with the
same source name and epoch (each numbers its own batches), and sends

* a Store to the partition of its block (:class:`~event_plane.partition.ChainRouter`; a
  trunk block to every partition),
* a Remove to the partition its Store went to (every partition when it never saw it),
* a Cleared to every partition,

so each partition's stream is exactly the events of its blocks, in the order they
happened.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from typing import Any
from urllib.parse import parse_qsl, urlencode, urlsplit, urlunsplit

from event_plane.config import PublisherStats
from event_plane.errors import EventURLError
from event_plane.nats_auth import redact_url
from event_plane.partition import TRUNK, ChainRouter, PartitionScheme
from event_plane.publisher import EventPublisher
from event_plane.schema import EventType, KVEvent

__all__ = ["PartitionedPublisher", "close_all", "partition_namespace", "partition_url"]


def close_all(publishers: Sequence[Any]) -> None:
    """Close every publisher of ``publishers``; the first error is raised once all are closed."""
    first: BaseException | None = None
    for p in publishers:
        try:
            p.close()
        except BaseException as exc:  # noqa: BLE001 - close the others first
            first = first or exc
    if first is not None:
        raise first


def partition_namespace(namespace: str, partition: int) -> str:
    """Namespace of partition ``partition`` of ``namespace``: ``"<namespace>-p<partition>"``."""
    return f"{namespace}-p{partition}"


def partition_url(url: str, partition: int) -> str:
    """``url`` (``jetstream://`` or ``nats://``) with its ``namespace`` parameter replaced by
    that of partition ``partition`` (``default`` when the URL names none).

    Raises:
        EventURLError: a scheme other than ``jetstream``/``nats``/``tls``.
    """
    parts = urlsplit(url)
    if parts.scheme not in ("jetstream", "nats", "tls"):
        raise EventURLError(f"a partitioned publisher needs a NATS URL, got {redact_url(url)!r}")
    query = dict(parse_qsl(parts.query, keep_blank_values=True))
    query["namespace"] = partition_namespace(query.get("namespace", "default"), partition)
    return urlunsplit(parts._replace(query=urlencode(query)))


class PartitionedPublisher:
    """Routes a source's events to one publisher per partition (module docstring).

    Args:
        scheme: the cluster's partition scheme.
        make: ``make(partition) -> EventPublisher``, called once per partition at
            construction (e.g. ``lambda k: make_publisher(partition_url(url, k), source,
            epoch=epoch)``); every publisher must have the same source and epoch.
        router: the :class:`ChainRouter` (default: a new one for ``scheme``).

    Raises:
        ValueError: the inner publishers disagree on source or epoch.
    """

    def __init__(self, scheme: PartitionScheme, make: Callable[[int], EventPublisher],
                 router: ChainRouter | None = None) -> None:
        self.scheme = scheme
        self.router = router or ChainRouter(scheme)
        self.publishers: list[EventPublisher] = []
        try:
            for k in range(scheme.partitions):
                self.publishers.append(make(k))
        except BaseException:
            self.close()
            raise
        ids = {(p.source, p.epoch) for p in self.publishers}
        if len(ids) != 1:
            self.close()
            raise ValueError(f"partition publishers must share one source and epoch, got {sorted(ids)}")
        self.source, self.epoch = next(iter(ids))

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Route ``events`` (in order) to their partitions' publishers.

        Raises:
            InvalidEventError, PublisherClosedError: from the inner publishers.
        """
        n = self.scheme.partitions
        per: list[list[KVEvent]] = [[] for _ in range(n)]
        for e in events:
            if e.type == EventType.STORE:
                target: int | None = self.router.route_store(e.sequence_hash, e.parent_hash)
            elif e.type == EventType.REMOVE:
                target = self.router.route_remove(e.sequence_hash)
            else:
                target = None
            if target is None or target == TRUNK:
                for lst in per:
                    lst.append(e)
            else:
                per[target].append(e)
        for pub, lst in zip(self.publishers, per):
            if lst:
                pub.publish(lst)

    def flush(self) -> None:
        """Send every partition's pending batch."""
        for p in self.publishers:
            p.flush()

    def close(self) -> None:
        """Flush and close every inner publisher (the first error is raised after all are closed)."""
        close_all(self.publishers)

    def stats(self) -> PublisherStats:
        """The partitions' publishers together (``EventPublisher.stats``'s shape, so this
        publisher stands in for one): counters summed, ``flush_delay_s`` the largest.  A trunk
        event sent to every partition counts once per partition."""
        out = PublisherStats()
        for st in self.partition_stats():
            out.events += st.events
            out.batches += st.batches
            out.payload_bytes += st.payload_bytes
            out.event_bytes += st.event_bytes
            out.dropped += st.dropped
            out.refused += st.refused
            out.flush_delay_s = max(out.flush_delay_s, st.flush_delay_s)
            out.event_rate += st.event_rate
        return out

    def partition_stats(self) -> list[PublisherStats]:
        """Each partition publisher's ``stats()``, in partition order."""
        return [p.stats() for p in self.publishers]

    def __enter__(self) -> PartitionedPublisher:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
