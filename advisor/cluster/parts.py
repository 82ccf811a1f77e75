"""The parts of a cluster advisor that its node, mover, expiry and metrics share: its
settings (:class:`ClusterSettings`), one owned partition (:class:`Replica`) and what the
parts see of the node (:class:`NodeParts`, which :class:`advisor.cluster.node.ClusterNode`
implements).  docs/design.md §8 describes the cluster.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.jslog import JetStreamLog
from advisor.cluster.leases import LeaseKeeper, LeaseSettings
from advisor.cluster.partition_fold import PartitionFold
from advisor.index.snapshot import RedisSnapshotStore, encode_index, load_latest, make_snapshot
from advisor.ingest.quotas import QuotaLimits
from advisor.ingest.source_expiry import EXPIRY_SEQ_BASE
from advisor.policy.eviction.experts import ANONYMOUS
from advisor.policy.live_selection import new_selector, observe
from event_plane.codec import BatchHead, decode_batch, decode_head
from event_plane.config import StreamLimits
from event_plane.partition import PartitionScheme
from event_plane.partitioned import partition_namespace

__all__ = ["MOVER_SUFFIX", "ClusterSettings", "NodeParts", "Replica", "foreign_source", "is_mover_source"]

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class ClusterSettings:
    """One advisor of a cluster.

    Attributes:
        nats_url: NATS server(s) (a cluster's URLs comma-separated, as nats-py takes them).
        redis_url: Redis for snapshots (``redis://HOST:PORT/DB``).
        advisor_id: this advisor's name (letters, digits, ``_``, ``-``).
        scheme: the partition scheme (every advisor and publisher of a cluster uses the same).
        namespace: the event namespace the partitions belong to.
        lease_ttl_s, heartbeat_s: lease time and renewal period (:class:`LeaseSettings`).
        replicas: JetStream replicas of the events stream and the lease bucket.
        snapshot_interval_s: seconds between snapshots of each owned partition.
        query_timeout_s: how long a client waits for an owner's answer.
        source_ttl_s: a source silent this long on every partition has its g1/g2 blocks
            dropped (:mod:`advisor.cluster.expiry`); ``0`` = never.
        quota_max_sources / quota_max_locations / quota_max_batch_events /
            quota_max_event_metadata_bytes / quota_max_batch_metadata_bytes /
            quota_max_source_blocks / quota_max_blocks: the state quotas each partition's
            fold applies to worker batches (:mod:`advisor.cluster.partition_fold`), with the
            names and defaults of the embedded advisor's (``AdvisorSettings``); the limits
            apply per partition replica (each partition's index on its own).
    """

    nats_url: str
    redis_url: str
    advisor_id: str
    scheme: PartitionScheme
    namespace: str = "default"
    lease_ttl_s: float = 10.0
    heartbeat_s: float = 2.0
    replicas: int = 1
    snapshot_interval_s: float = 30.0
    query_timeout_s: float = 2.0
    source_ttl_s: float = 600.0
    connect_options: dict[str, Any] = field(default_factory=dict)
    quota_max_sources: int = 10_000
    quota_max_locations: int = 256
    quota_max_batch_events: int = 65_536
    quota_max_event_metadata_bytes: int = 4096
    quota_max_batch_metadata_bytes: int = 1 << 20
    quota_max_source_blocks: int = 1 << 20
    quota_max_blocks: int = 1 << 24

    def quota_limits(self) -> QuotaLimits:
        """The state quotas of a partition's fold (no rate limit: every fold of a log must
        decide the same)."""
        return QuotaLimits(max_sources=self.quota_max_sources, max_locations=self.quota_max_locations,
                           max_batch_events=self.quota_max_batch_events,
                           max_event_metadata_bytes=self.quota_max_event_metadata_bytes,
                           max_batch_metadata_bytes=self.quota_max_batch_metadata_bytes,
                           max_source_blocks=self.quota_max_source_blocks, max_blocks=self.quota_max_blocks)

    def lease_settings(self) -> LeaseSettings:
        """The lease settings these settings imply."""
        return LeaseSettings(partitions=self.scheme.partitions, ttl_s=self.lease_ttl_s,
                             heartbeat_s=self.heartbeat_s, replicas=self.replicas)


MOVER_SUFFIX = "-mover"
"""A cluster advisor's mover publishes its moves and repairs under ``<advisor id>-mover``
(:class:`advisor.cluster.mover.ClusterMover`)."""


def is_mover_source(source: str) -> bool:
    """Whether batches of ``source`` are a cluster mover's moves or repairs (any advisor's:
    a partition's stream holds those of each of its past owners), not a worker's requests."""
    return source.endswith(MOVER_SUFFIX)


def foreign_source(head: BatchHead | None, subject: str) -> str | None:
    """Why a batch that came on ``subject`` must be refused, or ``None``.

    On NATS a batch's origin is its subject, ``kvadvisor.events.<namespace>.<source>``, and
    nats-server per-user publish permissions bind users to subjects (docs/operations.md,
    "NATS and JetStream"); a batch naming another source than its subject's is a forgery
    (or a broken publisher) and changes nothing.  Undecodable envelopes (``head`` is
    ``None``) are left to the index, which rejects and counts them."""
    if head is None:
        return None
    token = subject.rsplit(".", 1)[-1]
    if subject and head.source != token:
        return f"source {head.source[:64]!r} on subject {subject[:160]!r}"
    return None


class Replica:
    """One owned partition: its index, its stream reader and its fold thread."""

    def __init__(self, node: NodeParts, partition: int) -> None:
        s = node.settings
        self.partition = partition
        self.started_at = time.time()  # wall clock, comparable across advisors (rebuild timing)
        self.ready_at = 0.0
        self.lock = threading.Lock()
        self.snapshots = RedisSnapshotStore(s.redis_url, key_prefix=f"kvadvisor:{s.namespace}:p{partition}")
        self.snapshots_skipped = 0  # snapshots that failed to load (checksum, payload): the next older one is used

        def skipped(_position: int, _why: str) -> None:
            self.snapshots_skipped += 1

        loaded = load_latest(self.snapshots, on_skip=skipped)
        self.index = loaded[1] if loaded else PrefixIndex()
        # each batch once (a stream may hold a re-sent one twice), within the state quotas
        self.fold = PartitionFold(self.index, s.quota_limits(), trusted=is_mover_source)
        self.position = loaded[0].position if loaded else 0
        self.saved_position = self.position
        self.log = JetStreamLog(
            s.nats_url, partition_namespace(s.namespace, partition), start_seq=self.position + 1,
            stream=StreamLimits(replicas=s.replicas), durable=f"kvadvisor-{s.namespace}-p{partition}-{s.advisor_id}",
            keep_subjects=True,
            # the replicas of one lease round are made one after another (the keeper renews
            # its leases beside them): waiting for a current copy of the stream (right after a
            # NATS node restart) is kept short so the round's other partitions are served
            # soon; past the wait the fold reads from the copy it got (a warning, counted in
            # the log's ``misplaced``)
            placement_wait_s=s.lease_ttl_s * 0.1,
            connect_timeout_s=5.0, **s.connect_options)
        self.log.start()
        # answers wait until the fold has applied what the stream held for it at acquisition
        self.ready_after = self.log.pending_at_start
        self.ready = threading.Event()
        if self.ready_after == 0:
            self.ready.set()
            self.ready_at = time.time()
        self.stop_flag = threading.Event()
        self.started_mono = time.monotonic()
        self.heard: dict[str, float] = {}  # source -> monotonic s of its last batch folded here
        self.node_mover: Any = node.mover  # advisor.cluster.mover.ClusterMover, or None
        # the default policy's expert selection for this partition's policy rounds, fed the
        # worker batches this replica folds from now on (a replica rebuilt from a snapshot
        # starts its window at the snapshot); only a replica whose advisor moves blocks has one
        self.selector = new_selector(node.mover.storage.policy.selector) if node.mover is not None else None
        self.fence: Any = None  # storage_backends.Fence of this ownership (cluster mover)
        self.fenced = False  # a newer owner raised the fence: no more moves
        self.take_failed = False  # the fence could not be raised at take-over: retried (ClusterMover.raise_fence)
        self.repaired = False  # the mover compared the catalog with this index
        self.suspects: set[tuple[str, int, str]] = set()  # differences the last periodic repair saw
        self.applied = 0
        self.errors = 0
        self.read = 0
        self.origin_refused = 0
        self.lookups = 0
        self.thread = threading.Thread(target=self._fold, name=f"fold-p{partition}", daemon=True)
        self.thread.start()

    def _fold(self) -> None:
        while not self.stop_flag.is_set():
            item = self.log.get(timeout=0.1)
            if item is None:
                continue
            seq, payload = item
            subject = self.log.subject_of(seq) or ""
            with self.lock:
                try:
                    head = decode_head(payload)
                    refused = foreign_source(head, subject)
                    if refused:
                        self.origin_refused += 1
                        if self.origin_refused == 1 or self.origin_refused % 1000 == 0:
                            logger.warning("partition %d: batch at stream seq %d refused: %s (%d so far)",
                                           self.partition, seq, refused, self.origin_refused)
                    elif self.fold.apply(payload, head):
                        self.applied += 1
                        if head is not None and head.seq < EXPIRY_SEQ_BASE:  # an expiry is no sign of life
                            self.heard[head.source] = time.monotonic()
                            if self.selector is not None and not is_mover_source(head.source):
                                observe(self.selector, self.index, self.fold.admitted or decode_batch(payload))
                except Exception as exc:  # noqa: BLE001 - a bad batch is counted, never fatal
                    self.errors += 1
                    logger.warning("partition %d: batch at stream seq %d refused: %s", self.partition, seq, exc)
                self.position = seq
                self.read += 1
            if not self.ready.is_set() and self.read >= self.ready_after:
                self.ready_at = time.time()
                self.ready.set()

    def caught_up(self, timeout_s: float = 0.5) -> bool:
        """Whether the fold has applied everything the partition's log held a moment ago:
        nothing left on the server for this replica's consumer nor in its queue, and every
        entry handed out folded (a server that does not answer within ``timeout_s`` counts
        as not caught up)."""
        if not self.ready.is_set() or self.stop_flag.is_set():
            return False
        if self.log.backlog(timeout=timeout_s) != 0:
            return False
        with self.lock:
            return self.position >= self.log.handed_out

    def lookup(self, hashes: Sequence[int]) -> dict[str, Any]:
        if not self.ready.is_set():
            return {"unavailable": "rebuilding"}
        with self.lock:
            self.lookups += 1
            return {"locations": self.index.lookup(hashes), "any": self.index.lookup_any(hashes),
                    "position": self.position}

    def op(self, request: dict[str, Any]) -> dict[str, Any]:
        """``{"op": "status"}`` -> position, block count, per-source last seq;
        ``{"op": "blocks_at", "location": L}`` -> the hashes held at ``L``; ``{"op":
        "finished", "hash", "reason", "client"?}`` -> whether the selector took the finish hint (the
        other ops: :mod:`advisor.cluster.node`)."""
        if not self.ready.is_set():
            return {"unavailable": "rebuilding"}
        if request.get("op") == "volumes":
            return self._volumes(bool(request.get("usage", True)))
        with self.lock:
            if request.get("op") == "status":
                moves = self.node_mover.partition_moves(self.partition) if self.node_mover is not None else {}
                return {"moves": moves, "duplicates": self.fold.duplicates,
                        "policy": self.selector.stats() if self.selector is not None else {},
                        "position": self.position, "blocks": len(self.index), "applied": self.applied,
                        "errors": self.errors, "origin_refused": self.origin_refused,
                        "quotas": self.fold.quota_counters(),
                        "tracked_epochs": self.fold.tracked_epochs(),
                        "snapshots_skipped": self.snapshots_skipped, "started_at": self.started_at, "ready_at": self.ready_at,
                        "events": sum(st.events for st in self.index.sources().values()),
                        "sources": {name: [st.epoch, st.last_seq] for name, st in self.index.sources().items()},
                        "source_figures": {name: [st.batches, st.events, st.last_ts_ns]
                                           for name, st in self.index.sources().items()}}
            if request.get("op") == "blocks_at" and isinstance(request.get("location"), str):
                return {"position": self.position, "hashes": sorted(self.index.blocks_at(request["location"]))}
            if request.get("op") == "locations":
                st = self.index.stats()
                return {"position": self.position, "locations": dict(st["blocks_per_location"]),
                        "orphans": int(st["orphans_pending"])}
            if request.get("op") == "block" and isinstance(request.get("hash"), int):
                info = self.index.block(request["hash"])
                if info is None:
                    return {"position": self.position, "block": None}
                return {"position": self.position, "block": [info.sequence_hash, info.parent, info.prefix_hash,
                                                               info.size, sorted(info.locations), info.hits,
                                                               info.last_access_ns, info.orphan]}
            if request.get("op") == "finished":
                h, why, who = request.get("hash"), request.get("reason"), request.get("client", ANONYMOUS)
                if not (type(h) is int and 0 <= h < 1 << 64 and isinstance(why, str) and isinstance(who, str)):
                    return {"unavailable": "bad request: finished needs a u64 hash, a reason and a client name"}
                taken = (self.selector.finished([h], why[:64], client=who[:64]) if self.selector is not None
                         else False)
                return {"position": self.position, "taken": bool(taken)}
        return {"unavailable": f"bad request: unknown op {str(request.get('op'))[:40]!r}"}

    def _volumes(self, usage: bool) -> dict[str, Any]:
        """``{"op": "volumes", "usage": bool}``: the volumes this advisor's mover manages (with
        usage from the catalog when ``usage``; ``[]`` without a mover) and, per volume, the
        blocks this partition's index places there that are this partition's own
        (``ClusterMover.indexed_counts``), so the counts of all partitions add up to the
        blocks indexed there."""
        mover = self.node_mover
        if mover is None:
            return {"position": self.position, "volumes": [], "indexed": {}}
        views = mover.volume_views() if usage else []
        with self.lock:
            indexed = mover.indexed_counts(self)
            position = self.position
        return {"position": position, "volumes": views, "indexed": indexed}

    def snapshot(self) -> None:
        with self.lock:
            if self.position == self.saved_position:
                return
            payload, pos = encode_index(self.index), self.position
        self.snapshots.save(make_snapshot(pos, payload))
        self.saved_position = pos

    def stop(self, save: bool) -> None:
        self.stop_flag.set()
        self.thread.join(10)
        self.log.close()
        if save:
            try:
                self.snapshot()
            except Exception as exc:  # noqa: BLE001 - the next owner folds a longer tail
                logger.warning("partition %d: final snapshot failed: %s", self.partition, exc)
        self.snapshots.close()


class NodeParts(Protocol):
    """What a replica, the cluster mover, the expiry and the metrics use of their node.

    Attributes:
        settings: the node's settings.
        mover: the node's ``ClusterMover``, ``None`` without storage.
        keeper: the lease keeper, ``None`` before the node started.
    """

    settings: ClusterSettings
    mover: Any
    keeper: LeaseKeeper | None

    @property
    def nats(self) -> Any:
        """The node's NATS connection (``nats.aio.client.Client``), ``None`` before start."""

    def stopping(self) -> bool:
        """Whether :meth:`ClusterNode.stop` was asked."""

    def serving(self) -> dict[int, Replica]:
        """The replicas the node serves now (rebuilt), by partition."""

    def owned(self) -> frozenset[int]:
        """Partitions the node serves now."""

    def status(self) -> dict[str, Any]:
        """The node's status (``ClusterNode.status``)."""
