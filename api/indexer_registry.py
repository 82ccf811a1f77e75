"""Registered workers of the indexer-compatible API and their ZMQ KV-event subscriptions
(docs/operations.md, "Indexer API").

One :class:`~api.worker_index.WorkerIndex` per ``(model_name, tenant_id)``; its block size is
fixed by the first registration of the pair. Each registration ``(instance_id, dp_rank,
model_name, tenant_id)`` subscribes to the worker's vLLM- or SGLang-format ZMQ publisher
(``engine``) through the event plane's adapters (:mod:`event_plane.adapters.vllm`,
:mod:`event_plane.adapters.sglang`; gap recovery through the replay endpoint when one is
given) and applies its events, in seq order, to that index:
a ``BlockStored`` needs its ``token_ids`` (one full block each) to key the blocks by
tokens (:mod:`api.token_hashes`); media map to tiers ``g1`` (GPU), ``g2`` (CPU,
CPU_PINNED), ``g3`` (DISK), ``g4`` (EXTERNAL).  ``AllBlocksCleared`` (a reset of the engine's
prefix cache) clears the worker's ``g1`` copies only: the G2 and volume copies an offloading
connector publishes in the same stream stay.

With a :class:`RegistrationStore` (the advisor's run state, :mod:`advisor.embedded.run_state`) every
accepted registration is stored before ``/register`` answers, a deregistration removes it,
and :meth:`IndexerRegistry.restore` subscribes to the stored ones again after a restart,
checked against today's endpoint policy: one refused now is dropped, logged and counted
(docs/operations.md, "Indexer API").
"""

from __future__ import annotations

import logging
import resource
import threading
from collections.abc import Iterable
from dataclasses import asdict, dataclass, replace
from typing import Any, Protocol

import zmq
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from api.errors import ApiError
from api.register_policy import EndpointPolicy
from api.token_hashes import TokenIdError, local_block_hashes
from api.worker_index import BlockBudget, WorkerIndex
from event_plane.adapters.peer import PeerConverter, PeerFormatError, PeerSubscriber
from event_plane.adapters.sglang import SGLANG_FIELDS, sglang_config
from event_plane.adapters.vllm import VLLM_FIELDS, vllm_config
from event_plane.schema import EventBatch, EventType, KVEvent

logger = logging.getLogger(__name__)

DEFAULT_TENANT = "default"
SOCKETS_PER_REGISTRATION = 6
"""ZMQ sockets one registration may hold at once (its SUB, the SUB's disconnect monitor
pair, a replay DEALER of a gap and of a catch-up, one spare); also its file descriptors
(a socket's mailbox, a TCP connection)."""
FD_SHARE = 0.25
"""Share of the process's file-descriptor limit registrations may take at most: the
advisor's own ingest, journal, API and storage need the rest."""
TIER_MEDIA = {"GPU": "g1", "CPU": "g2", "CPU_PINNED": "g2", "DISK": "g3", "EXTERNAL": "g4"}
"""Peer medium → tier name used in per-tier answers."""


@dataclass(frozen=True)
class Registration:
    """One worker rank of one (model, tenant).

    Attributes:
        instance_id: the worker's id (u64).
        dp_rank: its data-parallel rank.
        model_name / tenant_id: which index it feeds.
        endpoint: its ZMQ PUB endpoint (``tcp://HOST:PORT``).
        replay_endpoint: its ZMQ replay ROUTER endpoint, or ``None``.
        block_size: tokens per block.
        engine: the worker's KV-event format, ``"vllm"`` or ``"sglang"``.
    """

    instance_id: int
    dp_rank: int
    model_name: str
    tenant_id: str
    endpoint: str
    replay_endpoint: str | None
    block_size: int
    engine: str = "vllm"


class RegistrationStore(Protocol):
    """Where registrations are kept across restarts (:class:`advisor.ops.query.AdvisorQuery`
    keeps them in the advisor's run state)."""

    def load_registrations(self) -> list[dict[str, Any]]:
        """The stored registrations (:class:`Registration` fields by name), oldest first."""
        ...

    def save_registrations(self, registrations: list[dict[str, Any]]) -> None:
        """Replace the stored registrations (durable when it returns; raises when it cannot be)."""
        ...

    def count_registrations_dropped(self, n: int) -> None:
        """Count ``n`` stored registrations refused at a restore."""
        ...


