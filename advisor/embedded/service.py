"""AdvisorService: ingest → journal → PrefixIndex, policy rounds → planner → mover, REST API.

Threads:
    * ``ingest``: ``subscriber.get`` → :meth:`AdvisorService.ingest` (journal, then apply);
    * ``policy``: every ``policy_interval_s``, :meth:`AdvisorService.run_policies_once`;
    * ``expiry``: drops the ``g1``/``g2`` of sources silent for ``source_ttl_s``
      (:meth:`AdvisorService.expire_sources`, :mod:`advisor.ingest.source_expiry`);
    * ``gc``: every ``gc_interval_s``, :meth:`AdvisorService.collect_garbage` (crash leftovers);
    * ``prefetch``: lookups taken as prefetch hints become promotions to the fast volume
      (:mod:`advisor.moves.prefetch`, through :meth:`AdvisorService.execute_items`);
    * the API server (uvicorn), loaded by name from ``settings.api_factory``.

One re-entrant *state lock* orders journal appends and index updates, so the journal
order is exactly the apply order and a replay of the journal rebuilds the same index.
The advisor's own events (moves) go through its publisher, whose ``on_flush`` callback
calls :meth:`ingest` as well.  Lock order: publisher lock → state lock; the service
never calls into the publisher while holding the state lock.
"""

from __future__ import annotations

import importlib
import logging
import sqlite3
import threading
import time
from collections import deque
from collections.abc import Callable
from dataclasses import asdict
from typing import Any

from advisor.index.prefix_index import PLACEMENT_KEYS, BlockInfo, PrefixIndex
from advisor.ingest.journal import BadPayloadError, JournalError, SqliteJournal
from advisor.embedded.metrics import AdvisorMetrics
from advisor.moves.move_guard import MoveGuard
from advisor.moves.mover import Mover
from advisor.embedded.owner_lock import OwnedError, OwnerLock
from advisor.policy.plan import PlanKind, PlanResult, PlanStatus
from advisor.moves.planner import Planner
from advisor.policy.policies import PolicyInput, VolumeUsage, plan_all
from advisor.ops.query import AdvisorQuery
from advisor.ingest.quotas import QuotaGuard
from advisor.embedded.run_state import RunStateStore
from advisor.moves.prefetch import PrefetchCollector, Prefetcher
from advisor.policy.eviction.live_scoring import FinishView
from advisor.policy.live_selection import leader_for, new_selector, observe
from advisor.settings import AdvisorSettings
from advisor.ingest.source_expiry import due, expiry_batch, private_blocks
from advisor.index.snapshot import (
    RedisSnapshotStore,
    SnapshotStore,
    SqliteSnapshotStore,
    encode_index,
    load_latest,
    make_snapshot,
)
from advisor.embedded.volume_backoff import FullVolumeBackoff
from event_plane.codec import CodecError, decode_batch, encode_batch
from event_plane.schema import EventBatch, remove, store

logger = logging.getLogger(__name__)


class AdvisorError(RuntimeError):
    """The advisor cannot start or was used in the wrong state."""


def _open_file(what: str, path: object, factory: Any, *args: Any, **kw: Any) -> Any:
    """``factory(*args, **kw)``, turning OS / SQLite errors into one AdvisorError naming the file."""
    try:
        return factory(*args, **kw)
    except (OSError, sqlite3.Error) as exc:
        raise AdvisorError(f"cannot open the {what} at {path}: {type(exc).__name__}: {exc}") from exc


class RateMeter:
    """Events per second over a sliding window of ``window_s`` seconds (not thread-safe),
    and the ingest capacity: events per second of time actually spent ingesting."""

    def __init__(self, window_s: float = 10.0) -> None:
        self.window_s = window_s
        self._samples: deque[tuple[float, int]] = deque()  # (monotonic time, total before)
        self.total = 0
        self.busy_s = 0.0

    def busy_rate(self) -> float:
        """Events per second of ingest work (journal + apply), idle time excluded."""
        return self.total / self.busy_s if self.busy_s > 0 else 0.0

    def add(self, n: int, busy_s: float = 0.0) -> None:
        """Count ``n`` more events now, which took ``busy_s`` seconds to ingest."""
        self.busy_s += busy_s
        now = time.monotonic()
        if not self._samples or now - self._samples[-1][0] >= 0.25:
            self._samples.append((now, self.total))
            self._prune(now)
        self.total += n

    def _prune(self, now: float) -> None:
        while len(self._samples) > 1 and now - self._samples[1][0] >= self.window_s:
            self._samples.popleft()

    def rate(self) -> float:
        """Events per second over the last ``window_s`` seconds (at least 1 s is assumed)."""
        now = time.monotonic()
        self._prune(now)
        if not self._samples:
            return 0.0
        t0, n0 = self._samples[0]
        if now - t0 > 2 * self.window_s:
            return 0.0
        return (self.total - n0) / max(now - t0, 1.0)


