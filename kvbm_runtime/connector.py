"""Engine-facing connector with the call points of vLLM's KV connector (v1).

The engine keeps its own device KV cache (G1) and its own block allocator; the connector
gives it the runtime's host pool (G2) and storage volumes (G3/G4) behind them:

Scheduler side (:class:`KvbmConnectorScheduler`), once per scheduling step:

* ``get_num_new_matched_tokens(request, num_computed_tokens) -> (tokens, load_async)``:
  how many tokens after the engine's own prefix hit can be loaded from G2/G3 (whole
  blocks, longest prefix, never the whole prompt: the engine must compute at least one
  token).  Matched G2 blocks are pinned until they are loaded.
* ``update_state_after_alloc(request, block_ids, num_external_tokens)``: the engine's
  block ids for the request; plans the loads into them.
* ``build_connector_meta(scheduler_output) -> KvConnectorMetadata``: the step's loads and
  the saves of every block the step completes (plain data; can cross processes).
* ``request_finished(request, block_ids) -> (delay_free, params)``: ``delay_free`` is true
  while saves of the request may still read the engine's blocks; the engine then frees
  them once the worker's ``get_finished`` lists the request as finished sending.

Worker side (:class:`KvbmConnectorWorker`), around each forward pass:

* ``register_kv_caches({layer_name: [num_blocks, 2, page_size, inner_dim] tensor})`` once;
* ``bind_connector_metadata(meta)``; ``start_load_kv(forward_context)`` queues the loads
  (G2 → engine, G3 → engine through the transfer manager) and queues the saves behind
  the step; ``wait_for_layer_load(layer_name)`` blocks until the step's loads are in
  place (loads are not pipelined per layer: the first call waits for all layers);
  ``save_kv_layer(layer_name, kv_layer, attn_metadata)`` notes the layer;
  ``wait_for_save()`` ends the step: the queued saves (engine → G2, then G2 → G3 through
  the admission filter) start, asynchronously;
* ``get_finished(finished_req_ids) -> (finished_sending, finished_recving)``.

The request / scheduler-output types are small dataclasses with the fields of vLLM's that
the connector reads; :mod:`kvbm_runtime.vllm_adapter` maps vLLM's own objects onto them.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field
from typing import Any

import torch

from event_plane.schema import EventType, KVEvent

from .block import BlockMeta, ImmutableBlock
from .errors import KvbmError, PoolExhaustedError
from .layout import ExternalLayout
from .manager import BlockManager
from .residency import HOST, STORAGE, ReportingSink, ResidencyReport
from .transfer import (
    HostOffloadItem,
    HostOffloadResult,
    StepEvent,
    StorageOffloadItem,
    StorageOffloadResult,
    StorageOnboardResult,
)

logger = logging.getLogger(__name__)


class ConnectorError(KvbmError):
    """The connector was called out of order or with inconsistent arguments."""


@dataclass(slots=True)
class ConnectorRequest:
    """What the connector needs of an engine request.

    Attributes:
        request_id: engine request id.
        prompt_token_ids: prompt token ids (u32 values).
        output_token_ids: tokens generated so far (their full blocks are saved too).
    """

    request_id: str
    prompt_token_ids: list[int]
    output_token_ids: list[int] = field(default_factory=list)

    @property
    def all_token_ids(self) -> list[int]:
        """Prompt then output tokens."""
        return self.prompt_token_ids + self.output_token_ids


@dataclass(slots=True)
class ScheduledRequest:
    """One request in a scheduling step.

    Attributes:
        request: the request.
        block_ids: the engine's block ids for the request, in block order.
        num_computed_tokens: tokens whose KV is in the engine before the step (its own
            prefix hit plus the tokens the connector loads).
        num_scheduled_tokens: tokens the step computes.
    """

    request: ConnectorRequest
    block_ids: list[int]
    num_computed_tokens: int
    num_scheduled_tokens: int


@dataclass(slots=True)
class SchedulerOutput:
    """The part of vLLM's ``SchedulerOutput`` the connector reads."""

    scheduled: list[ScheduledRequest] = field(default_factory=list)