class _TokenConverter(PeerConverter):
    """vLLM or SGLang converter that also keys each stored block by its tokens' local hash
    (``extra_metadata = {"tokens_hash": h}``); a Store without one full block of token
    ids per hash, or of another block size, is malformed (skipped and counted).  SGLang's
    ``BlockStored`` carries no LoRA name, so its blocks hash without one."""

    def __init__(self, source: str, block_size: int, engine: str = "vllm") -> None:
        make, fields = (sglang_config, SGLANG_FIELDS) if engine == "sglang" else (vllm_config, VLLM_FIELDS)
        super().__init__(make(source, disk_volume="g3", external_volume="g4", cleared_locations=("g1",)), fields)
        self.block_size = block_size

    def convert_event(self, ev: object, dp_rank: int | None = None) -> list[KVEvent]:
        out = super().convert_event(ev, dp_rank)
        if not out or out[0].type != EventType.STORE:
            return out
        _, f = self._fields_of(ev)
        tokens, size, lora = f.get("token_ids"), f.get("block_size"), f.get("lora_name")
        if size != self.block_size:
            raise PeerFormatError(f"block_size {size!r} differs from the registered {self.block_size}")
        if not isinstance(tokens, list) or len(tokens) != size * len(out):
            raise PeerFormatError("token_ids must hold block_size ids per block hash")
        try:
            locals_ = local_block_hashes(tokens, size, lora if isinstance(lora, str) else None)
        except (TokenIdError, ValueError) as exc:
            raise PeerFormatError(str(exc)) from None
        return [KVEvent(e.type, e.sequence_hash, e.prefix_hash, e.parent_hash, e.block_size, e.storage_location,
                        {"tokens_hash": h}) for e, h in zip(out, locals_)]


class _IndexingSubscriber(PeerSubscriber):
    """Applies each delivered batch (in seq order) to one worker's slot of an index."""

    def __init__(self, reg: Registration, index: WorkerIndex, context: zmq.Context | None) -> None:
        source = f"{reg.instance_id}/{reg.dp_rank}"
        super().__init__(reg.endpoint, reg.replay_endpoint, _TokenConverter(source, reg.block_size, reg.engine),
                         context=context, queue_capacity=16)
        self._worker = (reg.instance_id, reg.dp_rank)
        self._index = index

    def _deliver(self, batch: EventBatch) -> None:
        batch = self.converter.enrich(batch)
        idx, w = self._index, self._worker
        for ev in batch.events:
            if ev.type == EventType.STORE:
                meta = ev.extra_metadata or {}
                local = meta.get("tokens_hash")
                if isinstance(local, int):
                    idx.stored(w, [ev.sequence_hash], ev.parent_hash, [local], ev.storage_location)
            elif ev.type == EventType.REMOVE:
                idx.removed(w, [ev.sequence_hash], ev.storage_location)
            elif ev.type == EventType.CLEARED:
                idx.cleared(w, ev.storage_location)  # the engine's g1 alone
        self._answered.set()
        self._stats.batches += 1
        self._stats.events += len(batch.events)


class IndexerCollector(Collector):
    """Prometheus view of a registry's block quotas: ``kvadvisor_api_indexer_blocks`` (held)
    and ``kvadvisor_api_indexer_blocks_refused_total{reason}`` (``worker_blocks``, ``blocks``)."""

    def __init__(self, registry: IndexerRegistry) -> None:
        self._registry = registry

    def collect(self) -> Iterable[Any]:
        st = self._registry.budget.as_dict()
        yield GaugeMetricFamily("kvadvisor_api_indexer_blocks", "Blocks (per medium) held by the indexer routes' indexes",
                                value=st["blocks"])
        refused = CounterMetricFamily("kvadvisor_api_indexer_blocks_refused",
                                      "Blocks the indexer routes' quotas refused", labels=["reason"])
        for reason, n in st["refused_blocks"].items():
            refused.add_metric([reason], n)
        yield refused


