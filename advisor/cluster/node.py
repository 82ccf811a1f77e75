"""Scaled mode: advisors that each own partitions of the prefix index (docs/design.md §8).

Pieces, all on the engines the project already runs (no home-made consensus or queue):

* **Log.**  Partition ``k`` of namespace ``NS`` is the JetStream namespace ``NS-p<k>``
  (:func:`event_plane.partitioned.partition_namespace`) in the replicated
  ``KVADVISOR_EVENTS`` stream; publishers route events there with
  :class:`event_plane.partitioned.PartitionedPublisher`.
* **Ownership.**  :class:`~advisor.cluster.leases.LeaseKeeper` leases in a JetStream KV bucket.
* **State.**  On acquiring partition ``k`` an advisor loads the newest snapshot of ``k``
  from Redis (:class:`~advisor.index.snapshot.RedisSnapshotStore`, key prefix
  ``kvadvisor:<NS>:p<k>``), then folds the stream tail after the snapshot's stream sequence
  through a durable pull consumer with explicit acks (``kvadvisor-<NS>-p<k>-<advisor id>``:
  one per owner, so an old owner still stopping never takes messages from the new owner's
  consumer; an abandoned one is removed by the server after 60 s without a reader).  It saves a
  snapshot every ``snapshot_interval_s`` and when it hands the partition over.
* **Origins.**  A batch whose source is not its subject's last token is refused and
  counted (``origin_refused`` in the status): the subject is the origin, and nats-server
  permissions decide who may publish on it.
* **Queries.**  The owner of ``k`` answers NATS requests on ``kvadvisor.query.<NS>.p<k>``
  (a subscription it holds only while it owns ``k``), so a lookup reaches the owner
  whoever it is; with no owner (a take-over in progress) NATS answers "no responders" at
  once and :class:`ClusterClient` raises :class:`PartitionUnavailable` (the API's 503 with
  ``Retry-After``).  An owner still folding the tail it found at acquisition answers
  ``unavailable`` too, so an answer is never older than the log was when the owner took
  over.  Every answer carries the stream sequence it reflects (``position``).  Once the
  event stream is found deleted, every answer is ``unavailable`` (:meth:`ClusterNode._stream_watch`).

Wire format of a query (MessagePack): a lookup is an array of u64 sequence hashes (one
piece of a chain), answered ``{"locations": {location: n}, "position": int}``;
``{"op": "status"}`` is answered ``{"position", "blocks", "applied", "errors", "origin_refused",
"snapshots_skipped" (snapshots that failed to load when the owner took it), "events", "moves" (the
mover's results for this partition since its owner took it, ``ClusterMover.partition_moves``), "policy"
(the partition's expert selection, ``LiveSelector.stats``; ``{}`` without a mover),
"started_at", "ready_at" (wall-clock s: when the owner took the partition and when its
rebuild was done), "sources": {source: [epoch, last_seq]}, "source_figures": {source: [batches,
events, last_ts_ns]} (what this partition applied of each source)}``; ``{"op": "blocks_at", "location": L}`` is answered
``{"position", "hashes": [...]}``; ``{"op": "locations"}`` ``{"position", "locations":
{location: blocks}, "orphans"}``; ``{"op": "block", "hash": h}`` ``{"position", "block":
[hash, parent, prefix, size, locations, hits, last_access_ns, orphan] or null}``;
``{"op": "volumes", "usage": bool}`` ``{"position", "volumes": [{"id", "kind", "media",
"capacity_bytes", "role", "stats"}] (the owner's mover's volumes, usage from the catalog;
``[]`` when ``usage`` is false or the owner runs no mover), "indexed": {volume: blocks of this
partition placed there, a trunk block in partition sequence_hash % P only}}``;
``{"op": "finished", "hash": h, "reason": r, "client": c}`` (a router's finish hint for the
request whose prompt ends at block ``h``, ``LiveSelector.finished``; ``client``, optional, the
API token's digest whose share of the hint quota it counts in) ``{"position", "taken": bool}``
(``false`` without a mover).  A lookup
answer also carries ``"any"``: the leading blocks held at some location.  Any of them may be answered ``{"unavailable": reason}``.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from typing import Any

import msgspec
from nats.errors import NoRespondersError
from nats.errors import TimeoutError as NatsTimeoutError

from advisor.cluster.parts import ClusterSettings, Replica
from advisor.cluster.leases import LeaseKeeper
from event_plane.nats_auth import redact_url
from event_plane.nats_transport import STREAM_NAME, connect_nats
from event_plane.partition import PartitionScheme, combine_lookups

__all__ = ["ClusterClient", "ClusterNode", "ClusterSettings", "PartitionUnavailable", "query_subject"]

logger = logging.getLogger(__name__)
_enc = msgspec.msgpack.Encoder()
_dec = msgspec.msgpack.Decoder()


def query_subject(namespace: str, partition: int) -> str:
    """NATS subject the owner of ``partition`` answers lookups on."""
    return f"kvadvisor.query.{namespace}.p{partition}"


class PartitionUnavailable(RuntimeError):
    """No advisor answers for a partition now (a take-over or a rebuild in progress).

    Attributes:
        partition: the partition.
        retry_after_s: seconds after which asking again is worthwhile (the lease TTL).
    """

    def __init__(self, partition: int, reason: str, retry_after_s: float) -> None:
        super().__init__(f"partition {partition} unavailable: {reason}")
        self.partition = partition
        self.retry_after_s = retry_after_s


class ClusterNode:
    """An advisor of a cluster: leases, partition replicas, query answers, snapshots.

    Raises (from :meth:`start`): LeaseError, JetStreamLogError, SnapshotError when NATS,
    the stream or Redis cannot be used; StorageError (``storage_backends``) when the
    storage settings name a catalog or volume that cannot be opened (an S3 endpoint that
    does not answer, a bucket name S3 refuses, a root outside ``volume_roots``): nothing
    is left open then.
    """

    def __init__(self, settings: ClusterSettings, storage: Any = None) -> None:
        self.settings = settings
        self.storage = storage  # advisor.cluster.mover.ClusterStorageSettings, or None: no mover
        self.mover: Any = None
        self.replicas: dict[int, Replica] = {}
        self._lock = threading.Lock()
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name=f"cluster-{settings.advisor_id}",
                                         daemon=True)
        self._nc: Any = None
        self._subs: dict[int, Any] = {}
        self._stop = threading.Event()
        self._snapshotter: threading.Thread | None = None
        self._policy: threading.Thread | None = None
        self.expiry: Any = None  # advisor.cluster.expiry.ClusterExpiry when source_ttl_s > 0
        self.keeper: LeaseKeeper | None = None
        self.stream_missing = False  # the event stream was found deleted (sticky: _stream_watch)

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> ClusterNode:
        """Connect, join the lease table and start serving the partitions it gets."""
        s = self.settings
        self._thread.start()
        if self.storage is not None:
            from advisor.cluster.mover import ClusterMover

            try:
                self.mover = ClusterMover(self, self.storage)
            except BaseException:
                self._loop.call_soon_threadsafe(self._loop.stop)
                self._thread.join(5)
                raise
        self._nc = self._call(connect_nats(s.nats_url, 5.0, dict(s.connect_options)), 15)
        self.keeper = LeaseKeeper(s.nats_url, s.advisor_id, s.lease_settings(), on_acquire=self._acquire,
                                  on_release=self._release, connect_options=dict(s.connect_options))
        self.keeper.start()
        self._snapshotter = threading.Thread(target=self._snapshot_loop, name="snapshots", daemon=True)
        self._snapshotter.start()
        threading.Thread(target=self._stream_watch, name="stream-watch", daemon=True).start()
        if self.mover is not None:
            self._policy = threading.Thread(target=self._policy_loop, name="policy", daemon=True)
            self._policy.start()
        if s.source_ttl_s > 0:
            from advisor.cluster.expiry import ClusterExpiry

            self.expiry = ClusterExpiry(self, s.source_ttl_s, self._call)
            threading.Thread(target=self._expiry_loop, name="expiry", daemon=True).start()
        logger.info("cluster advisor %s up at %s", s.advisor_id, redact_url(s.nats_url))
        return self

    def stop(self) -> None:
        """Hand every partition over (final snapshots), leave, and disconnect."""
        self._stop.set()
        if self._policy is not None:  # no move after the leases go: the round in progress ends first
            self._policy.join(120)
        if self.mover is not None:
            # the leases are still held: leave each partition's log matching the catalog
            # (ClusterMover.repair_before_stop), then flush and close the publishers
            try:
                self.mover.repair_before_stop(max(2.0, self.settings.lease_ttl_s))
            except Exception as exc:  # noqa: BLE001 - stopping: the next owner repairs on take-over
                logger.warning("advisor %s: last repairs before the stop failed: %s: %s", self.settings.advisor_id,
                               type(exc).__name__, exc)
            self.mover.close()
        if self.keeper is not None:
            self.keeper.stop()
        with self._lock:
            left = list(self.replicas)
        for p in left:
            self._release(p, "stop")
        if self._nc is not None:
            try:
                self._call(self._nc.close(), 5)
            except Exception:  # noqa: BLE001 - stopping
                pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)

    @property
    def nats(self) -> Any:
        """The node's NATS connection, ``None`` before :meth:`start`."""
        return self._nc

    def stopping(self) -> bool:
        """Whether :meth:`stop` was asked."""
        return self._stop.is_set()

    def serving(self) -> dict[int, Replica]:
        """The replicas this advisor serves now (rebuilt), by partition."""
        with self._lock:
            return {p: r for p, r in self.replicas.items() if r.ready.is_set()}

    def owned(self) -> frozenset[int]:
        """Partitions this advisor serves now."""
        with self._lock:
            return frozenset(p for p, r in self.replicas.items() if r.ready.is_set())

    def status(self) -> dict[str, Any]:
        """``{"advisor", "partitions": {k: {"position", "blocks", "applied", "errors", "lookups", "ready",
        "fenced", "quotas"}}}`` (``quotas``: the fold's quota counters, ``QuotaGuard.as_dict``)."""
        with self._lock:
            reps = dict(self.replicas)
        parts = {}
        for p, r in sorted(reps.items()):
            with r.lock:
                parts[p] = {"position": r.position, "blocks": len(r.index), "applied": r.applied,
                            "errors": r.errors, "lookups": r.lookups, "ready": r.ready.is_set(),
                            "fenced": r.fenced,
                            "quotas": r.fold.quota_counters()}
        out: dict[str, Any] = {"advisor": self.settings.advisor_id, "partitions": parts}
        if self.mover is not None:
            out["mover"] = self.mover.status()
        return out

    # ------------------------------------------------------------------ leases
    def _acquire(self, p: int) -> bool:
        """Serve partition ``p`` (keeper callback); ``False`` hands the lease back."""
        if self.stopping():
            return False
        try:
            rep = Replica(self, p)
        except Exception as exc:  # noqa: BLE001 - without a replica the lease is useless: give it back
            logger.error("advisor %s: cannot serve partition %d (lease handed back): %s",
                         self.settings.advisor_id, p, exc)
            return False
        if self.stopping():  # stop() may have swept the replicas while this one opened
            rep.stop(save=False)
            return False
        if self.mover is not None:
            self.mover.raise_fence(rep)  # on failure: lookups only, retried by later rounds
        with self._lock:
            self.replicas[p] = rep
        try:
            self._subs[p] = self._call(self._nc.subscribe(query_subject(self.settings.namespace, p),
                                                          cb=self._answerer(p)), 10)
        except Exception as exc:  # noqa: BLE001 - nobody could ask it: give the lease back
            logger.error("advisor %s: cannot answer for partition %d (lease handed back): %s",
                         self.settings.advisor_id, p, exc)
            with self._lock:
                self.replicas.pop(p, None)
            rep.stop(save=False)
            return False
        return True

    def _release(self, p: int, reason: str) -> None:
        sub = self._subs.pop(p, None)
        if sub is not None:
            try:
                self._call(sub.unsubscribe(), 5)
            except Exception:  # noqa: BLE001 - the connection may be gone
                pass
        with self._lock:
            rep = self.replicas.pop(p, None)
        if rep is not None:
            rep.stop(save=reason != "lost")

    def _answerer(self, p: int) -> Any:
        async def answer(msg: Any) -> None:
            with self._lock:
                rep = self.replicas.get(p)
            try:
                req = _dec.decode(msg.data)
                if rep is None:
                    body = {"unavailable": "released"}
                elif self.stream_missing:
                    # the fold reads nothing any more: answers would go stale without a sign
                    body = {"unavailable": f"event stream {STREAM_NAME} missing"}
                elif isinstance(req, dict):
                    body = rep.op(req)
                else:
                    body = rep.lookup(req)
            except Exception as exc:  # noqa: BLE001 - a malformed request gets an error answer
                body = {"unavailable": f"bad request: {type(exc).__name__}"}
            await msg.respond(_enc.encode(body))
        return answer

    def _expiry_loop(self) -> None:
        """Dead-source expiry of the served partitions (:mod:`advisor.cluster.expiry`)."""
        assert self.expiry is not None
        step = min(max(self.settings.source_ttl_s / 10.0, 0.2), 5.0)
        while not self._stop.wait(step):
            try:
                self.expiry.run_once()
            except Exception as exc:  # noqa: BLE001 - retried next pass
                logger.warning("advisor %s: source expiry failed: %s: %s", self.settings.advisor_id,
                               type(exc).__name__, exc)

    def _policy_loop(self) -> None:
        """Repairs of newly taken partitions at once, policy rounds every ``policy_interval_s``."""
        interval = self.storage.policy_interval_s
        last = time.monotonic()
        while not self._stop.wait(0.5):
            due = interval > 0 and time.monotonic() - last >= interval
            pending = any(not r.repaired and not r.fenced for r in self.serving().values())
            if not (due or pending):
                continue
            try:
                if due:
                    last = time.monotonic()
                    self.mover.run_round()
                else:
                    self.mover.run_repairs()
            except Exception as exc:  # noqa: BLE001 - retried next round
                logger.warning("advisor %s: policy round failed: %s: %s", self.settings.advisor_id,
                               type(exc).__name__, exc)

    def _stream_watch(self) -> None:
        """Every ``heartbeat_s``: whether the event stream exists (3 answers "not found" in a
        row, while this advisor owns a partition, mean it is gone).  A deleted stream (only
        someone with the advisor's NATS rights can delete it, docs/security.md) takes every
        fold's consumer with it, and a stream made again restarts its sequence numbers, so
        the folds never read again: from then on each partition this advisor owns answers
        ``unavailable`` (the cluster API's health is 503) until the advisor is restarted
        (it then rebuilds from the snapshots and the new stream).  Logged as an error once."""
        from nats.js.errors import NotFoundError

        not_found = 0  # answers "not found" in a row: 3 are needed (never a fail-over's blip)
        while not self._stop.wait(self.settings.heartbeat_s) and not self.stream_missing:
            with self._lock:
                owning = bool(self.replicas)  # each replica's log made sure the stream existed
            if not owning:
                continue  # the first replica creates it: missing before that is no loss
            try:
                self._call(self._nc.jetstream(timeout=5).stream_info(STREAM_NAME), 10)
                not_found = 0
            except NotFoundError:
                not_found += 1
                if not_found < 3:
                    continue
                self.stream_missing = True
                logger.error("advisor %s: event stream %s is missing: every partition of this advisor answers "
                             "unavailable until it is restarted", self.settings.advisor_id, STREAM_NAME)
            except Exception:  # noqa: BLE001 - NATS unreachable now: not known to be missing
                continue

    def _snapshot_loop(self) -> None:
        while not self._stop.wait(self.settings.snapshot_interval_s):
            with self._lock:
                reps = list(self.replicas.values())
            for r in reps:
                try:
                    r.snapshot()
                except Exception as exc:  # noqa: BLE001 - retried next round
                    logger.warning("partition %d: snapshot failed: %s", r.partition, exc)

    def _call(self, coro: Any, timeout: float) -> Any:
        return asyncio.run_coroutine_threadsafe(coro, self._loop).result(timeout)


