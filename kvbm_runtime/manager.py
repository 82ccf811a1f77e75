"""One worker's block manager: G1 and G2 pools, write-through offload, onboarding.

Data path of :meth:`BlockManager.serve` for one request (docs/design.md §1, §5)::

    tokens ──hash──▶ sequence hashes of the full blocks
      lookup, per block in order: G1 → G2 → storage agent (G3 volume, or G4 when the
      volume's media is "object"); stop at the first block found nowhere
      onboard  G2 → G1 (copy), G3/G4 → G1 (storage ``get``, checksum-verified)
      compute  the remaining blocks in G1 through ``kv_fill``
      offload  write-through G1 → G2 (missing ones), G2 → G3 (``store.put`` of the keys
               the agent does not hold yet, one call per request)
      release  every handle of the request (blocks stay matchable, inactive)

Events, in causal order: Store("g1") per block newly registered in G1, Store("g2") per
block newly offloaded to G2, Store(<volume id>) per block put into the storage agent, and
Remove(tier) when an eviction drops the last copy of a hash at a tier.  Parents are the
sequence predecessors (case C1), so every published parent was published before.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import numpy as np
import torch

from event_plane.schema import EventType, KVEvent
from storage_backends.types import BlockKey, MediaClass, Placement, VolumeDescriptor

from .block import BlockMeta, ImmutableBlock, MutableBlock
from .config import RuntimeConfig
from .errors import PoolExhaustedError, StorageTierError
from .hashing import ModelFingerprint, salt_hash, sequence_hashes
from .layout import BlockLayout, make_layout
from .metrics import RuntimeMetrics
from .pool import BlockPool, EventSink, PoolStats
from .transfer import DiskOffloadFilter, HostOffloadItem, StepEvent, StorageOffloadItem, TransferManager, host_bytes

logger = logging.getLogger(__name__)

KvFill = Callable[[int, torch.Tensor], None]
"""``kv_fill(sequence_hash, block_view)`` writes a block's KV into ``block_view``
(``[num_layers, outer_dim, page_size, inner_dim]``, on the G1 device)."""


class BlockStore(Protocol):
    """What the runtime needs from ``storage_backends.StorageAgent``."""

    def put(self, items: Sequence[tuple[BlockKey, torch.Tensor]], volume_id: str) -> list[Placement]: ...

    def get(self, keys: Sequence[BlockKey], out: Any = None) -> list[torch.Tensor]: ...

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]: ...

    def locate(self, keys: Sequence[BlockKey]) -> list[Placement | None]: ...

    def volume(self, volume_id: str) -> VolumeDescriptor: ...


class Publisher(EventSink, Protocol):
    """What the manager needs from ``event_plane.EventPublisher``."""

    def flush(self) -> None: ...


@dataclass(frozen=True, slots=True)
class ServeError:
    """A failure recorded while serving a request (the request itself still completes).

    Attributes:
        position: block index in the request.
        sequence_hash: the block's sequence hash.
        stage: ``"onboard"`` (storage read) or ``"offload"`` (storage write).
        error: exception class name.
        message: exception text.
    """

    position: int
    sequence_hash: int
    stage: str
    error: str
    message: str


@dataclass(slots=True)
class ServeResult:
    """Outcome of :meth:`BlockManager.serve` (blocks unless stated).

    Attributes:
        num_blocks: full blocks in the request (tail tokens are never blocks, case C10).
        hits_g1, hits_g2, hits_g3, hits_g4: prefix blocks found at each tier and reused.
        computed: blocks filled by ``kv_fill`` (``num_blocks - hits``).
        onboarded_bytes: bytes copied into G1 from G2 / G3 / G4.
        offloaded_bytes: bytes written to G2 and to the G3 volume.
        stored_g3: blocks newly put into the storage agent.
        sequence_hashes: the request's sequence hashes, in block order.
        errors: failures recorded (e.g. a storage read that failed during onboarding,
            case C17: the prefix stops there and the rest is recomputed).
    """

    num_blocks: int
    hits_g1: int = 0
    hits_g2: int = 0
    hits_g3: int = 0
    hits_g4: int = 0
    computed: int = 0
    onboarded_bytes: int = 0
    offloaded_bytes: int = 0
    stored_g3: int = 0
    sequence_hashes: list[int] = field(default_factory=list)
    errors: list[ServeError] = field(default_factory=list)

    @property
    def hits(self) -> int:
        """Blocks reused from any tier."""
        return self.hits_g1 + self.hits_g2 + self.hits_g3 + self.hits_g4


@dataclass(slots=True)
class _Totals:
    requests: int = 0
    blocks: int = 0
    hits_g1: int = 0
    hits_g2: int = 0
    hits_g3: int = 0
    hits_g4: int = 0
    computed: int = 0
    onboarded_bytes: int = 0
    offloaded_bytes: int = 0
    stored_g3: int = 0
    errors: int = 0


class BlockManager:
    """Owns one worker's G1 and G2 pools and its path to the storage agent.

    Args:
        config: runtime configuration (geometry, pool sizes, model / salt fields).
        publisher: event publisher of this worker (``event_plane.EventPublisher``).
        store: the storage agent for G3/G4 (``storage_backends.StorageAgent``), or ``None``
            for a G1+G2-only runtime.
        g3_volume: volume id that offloaded blocks are put into (needed with ``store``).
        metrics: metrics holder (a fresh one labelled with the publisher's source when None).
        engine_g1: the engine keeps G1 itself (vLLM's KV cache, reached through the
            connector): no G1 pool is allocated, G2 may be smaller than the engine's G1,
            and :meth:`serve` is not available.

    Raises:
        CapacityConfigError: G2 smaller than G1 (or G3 smaller than G2), naming the numbers.
        StorageTierError: ``store`` given without ``g3_volume``, or the other way round.
        LayoutConfigError: invalid geometry.
    """

    def __init__(
        self,
        config: RuntimeConfig,
        publisher: Publisher,
        store: BlockStore | None = None,
        g3_volume: str | None = None,
        *,
        metrics: RuntimeMetrics | None = None,
        engine_g1: bool = False,
    ) -> None:
        config.check_capacities(g1=not engine_g1)
        config.check_memory(g1=not engine_g1)
        if (store is None) != (g3_volume is None):
            raise StorageTierError("store and g3_volume must be given together")
        self.config = config
        self.publisher = publisher
        self.store = store
        self.g3_volume = g3_volume
        self.layout_config = config.layout_config()
        self.fingerprint: ModelFingerprint = config.fingerprint()
        self.namespace = self.fingerprint.namespace() + config.namespace_suffix()
        self.salt = salt_hash(self.fingerprint, config.lora_name, config.cache_salt)
        self.block_bytes = self.layout_config.block_bytes
        assert config.g2_blocks is not None
        g2_layout = make_layout(config.layout, self.layout_config, config.g2_blocks, tier="g2")
        self._g1: BlockPool | None = None
        if not engine_g1:
            self._g1 = BlockPool("g1", make_layout(config.layout, self.layout_config, config.g1_blocks, tier="g1"), publisher)
        self.g2 = BlockPool("g2", g2_layout, publisher)
        source = str(getattr(publisher, "source", "worker"))
        self.metrics = metrics or RuntimeMetrics(source, window=config.hit_rate_window)
        self.metrics.track_g2(self.g2.resident_blocks)
        self.disk_filter: DiskOffloadFilter | None = (
            DiskOffloadFilter(decay_interval_s=config.disk_filter_decay_s)
            if store is not None and config.offload_filter_enabled
            else None
        )
        self.transfers = TransferManager(
            self.g2,
            publisher,
            self.metrics,
            store,
            g3_volume,
            disk_filter=self.disk_filter,
            max_batch_blocks=config.transfer_batch_blocks,
            bounce_blocks=config.bounce_blocks,
        )
        self.metrics_url: str | None = None
        if config.metrics:
            self.metrics_url = self.metrics.serve_http(config.metrics_port)
        self._lock = threading.RLock()
        self._totals = _Totals()
        self._media: dict[str, MediaClass] = {}
        self._closed = False

    @property
    def g1(self) -> BlockPool:
        """The G1 pool.

        Raises:
            StorageTierError: the engine keeps G1 itself (``engine_g1=True``).
        """
        if self._g1 is None:
            raise StorageTierError("this manager has no G1 pool: the engine keeps G1 (engine_g1=True)")
        return self._g1

    # ------------------------------------------------------------------ identity helpers

    def sequence_hashes(self, tokens: np.ndarray | Sequence[int]) -> list[int]:
        """Sequence hashes of the full blocks of ``tokens`` under this manager's salt."""
        return sequence_hashes(tokens, self.layout_config.page_size, self.salt)

    def block_key(self, sequence_hash: int) -> BlockKey:
        """Storage key of a block of this model."""
        return BlockKey(self.namespace, sequence_hash)

    def pool(self, tier: str) -> BlockPool:
        """The ``"g1"`` or ``"g2"`` pool.

        Raises:
            ValueError: another tier name.
        """
        if tier == "g1":
            return self.g1
        if tier == "g2":
            return self.g2
        raise ValueError(f"tier must be 'g1' or 'g2', got {tier!r}")

    # ------------------------------------------------------------------ main entry

    def serve(self, tokens: np.ndarray | Sequence[int], kv_fill: KvFill, *, max_prefix: int | None = None) -> ServeResult:
        """Serve one request: reuse the longest cached prefix, compute the rest, offload.

        Args:
            tokens: token ids (u32 values); the tail after the last full block is ignored.
            kv_fill: called as ``kv_fill(sequence_hash, block_view)`` for every block that
                is computed, in block order; ``block_view`` is the G1 block's typed
                ``[num_layers, outer_dim, page_size, inner_dim]`` view.
            max_prefix: reuse at most this many leading blocks (tensor-parallel ranks
                agree on one prefix length, see :mod:`kvbm_runtime.parallel`).

        Returns:
            A :class:`ServeResult`; storage read failures during onboarding are recorded in
            ``errors`` (prefix stops at the failed block, which is recomputed).

        Raises:
            PoolExhaustedError: the request has more full blocks than G1 can hold at once.
            ValueError: a token id outside ``[0, 2**32)``.
        """
        hashes = self.sequence_hashes(tokens)
        n = len(hashes)
        result = ServeResult(num_blocks=n, sequence_hashes=list(hashes))
        if n == 0:
            self._account(result, looked_up=0)
            return result
        if n > self.g1.num_blocks:
            raise PoolExhaustedError(f"request has {n} full blocks but G1 holds only {self.g1.num_blocks}")
        metas = [
            BlockMeta(h, hashes[i - 1] if i else None, hashes[0], self.salt) for i, h in enumerate(hashes)
        ]
        toks = np.asarray(tokens).reshape(-1)
        with self._lock:
            g1_handles: dict[int, ImmutableBlock] = {}
            scratch: list[MutableBlock] = []
            try:
                self._serve_locked(toks, metas, kv_fill, result, g1_handles, scratch, max_prefix)
            finally:
                # on an error (kv_fill raising, storage failing hard...) unregistered blocks
                # go back to Reset at once, not whenever the traceback is collected
                for mb in scratch:
                    if not mb.consumed:
                        mb.release()
                for handle in g1_handles.values():
                    if not handle.consumed:
                        handle.release()
        return result

    def _serve_locked(
        self,
        tokens: np.ndarray,
        metas: list[BlockMeta],
        kv_fill: KvFill,
        result: ServeResult,
        g1_handles: dict[int, ImmutableBlock],
        scratch: list[MutableBlock],
        max_prefix: int | None = None,
    ) -> None:
        n = len(metas)
        page = self.layout_config.page_size
        tm = self.transfers
        # 1-2. lookup: G1 → G2 → storage, per position, stop at first miss
        g2_handles: dict[int, ImmutableBlock] = {}
        storage_pos: list[int] = []
        storage_tier: dict[int, str] = {}
        try:
            placements = self._locate_missing(metas)
            prefix = 0
            for i, meta in enumerate(metas):
                if max_prefix is not None and i >= max_prefix:
                    break
                h = meta.sequence_hash
                got = self.g1.match_blocks([h])
                if got:
                    g1_handles[i] = got[0]
                else:
                    got = self.g2.match_blocks([h])
                    if got:
                        g2_handles[i] = got[0]
                    elif placements.get(i) is not None:
                        storage_pos.append(i)
                        storage_tier[i] = self._tier_of(placements[i])  # type: ignore[arg-type]
                    else:
                        break
                prefix = i + 1
            onboard = [i for i in range(prefix) if i not in g1_handles]
            fresh = self.g1.allocate(len(onboard) + n - prefix)
            scratch.extend(fresh)
            slot = {i: fresh[k] for k, i in enumerate(onboard)}
            spare: list[MutableBlock] = fresh[len(onboard) :]
            # 3a. onboard: storage → G1 first (G3_TO_G1 path); a failed read stops the prefix
            valid = prefix
            if storage_pos:
                keys = [self.block_key(metas[i].sequence_hash) for i in storage_pos]
                got3 = tm.onboard_from_storage(keys, self.g1.layout, [slot[i].block_id for i in storage_pos]).result()
                if got3.failed_index is not None:
                    valid = storage_pos[got3.failed_index]
                    cause = got3.error
                    assert cause is not None
                    logger.warning("onboard read of block %d (%#x) failed: %r", valid, metas[valid].sequence_hash, cause)
                    self.publish_dropped(got3.dropped, {metas[i].sequence_hash: metas[i] for i in storage_pos})
                    result.errors.append(
                        ServeError(valid, metas[valid].sequence_hash, "onboard", type(cause).__name__, str(cause))
                    )
                    self.metrics.onboard_errors.inc()
            if valid < prefix:
                # blocks past the failed one are recomputed, not reused
                for i in [i for i in g1_handles if i >= valid]:
                    g1_handles.pop(i).release()
                for i in [i for i in g2_handles if i >= valid]:
                    g2_handles.pop(i).release()
                spare = [slot.pop(i) for i in onboard if i >= valid] + spare
                onboard = [i for i in onboard if i < valid]
                short = (n - valid) - len(spare)
                if short > 0:
                    extra = self.g1.allocate(short)
                    scratch.extend(extra)
                    spare.extend(extra)
            # G2 → G1 (G2_TO_G1 path; the job releases the G2 handles)
            from_g2 = [i for i in onboard if i in g2_handles]
            tm.onboard_from_host(
                [g2_handles.pop(i) for i in from_g2], self.g1.layout, [slot[i].block_id for i in from_g2]
            ).result()
            ready: list[MutableBlock] = []
            for i in onboard:
                ready.append(slot[i].init_from(metas[i]))
                scratch.append(ready[-1])
            for i, handle in zip(onboard, self.g1.register_blocks(ready), strict=True):
                g1_handles[i] = handle
            result.hits_g1 = valid - len(onboard)
            result.hits_g2 = len(from_g2)
            result.hits_g3 = sum(1 for i in onboard if storage_tier.get(i) == "g3")
            result.hits_g4 = sum(1 for i in onboard if storage_tier.get(i) == "g4")
            result.onboarded_bytes = len(onboard) * self.block_bytes
            self.metrics.matched_tokens.inc(len(onboard) * page)
        finally:
            for handle in g2_handles.values():
                handle.release()
        # 3b. compute the rest in G1, in block order
        compute = list(range(valid, n))
        for extra_block in spare[len(compute) :]:
            extra_block.release()
        computed: list[MutableBlock] = []
        for k, i in enumerate(compute):
            mb = spare[k].init_sequence(self.salt, metas[i - 1] if i else None)
            scratch.append(mb)
            mb.append_tokens(tokens[i * page : (i + 1) * page])
            mb = mb.commit()
            scratch.append(mb)
            assert mb.sequence_hash == metas[i].sequence_hash
            kv_fill(metas[i].sequence_hash, mb.view())
            computed.append(mb)
        for i, handle in zip(compute, self.g1.register_blocks(computed), strict=True):
            g1_handles[i] = handle
        result.computed = len(compute)
        # 4. write-through offload G1 → G2 → G3 (the producing step is over)
        result.offloaded_bytes = self._offload(metas, g1_handles, result)
        self._account(result, looked_up=n - result.hits_g1)

    def publish_dropped(self, dropped: Sequence[Placement], metas: Mapping[int, BlockMeta]) -> list[KVEvent]:
        """Publish one Remove(<volume>) per copy a failed read quarantined (``dropped``,
        :attr:`StorageOnboardResult.dropped`), so the advisor and any router stop placing
        the block there; ``metas`` gives the identity of the blocks read, by sequence hash
        (copies of other blocks or namespaces are skipped).  Flushes the publisher.

        Returns:
            The events published (in ``dropped`` order).
        """
        events = [
            KVEvent(EventType.REMOVE, m.sequence_hash, m.prefix_hash, m.parent_hash, self.block_bytes, p.volume_id)
            for p in dropped
            if p.key.namespace == self.namespace and (m := metas.get(p.key.sequence_hash)) is not None
        ]
        if events:
            self.publisher.publish(events)
            self.publisher.flush()
        return events

    def lookup(self, tokens: np.ndarray | Sequence[int]) -> int:
        """Leading full blocks of ``tokens`` held in G1, G2 or storage (no side effects:
        nothing is pinned, touched or read).

        Raises:
            ValueError: a token id outside ``[0, 2**32)``.
        """
        hashes = self.sequence_hashes(tokens)
        metas = [BlockMeta(h, hashes[i - 1] if i else None, hashes[0], self.salt) for i, h in enumerate(hashes)]
        with self._lock:
            placements = self._locate_missing(metas)
            for i, h in enumerate(hashes):
                if not (self.g1.contains(h) or self.g2.contains(h) or placements.get(i) is not None):
                    return i
            return len(hashes)

    # ------------------------------------------------------------------ lookup / onboarding helpers

    def _locate_missing(self, metas: list[BlockMeta]) -> dict[int, Placement | None]:
        """Placements (from the storage agent) of blocks held neither in G1 nor in G2."""
        if self.store is None:
            return {}
        want = [i for i, m in enumerate(metas) if not self.g1.contains(m.sequence_hash) and not self.g2.contains(m.sequence_hash)]
        if not want:
            return {}
        found = self.store.locate([self.block_key(metas[i].sequence_hash) for i in want])
        return dict(zip(want, found, strict=True))

    def _tier_of(self, placement: Placement) -> str:
        """``"g4"`` for a volume whose media is ``object``, else ``"g3"``."""
        media = self._media.get(placement.volume_id)
        if media is None:
            assert self.store is not None
            media = MediaClass(self.store.volume(placement.volume_id).media)
            self._media[placement.volume_id] = media
        return "g4" if media is MediaClass.OBJECT else "g3"

    # ------------------------------------------------------------------ offload

    def _offload(self, metas: list[BlockMeta], g1_handles: dict[int, ImmutableBlock], result: ServeResult) -> int:
        """Write-through G1 → G2 (blocks G2 lacks), then G2 → G3 (keys the agent lacks and
        the admission filter lets through), through the transfer manager; waits for both.

        Returns:
            Bytes written (G2 + G3).
        """
        step = StepEvent.completed()
        tm = self.transfers
        g1_weak = [g1_handles[i].weak() for i in range(len(metas))]
        host = tm.offload_to_host(
            [HostOffloadItem(m, self.g1.layout, g1_handles[i].block_id, g1_weak[i]) for i, m in enumerate(metas)], step
        ).result()
        written = host.copied * self.block_bytes
        if self.store is None:
            return written
        items = [
            StorageOffloadItem(m, self.block_key(m.sequence_hash), (host.blocks[i], g1_weak[i]))
            for i, m in enumerate(metas)
        ]
        res = tm.offload_to_storage(items, step).result()
        if res.error is not None:
            # only the blocks that did not land (a put may fail part-way, case C14)
            exc = res.error
            for i in res.failed:
                result.errors.append(ServeError(i, metas[i].sequence_hash, "offload", type(exc).__name__, str(exc)))
        result.stored_g3 = res.written
        return written + res.written * self.block_bytes

    @staticmethod
    def _host_bytes(layout: BlockLayout, block_id: int) -> torch.Tensor:
        """Contiguous CPU ``uint8`` bytes of a block in universal format (a view when the
        layout allows it, else a copy)."""
        return host_bytes(layout, block_id)

    # ------------------------------------------------------------------ accounting / introspection

    def _account(self, result: ServeResult, looked_up: int) -> None:
        t = self._totals
        t.requests += 1
        t.blocks += result.num_blocks
        t.hits_g1 += result.hits_g1
        t.hits_g2 += result.hits_g2
        t.hits_g3 += result.hits_g3
        t.hits_g4 += result.hits_g4
        t.computed += result.computed
        t.onboarded_bytes += result.onboarded_bytes
        t.offloaded_bytes += result.offloaded_bytes
        t.stored_g3 += result.stored_g3
        t.errors += len(result.errors)
        self.metrics.record_lookup(looked_up, result.hits_g2, result.hits_g3 + result.hits_g4)

    def resident(self, tier: str) -> set[int]:
        """Sequence hashes registered at ``"g1"`` or ``"g2"`` (active or inactive)."""
        return self.pool(tier).resident()

    def read_block(self, tier: str, sequence_hash: int) -> torch.Tensor:
        """Bytes (universal format, CPU ``uint8``, ``block_bytes`` long) of a resident block.

        Raises:
            KeyError: the block is not registered at ``tier``.
            ValueError: unknown tier.
        """
        pool = self.pool(tier)
        handle = pool.get(sequence_hash)
        if handle is None:
            raise KeyError(f"block {sequence_hash:#x} is not resident at {tier}")
        try:
            return pool.layout.read_bytes(handle.block_id)
        finally:
            handle.release()

    def stats(self) -> dict[str, Any]:
        """Totals since start, per-pool counts and hit rates (plain dict)."""
        with self._lock:
            t = self._totals
            pools: dict[str, PoolStats] = {"g2": self.g2.stats()}
            if self._g1 is not None:
                pools = {"g1": self._g1.stats(), **pools}
            return {
                "requests": t.requests,
                "blocks": t.blocks,
                "hits_g1": t.hits_g1,
                "hits_g2": t.hits_g2,
                "hits_g3": t.hits_g3,
                "hits_g4": t.hits_g4,
                "computed": t.computed,
                "onboarded_bytes": t.onboarded_bytes,
                "offloaded_bytes": t.offloaded_bytes,
                "stored_g3": t.stored_g3,
                "errors": t.errors,
                "block_bytes": self.block_bytes,
                "pools": {name: vars_of(s) for name, s in pools.items()},
                "g2_resident_blocks": pools["g2"].registered_hashes,
                "onboarded_by_volume": self.metrics.onboarded_by_volume(),
                "host_cache_hit_rate": self.metrics.sample("kvbm_host_cache_hit_rate"),
                "disk_cache_hit_rate": self.metrics.sample("kvbm_disk_cache_hit_rate"),
            }

    def flush(self) -> None:
        """Send the publisher's pending events now."""
        self.publisher.flush()

    def close(self) -> None:
        """Stop the transfer manager (queued transfers are cancelled), stop the metrics
        endpoint and flush the publisher (it is not closed: the caller owns it).
        Idempotent."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self.transfers.close()
            self.metrics.stop_http()
            self.publisher.flush()


def vars_of(obj: Any) -> dict[str, Any]:
    """Fields of a slotted dataclass as a dict."""
    return {name: getattr(obj, name) for name in obj.__slots__}