class AdvisorService:
    """The advisor: event-sourced prefix index plus tiering policies over the volumes.

    Args:
        settings: :class:`AdvisorSettings`.

    Use ``start()`` then ``run_forever()`` (blocks until ``stop()``), or ``start()`` and
    ``stop()`` around a test.
    """

    def __init__(self, settings: AdvisorSettings) -> None:
        self.settings = settings
        self.index = PrefixIndex()
        self.lock = threading.RLock()
        self._round_lock = threading.Lock()
        self.journal: SqliteJournal | None = None
        self.run_state: RunStateStore | None = None
        self._journal_lock: OwnerLock | None = None
        self.catalog: Any = None
        self.agent: Any = None
        self.publisher: Any = None
        self.subscriber: Any = None
        self.mover: Mover | None = None
        self.prefetcher: Prefetcher | None = None
        self.planner = Planner(settings.policy.planner)
        self.selector = new_selector(settings.policy.selector)
        """The default policy's expert selection, fed the requests of the event stream
        (:class:`advisor.policy.eviction.experts.LiveSelector`); each policy round ranks by its leader."""
        self.move_guard = MoveGuard(settings.policy.planner.min_move_interval_s, self._last_access)
        self._heard: dict[str, float] = {}  # source -> monotonic time of its last batch received
        self.full_backoff = FullVolumeBackoff(settings.full_backoff_s, settings.full_backoff_max_s)
        self.api: Any = None
        self.metrics = AdvisorMetrics(self._metrics_snapshot, max_locations=settings.metrics_max_locations,
                                      keep_locations=[v.id for v in settings.volumes])
        self.plans: deque[PlanResult] = deque(maxlen=1000)
        self.position = 0
        self.snapshots: SnapshotStore | None = None
        self.stream_log: Any = None
        self._snap_lock = threading.Lock()
        self._snapshot_position = 0
        self._batches_since_snapshot = 0
        self._last_snapshot_t = time.monotonic()
        self.counters: dict[str, int] = {
            "replayed_batches": 0,
            "ingested_batches": 0,
            "duplicate_batches": 0,
            "bad_batches": 0,
            "journal_skipped": 0,
            "policy_rounds": 0,
            "plans_deferred": 0,
            "reconciled_events": 0,
            "snapshots_taken": 0,
            "snapshot_failures": 0,
            "snapshot_position": 0,
            "snapshot_loaded_position": 0,
            "log_discarded": 0,
            "reserved_source_refused": 0,
            "origin_refused": 0,
            "moves_held_back": 0,
            "moves_held_back_draining": 0,
            "sources_expired": 0,
            "journal_failures": 0,
            "gc_segments_removed": 0,
            "registrations_dropped": 0,
            "ingest_restarts": 0,
            "snapshots_skipped": 0,
        }
        self._ingest_thread: threading.Thread | None = None
        self.runtime_volumes: dict[str, tuple[Any, str]] = {}
        """Volumes registered at run time (``advisor.ops.volume_admin``): id -> (settings, role);
        kept in the run state and registered again at start."""
        self.draining: set[str] = set()
        """Volumes being drained (``advisor.ops.drain``): policy rounds move nothing onto them
        and compact nothing on them; kept in the run state."""
        self.namespace_counts: dict[str, dict[str, int]] = {}
        """The catalog's placements per key namespace and volume, as last looked at
        (:meth:`managed_namespaces`)."""
        self.namespaces_left: dict[str, int] = {}
        """Namespaces the catalog holds blocks in that are not managed (beyond
        ``max_namespaces``, or not followed) → blocks."""
        self._managed: list[str] = list(settings.namespaces)
        self._ns_looked = float("-inf")
        self._ns_lock = threading.Lock()
        self.journal_error: str | None = None
        """Why the last journal append failed, while it keeps failing (``/healthz`` is then
        unhealthy); ``None`` once an append succeeds again."""
        self.origins: Any = None  # event_plane.origins.OriginGuard while subscribed with origin_binding
        self._origin_store: Any = None
        self.counters.update(dict.fromkeys(QuotaGuard.counter_names(), 0))
        self.quotas = QuotaGuard(settings.quota_limits())
        self._quota_seen: dict[str, int] = {}  # the guard's counts already added to self.counters
        self.rate = RateMeter()
        self.started_at: float | None = None
        self._stop = threading.Event()
        self._threads: list[threading.Thread] = []
        self._started = False
        self._stopped = False

    # ------------------------------------------------------------------ lifecycle
    def start(self) -> None:
        """Open the journal, replay it into the index, register volumes, subscribe, serve.

        Raises:
            AdvisorError: already started, ``api_factory`` cannot be loaded, or another
                process owns the journal (``<journal_path>.lock``).
            Errors of the parts propagate unchanged (``JournalError``,
            ``VolumeConfigError``, ``EventURLError`` / ``TransportError``, ``ServerError``);
            call :meth:`stop` to release what was opened.
        """
        if self._started:
            raise AdvisorError("advisor already started")
        self._started = True
        s = self.settings
        self.started_at = time.monotonic()
        self.snapshots = self._open_snapshot_store()
        if s.log == "sqlite":
            self._journal_lock = self._lock_journal(s.journal_path)
            self.journal = _open_file("journal", s.journal_path, SqliteJournal, s.journal_path, synchronous=s.journal_synchronous)
            self._load_snapshot(self.journal.last_position())
            self._replay_journal()
            self.run_state = _open_file("run state", s.journal_path, RunStateStore, s.journal_path,
                                        synchronous=s.journal_synchronous)
        else:
            self._load_snapshot(None)
            self._open_stream_log()
        if s.catalog_path is not None:
            self._open_storage()
        from event_plane import make_publisher

        # the advisor owns the stream (its NATS user has the rights): its own JetStream
        # publisher creates or checks it with the advisor's limits, as its log does
        own = {"manage_stream": True} if s.publish_url.lower().startswith("jetstream://") else {}
        self.publisher = make_publisher(s.publish_url, s.source, on_flush=self._on_own_batch, stream=s.stream_limits(),
                                        nats_auth=s.nats_auth(), **own)
        if self.agent is not None:
            from storage_backends.types import BlockKey

            self.mover = Mover(self.agent, self.publisher, s.namespaces, self.block_info, BlockKey)
            self.managed_namespaces(max_age_s=0.0)
        self._restore_run_state()
        if self.mover is not None:
            if s.reconcile_on_start:
                self.reconcile()
            self.collect_garbage()
            if s.gc_interval_s > 0:
                self._spawn("kvadvisor-gc", self._gc_loop)
        if self.stream_log is not None:
            self._spawn("kvadvisor-log", self._log_loop)
        if self.snapshots is not None and s.snapshot_every_s > 0:
            self._spawn("kvadvisor-snapshot", self._snapshot_loop)
        if s.subscribe_urls:
            from event_plane import subscribe

            if s.origin_binding:
                self._open_origins()
            self.subscriber = subscribe(s.subscribe_urls, stream=s.stream_limits(), nats_auth=s.nats_auth(),
                                        origins=self.origins, **s.zmq_auth())
            # a message larger than any batch the quotas admit is dropped unread, and a batch
            # declaring too many events is refused before its events are decoded
            self.subscriber.limit_batches(s.quota_max_batch_events, s.max_message_bytes())
            self.subscriber.start()
            self._ingest_thread = self._spawn("kvadvisor-ingest", self._ingest_loop)
            self._spawn("kvadvisor-watchdog", self._watchdog_loop)
        if self.mover is not None and s.policy_interval_s > 0:
            self._spawn("kvadvisor-policy", self._policy_loop)
        self._start_prefetch()
        if self.journal is not None and s.source_ttl_s > 0:
            self._spawn("kvadvisor-expiry", self._expiry_loop)
        if s.api_enabled:
            self.api = self._load_api_factory()(self.query(), s.api_host, s.api_port)

    def _start_prefetch(self) -> None:
        """Take lookups as prefetch hints (:mod:`advisor.moves.prefetch`) when there is a mover and
        a fast volume; its moves go through :meth:`execute_items`."""
        s = self.settings
        if self.mover is None or s.fast_volume is None or not s.prefetch.enabled:
            return
        sources = [*s.slow_volumes, *([s.archive_volume] if s.archive_volume else [])]

        def blocks(hashes: Any) -> list[BlockInfo | None]:
            with self.lock:
                return [self.index.block(h) for h in hashes]

        fast = s.fast_volume
        limit = min(s.policy.promotion.max_fill, s.policy.demotion.high_watermark)

        def room() -> int:
            # the promotion policy's own bound: never fill the fast volume past the fraction a
            # policy round promotes to (:func:`advisor.policy.policies.plan_promotions`)
            st = next((v for v in self.agent.stats() if v.volume_id == fast), None)
            return 0 if st is None else int(st.capacity_bytes * limit) - st.used_bytes

        prefetcher = Prefetcher(s.prefetch, fast, sources, blocks, self.execute_items, room=room)
        self.prefetcher = prefetcher
        self.metrics.registry.register(PrefetchCollector(prefetcher))
        stop = self._stop
        self._spawn("kvadvisor-prefetch", lambda: prefetcher.run(stop))

    def _open_origins(self) -> None:
        """Restore the source → origin bindings (``settings.origins_file``) into a guard
        that persists each new one there and counts refusals (:mod:`event_plane.origins`)."""
        from advisor.ingest.origin_store import SqliteOriginStore
        from event_plane.origins import OriginGuard

        path = self.settings.origins_file
        self._origin_store = _open_file("origin bindings", path, SqliteOriginStore, path)

        def refused(transport: str, _origin: str) -> None:
            self.counters["origin_refused"] += 1
            self.metrics.origin_refused.labels(transport).inc()

        # deferred: a source is bound only once a batch of it passes the quotas (ingest)
        self.origins = OriginGuard(self._origin_store.load(), on_bind=self._origin_store.bind, on_refuse=refused,
                                   deferred=True)

    def release_origin(self, source: str) -> bool:
        """Release ``source``'s origin binding (an operator retired the source or moved it to
        another endpoint / subject): the next origin to deliver it is bound instead.

        Returns:
            Whether ``source`` was bound.
        """
        if self.origins is None:
            return False
        released = self.origins.release(source)
        return self._origin_store.release(source) or released
    @staticmethod
    def _lock_journal(journal_path: str) -> OwnerLock:
        """Own the journal for this process (``<journal_path>.lock``): two advisors folding
        and appending one journal would each miss the other's batches.

        Raises:
            AdvisorError: another process owns it (naming its pid).
        """
        from pathlib import Path

        Path(journal_path).parent.mkdir(parents=True, exist_ok=True)
        lock = OwnerLock(f"{journal_path}.lock", f"journal {journal_path}", "advisor")
        try:
            lock.acquire()
        except (OwnedError, OSError) as exc:
            raise AdvisorError(str(exc)) from exc
        return lock

    def _spawn(self, name: str, target: Callable[[], None]) -> threading.Thread:
        t = threading.Thread(target=target, name=name, daemon=True)
        t.start()
        self._threads.append(t)
        return t

    def ingest_problem(self) -> str | None:
        """Why subscribed batches are not being ingested now (``/healthz`` is then
        unhealthy), or ``None``: the ingest thread stopped, or the subscriber's receive
        loop fails (e.g. out of file descriptors) or stopped."""
        if self.subscriber is None or self._stop.is_set():
            return None
        t = self._ingest_thread
        if t is not None and not t.is_alive():
            return "the ingest thread stopped"
        if not self.subscriber.alive:
            return f"the subscriber does not receive: {self.subscriber.failing or 'stopped'}"
        return None

    def _watchdog_loop(self) -> None:
        """Every second: restart a stopped ingest thread (counted ``ingest_restarts``). A
        subscriber whose receive loop fails retries by itself; health reports it meanwhile."""
        while not self._stop.wait(1.0):
            t = self._ingest_thread
            if t is not None and not t.is_alive() and not self._stop.is_set():
                self.counters["ingest_restarts"] += 1
                logger.error("advisor: the ingest thread stopped; starting it again")
                self._ingest_thread = self._spawn("kvadvisor-ingest", self._ingest_loop)

    # ------------------------------------------------------------------ snapshots + log
    def _open_snapshot_store(self) -> SnapshotStore | None:
        s = self.settings
        if s.snapshot_store == "sqlite":
            return _open_file("snapshot store", s.snapshot_file, SqliteSnapshotStore, s.snapshot_file, keep=s.snapshot_keep)
        if s.snapshot_store == "redis":
            return RedisSnapshotStore(s.redis_url, s.snapshot_key_prefix, keep=s.snapshot_keep)
        return None

    def _load_snapshot(self, max_position: int | None) -> None:
        """Start from the newest usable snapshot the log still covers (if any)."""
        if self.snapshots is None:
            return
        def skipped(_position: int, _why: str) -> None:
            self.counters["snapshots_skipped"] += 1

        found = load_latest(self.snapshots, max_position, on_skip=skipped)
        if found is None:
            return
        snap, index = found
        with self.lock:
            self.index = index
            self.position = snap.position
            self._snapshot_position = snap.position
            self.counters["snapshot_loaded_position"] = snap.position
        logger.info("advisor: loaded snapshot at position %d", snap.position)

    def snapshot_now(self) -> int | None:
        """Save a snapshot of the index at the current log position.

        Returns:
            The position saved, or ``None`` without a snapshot store or when the newest
            snapshot already covers the current position.

        Raises:
            SnapshotError: the store refused the write.
        """
        if self.snapshots is None:
            return None
        with self._snap_lock:
            with self.lock:
                pos = self.position
                if pos <= self._snapshot_position:
                    self._batches_since_snapshot = 0
                    return None
                payload = encode_index(self.index)
                self._batches_since_snapshot = 0
            self.snapshots.save(make_snapshot(pos, payload))
            self._snapshot_position = pos
            self._last_snapshot_t = time.monotonic()
            self.counters["snapshots_taken"] += 1
            self.counters["snapshot_position"] = pos
        return pos

    def _maybe_snapshot(self) -> None:
        n = self.settings.snapshot_every_batches
        if n and self._batches_since_snapshot >= n and self.snapshots is not None:
            try:
                self.snapshot_now()
            except Exception as exc:  # noqa: BLE001 - a failed snapshot only makes the next start slower
                # Wait another full interval before retrying: a snapshot that cannot be
                # written must not turn every later batch into a full re-encode.
                self._batches_since_snapshot = 0
                self.counters["snapshot_failures"] += 1
                logger.warning("advisor: snapshot failed (next try in %d batches): %s: %s", n, type(exc).__name__, exc)

    def _snapshot_loop(self) -> None:
        every = self.settings.snapshot_every_s
        while not self._stop.wait(min(every, 1.0)):
            if time.monotonic() - self._last_snapshot_t >= every:
                try:
                    self.snapshot_now()
                except Exception as exc:  # noqa: BLE001
                    self.counters["snapshot_failures"] += 1
                    logger.warning("advisor: snapshot failed: %s: %s", type(exc).__name__, exc)
                self._last_snapshot_t = time.monotonic()

    def _open_stream_log(self) -> None:
        """Scaled mode: read the stream from the snapshot's position + 1 and catch up."""
        from advisor.ingest.jslog import JetStreamLog

        s = self.settings
        from event_plane.urls import nats_connection

        assert s.jetstream_url is not None
        server, connect_options = nats_connection(s.jetstream_url, s.nats_auth())
        self.stream_log = JetStreamLog(server, s.jetstream_namespace, start_seq=self.position + 1,
                                       stream=s.stream_limits(), **connect_options)
        self.stream_log.start()
        self.counters["log_discarded"] = self.stream_log.discarded
        target = self.stream_log.last_sequence()
        deadline = time.monotonic() + 60.0
        n = 0
        while self.position < target and time.monotonic() < deadline:
            got = self.stream_log.get(timeout=0.5)
            if got is not None:
                self._apply_logged(*got)
                n += 1
        self.counters["replayed_batches"] += n
        logger.info("advisor: replayed %d stream batches (stream sequence %d)", n, self.position)

    def _apply_logged(self, seq: int, payload: bytes) -> bool:
        """Fold one stream entry (scaled mode); entries at or below the position are skipped.

        An entry that does not decode is counted and skipped: it is part of the log, so a
        fresh fold skips it as well and the position still advances. Entries of other
        sources than the advisor's own pass the quotas (:class:`advisor.ingest.quotas.QuotaGuard`)
        except the rate limit: the stream is the log, so each decision must come out the
        same when the stream is folded again from a snapshot, and these only read the batch,
        the index and the settings. A refused entry advances the position, nothing applied.
        """
        with self.lock:
            t0 = time.perf_counter()
            if seq <= self.position:
                self.counters["duplicate_batches"] += 1
                return False
            try:
                batch = decode_batch(payload)  # CodecError: nothing is applied
            except CodecError as exc:
                self.position = seq
                self.counters["bad_batches"] += 1
                self.metrics.bad_batches.inc()
                logger.warning("advisor: stream entry %d is not a KVEvent v1 batch: %s", seq, exc)
                return False
            admitted = batch if batch.source == self.settings.source else self._admit(batch, rate=False)
            self.position = seq
            if admitted is None:
                self._batches_since_snapshot += 1
                return False
            self.index.apply_batch(admitted)
            observe(self.selector, self.index, admitted, self._is_own_move)
            n_events = len(admitted.events)
            self.counters["ingested_batches"] += 1
            self._batches_since_snapshot += 1
            self.rate.add(n_events, time.perf_counter() - t0)
        self.metrics.batches_applied.inc()
        self.metrics.events_applied.inc(n_events)
        self.metrics.journal_position.set(seq)
        self._maybe_snapshot()
        return True

    def _log_loop(self) -> None:
        log = self.stream_log
        assert log is not None
        timeout = self.settings.get_timeout_s
        while not self._stop.is_set():
            try:
                got = log.get(timeout=timeout)
                if got is not None:
                    self._apply_logged(*got)
            except Exception:  # noqa: BLE001 - keep folding; the error is logged
                logger.exception("advisor: stream fold failed")

    def wait_position(self, position: int, timeout: float = 10.0) -> bool:
        """Wait until the fold reached ``position`` (scaled mode: a stream sequence)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.position >= position:
                return True
            time.sleep(0.01)
        return self.position >= position

    def _replay_journal(self) -> None:
        """Fold the journal past the current position into the index. An entry that does not
        decode (:func:`event_plane.codec.decode_batch`, the live decoder) is skipped, logged
        and counted (``journal_skipped``); the replay goes on."""
        assert self.journal is not None
        with self.lock:
            n = 0
            skipped = 0
            for pos, payload in self.journal.read_raw(self.position):
                try:
                    self.index.apply_payload(payload)  # decode + fold in one pass
                except CodecError as exc:
                    # Damaged on disk, or written by a build that accepted what the decoder
                    # now refuses: one entry must not keep the advisor from starting.
                    skipped += 1
                    logger.warning("advisor: journal entry %d skipped, not a valid KVEvent v1 batch: %s", pos, exc)
                else:
                    n += 1
                self.position = pos
            self.counters["replayed_batches"] += n
            self.counters["journal_skipped"] += skipped
            if skipped:
                self.metrics.journal_skipped.inc(skipped)
            self._batches_since_snapshot += n
            self.metrics.journal_position.set(self.position)
        logger.info("advisor: replayed %d journal batches (position %d)", n, self.position)
        self._maybe_snapshot()

    def _open_storage(self) -> None:
        from storage_backends import SqliteCatalog, StorageAgent

        s = self.settings
        self.catalog = _open_file("placement catalog", s.catalog_path, SqliteCatalog, s.catalog_path)
        self.agent = StorageAgent(self.catalog, name=f"kvadvisor-{s.source}", allowed_roots=s.allowed_volume_roots())
        for vol in s.volumes:
            self.agent.register_volume(vol.to_descriptor())

    def _load_api_factory(self) -> Callable[..., Any]:
        mod_name, _, fn_name = self.settings.api_factory.partition(":")
        try:
            return getattr(importlib.import_module(mod_name), fn_name)  # type: ignore[no-any-return]
        except (ImportError, AttributeError) as exc:
            raise AdvisorError(f"cannot load api_factory {self.settings.api_factory!r}: {exc}") from exc

    @property
    def api_url(self) -> str | None:
        """Base URL of the running API (``http://HOST:PORT``), if any."""
        return getattr(self.api, "url", None)

    def run_forever(self) -> None:
        """Block until :meth:`stop` is called (from another thread or a signal handler)."""
        self._stop.wait()

    def request_stop(self) -> None:
        """Ask :meth:`run_forever` to return (safe from a signal handler)."""
        self._stop.set()

    def stop(self) -> None:
        """Stop threads, flush the publisher, close everything. Idempotent."""
        if self._stopped:
            return
        self._stopped = True
        self._stop.set()
        if self.prefetcher is not None:
            self.prefetcher.stop()
        if self.subscriber is not None:
            self.subscriber.close()
        for t in self._threads:
            t.join(timeout=30)
        if self.api is not None:
            self.api.stop()
        if self.publisher is not None:
            self.publisher.close()  # flushes: the last batch is journaled via on_flush
        if self.stream_log is not None:
            self.stream_log.close()
        if self.snapshots is not None:
            if self.settings.snapshot_on_stop and (self.journal is not None or self.stream_log is not None):
                try:
                    self.snapshot_now()
                except Exception as exc:  # noqa: BLE001 - stopping must not fail on a snapshot
                    logger.warning("advisor: snapshot on stop failed: %s: %s", type(exc).__name__, exc)
            self.snapshots.close()
        if self.agent is not None:
            self.agent.close()
        if self.catalog is not None:
            self.catalog.close()
        if self.run_state is not None:
            self._save_run_state([])
            self.run_state.close()
        if self.journal is not None:
            self.journal.close()
        if self._origin_store is not None:
            self._origin_store.close()
        if self._journal_lock is not None:
            self._journal_lock.release()

    def __enter__(self) -> AdvisorService:
        self.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ ingest
    def ingest(self, batch: EventBatch, payload: bytes | None = None, *, verify: bool = True) -> bool:
        """Journal ``batch`` durably, then apply it to the index.

        Args:
            batch: a decoded batch.
            payload: its wire bytes (encoded from ``batch`` when ``None``).
            verify: check that ``payload`` decodes to ``batch`` before journaling.

        Batches of other sources than the advisor's own pass the quotas first
        (:class:`advisor.ingest.quotas.QuotaGuard`): a batch refused whole is not journaled; one
        with refused events or rewritten ``hits`` is journaled as admitted (encoded again).

        Returns:
            ``True`` if applied, ``False`` if it was already journaled (duplicate),
            refused as bad or refused whole by a quota (counted in ``counters``; nothing
            else changes).

        Raises:
            JournalError: the journal could not store the batch (disk full, I/O error):
                nothing is applied, ``journal_failures`` is counted and the service
                reports unhealthy (:attr:`journal_error`) until an append succeeds.
        """
        if self.journal is None:
            if self.stream_log is not None:
                raise AdvisorError("log=jetstream: batches enter through the stream, not ingest()")
            raise AdvisorError("advisor not started")
        if payload is None:
            payload = encode_batch(batch)
        with self.lock:
            t0 = time.perf_counter()
            if batch.source != self.settings.source:
                origins = self.origins
                bindings = None
                if origins is not None and origins.origin_of(batch.source) is None:
                    bindings = origins.count()
                admitted = self._admit(batch, bindings=bindings)
                if origins is not None:
                    if admitted is None:
                        origins.discard(batch.source)  # no binding for a refused batch
                        return False
                    if not origins.commit(batch.source):
                        return False
                if admitted is None:
                    return False
                if admitted is not batch:
                    batch, payload, verify = admitted, encode_batch(admitted), False
            self._heard[batch.source] = time.monotonic()
            try:
                pos = self.journal.append(payload, batch, verify=verify)
            except BadPayloadError as exc:
                self.counters["bad_batches"] += 1
                self.metrics.bad_batches.inc()
                logger.warning("advisor: refused batch %s:%s:%s: %s", batch.source, batch.epoch, batch.seq, exc)
                return False
            except JournalError as exc:
                # not durable, so not applied: the caller keeps the batch and retries
                self.counters["journal_failures"] += 1
                self.metrics.journal_failures.inc()
                self.journal_error = f"journal append failed: {exc}"
                raise
            self.journal_error = None
            if pos is None:
                self.counters["duplicate_batches"] += 1
                self.metrics.duplicate_batches.inc()
                return False
            self.index.apply_batch(batch)
            observe(self.selector, self.index, batch, self._is_own_move)
            self.position = pos
            self.counters["ingested_batches"] += 1
            self._batches_since_snapshot += 1
            self.rate.add(len(batch.events), time.perf_counter() - t0)
        self.metrics.batches_applied.inc()
        self.metrics.events_applied.inc(len(batch.events))
        self.metrics.journal_position.set(pos)
        self._maybe_snapshot()
        return True

    def _admit(self, batch: EventBatch, *, rate: bool = True, bindings: int | None = None) -> EventBatch | None:
        """The quota decision for ``batch`` (call under the state lock): ``None`` when
        refused whole, else the batch to journal / apply; counters and metrics are updated.
        ``rate=False`` skips the per-source rate limit (stream fold); ``bindings``: origin
        bindings held when the source is not bound yet (:meth:`QuotaGuard.admit`)."""
        q = self.quotas
        v0 = q.changes
        got = q.admit(batch, self.index, rate=rate, bindings=bindings)
        if q.changes == v0:
            return got.batch
        # deltas of the guard's own counts (they start at 0 in each process, while
        # self.counters may come back from the run state of an earlier one)
        before = self._quota_seen
        m = self.metrics
        for key, n in q.as_dict().items():
            d = n - before.get(key, 0)
            if not d:
                continue
            before[key] = n
            self.counters[key] = self.counters.get(key, 0) + d
            if key.startswith("quota_refused_batches_"):
                m.quota_refused_batches.labels(reason=key[len("quota_refused_batches_"):]).inc(d)
            elif key.startswith("quota_refused_events_"):
                m.quota_refused_events.labels(reason=key[len("quota_refused_events_"):]).inc(d)
            elif key == "reported_hits_capped":
                m.reported_hits_capped.inc(d)
            elif key == "reported_hits_untrusted":
                m.reported_hits_untrusted.inc(d)
        return got.batch

    def _on_own_batch(self, batch: EventBatch, payload: bytes) -> None:
        """Journal and apply one of the advisor's own batches (a move's Store/Remove).

        The move is committed in the catalog already, so its announcement must not be
        dropped: while the journal refuses writes (a full disk) it is retried with the
        backpressure of ingest (:meth:`_ingest_until_journaled`), which holds the mover
        (it flushes at the end of each group) until the journal accepts it, and the index
        agrees with the catalog again without a restart.

        Raises:
            AdvisorError: the service stopped before the journal accepted the batch (the
                next start's reconciliation repairs the index from the catalog).
        """
        if self.settings.log == "jetstream":
            return  # the batch enters the stream and is folded when read back, in log order
        if not self._ingest_until_journaled(batch, payload):
            raise AdvisorError(f"stopped before the journal accepted the advisor's batch {batch.epoch}:{batch.seq}; "
                               "the next start reconciles the index with the catalog")

    def _ingest_loop(self) -> None:
        sub = self.subscriber
        timeout = self.settings.get_timeout_s
        own = self.settings.source
        while not self._stop.is_set():
            try:
                batch = sub.get(timeout=timeout)
                if batch is None:
                    continue
                if batch.source == own:
                    # the advisor's own source name is reserved: its moves are journaled
                    # as they are published (_on_own_batch), so a batch under that name
                    # from the network is either its own coming back or a forgery that
                    # would take the (epoch, seq) of a real move (dropped as a duplicate)
                    self.counters["reserved_source_refused"] += 1
                    self.metrics.bad_batches.inc()
                    continue
                self._ingest_until_journaled(batch)
            except Exception:  # noqa: BLE001 - keep ingesting; the error is logged
                logger.exception("advisor: ingest failed")

    def _ingest_until_journaled(self, batch: EventBatch, payload: bytes | None = None) -> bool:
        """Backpressure: retry one batch while the journal refuses writes (backoff doubling
        from 0.1 s to 5 s); no later batch is taken from the subscriber meanwhile, so
        nothing is dropped and the publishers' replay covers what piles up.  Returns
        ``True`` once the journal took it (or refused it as bad or duplicate), ``False``
        when the service stopped first."""
        delay = 0.1
        while True:
            try:
                self.ingest(batch, payload, verify=False)
                return True
            except JournalError as exc:
                logger.error("advisor: %s; retrying batch %s:%s:%s in %.1f s", exc, batch.source, batch.epoch,
                             batch.seq, delay)
            if self._stop.wait(delay):
                return False
            delay = min(delay * 2, 5.0)

    # ------------------------------------------------------------------ policies
    def _policy_loop(self) -> None:
        interval = self.settings.policy_interval_s
        while not self._stop.wait(interval):
            try:
                self.run_policies_once()
            except Exception:  # noqa: BLE001
                logger.exception("advisor: policy round failed")

    def _last_access(self, h: int) -> int | None:
        with self.lock:
            info = self.index.block(h)
        return info.last_access_ns if info is not None else None

    def _expiry_loop(self) -> None:
        ttl = self.settings.source_ttl_s
        while not self._stop.wait(min(max(ttl / 10.0, 0.05), 5.0)):
            try:
                self.expire_sources()
            except Exception:  # noqa: BLE001 - keep checking; the error is logged
                logger.exception("advisor: source expiry failed")

    def expire_sources(self, now: float | None = None) -> list[str]:
        """Drop the ``g1``/``g2`` blocks of every source silent for ``source_ttl_s``.

        Each expiry is a batch journaled and applied like any other (Cleared of ``g1`` and
        ``g2`` under the source's name and epoch, :func:`advisor.ingest.source_expiry.expiry_batch`),
        so a replay of the journal reproduces it.  Its blocks on shared volumes stay.

        Args:
            now: monotonic seconds (default: now).

        Returns:
            The sources expired.
        """
        s = self.settings
        if self.journal is None or s.source_ttl_s <= 0:
            return []
        t = time.monotonic() if now is None else now
        start = self.started_at if self.started_at is not None else t
        done: list[str] = []
        with self.lock:
            sources = self.index.sources()
            holding = [n for n in sources if private_blocks(self.index, n)]
            for name in due(holding, self._heard, t, s.source_ttl_s, start, exclude=[s.source]):
                heard = self._heard.get(name)
                if self.ingest(expiry_batch(name, sources[name]), verify=False):
                    self._heard[name] = start if heard is None else heard  # expiry is not a sign of life
                    done.append(name)
                    self.counters["sources_expired"] += 1
        for name in done:
            logger.warning("advisor: source %r sent nothing for %.0f s: its g1/g2 blocks were dropped",
                           name, s.source_ttl_s)
        return done

    def managed_namespaces(self, max_age_s: float = 5.0) -> list[str]:
        """The key namespaces this advisor manages now: ``namespace``, ``extra_namespaces``
        and, with ``follow_catalog_namespaces``, those the catalog holds blocks in, up to
        ``max_namespaces`` (:meth:`advisor.settings.AdvisorSettings.managed_namespaces`).

        The catalog is looked at (one grouped scan) when the last look is older than
        ``max_age_s`` seconds; the mover is told the new list, a namespace followed for the
        first time is logged, and so is one left out by the quota.
        """
        s = self.settings
        if self.catalog is None:
            return list(self._managed)
        with self._ns_lock:
            now = time.monotonic()
            if now - self._ns_looked <= max_age_s:
                return list(self._managed)
            self._ns_looked = now
            counts_of = getattr(self.catalog, "namespace_counts", None)
            counts: dict[str, dict[str, int]] = counts_of() if callable(counts_of) else {}
            managed, left = s.managed_namespaces({ns: sum(v.values()) for ns, v in counts.items()})
            for ns in managed:
                if ns not in self._managed:
                    logger.info("advisor: managing key namespace %s too (%s blocks in the catalog)", ns,
                                f"{sum(counts.get(ns, {}).values()):,}")
            for ns in left.keys() - self.namespaces_left.keys():
                logger.warning("advisor: key namespace %s (%s blocks) left alone: %s", ns, f"{left[ns]:,}",
                               f"max_namespaces ({s.max_namespaces}) reached" if s.follow_catalog_namespaces
                               else "follow_catalog_namespaces is off; add it to extra_namespaces")
            self.namespace_counts, self.namespaces_left, self._managed = counts, left, managed
            if self.mover is not None:
                self.mover.namespaces = list(managed)
            return list(managed)

    def policy_input(self) -> PolicyInput:
        """Gather volume usage, fast-volume placements and segments from storage, and the
        move guard's view (``held``: the policies plan no move it would hold back)."""
        s = self.settings
        inp = PolicyInput(s.fast_volume, list(s.slow_volumes), s.archive_volume, held=self.move_guard.view())
        if self.agent is None:
            return inp
        for st in self.agent.stats():
            inp.usage[st.volume_id] = VolumeUsage(st.capacity_bytes, st.used_bytes, st.live_bytes)
        namespaces = set(self.managed_namespaces())
        if s.fast_volume is not None:
            inp.fast_placements = [p for p in self.catalog.iter_volume(s.fast_volume) if p.key.namespace in namespaces]
        for vol in s.slow_volumes:
            inp.placements[vol] = [p for p in self.catalog.iter_volume(vol) if p.key.namespace in namespaces]
        for vol in s.volumes:
            inp.segments[vol.id] = list(self.agent.segments(vol.id))
        return inp

    def _is_own_move(self, source: str) -> bool:
        """Whether batches of ``source`` are this advisor's own moves (not requests)."""
        return source == self.settings.source

    def policy_leader(self, inp: PolicyInput | None = None) -> str:
        """The expert the default policy follows now: the selector's leader after replaying
        its window for the fast volume's capacity in blocks (capacity bytes / the latest
        Stored block's bytes); the current leader when neither is known yet."""
        s = self.settings
        fast = s.fast_volume
        cap_bytes = 0
        if inp is not None and fast is not None and fast in inp.usage:
            cap_bytes = inp.usage[fast].capacity_bytes
        elif fast is not None:
            cap_bytes = next((v.capacity_bytes for v in s.volumes if v.id == fast), 0)
        return leader_for(self.selector, cap_bytes)

    def run_policies_once(self) -> list[PlanResult]:
        """Run one round now: plan (policies + rate limits), execute, record.

        Returns:
            The results of the executed items, in execution order (empty without storage).
        """
        if self.mover is None:
            return []
        with self._round_lock:
            inp = self.policy_input()
            leader = self.policy_leader(inp)  # replays outside the index lock
            inp.superseded = self.selector.superseded  # that replay's superseded branches
            inp.finish = FinishView(self.selector.finish_states(), self.selector.returns, self.selector.latest_s)
            with self.lock:
                proposed = plan_all(self.settings.policy, inp, self.index, leader)
            results = self._execute_locked(proposed, policy_round=True)
            self.metrics.policy_rounds.inc()
            return results

    def execute_items(self, proposed: list[Any]) -> list[PlanResult]:
        """Carry out plan items outside a policy round (prefetches, :mod:`advisor.moves.prefetch`),
        through the same move guard, full-volume backoff, planner and mover as a round, and
        never at the same time as one.

        Returns:
            The results of the items executed (held back or deferred items have none).
        """
        if self.mover is None:
            return []
        with self._round_lock:
            return self._execute_locked(proposed)

    def _execute_locked(self, proposed: list[Any], *, policy_round: bool = False) -> list[PlanResult]:
        """Guard, plan, execute and record ``proposed`` (counted as a policy round when
        ``policy_round``); the caller holds the round lock."""
        assert self.mover is not None
        proposed, held = self.move_guard.filter(proposed)
        proposed, held_full = self._hold_back_full(proposed)
        proposed, held_draining = self._hold_back_draining(proposed)
        plan = self.planner.plan(proposed)
        try:
            results = self.mover.execute_many(plan.items)
        finally:
            self.planner.release(len(plan.items))
        self.move_guard.record(results)
        with self.lock:
            self.counters["moves_held_back"] += held
            self.counters["moves_held_back_draining"] += held_draining
            self.plans.extend(results)
            self.counters["policy_rounds"] += int(policy_round)
            self.counters["plans_deferred"] += plan.deferred + held_full
            if held_full:
                self.counters["deferred_volume_full"] = self.counters.get("deferred_volume_full", 0) + held_full
            for why, n in plan.deferred_reasons.items():
                self.counters[f"deferred_{why}"] = self.counters.get(f"deferred_{why}", 0) + n
        self.metrics.record_results(results)
        self._note_full(results)
        self._save_run_state(results)
        return results

    def _hold_back_full(self, proposed: list[Any]) -> tuple[list[Any], int]:
        """Drop the items writing into a volume in full-volume backoff; return the rest and
        how many were held back."""
        keep = [it for it in proposed
                if not self.full_backoff.waiting(it.dst_volume if it.dst_volume is not None else it.src_volume)]
        return keep, len(proposed) - len(keep)

    def _hold_back_draining(self, proposed: list[Any]) -> tuple[list[Any], int]:
        """Drop the moves onto a draining volume and the compactions on one; return the
        rest and how many were dropped."""
        if not self.draining:
            return proposed, 0
        keep = [it for it in proposed
                if (it.dst_volume if it.dst_volume is not None else it.src_volume) not in self.draining]
        return keep, len(proposed) - len(keep)

    def save_admin_state(self) -> None:
        """Store the operator's changes (:attr:`runtime_volumes`, :attr:`draining`) in the run
        state, so a restart keeps them.  An inline S3 secret is stored with its volume: the
        journal file is made owner-only (0600) first.  No-op without a run state (a stream
        log); errors are raised (the caller's action must not claim to be durable)."""
        if self.run_state is None:
            return
        volumes, secret = [], False
        for vol, role in self.runtime_volumes.values():
            d = vol.model_dump(mode="json")
            if vol.secret_key is not None:
                d["secret_key"] = vol.secret_key.get_secret_value()
                secret = True
            volumes.append({"volume": d, "role": role})
        if secret:
            import os

            for suffix in ("", "-wal", "-shm"):
                if os.path.exists(self.settings.journal_path + suffix):
                    os.chmod(self.settings.journal_path + suffix, 0o600)
        self.run_state.save_admin({"volumes": volumes, "draining": sorted(self.draining)})

    def saved_registrations(self) -> list[dict[str, Any]]:
        """The indexer API's worker registrations kept in the run state (``api.indexer_registry``);
        empty without a run state."""
        if self.run_state is None:
            return []
        return list(self.run_state.admin().get("registrations", []))  # type: ignore[call-overload]

    def save_registrations(self, registrations: list[dict[str, Any]]) -> None:
        """Replace the worker registrations kept in the run state (no-op without one; errors raised)."""
        if self.run_state is not None:
            self.run_state.save_admin({"registrations": registrations})

    def _restore_admin_state(self) -> None:
        """Register the run-time volumes again and restore the draining marks (see
        :meth:`save_admin_state`); a volume that cannot be opened now is logged and kept in
        the run state, so the next start tries again."""
        from advisor.settings import VolumeSettings

        assert self.run_state is not None
        saved = self.run_state.admin()
        s = self.settings
        for entry in saved.get("volumes", []):  # type: ignore[union-attr]
            vol, role = VolumeSettings(**entry["volume"]), entry["role"]
            self.runtime_volumes[vol.id] = (vol, role)
            if any(v.id == vol.id for v in s.volumes):
                continue  # in the configuration now
            if self.agent is not None:
                try:
                    self.agent.register_volume(vol.to_descriptor())
                except Exception as exc:  # noqa: BLE001 - the other volumes still serve
                    logger.error("advisor: cannot open volume %s registered at run time: %s: %s", vol.id,
                                 type(exc).__name__, exc)
                    continue
            s.volumes.append(vol)
            if role == "slow" and vol.id not in s.slow_volumes:
                s.slow_volumes.append(vol.id)
            logger.info("advisor: volume %s (registered at run time, role %s) registered again", vol.id, role)
        known = {v.id for v in s.volumes}
        self.draining = {v for v in saved.get("draining", []) if v in known}  # type: ignore[union-attr]
        if self.draining:
            logger.warning("advisor: volumes still draining: %s", sorted(self.draining))

    def _note_full(self, results: list[PlanResult]) -> None:
        """Start or reset the full-volume backoff of each destination from a round's results."""
        for r in results:
            dst = r.item.dst_volume if r.item.dst_volume is not None else r.item.src_volume
            if r.status is PlanStatus.FAILED and "VolumeFullError" in r.detail:
                if not self.full_backoff.waiting(dst):
                    wait = self.full_backoff.failed(dst)
                    logger.warning("advisor: volume %s is full (%s); no moves into it for %.0f s", dst, r.detail, wait)
            elif r.status is PlanStatus.DONE:
                self.full_backoff.succeeded(dst)

    #: counters that describe one start, not the service's history (not restored)
    _PER_START = frozenset({"replayed_batches", "snapshot_loaded_position", "journal_skipped", "snapshots_skipped"})

    def _restore_run_state(self) -> None:
        """Counters, mover counters and recent plans of the previous runs (:mod:`advisor.embedded.run_state`)."""
        if self.run_state is None:
            return
        self._restore_admin_state()
        saved = self.run_state.counters()
        with self.lock:
            for name, v in saved.items():
                if name.startswith("mover."):
                    _, field_name, kind = name.split(".", 2)
                    table = getattr(self.mover.counters, field_name, None) if self.mover is not None else None
                    if isinstance(table, dict) and kind in table:
                        table[kind] = v
                elif name not in self._PER_START:
                    self.counters[name] = v
            self.plans.extend(self.run_state.plans())
        restored = self.move_guard.restore(self.run_state.moves())
        if restored:
            logger.info("advisor: the move guard remembers %d blocks moved by the previous run", restored)

    def _save_run_state(self, results: list[PlanResult]) -> None:
        if self.run_state is None:
            return
        with self.lock:
            counters = dict(self.counters)
        if self.mover is not None:
            for field_name, table in asdict(self.mover.counters).items():
                counters.update({f"mover.{field_name}.{k}": v for k, v in table.items()})
        try:
            self.run_state.save(counters, results, self.move_guard.export())
        except Exception as exc:  # noqa: BLE001 - the state is also rebuilt at the next round
            logger.warning("advisor: cannot save the run state: %s: %s", type(exc).__name__, exc)

    def reconcile(self) -> int:
        """Publish the events a crash between catalog commit and publish left out.

        For each managed volume: a block the catalog holds there but the index places
        elsewhere gets a Store; a block the index places there but the catalog does not
        gets a Remove.  Blocks the index does not know at all are left to their owners.

        Returns:
            Number of events published.
        """
        if self.agent is None or self.publisher is None:
            return 0
        namespaces = set(self.managed_namespaces(max_age_s=0.0))
        events = []
        for vol in self.settings.volumes:
            in_catalog = {p.key.sequence_hash: p for p in self.catalog.iter_volume(vol.id) if p.key.namespace in namespaces}
            with self.lock:
                in_index = self.index.blocks_at(vol.id)
                for h, p in in_catalog.items():
                    if h not in in_index:
                        info = self.index.block(h)
                        if info is not None:
                            events.append(store(h, info.prefix_hash, info.parent, p.length, vol.id,
                                                {PLACEMENT_KEYS[1]: True}))
                for h in sorted(in_index - in_catalog.keys()):
                    info = self.index.block(h)
                    assert info is not None
                    events.append(remove(h, info.prefix_hash, info.parent, info.size, vol.id))
        if events:
            self.publisher.publish(events)
            self.publisher.flush()
            logger.warning("advisor: reconciled %d placement events with the catalog", len(events))
        self.counters["reconciled_events"] += len(events)
        return len(events)

    def collect_garbage(self) -> int:
        """Remove crash leftovers on every managed volume (``StorageAgent.collect_garbage``:
        unsealed segments without live blocks older than ``gc_min_age_s``, and segment
        files or objects the catalog does not know); runs at start and every
        ``gc_interval_s``.  A volume that fails is logged and skipped.

        Returns:
            Segments removed (also added to ``counters["gc_segments_removed"]``).
        """
        if self.agent is None:
            return 0
        removed = 0
        for vol in self.settings.volumes:
            try:
                removed += self.agent.collect_garbage(vol.id, min_age_s=self.settings.gc_min_age_s)
            except Exception as exc:  # noqa: BLE001 - one volume must not stop the others
                logger.warning("advisor: garbage collection of %s failed: %s: %s", vol.id, type(exc).__name__, exc)
        with self.lock:
            self.counters["gc_segments_removed"] += removed
        if removed:
            logger.info("advisor: garbage collection removed %d segments", removed)
        return removed

    def _gc_loop(self) -> None:
        while not self._stop.wait(self.settings.gc_interval_s):
            self.collect_garbage()

    # ------------------------------------------------------------------ reads
    def block_info(self, h: int) -> BlockInfo | None:
        """Index view of one block (thread-safe)."""
        with self.lock:
            return self.index.block(h)

    def query(self) -> AdvisorQuery:
        """An :class:`advisor.ops.query.AdvisorQuery` over this service."""
        return AdvisorQuery(self)

    @property
    def round_lock(self) -> threading.Lock:
        """The lock a policy round holds (operator actions take it: no move in flight)."""
        return self._round_lock

    def mover_summary(self) -> dict[str, Any]:
        """Done / skipped / failed counts and bytes moved per plan kind."""
        if self.mover is None:
            zero = {k.value: 0 for k in PlanKind}
            return {"done": dict(zero), "skipped": dict(zero), "failed": dict(zero), "bytes_moved": dict(zero),
                    "blocks_moved": dict(zero)}
        return asdict(self.mover.counters)

    def subscriber_stats(self) -> dict[str, int]:
        """The subscriber's counters (empty without subscriptions)."""
        if self.subscriber is None:
            return {}
        return dict(asdict(self.subscriber.stats()))

    def _metrics_snapshot(self) -> dict[str, Any]:
        with self.lock:
            st = self.index.stats()
            rate = self.rate.rate()
        return {
            "blocks": st["blocks"],
            "blocks_per_location": st["blocks_per_location"],
            "orphans_pending": st["orphans_pending"],
            "index_counters": st["counters"],
            "subscriber": self.subscriber_stats(),
            "replay": self.replay_stats(),
            "events_per_s": rate,
        }

    def replay_stats(self) -> dict[str, int]:
        """The replay counters of the advisor's own ZMQ publisher (refused, cut or abandoned
        answers: :meth:`event_plane.ZmqPublisher.replay_stats`); empty for other publishers."""
        stats = getattr(self.publisher, "replay_stats", None)
        return stats() if callable(stats) else {}


def results_summary(results: list[PlanResult]) -> dict[str, int]:
    """Count results by ``"<kind>_<status>"`` (e.g. ``promote_done``)."""
    out: dict[str, int] = {}
    for r in results:
        key = f"{r.item.kind.value}_{r.status.value}"
        out[key] = out.get(key, 0) + 1
    return out


S3_GONE_HINT = ("start that S3 again at the same address; a working directory of a plain `kvadvisor demo` "
                "kept its s3 blocks in the demo's own S3, which stopped with it: run the demo again with "
                "--s3-endpoint of an S3 that outlives it (README: moto_server)")
"""What to do when an S3 volume's endpoint is gone (``advisor run``, ``kvadvisor check``)."""


def start_failure_line(exc: BaseException) -> str:
    """One line for a start failure: the cause, and what to do when an S3 endpoint is gone."""
    from storage_backends import S3EndpointUnreachableError

    if isinstance(exc, S3EndpointUnreachableError):
        return f"{exc}; {S3_GONE_HINT}"
    return f"{type(exc).__name__}: {exc}"


def main(argv: list[str] | None = None) -> int:
    """Run the advisor as its own process: ``python -m advisor --config FILE.json``.

    Prints ``ADVISOR READY http://HOST:PORT`` (or ``ADVISOR READY -`` without API) on
    stdout once it is subscribed and serving; SIGTERM / SIGINT stop it cleanly; SIGUSR1 writes
    every thread's Python stack to stderr and goes on (:func:`advisor.embedded.stacks.dump_stacks`),
    to see where a stuck or slow advisor waits (docs/operations.md, "Failure behaviour").

    Returns:
        Exit status: 0 after a clean stop, 2 on a configuration error, 1 on a start error.
    """
    import argparse
    import signal
    import sys

    from advisor.embedded.stacks import dump_stacks
    from advisor.settings import SettingsError

    parser = argparse.ArgumentParser(prog="python -m advisor", description="kvadvisor advisor service")
    parser.add_argument("--config", help="JSON settings file (environment KVADVISOR_ADVISOR_* fills the rest)")
    parser.add_argument("--log-level", default="WARNING", help="Python logging level (default WARNING)")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    try:
        settings = AdvisorSettings.from_json_file(args.config) if args.config else AdvisorSettings()
    except (SettingsError, ValueError) as exc:
        print(f"advisor: configuration error: {exc}", file=sys.stderr)
        return 2
    service = AdvisorService(settings)

    def _on_signal(signum: int, _frame: object) -> None:
        service.request_stop()

    signal.signal(signal.SIGTERM, _on_signal)
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGUSR1, lambda *_: dump_stacks(sys.stderr))
    try:
        service.start()
    except Exception as exc:  # noqa: BLE001 - report any start failure and exit non-zero
        print(f"advisor: start failed: {start_failure_line(exc)}", file=sys.stderr)
        service.stop()
        return 1
    print(f"ADVISOR READY {service.api_url or '-'}", flush=True)
    try:
        service.run_forever()
    finally:
        service.stop()
    return 0


__all__ = ["AdvisorError", "AdvisorService", "RateMeter", "main", "results_summary"]