class ClusterClient:
    """Asks a cluster for longest-prefix lookups (the API's and routers' side).

    Args:
        nats_url: NATS server(s).
        scheme: the cluster's partition scheme.
        namespace: the event namespace.
        timeout_s: how long to wait for an owner's answer.
        retry_after_s: the ``retry_after_s`` given with :class:`PartitionUnavailable`.
    """

    def __init__(self, nats_url: str, scheme: PartitionScheme, namespace: str = "default",
                 timeout_s: float = 2.0, retry_after_s: float = 2.0, **connect_options: Any) -> None:
        self.scheme, self.namespace = scheme, namespace
        self.timeout_s, self.retry_after_s = timeout_s, retry_after_s
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, name="cluster-client", daemon=True)
        self._thread.start()
        self._nc = asyncio.run_coroutine_threadsafe(
            connect_nats(nats_url, 5.0, connect_options), self._loop).result(15)
        self.positions: dict[int, int] = {}

    def ask(self, partition: int, hashes: Sequence[int]) -> tuple[dict[str, int], int]:
        """One partition's answer for one piece: ``(locations, position)``.

        Raises:
            PartitionUnavailable: no owner, an owner still rebuilding, or no answer in time.
        """
        body = self._request(partition, list(hashes))
        try:
            return {str(k): int(v) for k, v in body["locations"].items()}, int(body["position"])
        except (KeyError, TypeError, ValueError, AttributeError):
            raise PartitionUnavailable(partition, "malformed answer", self.retry_after_s) from None

    def _request(self, partition: int, body: Any) -> dict[str, Any]:
        async def req() -> Any:
            return await self._nc.request(query_subject(self.namespace, partition), _enc.encode(body),
                                          timeout=self.timeout_s)
        try:
            msg = asyncio.run_coroutine_threadsafe(req(), self._loop).result(self.timeout_s + 5)
        except NoRespondersError:
            raise PartitionUnavailable(partition, "no owner", self.retry_after_s) from None
        except (NatsTimeoutError, asyncio.TimeoutError, TimeoutError):
            raise PartitionUnavailable(partition, "no answer in time", self.retry_after_s) from None
        try:
            out = _dec.decode(msg.data)
        except (msgspec.DecodeError, RecursionError, ValueError):
            out = None
        if not isinstance(out, dict):
            # whoever may answer on the query subject sent something else than an answer
            # (with NATS authorization only advisors can: docs/security.md)
            raise PartitionUnavailable(partition, "malformed answer", self.retry_after_s)
        if "unavailable" in out:
            raise PartitionUnavailable(partition, str(out["unavailable"]), self.retry_after_s)
        return out

    def status(self) -> dict[int, dict[str, Any]]:
        """Every partition's status (``{"op": "status"}`` answer), by partition.

        Raises:
            PartitionUnavailable: a partition has no owner serving now.
        """
        return {p: self._request(p, {"op": "status"}) for p in range(self.scheme.partitions)}

    def blocks_at(self, location: str) -> set[int]:
        """Sequence hashes held at ``location`` across every partition.

        Raises:
            PartitionUnavailable: a partition has no owner serving now.
        """
        out: set[int] = set()
        for p in range(self.scheme.partitions):
            out.update(self._request(p, {"op": "blocks_at", "location": location})["hashes"])
        return out

    def locations(self) -> list[dict[str, int]]:
        """Each partition's blocks per location (trunk blocks appear in every partition).

        Raises:
            PartitionUnavailable: a partition has no owner serving now.
        """
        return [self._request(p, {"op": "locations"})["locations"] for p in range(self.scheme.partitions)]

    def volumes(self) -> tuple[list[dict[str, Any]], dict[str, int]]:
        """``(volumes, indexed)``: the volumes the cluster advisors' movers manage (the first
        partition whose owner runs a mover describes them, usage read from the shared
        catalog) and, per volume, the blocks the partitions place there (each block once).

        Raises:
            PartitionUnavailable: a partition has no owner serving now.
        """
        views: list[dict[str, Any]] = []
        indexed: dict[str, int] = {}
        for p in range(self.scheme.partitions):
            body = self._request(p, {"op": "volumes", "usage": not views})
            if not views:
                views = [dict(v) for v in body.get("volumes", [])]
            for vol, n in body.get("indexed", {}).items():
                indexed[str(vol)] = indexed.get(str(vol), 0) + int(n)
        return views, indexed

    def block(self, sequence_hash: int) -> list[Any] | None:
        """What the partitions know of one block (the first that has it), or ``None``.

        Raises:
            PartitionUnavailable: a partition has no owner serving now.
        """
        for p in range(self.scheme.partitions):
            got = self._request(p, {"op": "block", "hash": int(sequence_hash)})["block"]
            if got is not None:
                return list(got)
        return None

    def finished(self, hashes: Sequence[int], finish_reason: str, client: str | None = None) -> bool:
        """Hand a router's finish hint (the prompt ``hashes``, first block first, and how it
        ended) to the partitions whose selectors saw the request: the owner of the prompt's
        last piece, or every partition when the whole prompt is trunk (each keeps the trunk);
        whether one of them took it (``False`` for an empty prompt).  ``client`` names whose
        share of the selectors' hint quota it counts in (``None``: the anonymous client).
        Every partition it goes to is asked, even after one was unavailable, so an all-trunk
        hint reaches every partition serving now; a retry after the error gives the others
        the same hint again, which replaces theirs (one hint per prompt).

        Raises:
            PartitionUnavailable: a partition the hint goes to has no owner serving now (the
                first such one, after the others were asked).
        """
        if not hashes:
            return False
        last = self.scheme.pieces(hashes)[-1].partition
        targets = [last] if last >= 0 else list(range(self.scheme.partitions))
        op: dict[str, Any] = {"op": "finished", "hash": int(hashes[-1]), "reason": str(finish_reason)[:64]}
        if client is not None:
            op["client"] = str(client)[:64]
        taken, missed = False, None
        for p in targets:
            try:
                taken = bool(self._request(p, op).get("taken")) or taken
            except PartitionUnavailable as exc:
                missed = missed or exc
        if missed is not None:
            raise missed
        return taken

    def lookup_full(self, hashes: Sequence[int]) -> tuple[dict[str, int], int]:
        """``(per location, any location)``: :meth:`lookup`'s answer and the number of
        leading blocks held at some location (locations may differ per block);
        :attr:`positions` then holds the stream sequence each asked partition answered at.

        Raises:
            PartitionUnavailable: a partition the answer needs has no owner serving now.
        """
        pieces = self.scheme.pieces(hashes)
        trunk_owner = next((pc.partition for pc in pieces if pc.partition >= 0), 0)
        answers, done, any_n = [], [], 0
        any_alive = True
        self.positions = {}
        for pc in pieces:
            owner = trunk_owner if pc.partition < 0 else pc.partition
            body = self._request(owner, list(hashes[pc.start:pc.end]))
            try:
                self.positions[owner] = int(body["position"])
                locs = {str(k): int(v) for k, v in body["locations"].items()}
                int(body["any"])
            except (KeyError, TypeError, ValueError, AttributeError):
                raise PartitionUnavailable(owner, "malformed answer", self.retry_after_s) from None
            answers.append(locs)
            done.append(pc)
            if any_alive:
                any_n += int(body["any"])
                any_alive = int(body["any"]) == pc.end - pc.start
            if not any_alive and not any(n == pc.end - pc.start for n in locs.values()):
                break
        return combine_lookups(done, answers), any_n

    def lookup(self, hashes: Sequence[int]) -> dict[str, int]:
        """Longest cached prefix of a chain at each location, across the cluster
        (``PrefixIndex.lookup``'s answer); :attr:`positions` then holds the stream
        sequence each asked partition answered at.

        Raises:
            PartitionUnavailable: a partition the answer needs has no owner serving now.
        """
        return self.lookup_full(hashes)[0]

    def call(self, fn: Callable[[Any], Awaitable[Any]], timeout_s: float) -> Any:
        """Run ``fn(nats connection)`` on the client's event loop and return its result
        (:mod:`advisor.cluster.api_state` keeps the API's state through it).

        Raises:
            TimeoutError: no result within ``timeout_s`` seconds; else what ``fn`` raises.
        """
        return asyncio.run_coroutine_threadsafe(fn(self._nc), self._loop).result(timeout_s)

    def close(self) -> None:
        """Disconnect."""
        try:
            asyncio.run_coroutine_threadsafe(self._nc.close(), self._loop).result(5)
        except Exception:  # noqa: BLE001 - closing
            pass
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(5)