class IndexerRegistry:
    """Registrations, their subscriptions and the per-(model, tenant) indexes.

    Args:
        max_registrations: registrations held at once (each holds ZMQ sockets and a thread),
            lowered to what :data:`FD_SHARE` of the file-descriptor limit allows at
            :data:`SOCKETS_PER_REGISTRATION` each.
        max_indexes: ``(model, tenant)`` indexes held at once (a registration or a
            ``/load`` of a new pair beyond is refused, 429 ``too_many_indexes``).
        policy: the endpoints registrations may connect to (:mod:`api.register_policy`;
            default loopback addresses only).
        context: ZMQ context; by default one of the registry's own, with a socket budget
            of :data:`SOCKETS_PER_REGISTRATION` per registration (well below libzmq's
            default 1,023): registrations can never take the sockets of the advisor's
            own ingest, which uses the process-wide context.
        store: keeps the registrations across restarts (none: they last as long as the
            registry).
        max_worker_blocks / max_blocks: block quotas of the indexes (:class:`BlockBudget`):
            blocks one worker holds in one index, blocks in all of them; a block on several
            media counts once per medium.

    Thread-safe.
    """

    def __init__(self, max_registrations: int = 256, context: zmq.Context | None = None, *,
                 max_indexes: int = 64, policy: EndpointPolicy | None = None,
                 store: RegistrationStore | None = None, max_worker_blocks: int = 1 << 17,
                 max_blocks: int = 1 << 21) -> None:
        self._lock = threading.Lock()
        self.budget = BlockBudget(max_worker_blocks, max_blocks)
        self._store = store
        self._save_lock = threading.Lock()
        self._to_restore: list[Registration] = []
        self._restore_thread: threading.Thread | None = None
        self._closed = False
        self._regs: dict[tuple[int, int, str, str], tuple[Registration, _IndexingSubscriber]] = {}
        self._indexes: dict[tuple[str, str], WorkerIndex] = {}
        self._pending: set[tuple[int, int, str, str]] = set()
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft != resource.RLIM_INFINITY:
            max_registrations = min(max_registrations, max(1, int(soft * FD_SHARE) // SOCKETS_PER_REGISTRATION))
        self._max = max_registrations
        self._max_indexes = max_indexes
        self.policy = policy if policy is not None else EndpointPolicy()
        self._own_ctx = context is None
        self._ctx = context  # our own one is made at the first registration (an I/O thread)

    @property
    def max_registrations(self) -> int:
        """Registrations held at most (after the file-descriptor budget)."""
        return self._max

    def index(self, model_name: str, tenant_id: str) -> WorkerIndex | None:
        """The index of ``(model_name, tenant_id)``, or ``None``."""
        with self._lock:
            return self._indexes.get((model_name, tenant_id))

    def indexes(self) -> dict[tuple[str, str], WorkerIndex]:
        """All indexes by ``(model_name, tenant_id)``."""
        with self._lock:
            return dict(self._indexes)

    def ensure_index(self, model_name: str, tenant_id: str, block_size: int) -> WorkerIndex:
        """The index of the pair, created with ``block_size`` if new.

        Raises:
            ApiError: 409 ``block_size_mismatch`` when the pair exists with another block size.
        """
        with self._lock:
            return self._ensure(model_name, tenant_id, block_size)

    def _ensure(self, model_name: str, tenant_id: str, block_size: int) -> WorkerIndex:
        idx = self._indexes.get((model_name, tenant_id))
        if idx is None:
            if len(self._indexes) >= self._max_indexes:
                raise ApiError(429, "too_many_indexes", f"at most {self._max_indexes} (model, tenant) indexes")
            idx = self._indexes[(model_name, tenant_id)] = WorkerIndex(block_size, self.budget)
        elif idx.block_size != block_size:
            raise ApiError(409, "block_size_mismatch",
                           f"{model_name}:{tenant_id} has block_size {idx.block_size}, not {block_size}")
        return idx

    def register(self, reg: Registration) -> None:
        """Subscribe to the worker's events and feed the pair's index; with a store, the
        registration is stored before this returns.

        Raises:
            ApiError: 409 ``already_registered`` / ``block_size_mismatch``, 429
                ``too_many_registrations`` / ``too_many_indexes``, 403
                ``endpoint_not_allowed`` / ``registrations_closed`` (:mod:`api.register_policy`),
                400 ``subscribe_failed`` (bad endpoint), 503 ``state_not_saved`` (the store
                failed: the registration is undone).
        """
        self._register(reg, persist=True)

    def _register(self, reg: Registration, persist: bool) -> None:
        endpoint = self.policy.check(reg.endpoint)
        replay = None if reg.replay_endpoint is None else self.policy.check(reg.replay_endpoint)
        connect = replace(reg, endpoint=endpoint, replay_endpoint=replay)
        key = (reg.instance_id, reg.dp_rank, reg.model_name, reg.tenant_id)
        with self._lock:
            if key in self._regs or key in self._pending:
                raise ApiError(409, "already_registered",
                               f"instance {reg.instance_id} dp_rank {reg.dp_rank} is registered for "
                               f"{reg.model_name}:{reg.tenant_id}")
            if len(self._regs) + len(self._pending) >= self._max:
                raise ApiError(429, "too_many_registrations", f"at most {self._max} registrations")
            idx = self._ensure(reg.model_name, reg.tenant_id, reg.block_size)
            self._pending.add(key)
            if self._ctx is None:
                self._ctx = zmq.Context()
                self._ctx.set(zmq.MAX_SOCKETS, SOCKETS_PER_REGISTRATION * self._max + 8)
        # connecting and catching up through the replay socket take a while: not under the lock
        sub = _IndexingSubscriber(connect, idx, self._ctx)
        try:
            sub.start()
        except Exception as exc:  # noqa: BLE001 - the event plane raises several kinds
            sub.close()
            with self._lock:
                self._pending.discard(key)
            raise ApiError(400, "subscribe_failed", f"cannot subscribe to {reg.endpoint}: {type(exc).__name__}") from None
        with self._lock:
            self._pending.discard(key)
            closed = self._closed
            if not closed:
                self._regs[key] = (reg, sub)
        if closed:
            sub.close()
            raise ApiError(503, "registry_closed", "the registry is closing")
        if persist:
            try:
                self._persist()
            except Exception as exc:  # noqa: BLE001 - the store's errors vary (SQLite, disk full)
                with self._lock:
                    self._regs.pop(key, None)
                sub.close()
                idx.remove_worker((reg.instance_id, reg.dp_rank))
                logger.error("indexer: registration of instance %d not stored, undone: %s: %s", reg.instance_id,
                             type(exc).__name__, exc)
                raise ApiError(503, "state_not_saved", f"the registration could not be stored: {type(exc).__name__}",
                               headers={"Retry-After": "5"}) from None
        logger.info("indexer: registered instance %d dp_rank %d for %s:%s", reg.instance_id, reg.dp_rank,
                    reg.model_name, reg.tenant_id)

    def unregister(self, instance_id: int, model_name: str, tenant_id: str | None, dp_rank: int | None) -> int:
        """Stop the matching subscriptions and drop their blocks; ``None`` tenant / rank
        matches every tenant / rank; with a store, they are removed from it. Returns
        registrations removed (0: nothing matched).

        Raises:
            ApiError: 503 ``state_not_saved``: removed here, but the store failed.
        """
        with self._lock:
            keys = [k for k in self._regs if k[0] == instance_id and k[2] == model_name
                    and (tenant_id is None or k[3] == tenant_id) and (dp_rank is None or k[1] == dp_rank)]
            gone = [self._regs.pop(k) for k in keys]
            waiting = [r for r in self._to_restore[1:] if r.instance_id == instance_id and r.model_name == model_name
                       and (tenant_id is None or r.tenant_id == tenant_id) and (dp_rank is None or r.dp_rank == dp_rank)]
            self._to_restore = [r for r in self._to_restore if not any(r is w for w in waiting)]
        for reg, sub in gone:
            sub.close()
            idx = self.index(reg.model_name, reg.tenant_id)
            if idx is not None:
                idx.remove_worker((reg.instance_id, reg.dp_rank))
        if gone or waiting:
            try:
                self._persist()
            except Exception as exc:  # noqa: BLE001 - as in register
                logger.error("indexer: deregistration of instance %d not stored: %s: %s", instance_id,
                             type(exc).__name__, exc)
                raise ApiError(503, "state_not_saved", f"removed now, but not from the stored registrations "
                               f"({type(exc).__name__}): it may return after a restart", headers={"Retry-After": "5"}) from None
        return len(gone) + len(waiting)

    def _persist(self) -> None:
        """Store the registrations (held ones and those still to restore) in the store."""
        if self._store is None:
            return
        with self._save_lock:
            with self._lock:
                regs = [r for r, _ in self._regs.values()] + list(self._to_restore)
            self._store.save_registrations([asdict(r) for r in regs])

    def restore(self, background: bool = True) -> None:
        """Subscribe again to the registrations the store kept (after a restart), each
        checked as a new ``/register`` is (today's endpoint policy, quotas); one refused is
        dropped from the store, logged and counted (``registrations_dropped``).  Catching up
        with a worker that is down takes up to its catch-up timeout, so by default this runs
        on a thread of its own; until it is done the stored list keeps the ones not yet
        restored.  No-op without a store."""
        if self._store is None:
            return
        regs: list[Registration] = []
        dropped = 0
        for d in self._store.load_registrations():
            try:
                regs.append(Registration(**d))
            except TypeError as exc:
                dropped += 1
                logger.error("indexer: stored registration %r not understood, dropped: %s", d, exc)
        if not regs and not dropped:
            return
        with self._lock:
            self._to_restore = regs
        if background:
            self._restore_thread = threading.Thread(target=self._restore_all, args=(dropped,),
                                                    name="kvadvisor-register-restore", daemon=True)
            self._restore_thread.start()
        else:
            self._restore_all(dropped)

    def _restore_all(self, dropped: int) -> None:
        restored = 0
        while True:
            with self._lock:
                if self._closed or not self._to_restore:
                    break
                reg = self._to_restore[0]
            try:
                self._register(reg, persist=False)
                restored += 1
            except ApiError as exc:
                if exc.error == "registry_closed":
                    return
                if exc.error != "already_registered":  # registered again by the worker meanwhile: kept
                    dropped += 1
                    logger.warning("indexer: stored registration of instance %d dp_rank %d for %s:%s (%s) dropped: "
                                   "%s: %s", reg.instance_id, reg.dp_rank, reg.model_name, reg.tenant_id, reg.endpoint,
                                   exc.error, exc.detail)
            with self._lock:
                if self._to_restore and self._to_restore[0] is reg:
                    self._to_restore.pop(0)
        assert self._store is not None
        try:
            self._persist()
        except Exception as exc:  # noqa: BLE001 - the restored ones run; the next change stores them
            logger.error("indexer: restored registrations not stored: %s: %s", type(exc).__name__, exc)
        if dropped:
            self._store.count_registrations_dropped(dropped)
        logger.info("indexer: %d stored registrations restored, %d dropped", restored, dropped)

    def wait_restored(self, timeout_s: float | None = None) -> bool:
        """Wait for :meth:`restore`'s thread; whether it is done."""
        t = self._restore_thread
        if t is not None:
            t.join(timeout_s)
            return not t.is_alive()
        return True

    def registrations(self) -> list[Registration]:
        """Current registrations, in registration order."""
        with self._lock:
            return [r for r, _ in self._regs.values()]

    def stats(self) -> dict[str, Any]:
        """``/v1/stats``' ``indexer``: registrations, indexes and the block quotas
        (:meth:`BlockBudget.as_dict`: blocks held, the limits, blocks refused per reason)."""
        with self._lock:
            regs, indexes = len(self._regs), len(self._indexes)
        return {"registrations": regs, "indexes": indexes, **self.budget.as_dict()}

    def subscriber_stats(self) -> dict[str, Any]:
        """Per registration ``"instance/dp_rank@model:tenant"``: batches, events, gaps, invalid events."""
        with self._lock:
            items = list(self._regs.items())
        out: dict[str, Any] = {}
        for (inst, dp, model, tenant), (_, sub) in items:
            st, ps = sub.stats(), sub.peer_stats()
            out[f"{inst}/{dp}@{model}:{tenant}"] = {"batches": st.batches, "events": st.events, "gaps": st.gaps,
                                                    "invalid_events": ps.invalid_events}
        return out

    def close(self) -> None:
        """Stop every subscription (idempotent); the store keeps them."""
        with self._lock:
            self._closed = True
        self.wait_restored()
        with self._lock:
            subs = [s for _, s in self._regs.values()]
            self._regs.clear()
        for s in subs:
            s.close()
        if self._own_ctx and self._ctx is not None and not self._ctx.closed:
            self._ctx.destroy(linger=0)