@dataclass(frozen=True, slots=True)
class BlockTransfer:
    """One block to move between the engine and the runtime.

    Attributes:
        sequence_hash, parent_hash, prefix_hash, salt: identity of the block.
        engine_block_id: the engine's block id.
        tier: ``"g2"`` or ``"storage"`` (a G3 or G4 volume) for loads, where the block
            comes from; ``"g1"`` for saves.
    """

    sequence_hash: int
    parent_hash: int | None
    prefix_hash: int
    salt: int
    engine_block_id: int
    tier: str

    def meta(self) -> BlockMeta:
        """Identity as a :class:`BlockMeta`."""
        return BlockMeta(self.sequence_hash, self.parent_hash, self.prefix_hash, self.salt)


@dataclass(slots=True)
class RequestTransfers:
    """Loads or saves of one request in one step.

    Attributes:
        request_id: engine request id.
        blocks: the blocks, in block order.
        load_async: (loads) the engine does not wait for these loads in the step's
            forward pass; the worker lists the request in ``finished_recving`` once they
            are done (slow tiers).
    """

    request_id: str
    blocks: list[BlockTransfer]
    load_async: bool = False


@dataclass(slots=True)
class KvConnectorMetadata:
    """What the scheduler side tells the worker side for one step (plain data)."""

    loads: list[RequestTransfers] = field(default_factory=list)
    saves: list[RequestTransfers] = field(default_factory=list)


@dataclass(slots=True)
class _Match:
    hashes: list[int]
    first: int
    tiers: list[str]
    pins: list[ImmutableBlock]


def _metas(hashes: list[int], salt: int) -> list[BlockMeta]:
    return [BlockMeta(h, hashes[i - 1] if i else None, hashes[0], salt) for i, h in enumerate(hashes)]