def wait_until(cond: Any, timeout_s: float, step_s: float = 0.1) -> bool:
    """Poll ``cond()`` until true or ``timeout_s`` passes; returns the last value."""
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if cond():
            return True
        time.sleep(step_s)
    return bool(cond())


_QUOTA_FIELDS = ("quota_max_sources", "quota_max_locations", "quota_max_batch_events", "quota_max_event_metadata_bytes",
                 "quota_max_batch_metadata_bytes", "quota_max_source_blocks", "quota_max_blocks")
"""The :class:`ClusterSettings` state quotas, each a ``--quota-max-...`` option."""


def _positive_int(text: str) -> int:
    import argparse

    try:
        n = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if n < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1: {n}")
    return n


def main(argv: Sequence[str] | None = None) -> int:
    """Run one cluster advisor until SIGTERM/SIGINT (``python -m advisor.cluster --help``)."""
    import argparse
    import os
    import signal
    import sys

    ap = argparse.ArgumentParser(prog="python -m advisor.cluster", description="one advisor of a scaled cluster")
    ap.add_argument("--nats", default=os.environ.get("KVADVISOR_CLUSTER_NATS_URL"),
                    help="NATS URL(s), comma-separated, each may carry user:password@ (default: "
                         "$KVADVISOR_CLUSTER_NATS_URL, which keeps a password off the command line)")
    ap.add_argument("--redis", default=os.environ.get("KVADVISOR_CLUSTER_REDIS_URL"),
                    help="redis://[:PASSWORD@]HOST:PORT/DB for snapshots (default: $KVADVISOR_CLUSTER_REDIS_URL, "
                         "which keeps a password off the command line)")
    ap.add_argument("--id", required=True, help="this advisor's name")
    ap.add_argument("--namespace", default="default")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--trunk-depth", type=int, default=1)
    ap.add_argument("--stretch", type=int, default=64)
    ap.add_argument("--lease-ttl", type=float, default=10.0)
    ap.add_argument("--heartbeat", type=float, default=2.0)
    ap.add_argument("--replicas", type=int, default=1)
    ap.add_argument("--snapshot-interval", type=float, default=30.0)
    ap.add_argument("--source-ttl", type=float, default=600.0,
                    help="seconds of silence on every partition after which a source's g1/g2 blocks are dropped "
                         "(advisor.cluster.expiry); 0: never")
    quota_defaults = ClusterSettings("", "", "", PartitionScheme(1, 1, 1))
    for name in _QUOTA_FIELDS:  # the embedded advisor's names (docs/security.md "State quotas")
        env, default = f"KVADVISOR_CLUSTER_{name.upper()}", getattr(quota_defaults, name)
        ap.add_argument("--" + name.replace("_", "-"), type=_positive_int, default=os.environ.get(env, str(default)),
                        help=f"state quota of each partition's fold, per partition replica (default: ${env} or "
                             f"{default})")
    ap.add_argument("--storage", default=None,
                    help="JSON storage settings (advisor.cluster.mover.ClusterStorageSettings): run the mover "
                         "(policy rounds on the owned partitions, fenced commits in the Redis catalog); a file that "
                         "does not validate, or names storage that cannot be opened, stops the advisor at start "
                         "(exit code 2, one 'error:' line)")
    ap.add_argument("--metrics-port", type=int, default=None,
                    help="serve Prometheus /metrics on this port (advisor.cluster.metrics); off when not given")
    ap.add_argument("--metrics-host", default="127.0.0.1",
                    help="address of /metrics (no authentication: 0.0.0.0 only inside a private network)")
    a = ap.parse_args(argv)
    if not a.nats:
        ap.error("--nats or KVADVISOR_CLUSTER_NATS_URL is required")
    if not a.redis:
        ap.error("--redis or KVADVISOR_CLUSTER_REDIS_URL is required")
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    storage = None
    if a.storage:
        from advisor.cluster.mover import ClusterStorageSettings
        from advisor.settings import SettingsError

        try:
            storage = ClusterStorageSettings.load(a.storage)
        except SettingsError as exc:
            print(f"error: {exc}", file=sys.stderr)
            return 2
    from storage_backends import StorageError

    try:
        node = ClusterNode(ClusterSettings(
            nats_url=a.nats, redis_url=a.redis, advisor_id=a.id, namespace=a.namespace,
            scheme=PartitionScheme(a.partitions, a.trunk_depth, a.stretch), lease_ttl_s=a.lease_ttl,
            heartbeat_s=a.heartbeat, replicas=a.replicas, snapshot_interval_s=a.snapshot_interval,
            source_ttl_s=a.source_ttl, **{name: getattr(a, name) for name in _QUOTA_FIELDS}), storage).start()
    except StorageError as exc:  # storage that validates but cannot be opened: one line, as a bad file
        print(f"error: cluster storage {a.storage}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return 2
    metrics_url = None
    if a.metrics_port is not None:
        from advisor.cluster.metrics import serve_cluster_metrics

        metrics_url = serve_cluster_metrics(node, a.metrics_port, a.metrics_host)
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, lambda *_: done.set())
    print(f"advisor {a.id} ready", flush=True)
    if metrics_url is not None:
        print(f"advisor {a.id} metrics at {metrics_url}", flush=True)
    done.wait()
    node.stop()
    if node.mover is not None:  # what this advisor's mover did, for operators and drills
        import json

        print(f"advisor {a.id} stopped: mover {json.dumps(node.mover.status()['counters'], sort_keys=True)}",
              flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