class KvbmConnectorScheduler:
    """Scheduler side of the connector (see module doc).

    Args:
        manager: the worker's block manager (its G2 pool, storage agent, salt, metrics).
    """

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.page = manager.layout_config.page_size
        self._matches: dict[str, _Match] = {}
        self._loads: list[RequestTransfers] = []
        self._pins_next: list[ImmutableBlock] = []
        self._pins_in_flight: list[ImmutableBlock] = []
        self._saving: set[str] = set()
        self._lock = threading.Lock()

    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond the engine's ``num_computed_tokens`` the connector can load.

        Returns:
            ``(tokens, False)``: a multiple of the block size; loads are synchronous
            within the step (``load_async`` is always False).

        Raises:
            ConnectorError: ``num_computed_tokens`` is negative or not block-aligned.
        """
        if num_computed_tokens < 0 or num_computed_tokens % self.page:
            raise ConnectorError(f"num_computed_tokens={num_computed_tokens} must be a non-negative multiple of {self.page}")
        tokens = request.prompt_token_ids
        hashes = self.manager.sequence_hashes(tokens)
        first = num_computed_tokens // self.page
        # the engine must compute at least one token: never match the whole prompt
        last = min(len(hashes), (len(tokens) - 1) // self.page)
        tiers: list[str] = []
        pins: list[ImmutableBlock] = []
        g2 = self.manager.g2
        storage_missing_from = None
        for i in range(first, last):
            handle = g2.get(hashes[i])
            if handle is not None:
                pins.append(handle)
                tiers.append(HOST)
                continue
            storage_missing_from = i
            break
        if storage_missing_from is not None and self.manager.store is not None:
            rest = hashes[storage_missing_from:last]
            held = self.manager.store.exists([self.manager.block_key(h) for h in rest]) if rest else []
            for ok in held:
                if not ok:
                    break
                tiers.append(STORAGE)
        with self._lock:
            old = self._matches.pop(request.request_id, None)
            self._matches[request.request_id] = _Match(hashes, first, tiers, pins)
        if old is not None:
            for h in old.pins:
                h.release()
        return len(tiers) * self.page, False

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Plan the loads of the matched blocks into the engine's ``block_ids``.

        Args:
            request: the request matched by :meth:`get_num_new_matched_tokens`.
            block_ids: the engine's block ids for the whole request, in block order.
            num_external_tokens: tokens the engine accepted to load (0: none).

        Raises:
            ConnectorError: more external tokens than matched, or too few block ids.
        """
        with self._lock:
            match = self._matches.pop(request.request_id, None)
        if match is None or num_external_tokens == 0:
            if match is not None:
                for h in match.pins:
                    h.release()
            return
        n = num_external_tokens // self.page
        if num_external_tokens % self.page or n > len(match.tiers):
            for h in match.pins:
                h.release()
            raise ConnectorError(f"{num_external_tokens} external tokens but {len(match.tiers) * self.page} were matched")
        if len(block_ids) < match.first + n:
            for h in match.pins:
                h.release()
            raise ConnectorError(f"{len(block_ids)} engine blocks for {match.first + n} loaded blocks")
        metas = _metas(match.hashes, self.manager.salt)
        blocks = [
            BlockTransfer(m.sequence_hash, m.parent_hash, m.prefix_hash, m.salt, block_ids[i], match.tiers[i - match.first])
            for i, m in enumerate(metas[match.first : match.first + n], start=match.first)
        ]
        keep = match.pins[:n]
        for h in match.pins[n:]:
            h.release()
        with self._lock:
            self._loads.append(RequestTransfers(request.request_id, blocks))
            self._pins_next.extend(keep)
        self.manager.metrics.matched_tokens.inc(n * self.page)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvConnectorMetadata:
        """Loads planned since the last call, and saves of the blocks this step completes.

        Pins of the loads of the previous step are released here (that step has run).
        """
        with self._lock:
            # the previous step has run: its loads are done; this step's pins stay
            old_pins, self._pins_in_flight, self._pins_next = self._pins_in_flight, self._pins_next, []
            loads, self._loads = self._loads, []
        meta = KvConnectorMetadata(loads=loads)
        for sr in scheduler_output.scheduled:
            tokens = sr.request.all_token_ids
            done = sr.num_computed_tokens + sr.num_scheduled_tokens
            lo, hi = -(-sr.num_computed_tokens // self.page), done // self.page
            if hi <= lo:
                continue
            hashes = self.manager.sequence_hashes(tokens[: hi * self.page])
            metas = _metas(hashes, self.manager.salt)
            if len(sr.block_ids) < hi:
                raise ConnectorError(f"request {sr.request.request_id}: {len(sr.block_ids)} block ids for {hi} blocks")
            meta.saves.append(
                RequestTransfers(
                    sr.request.request_id,
                    [BlockTransfer(m.sequence_hash, m.parent_hash, m.prefix_hash, m.salt, sr.block_ids[i], "g1") for i, m in enumerate(metas) if i >= lo],
                )
            )
            with self._lock:
                self._saving.add(sr.request.request_id)
        for p in old_pins:
            p.release()
        return meta

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """The request is done.

        Returns:
            ``(delay_free, kv_transfer_params)``: ``delay_free`` when saves of the request
            were scheduled (free its blocks after the worker reports it in
            ``finished_sending``); the params list the request's saved sequence hashes.
        """
        with self._lock:
            match = self._matches.pop(request.request_id, None)
            saving = request.request_id in self._saving
            self._saving.discard(request.request_id)
        if match is not None:
            for h in match.pins:
                h.release()
        if not saving:
            return False, None
        hashes = self.manager.sequence_hashes(request.all_token_ids)
        return True, {"sequence_hashes": hashes, "namespace": self.manager.namespace}

    def close(self) -> None:
        """Release every pin."""
        with self._lock:
            pins = self._pins_next + self._pins_in_flight + [p for m in self._matches.values() for p in m.pins]
            self._pins_next, self._pins_in_flight, self._matches = [], [], {}
        for p in pins:
            p.release()


@dataclass(slots=True)
class _LoadJob:
    """One queued load: its future, its blocks (in the future's order), their tier."""

    future: Future[Any]
    blocks: list[BlockTransfer]
    tier: str


class KvbmConnectorWorker:
    """Worker side of the connector (see module doc).

    Args:
        manager: the worker's block manager (transfer manager, G2, storage agent).
        reporter: the sink the manager publishes through, when the scheduler side runs in
            another process (:class:`~kvbm_runtime.residency.ReportingSink`): failed loads
            are recorded there and :meth:`take_report` hands out the step's residency
            changes.
        disk_only: KVBM's disk-only mode: saves go from the engine's blocks straight to
            the storage volume (no G2, no disk-offload filter).
    """

    def __init__(self, manager: BlockManager, reporter: ReportingSink | None = None, *, disk_only: bool = False) -> None:
        if disk_only and manager.store is None:
            raise ConnectorError("disk-only mode needs a storage agent and a volume")
        self.manager = manager
        self.reporter = reporter
        self.disk_only = disk_only
        self.layout: ExternalLayout | None = None
        self.layer_names: list[str] = []
        self._meta: KvConnectorMetadata | None = None
        self._loads: list[_LoadJob] = []
        self._async: dict[str, list[_LoadJob]] = {}
        self._step: StepEvent | None = None
        self._saved_layers: set[str] = set()
        self._sending: dict[str, list[Future[Any]]] = {}
        self._finished_pending: set[str] = set()
        self._storage: list[Future[StorageOffloadResult]] = []
        self._load_errors: set[int] = set()
        self._lock = threading.Lock()
        self._direct: ThreadPoolExecutor | None = None
        # G1 → G2 saves whose G2 → G3 follow-up (a done-callback) has not been queued yet:
        # a future reads done before its callbacks ran
        self._chaining = 0
        self._chained = threading.Condition(self._lock)
        self.skipped_saves = 0

    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """Adopt the engine's KV caches, one ``[num_blocks, 2, page_size, inner_dim]``
        tensor per layer, in layer order.

        Raises:
            ConnectorError: the geometry differs from the runtime's configuration.
            LayoutConfigError: the tensors are inconsistent.
        """
        layout = ExternalLayout(list(kv_caches.values()))
        want = self.manager.layout_config
        if layout.config.block_shape != want.block_shape or layout.config.dtype != want.dtype:
            raise ConnectorError(
                f"engine KV cache blocks are {layout.config.block_shape} {layout.config.dtype}, "
                f"the runtime is configured for {want.block_shape} {want.dtype}"
            )
        self.layout = layout
        self.layer_names = list(kv_caches)

    def bind_connector_metadata(self, metadata: KvConnectorMetadata) -> None:
        """Metadata of the step about to run."""
        self._meta = metadata

    def clear_connector_metadata(self) -> None:
        """Forget the step's metadata (after the forward pass)."""
        self._meta = None

    def _require(self) -> tuple[ExternalLayout, KvConnectorMetadata]:
        if self.layout is None:
            raise ConnectorError("register_kv_caches was not called")
        if self._meta is None:
            raise ConnectorError("no connector metadata bound for this step")
        return self.layout, self._meta

    def start_load_kv(self, forward_context: Any = None) -> None:
        """Queue the step's loads and, behind the step, its saves.

        Loads of a ``load_async`` request are not waited for in this step: the request is
        listed in ``finished_recving`` by :meth:`get_finished` once they are done.  A G2
        block evicted since scheduling fails alone (see
        :meth:`get_block_ids_with_load_errors`); the engine recomputes from it.
        """
        layout, meta = self._require()
        self._loads = []
        self._saved_layers = set()
        for req in meta.loads:
            jobs = self._queue_loads(layout, req.blocks)
            if req.load_async:
                with self._lock:
                    self._async.setdefault(req.request_id, []).extend(jobs)
            else:
                self._loads.extend(jobs)
        self._step = StepEvent()
        for req in meta.saves:
            self._queue_save(layout, req, self._step)

    def _queue_loads(self, layout: ExternalLayout, blocks: list[BlockTransfer]) -> list[_LoadJob]:
        tm = self.manager.transfers
        host: list[BlockTransfer] = []
        handles: list[ImmutableBlock] = []
        missing: list[BlockTransfer] = []
        stored: list[BlockTransfer] = []
        for b in blocks:
            if b.tier == HOST:
                h = self.manager.g2.get(b.sequence_hash)
                if h is None:  # evicted since scheduling
                    missing.append(b)
                else:
                    host.append(b)
                    handles.append(h)
            else:
                stored.append(b)
        if missing:
            self._fail(missing, HOST, lost=missing, error="evicted from G2 since scheduling")
        jobs: list[_LoadJob] = []
        if handles:
            jobs.append(_LoadJob(tm.onboard_from_host(handles, layout, [b.engine_block_id for b in host]), host, HOST))
        if stored:
            keys = [self.manager.block_key(b.sequence_hash) for b in stored]
            jobs.append(_LoadJob(tm.onboard_from_storage(keys, layout, [b.engine_block_id for b in stored]), stored, STORAGE))
        return jobs

    def _settle(self, job: _LoadJob) -> None:
        """Record the failures of a finished load job."""
        try:
            res = job.future.result()
        except Exception as exc:  # noqa: BLE001 - the whole job failed: recompute its blocks
            self._fail(job.blocks, job.tier, lost=[], error=repr(exc))
            return
        if isinstance(res, StorageOnboardResult) and res.failed_index is not None:
            bad = job.blocks[res.failed_index]
            # the copies the read quarantined: Remove(<volume>) for each, published and in
            # this step's residency report in order with the other changes
            gone = self.manager.publish_dropped(res.dropped, {b.sequence_hash: b.meta() for b in job.blocks})
            dropped = {ev.sequence_hash for ev in gone}
            lost = [] if bad.sequence_hash in dropped else [bad]
            self._fail(job.blocks[res.failed_index :], job.tier, lost=lost, error=repr(res.error))

    def _fail(self, blocks: list[BlockTransfer], tier: str, *, lost: list[BlockTransfer], error: str) -> None:
        self._load_errors.update(b.engine_block_id for b in blocks)
        self.manager.metrics.onboard_errors.inc(len(blocks))
        if self.reporter is not None:
            self.reporter.lost(tier, [b.sequence_hash for b in lost], failures=len(blocks))
        logger.warning("load of %d block(s) from %s failed, the engine recomputes them: %s", len(blocks), tier, error)

    def _queue_save(self, layout: ExternalLayout, req: RequestTransfers, step: StepEvent) -> None:
        if self.disk_only:
            if self._direct is None:
                self._direct = ThreadPoolExecutor(1, thread_name_prefix="kvbm-disk-save")
            fut: Future[Any] = self._direct.submit(self._save_direct, layout, req.blocks, step)
        else:
            items = [HostOffloadItem(b.meta(), layout, b.engine_block_id, None) for b in req.blocks]
            try:
                fut = self.manager.transfers.offload_to_host(items, step)
            except PoolExhaustedError as exc:  # G2 cannot take the step's blocks: skip the save
                self.skipped_saves += len(items)
                logger.warning("save of %d block(s) of %s skipped: %s", len(items), req.request_id, exc)
                fut = Future()
                fut.set_running_or_notify_cancel()
                fut.set_result(None)  # the engine still waits for this request's "finished sending"
            else:
                if self.manager.store is not None:
                    with self._lock:
                        self._chaining += 1
                    fut.add_done_callback(lambda f, blocks=req.blocks: self._to_storage(f, blocks))
        with self._lock:
            self._sending.setdefault(req.request_id, []).append(fut)

    def _save_direct(self, layout: ExternalLayout, blocks: list[BlockTransfer], step: StepEvent) -> int:
        """Disk-only save: after the step, copy the blocks out of the engine's cache and put
        the ones the store does not hold yet; publishes Store(<volume>) per block."""
        step.wait()
        m = self.manager
        assert m.store is not None and m.g3_volume is not None
        keys = [m.block_key(b.sequence_hash) for b in blocks]
        todo = [(k, b) for k, b, held in zip(keys, blocks, m.store.exists(keys), strict=True) if not held]
        if not todo:
            return 0
        try:
            m.store.put([(k, layout.read_bytes(b.engine_block_id)) for k, b in todo], m.g3_volume)
        except Exception as exc:  # noqa: BLE001 - a failed save is a future miss, never an engine error
            logger.warning("disk-only save of %d block(s) failed: %r", len(todo), exc)
            return 0
        m.publisher.publish(
            [KVEvent(EventType.STORE, b.sequence_hash, b.prefix_hash, b.parent_hash, m.block_bytes, m.g3_volume) for _, b in todo]
        )
        m.metrics.offload_d2d.inc(len(todo))
        return len(todo)

    def _to_storage(self, fut: Future[HostOffloadResult], blocks: list[BlockTransfer]) -> None:
        try:
            self._queue_storage(fut, blocks)
        finally:
            with self._lock:
                self._chaining -= 1
                self._chained.notify_all()

    def _queue_storage(self, fut: Future[HostOffloadResult], blocks: list[BlockTransfer]) -> None:
        if fut.cancelled() or fut.exception() is not None:
            return
        res = fut.result()
        items = [
            StorageOffloadItem(b.meta(), self.manager.block_key(b.sequence_hash), (w,))
            for b, w in zip(blocks, res.blocks, strict=True)
        ]
        try:
            sf = self.manager.transfers.offload_to_storage(items, StepEvent.completed())
        except Exception as exc:  # noqa: BLE001 - a closed manager at shutdown
            logger.warning("storage offload not queued: %r", exc)
            return
        with self._lock:
            self._storage.append(sf)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """Block until the step's synchronous loads are in the engine's blocks (all layers
        at once; the first call waits, later ones return at once).

        Raises:
            ConnectorError: unknown layer name.
        """
        if layer_name not in self.layer_names:
            raise ConnectorError(f"unknown layer {layer_name!r}")
        jobs, self._loads = self._loads, []
        for job in jobs:
            self._settle(job)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """Note that ``layer_name``'s KV of the step is written (saves start at
        :meth:`wait_for_save`, when every layer is done).

        Raises:
            ConnectorError: unknown layer, or a tensor that is not that layer's cache.
        """
        if layer_name not in self.layer_names:
            raise ConnectorError(f"unknown layer {layer_name!r}")
        assert self.layout is not None
        own = self.layout.layers[self.layer_names.index(layer_name)]
        if kv_layer.untyped_storage().data_ptr() != own.untyped_storage().data_ptr():
            raise ConnectorError(f"save_kv_layer({layer_name!r}) got a tensor that is not the registered cache")
        self._saved_layers.add(layer_name)

    def wait_for_save(self) -> None:
        """End of the forward pass: the step's queued saves may read the engine's blocks
        now.  Returns at once; the copies run in the transfer manager.  Synchronous loads
        not waited for yet (a step without attention layers) are settled here."""
        for job in self._loads:
            self._settle(job)
        self._loads = []
        if self._step is not None:
            self._step.done()
            self._step = None

    def wait_for_saves_reading_engine(self, timeout: float | None = None) -> None:
        """Block until no queued save still reads the engine's blocks (the engine is
        about to reuse blocks of preempted requests)."""
        with self._lock:
            futs = [f for fs in self._sending.values() for f in fs]
        for f in futs:
            try:
                f.result(timeout)
            except Exception:  # noqa: BLE001 - a failed save reads nothing any more
                pass

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Requests whose saves no longer read the engine's blocks, and requests whose
        asynchronous loads are done (their failed blocks are listed by
        :meth:`get_block_ids_with_load_errors` in the same step).

        Args:
            finished_req_ids: requests that finished this step (with delayed freeing).

        Returns:
            ``(finished_sending, finished_recving)``; ``None`` for an empty set.
        """
        done: set[str] = set()
        recv: set[str] = set()
        with self._lock:
            # only requests with saves were kept alive for us (request_finished said so)
            self._finished_pending |= {rid for rid in finished_req_ids if rid in self._sending}
            for rid in list(self._finished_pending):
                if all(f.done() for f in self._sending[rid]):
                    done.add(rid)
                    self._finished_pending.discard(rid)
                    del self._sending[rid]
            ready = [rid for rid, jobs in self._async.items() if all(j.future.done() for j in jobs)]
            settled = [(rid, self._async.pop(rid)) for rid in ready]
        for rid, jobs in settled:
            for job in jobs:
                self._settle(job)
            recv.add(rid)
        return (done or None), (recv or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        """Engine block ids whose load failed since the last call (to be recomputed)."""
        out, self._load_errors = self._load_errors, set()
        return out

    def take_report(self) -> ResidencyReport | None:
        """Residency changes since the last call for the scheduler side (``None`` without a
        reporter or without changes)."""
        return self.reporter.take_report() if self.reporter is not None else None

    def wait_for_storage(self, timeout: float | None = None) -> list[StorageOffloadResult]:
        """Wait for every queued G2 → G3 save (tests, shutdown); returns their results."""
        out: list[StorageOffloadResult] = []
        while True:
            with self._lock:
                sending = [f for fs in self._sending.values() for f in fs]
            for f in sending:
                f.result(timeout)
            with self._lock:
                # saves that finished (maybe already reported by get_finished) but whose
                # G2 → G3 follow-up is still being queued by their done-callback
                if not self._chained.wait_for(lambda: self._chaining == 0, timeout):
                    raise TimeoutError(f"G2 → G3 saves not queued within {timeout} s")
                futs, self._storage = self._storage, []
            if not futs:
                return out
            out.extend(f.result(timeout) for f in futs)

    def close(self) -> None:
        """Stop the disk-only save thread (waits for its saves)."""
        if self._direct is not None:
            self._direct.shutdown(wait=True)
            self._direct = None


class KvbmConnector:
    """Both sides over one :class:`BlockManager` (the single-process case).

    Attributes:
        scheduler: :class:`KvbmConnectorScheduler`.
        worker: :class:`KvbmConnectorWorker`.
    """

    def __init__(self, manager: BlockManager) -> None:
        self.manager = manager
        self.scheduler = KvbmConnectorScheduler(manager)
        self.worker = KvbmConnectorWorker(manager)

    # scheduler side
    def get_num_new_matched_tokens(self, request: ConnectorRequest, num_computed_tokens: int) -> tuple[int, bool]:
        """See :meth:`KvbmConnectorScheduler.get_num_new_matched_tokens`."""
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: ConnectorRequest, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """See :meth:`KvbmConnectorScheduler.update_state_after_alloc`."""
        self.scheduler.update_state_after_alloc(request, block_ids, num_external_tokens)

    def build_connector_meta(self, scheduler_output: SchedulerOutput) -> KvConnectorMetadata:
        """See :meth:`KvbmConnectorScheduler.build_connector_meta`."""
        return self.scheduler.build_connector_meta(scheduler_output)

    def request_finished(self, request: ConnectorRequest, block_ids: Sequence[int]) -> tuple[bool, dict[str, Any] | None]:
        """See :meth:`KvbmConnectorScheduler.request_finished`."""
        return self.scheduler.request_finished(request, block_ids)

    # worker side
    def register_kv_caches(self, kv_caches: Mapping[str, torch.Tensor]) -> None:
        """See :meth:`KvbmConnectorWorker.register_kv_caches`."""
        self.worker.register_kv_caches(kv_caches)

    def bind_connector_metadata(self, metadata: KvConnectorMetadata) -> None:
        """See :meth:`KvbmConnectorWorker.bind_connector_metadata`."""
        self.worker.bind_connector_metadata(metadata)

    def clear_connector_metadata(self) -> None:
        """See :meth:`KvbmConnectorWorker.clear_connector_metadata`."""
        self.worker.clear_connector_metadata()

    def start_load_kv(self, forward_context: Any = None) -> None:
        """See :meth:`KvbmConnectorWorker.start_load_kv`."""
        self.worker.start_load_kv(forward_context)

    def wait_for_layer_load(self, layer_name: str) -> None:
        """See :meth:`KvbmConnectorWorker.wait_for_layer_load`."""
        self.worker.wait_for_layer_load(layer_name)

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any = None) -> None:
        """See :meth:`KvbmConnectorWorker.save_kv_layer`."""
        self.worker.save_kv_layer(layer_name, kv_layer, attn_metadata)

    def wait_for_save(self) -> None:
        """See :meth:`KvbmConnectorWorker.wait_for_save`."""
        self.worker.wait_for_save()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """See :meth:`KvbmConnectorWorker.get_finished`."""
        return self.worker.get_finished(finished_req_ids)

    def close(self) -> None:
        """Release the scheduler side's pins."""
        self.scheduler.close()
