"""Transfer manager: asynchronous per-path queues that move blocks between tiers.

Paths (KVBM's names for the directions in parentheses)::

    G1_TO_G2  offload  device → host        (d2h)   batched index copy into reserved G2 blocks
    G2_TO_G3  offload  host → storage       (h2d)   one ``store.put`` per batch; the G1 copy
                                            (d2d)   is used when the G2 copy is gone
    G2_TO_G1  onboard  host → device        (h2d)   batched copy into caller-owned G1 blocks
    G3_TO_G1  onboard  storage → device     (d2d)   ``store.get`` straight into G1 when the G1
                                                    block is contiguous host memory, else
                                                    through a host bounce buffer

Each path has one worker thread and a FIFO queue of jobs; a worker takes the head job and
every following job that is ready, up to ``max_batch_blocks`` blocks, and moves them with one
transfer.  Submitting returns a :class:`concurrent.futures.Future`; ``future.cancel()``
withdraws a job that has not started, and a cancelled offload gives back the G2 blocks it
had reserved at once (they return to the Reset list).

Offload pipeline (both offload paths)::

    submit:  policy check (G1→G2: skip hashes G2 already holds; G2→G3: skip keys the store
             holds, then the disk admission filter) → reserve destination blocks → queue
    worker:  batch → wait for the producing step (:class:`StepEvent`) → weak → strong
             upgrade of each source (a block evicted meanwhile is skipped) → transfer →
             register at the destination / publish Store(volume) → release sources

The disk admission filter (:class:`DiskOffloadFilter`, KVBM's frequency filter) keeps
blocks used once off the disk: a block goes from G2 to G3 only when its frequency is at
least ``min_frequency`` (2); the frequency starts at 1 when the block is first offered,
doubles on each further offer and drops by 1 every ``decay_interval_s`` (entries reaching
0 are forgotten).
"""

from __future__ import annotations

import enum
import heapq
import logging
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from itertools import repeat
from operator import attrgetter
from typing import Any, Protocol

import torch

from event_plane.schema import EventType, KVEvent
from storage_backends.memory_budget import MemoryBudgetError, check_allocation
from storage_backends.types import BlockKey, BlockNotFoundError, Placement

from .block import BlockMeta, ImmutableBlock, MutableBlock, PinnedBlocks, WeakBlock
from .errors import CapacityConfigError, KvbmError
from .layout import BlockLayout, FullyContiguous, copy_blocks
from .metrics import RuntimeMetrics
from .pool import BlockPool, EventSink

logger = logging.getLogger(__name__)

# attribute readers for the per-item lists of the G1 → G2 path, built at C speed with map()
_GENERATION = attrgetter("generation")
_META = attrgetter("meta")
_META_HASH = attrgetter("meta.sequence_hash")
_SRC = attrgetter("src")
_SRC_LAYOUT = attrgetter("src_layout")
_SRC_ID = attrgetter("src_block_id")
_POOL = attrgetter("_pool")
_BLOCK = attrgetter("_block")
_BLOCK_ID = attrgetter("block_id")
_LIVE = attrgetter("_live")


class TransferClosedError(KvbmError):
    """A job was submitted to (or was still queued in) a closed transfer manager."""


class TransferPath(str, enum.Enum):
    """Direction of a transfer (see module doc)."""

    G1_TO_G2 = "g1_to_g2"
    G2_TO_G3 = "g2_to_g3"
    G2_TO_G1 = "g2_to_g1"
    G3_TO_G1 = "g3_to_g1"


class StepEvent:
    """Completion of the engine step that produces some blocks' KV.

    Offloads queued with a step wait until :meth:`done` is called: KV written by a forward
    pass must not be copied before the pass has finished.
    """

    __slots__ = ("_event",)

    def __init__(self, done: bool = False) -> None:
        self._event = threading.Event()
        if done:
            self._event.set()

    @classmethod
    def completed(cls) -> StepEvent:
        """A step that has already finished: one shared instance (a finished step never
        changes; :meth:`done` on it does nothing), so the offload an engine queues after its
        step builds no lock or event."""
        return _COMPLETED_STEP

    def done(self) -> None:
        """Mark the step finished (idempotent)."""
        self._event.set()

    @property
    def is_done(self) -> bool:
        """Whether :meth:`done` was called."""
        return self._event.is_set()

    def wait(self, timeout: float | None = None) -> bool:
        """Wait up to ``timeout`` seconds; True once the step is done."""
        return self._event.wait(timeout)


_COMPLETED_STEP = StepEvent(done=True)


class DiskOffloadFilter:
    """Admission filter before blocks are written to disk (G3), as KVBM's frequency filter.

    ``offer(h)`` counts one offer (hit) of block ``h``: the first sets its frequency to 1,
    each later one doubles it (capped at 2**16); the block is admitted when its frequency
    is at least ``min_frequency``.  Every ``decay_interval_s`` seconds (measured with
    ``clock``) every frequency drops by 1 and entries reaching 0 are forgotten.  When more
    than ``max_entries`` blocks are tracked, decay steps are applied at once until at most
    ``max_entries`` remain (as many steps as needed, in one pass) and the decay clock
    restarts.

    With the default ``min_frequency=2`` a block offered twice between two decay steps is
    admitted at its second offer (1 → 2); a block offered once per decay interval never is
    (1 → 0, forgotten, 1 again).

    Args:
        min_frequency: frequency needed for admission (>= 1).
        decay_interval_s: seconds between two decay steps (> 0).
        max_entries: most blocks tracked (> 0).
        clock: monotonic seconds (``time.monotonic``).

    Raises:
        ValueError: on out-of-range arguments.
    """

    _CAP = 1 << 16

    def __init__(
        self,
        min_frequency: int = 2,
        decay_interval_s: float = 600.0,
        max_entries: int = 1 << 20,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        if min_frequency < 1 or decay_interval_s <= 0 or max_entries < 1:
            raise ValueError(
                f"invalid filter settings: min_frequency={min_frequency}, "
                f"decay_interval_s={decay_interval_s}, max_entries={max_entries}"
            )
        self.min_frequency = min_frequency
        self.decay_interval_s = decay_interval_s
        self.max_entries = max_entries
        self._clock = clock
        self._counts: dict[int, int] = {}
        self._last_decay = clock()
        self._lock = threading.Lock()

    def offer(self, sequence_hash: int) -> bool:
        """Count one offer of a block; True when it may be written to disk now."""
        with self._lock:
            self._decay_due()
            count = self._counts.get(sequence_hash)
            count = 1 if count is None else min(count * 2, self._CAP)
            self._counts[sequence_hash] = count
            if len(self._counts) > self.max_entries:
                self._shrink()
            return count >= self.min_frequency

    def frequency(self, sequence_hash: int) -> int:
        """Current frequency of a block (0 when not tracked)."""
        with self._lock:
            self._decay_due()
            return self._counts.get(sequence_hash, 0)

    def __len__(self) -> int:
        with self._lock:
            return len(self._counts)

    def _decay_due(self) -> None:
        now = self._clock()
        steps = int((now - self._last_decay) // self.decay_interval_s)
        if steps <= 0:
            return
        self._last_decay += steps * self.decay_interval_s
        self._decrement(steps)

    def _decrement(self, steps: int) -> None:
        """``steps`` decay steps at once: every frequency minus ``steps``, zeros forgotten."""
        self._counts = {h: c - steps for h, c in self._counts.items() if c > steps}

    def _shrink(self) -> None:
        """The fewest decay steps that leave at most ``max_entries`` entries: the
        ``max_entries + 1``-th largest frequency (every entry at or below it goes)."""
        over = len(self._counts) - self.max_entries
        self._decrement(heapq.nsmallest(over, self._counts.values())[-1])
        self._last_decay = self._clock()


class BlockStore(Protocol):
    """The part of ``storage_backends.StorageAgent`` the transfer manager uses."""

    def put(self, items: Sequence[tuple[BlockKey, torch.Tensor]], volume_id: str) -> list[Placement]: ...

    def get(self, keys: Sequence[BlockKey], out: Any = None, *, sources: list[str] | None = None) -> list[torch.Tensor]: ...

    def exists(self, keys: Sequence[BlockKey]) -> list[bool]: ...


# ---------------------------------------------------------------------------- job inputs / results


@dataclass(frozen=True, slots=True)
class HostOffloadItem:
    """One block to copy into G2.

    Attributes:
        meta: identity of the block.
        src_layout: layout holding the source (G1 pool layout, or an engine's KV cache).
        src_block_id: block index in ``src_layout``.
        src: weak handle on the source; upgraded before the copy, the item is skipped when
            the block was evicted meanwhile.  ``None`` when the caller keeps the source alive
            (an engine's own KV cache).
    """

    meta: BlockMeta
    src_layout: BlockLayout
    src_block_id: int
    src: WeakBlock | None = None


@dataclass(frozen=True, slots=True)
class StorageOffloadItem:
    """One block to put into the storage agent.

    Attributes:
        meta: identity of the block.
        key: storage key.
        sources: weak handles tried in order (the G2 copy first, then G1); the item is
            skipped when none upgrades.
    """

    meta: BlockMeta
    key: BlockKey
    sources: tuple[WeakBlock | None, ...]


@dataclass(slots=True)
class HostOffloadResult:
    """Outcome of an offload to G2.

    Attributes:
        blocks: per item, a weak handle on the G2 copy (new or already held), ``None`` when
            the source was evicted before the copy.
        copied: blocks copied into G2 by this job.
        already: blocks G2 held before (policy check; no copy).
        skipped: items whose source was gone at transfer time.
    """

    blocks: list[WeakBlock | None]
    copied: int = 0
    already: int = 0
    skipped: int = 0


@dataclass(slots=True)
class StorageOffloadResult:
    """Outcome of an offload to the storage agent.

    Attributes:
        placements: per item, its placement; ``None`` when not written (already stored,
            refused by the admission filter, skipped, or failed).
        submitted: indices of the items that passed the policy check (queued for writing).
        held: items the store already held.
        filtered: items the admission filter kept off the disk.
        skipped: items whose sources were all gone at transfer time.
        from_host, from_device: items written from a G2 / G1 copy (each has its placement
            and one Store(<volume id>) event).
        error: the exception of a failed ``put``.  A put can fail part-way (the volume
            filled up after some segments landed): the blocks that landed still count as
            written, get their placement and their Store; the others are in ``failed``.
        failed: indices of the items the failed ``put`` did not store (no placement, no
            Store; their host copy stays registered).
    """

    placements: list[Placement | None]
    submitted: list[int] = field(default_factory=list)
    held: int = 0
    filtered: int = 0
    skipped: int = 0
    from_host: int = 0
    from_device: int = 0
    error: BaseException | None = None
    failed: list[int] = field(default_factory=list)

    @property
    def written(self) -> int:
        """Items written to storage by this job."""
        return self.from_host + self.from_device


@dataclass(slots=True)
class StorageOnboardResult:
    """Outcome of an onboard from the storage agent.

    Attributes:
        loaded: items read and copied into their destination: always a prefix of the
            request (reading stops at the first failure).
        failed_index: index of the first item that could not be read, else ``None``.
        error: its exception (for a checksum mismatch or a lost segment, that error, not
            the "not found" that a retry of the quarantined copy gives).
        dropped: copies the failed read quarantined (:attr:`StorageError.dropped` of
            every error met, the failed item's and any other's of its batch): the catalog
            no longer holds them, so their Removes are owed
            (:meth:`kvbm_runtime.manager.BlockManager.publish_dropped`).
    """

    loaded: int
    failed_index: int | None = None
    error: BaseException | None = None
    dropped: list[Placement] = field(default_factory=list)


# ---------------------------------------------------------------------------- internals


@dataclass(eq=False)
class _Job:
    path: TransferPath
    size: int
    run: Callable[[list[_Job]], None]
    future: Future[Any]
    step: StepEvent | None = None
    payload: Any = None
    cleanup: Callable[[], None] | None = None

    def ready(self) -> bool:
        return self.step is None or self.step.is_done


class _PathWorker:
    """Queue + thread of one path."""

    def __init__(self, path: TransferPath, max_batch: int) -> None:
        self.path = path
        self.max_batch = max_batch
        self.queue: deque[_Job] = deque()
        self.cond = threading.Condition()
        self.closed = False
        self.batches = 0
        self.jobs_done = 0
        self.thread = threading.Thread(target=self._loop, name=f"kvbm-{path.value}", daemon=True)
        self.started = False  # the thread starts with the first job

    def submit(self, job: _Job) -> None:
        with self.cond:
            if self.closed:
                raise TransferClosedError(f"transfer manager is closed ({self.path.value})")
            self.queue.append(job)
            if not self.started:
                self.started = True
                self.thread.start()
            self.cond.notify()

    def pending(self) -> int:
        with self.cond:
            return sum(1 for j in self.queue if not j.future.cancelled())

    def _next_batch(self) -> list[_Job] | None:
        with self.cond:
            while True:
                while self.queue and self.queue[0].future.cancelled():
                    self.queue.popleft()
                if self.closed and not self.queue:
                    return None
                if not self.queue:
                    self.cond.wait()
                    continue
                head = self.queue[0]
                if not head.ready():
                    # the head's step is still running: poll it (and cancellations / close)
                    self.cond.wait(0.002)
                    continue
                batch: list[_Job] = []
                size = 0
                while self.queue:
                    job = self.queue[0]
                    if job.future.cancelled():
                        self.queue.popleft()
                        continue
                    if not job.ready() or (batch and size + job.size > self.max_batch):
                        break
                    self.queue.popleft()
                    if job.future.set_running_or_notify_cancel():
                        batch.append(job)
                        size += job.size
                if batch:
                    return batch

    def _loop(self) -> None:
        while True:
            batch = self._next_batch()
            if batch is None:
                return
            try:
                batch[0].run(batch)
            except BaseException as exc:  # noqa: BLE001 - handed to every job of the batch
                logger.warning("%s batch of %d jobs failed: %r", self.path.value, len(batch), exc)
                for job in batch:
                    if job.cleanup is not None:
                        job.cleanup()
                    if not job.future.done():
                        job.future.set_exception(exc)
            self.batches += 1
            self.jobs_done += len(batch)

    def close(self) -> None:
        with self.cond:
            self.closed = True
            queued = list(self.queue)
            self.cond.notify_all()
        for job in queued:
            job.future.cancel()
        if self.started:
            self.thread.join(timeout=10)


def release_live(handles: list[ImmutableBlock]) -> None:
    """Release the strong handles in ``handles`` that are not consumed yet: one
    ``release_blocks`` call per pool (one call in all when they share a pool), so a batch of
    N handles costs O(1) Python calls.  A handle listed twice is released once (handles
    hash by identity).  Idempotent: a second call finds them consumed.
    """
    live = list(dict.fromkeys(filter(_LIVE, handles)))
    if not live:
        return
    pools = set(map(_POOL, live))
    if len(pools) == 1:
        pools.pop().release_blocks(live)
        return
    by_pool: dict[BlockPool, list[ImmutableBlock]] = {}
    for h in live:
        by_pool.setdefault(h._pool, []).append(h)
    for pool, hs in by_pool.items():
        pool.release_blocks(hs)


def host_bytes(layout: BlockLayout, block_id: int) -> torch.Tensor:
    """Contiguous CPU ``uint8`` bytes of a block in universal format: a view into the
    layout when the block is contiguous host memory, else a copy."""
    if isinstance(layout, FullyContiguous) and layout.storage.device.type == "cpu":
        start = block_id * layout.block_stride
        return layout.storage[start : start + layout.block_bytes]
    return layout.read_bytes(block_id)


def direct_host_slot(layout: BlockLayout, block_id: int) -> torch.Tensor | None:
    """The block's bytes as a writable contiguous CPU view (a direct storage → block path),
    or ``None`` when the block is not contiguous host memory (needs a bounce buffer)."""
    if isinstance(layout, FullyContiguous) and layout.storage.device.type == "cpu":
        start = block_id * layout.block_stride
        return layout.storage[start : start + layout.block_bytes]
    return None


class TransferManager:
    """Per-path asynchronous transfers of one worker (see module doc).

    Args:
        g2: the host pool offloads go to.
        publisher: where Store(volume) events of storage offloads go; one whose
            ``wants_events`` is false (``null://``) gets only their number (``skip_events``).
        metrics: counters to advance (``kvbm_offload_blocks_*``, ``kvbm_onboard_blocks_*``).
        store: the storage agent (``None``: no G3 paths).
        g3_volume: volume id offloads are put into.
        disk_filter: admission filter of the G2 → G3 path (``None``: write through).
        max_batch_blocks: most blocks one batch moves.
        bounce_blocks: blocks in the host bounce buffer of the G3 → G1 path.

    Raises:
        ValueError: ``store`` without ``g3_volume`` or the reverse, or non-positive sizes.
    """

    def __init__(
        self,
        g2: BlockPool,
        publisher: EventSink,
        metrics: RuntimeMetrics,
        store: BlockStore | None = None,
        g3_volume: str | None = None,
        *,
        disk_filter: DiskOffloadFilter | None = None,
        max_batch_blocks: int = 256,
        bounce_blocks: int = 32,
    ) -> None:
        if (store is None) != (g3_volume is None):
            raise ValueError("store and g3_volume must be given together")
        if max_batch_blocks <= 0 or bounce_blocks <= 0:
            raise ValueError(f"max_batch_blocks ({max_batch_blocks}) and bounce_blocks ({bounce_blocks}) must be > 0")
        try:  # allocated on first use: refuse its size now, not in the middle of a transfer
            check_allocation("G3 -> G1 bounce buffer", bounce_blocks * g2.block_bytes,
                             f"bounce_blocks={bounce_blocks} x {g2.block_bytes} bytes per block")
        except MemoryBudgetError as exc:
            raise CapacityConfigError(str(exc)) from None
        self.g2 = g2
        self.publisher = publisher
        # events off (``null://``, like the pools): Store(volume) events are only counted
        self._skip_events: Callable[[int], None] | None = None
        if getattr(publisher, "wants_events", True) is False:
            self._skip_events = getattr(publisher, "skip_events", None) or (lambda count: None)
        self.metrics = metrics
        self.store = store
        self.g3_volume = g3_volume
        self.disk_filter = disk_filter
        self.block_bytes = g2.block_bytes
        self.bounce_blocks = bounce_blocks
        self._bounce: torch.Tensor | None = None
        self._workers = {p: _PathWorker(p, max_batch_blocks) for p in TransferPath}
        self._closed = False

    # ------------------------------------------------------------------ introspection

    def pending(self, path: TransferPath) -> int:
        """Jobs queued (not started, not cancelled) on ``path``."""
        return self._workers[path].pending()

    def batches(self, path: TransferPath) -> int:
        """Batches executed on ``path`` since start."""
        return self._workers[path].batches

    def bounce_buffer(self) -> torch.Tensor:
        """``[bounce_blocks, block_bytes]`` uint8 host buffer (pinned when CUDA is present)."""
        if self._bounce is None:
            pin = torch.cuda.is_available()
            self._bounce = torch.empty((self.bounce_blocks, self.block_bytes), dtype=torch.uint8, pin_memory=pin)
        return self._bounce

    # ------------------------------------------------------------------ G1 → G2

    def offload_to_host(self, items: Sequence[HostOffloadItem], step: StepEvent | None = None) -> Future[HostOffloadResult]:
        """Queue an offload of ``items`` into G2.

        Policy check at submit: items whose hash G2 already holds are not copied (their
        result is a weak handle on the existing copy); destination blocks for the others
        are reserved now (G2 blocks of this request are pinned meanwhile, so the
        reservation cannot evict them).  The copy waits for ``step``.

        Returns:
            A future of :class:`HostOffloadResult`; ``cancel()`` before it starts returns
            the reserved G2 blocks to Reset and publishes nothing.

        Raises:
            PoolExhaustedError: G2 cannot reserve the blocks (nothing reserved then).
            TransferClosedError: the manager is closed.
        """
        self._check_open()
        items = list(items)  # the job's own copy: the caller may reuse its list
        n = len(items)
        blocks: list[WeakBlock | None] = [None] * n
        held = self.g2.get_many(list(map(_META_HASH, items)))
        if held.count(None) == n:  # nothing held yet (the common case): every item, in order
            todo = list(range(n))
            metas = list(map(_META, items))
            present: list[tuple[int, ImmutableBlock]] = []
        else:
            todo = [i for i, h in enumerate(held) if h is None]
            metas = [items[i].meta for i in todo]
            present = [(i, h) for i, h in enumerate(held) if h is not None]
        try:
            # Complete blocks carrying their identities; the copy fills them later
            reserved = self.g2.allocate_complete(metas) if todo else []
        finally:
            if present:
                for (i, _), weak in zip(present, self.g2.downgrade_many([h for _, h in present]), strict=True):
                    blocks[i] = weak
        result = HostOffloadResult(blocks=blocks, already=n - len(todo))
        future: Future[HostOffloadResult] = Future()
        if not todo:
            future.set_running_or_notify_cancel()
            future.set_result(result)
            return future
        payload = (items, todo, reserved, result)

        def cleanup() -> None:
            for mb in reserved:
                if not mb.consumed:
                    mb.release()

        self._enqueue(TransferPath.G1_TO_G2, len(todo), self._run_host_offload, future, step, payload, cleanup)
        return future

    def _run_host_offload(self, jobs: list[_Job]) -> None:
        # the batch as flat lists: item, reserved destination, source weak handle
        if len(jobs) == 1:
            items, todo, dsts, _ = jobs[0].payload
            items_all: list[HostOffloadItem] = items if len(todo) == len(items) else [items[i] for i in todo]
        else:
            items_all = []
            dsts = []
            for job in jobs:
                items, todo, reserved, _ = job.payload
                items_all.extend(items if len(todo) == len(items) else [items[i] for i in todo])
                dsts.extend(reserved)
        n = len(items_all)
        # weak → strong upgrade of the sources, one lock per source pool; an evicted
        # source comes back None and its item is skipped
        gone = [False] * n
        lost_any = False
        held: list[PinnedBlocks] = []
        by_pool: dict[BlockPool, list[int]] = {}
        srcs: list[WeakBlock | None] = list(map(_SRC, items_all))
        pools = set(map(_POOL, srcs)) if n and None not in srcs else None
        if pools is not None and len(pools) == 1:
            by_pool[pools.pop()] = []  # every source in one pool (the common case): all of them
        else:
            for k, src in enumerate(srcs):
                if src is not None:
                    ks = by_pool.get(src._pool)
                    if ks is None:
                        ks = by_pool[src._pool] = []
                    ks.append(k)
        for pool, ks in by_pool.items():
            whole = not ks
            pins = pool.pin_many(srcs if whole else [srcs[k] for k in ks])  # type: ignore[arg-type]
            held.append(pins)
            if pins.lost:
                lost_any = True
                for j in pins.lost:
                    gone[j if whole else ks[j]] = True
        settled = False
        try:
            dst_blocks = list(map(_BLOCK, dsts))
            g2 = self.g2
            # weak handles on the destinations built now, while their objects are still in
            # cache (the copy flushes it): the registration returns them when every block
            # registers as itself
            weaks_pre = list(map(WeakBlock, repeat(g2, n), dst_blocks, map(_GENERATION, dst_blocks), map(_META_HASH, dst_blocks)))
            # copy: one call per source layout (runs of consecutive blocks are one slice copy)
            groups: dict[int, tuple[BlockLayout, list[int], list[int]]] = {}
            if n and not lost_any and len(set(map(id, map(_SRC_LAYOUT, items_all)))) == 1:
                # one source layout, nothing lost (the common case): the id lists at once
                groups[0] = (items_all[0].src_layout, list(map(_SRC_ID, items_all)), list(map(_BLOCK_ID, dst_blocks)))
            else:
                for item, b, lost in zip(items_all, dst_blocks, gone, strict=True):
                    if lost:
                        continue
                    layout = item.src_layout
                    g = groups.get(id(layout))
                    if g is None:
                        g = groups[id(layout)] = (layout, [], [])
                    g[1].append(item.src_block_id)
                    g[2].append(b.block_id)
            for layout, src_ids, dst_ids in groups.values():
                copy_blocks(layout, src_ids, g2.layout, dst_ids)
            # register per job, in submission order (Store("g2") events in block order)
            pos = 0
            for job in jobs:
                _, todo, reserved, result = job.payload
                k = len(todo)
                if lost_any and any(gone[pos : pos + k]):
                    lost_here = gone[pos : pos + k]
                    result.skipped += sum(lost_here)
                    for dst, lost in zip(reserved, lost_here, strict=True):
                        if lost:
                            dst.release()
                    mine = [dst for dst, lost in zip(reserved, lost_here, strict=True) if not lost]
                    slots = [i for i, lost in zip(todo, lost_here, strict=True) if not lost]
                    pre = None
                else:
                    mine, slots = reserved, todo
                    pre = weaks_pre if len(jobs) == 1 else weaks_pre[pos : pos + k]
                # registered and left inactive in one call, no strong handle per block (a
                # dedup onto a copy registered meanwhile gets a handle on that copy)
                weak_g2 = g2.register_downgrade(mine, pre)
                pos += k
                blocks = result.blocks
                if len(slots) == len(blocks):  # every item copied: slots are 0..n-1
                    blocks[:] = weak_g2
                else:
                    for i, weak in zip(slots, weak_g2, strict=True):
                        blocks[i] = weak
                result.copied = len(mine)
                self.metrics.offload_d2h.inc(len(mine))
            settled = True  # every destination was registered or released above
        finally:
            for pins in held:
                pins.release()
            if not settled:
                for dst in dsts:
                    if dst._live:
                        dst.release()
        for job in jobs:
            job.future.set_result(job.payload[3])

    # ------------------------------------------------------------------ G2 → G3

    def offload_to_storage(
        self, items: Sequence[StorageOffloadItem], step: StepEvent | None = None
    ) -> Future[StorageOffloadResult]:
        """Queue a put of ``items`` into the storage volume.

        Policy check at submit: keys the store already holds are dropped, then each
        remaining block is offered to the admission filter (when one is set); only admitted
        blocks are queued.  At transfer time each item uses its first source that still
        upgrades; Store(<volume id>) events follow the item order.

        Returns:
            A future of :class:`StorageOffloadResult`; a failed ``put`` is reported in its
            ``error`` (the future itself does not fail for it).

        Raises:
            StorageTierError-like ``ValueError``: no store configured.
            TransferClosedError: the manager is closed.
        """
        self._check_open()
        if self.store is None:
            raise ValueError("no storage agent configured for G2 → G3 offloads")
        n = len(items)
        result = StorageOffloadResult(placements=[None] * n)
        future: Future[StorageOffloadResult] = Future()
        held = self.store.exists([it.key for it in items]) if items else []
        for i, it in enumerate(items):
            if held[i]:
                result.held += 1
            elif self.disk_filter is not None and not self.disk_filter.offer(it.meta.sequence_hash):
                result.filtered += 1
            else:
                result.submitted.append(i)
        if not result.submitted:
            future.set_running_or_notify_cancel()
            future.set_result(result)
            return future
        self._enqueue(TransferPath.G2_TO_G3, len(result.submitted), self._run_storage_offload, future, step, (list(items), result), None)
        return future

    def _run_storage_offload(self, jobs: list[_Job]) -> None:
        assert self.store is not None and self.g3_volume is not None
        entries: list[tuple[_Job, int, bool]] = []  # job, item index, from host
        puts: list[tuple[BlockKey, torch.Tensor]] = []
        holds: list[ImmutableBlock] = []
        try:
            for job in jobs:
                items, result = job.payload
                for i in result.submitted:
                    item: StorageOffloadItem = items[i]
                    strong = None
                    for src in item.sources:
                        strong = src.upgrade() if src is not None else None
                        if strong is not None:
                            break
                    if strong is None:
                        result.skipped += 1
                        continue
                    holds.append(strong)
                    pool = strong._pool
                    puts.append((item.key, host_bytes(pool.layout, strong._block.block_id)))
                    entries.append((job, i, pool.tier != "g1"))
            error: BaseException | None = None
            placements: list[Placement] = []
            if puts:
                try:
                    placements = self.store.put(puts, self.g3_volume)
                except Exception as exc:  # noqa: BLE001 - reported in the results
                    logger.warning("offload of %d blocks to %s failed: %r", len(puts), self.g3_volume, exc)
                    error = exc
        finally:
            by_pool: dict[BlockPool, list[ImmutableBlock]] = {}
            for h in holds:
                by_pool.setdefault(h._pool, []).append(h)
            for pool, hs in by_pool.items():
                pool.release_blocks(hs)
        landed: dict[BlockKey, Placement] = {}
        if error is None:
            landed = {key: p for (key, _), p in zip(puts, placements, strict=True)}
        else:
            # a put that failed part-way still stored the blocks of its earlier segments
            landed = {p.key: p for p in getattr(error, "stored", None) or []}
        counted: set[BlockKey] = set()
        for (job, i, from_host), (key, _) in zip(entries, puts, strict=True):
            result = job.payload[1]
            placement = landed.get(key)
            if placement is None:
                result.failed.append(i)
                continue
            if key in counted:  # the same block queued by two jobs: one write, one Store
                result.held += 1
                continue
            counted.add(key)
            result.placements[i] = placement
            if from_host:
                result.from_host += 1
            else:
                result.from_device += 1
        for job in jobs:
            items, result = job.payload
            if error is not None:
                result.error = error
            if self._skip_events is not None:
                stored = sum(1 for i in result.submitted if result.placements[i] is not None)
                if stored:
                    self._skip_events(stored)
            else:
                events: list[KVEvent] = []
                bb = self.block_bytes
                for i in result.submitted:
                    p = result.placements[i]
                    if p is not None:
                        m = items[i].meta
                        events.append(KVEvent(EventType.STORE, m.sequence_hash, m.prefix_hash, m.parent_hash, bb, p.volume_id))
                if events:
                    self.publisher.publish(events)
            self.metrics.offload_h2d.inc(result.from_host)
            self.metrics.offload_d2d.inc(result.from_device)
        for job in jobs:
            job.future.set_result(job.payload[1])

    # ------------------------------------------------------------------ G2 → G1

    def onboard_from_host(
        self, sources: Sequence[ImmutableBlock], dst_layout: BlockLayout, dst_ids: Sequence[int]
    ) -> Future[int]:
        """Queue copies of G2 blocks into ``dst_layout`` blocks ``dst_ids`` (caller-owned).

        The job owns ``sources`` (strong handles): it releases them after the copy, or at
        cancellation.

        Returns:
            A future of the number of blocks copied.

        Raises:
            ValueError: lists of different lengths.
            TransferClosedError: the manager is closed (the sources are released).
        """
        if len(sources) != len(dst_ids):
            raise ValueError(f"{len(sources)} sources for {len(dst_ids)} destinations")
        srcs = list(sources)

        def cleanup() -> None:
            release_live(srcs)

        future: Future[int] = Future()
        if not srcs:
            future.set_running_or_notify_cancel()
            future.set_result(0)
            return future
        try:
            self._check_open()
        except TransferClosedError:
            cleanup()
            raise
        self._enqueue(TransferPath.G2_TO_G1, len(srcs), self._run_host_onboard, future, None, (srcs, dst_layout, list(dst_ids)), cleanup)
        return future

    def _run_host_onboard(self, jobs: list[_Job]) -> None:
        # the batch as flat lists (one job, the common case: its own lists)
        if len(jobs) == 1:
            srcs, dst_layout, dst_ids = jobs[0].payload
            layouts = None
        else:
            srcs, dst_ids, layouts = [], [], []
            for job in jobs:
                s, dl, d = job.payload
                srcs.extend(s)
                dst_ids.extend(d)
                layouts.extend(repeat(dl, len(d)))
            dst_layout = layouts[0] if len(set(map(id, layouts))) == 1 else None
        try:
            pools = set(map(_POOL, srcs))
            if len(pools) == 1 and dst_layout is not None:
                # one source pool, one destination layout: the id lists at once, one
                # copy_blocks (one slice copy per run of consecutive ids)
                copy_blocks(pools.pop().layout, list(map(_BLOCK_ID, srcs)), dst_layout, dst_ids)
            else:
                groups: dict[tuple[int, int], tuple[BlockLayout, BlockLayout, list[int], list[int]]] = {}
                dls = layouts if layouts is not None else repeat(dst_layout)
                for h, dl, d in zip(srcs, dls, dst_ids):
                    layout = h._pool.layout
                    g = groups.setdefault((id(layout), id(dl)), (layout, dl, [], []))
                    g[2].append(h.block_id)
                    g[3].append(d)
                for src, dst, s_ids, d_ids in groups.values():
                    copy_blocks(src, s_ids, dst, d_ids)
        finally:
            # the sources of every job, one release call per pool
            release_live(srcs)
        for job in jobs:
            n = len(job.payload[0])
            self.metrics.onboard_h2d.inc(n)
            job.future.set_result(n)

    # ------------------------------------------------------------------ G3 → G1

    def onboard_from_storage(
        self, keys: Sequence[BlockKey], dst_layout: BlockLayout, dst_ids: Sequence[int]
    ) -> Future[StorageOnboardResult]:
        """Queue reads of ``keys`` (checksum-verified) into ``dst_layout`` blocks ``dst_ids``.

        Blocks that are contiguous host memory are read into directly; others go through
        the host bounce buffer (``bounce_blocks`` at a time) and are then copied (to the
        device when the layout is on CUDA).  Reading stops at the first failure.

        Returns:
            A future of :class:`StorageOnboardResult`.

        Raises:
            ValueError: lists of different lengths or no store configured.
            TransferClosedError: the manager is closed.
        """
        self._check_open()
        if self.store is None:
            raise ValueError("no storage agent configured for G3 → G1 onboarding")
        if len(keys) != len(dst_ids):
            raise ValueError(f"{len(keys)} keys for {len(dst_ids)} destinations")
        future: Future[StorageOnboardResult] = Future()
        if not keys:
            future.set_running_or_notify_cancel()
            future.set_result(StorageOnboardResult(loaded=0))
            return future
        self._enqueue(TransferPath.G3_TO_G1, len(keys), self._run_storage_onboard, future, None, (list(keys), dst_layout, list(dst_ids)), None)
        return future

    def _run_storage_onboard(self, jobs: list[_Job]) -> None:
        # jobs are read one after the other: each stops at its own first failure
        for job in jobs:
            keys, layout, dst_ids = job.payload
            try:
                res = self._read_into(keys, layout, dst_ids)
            except BaseException as exc:  # noqa: BLE001 - per job
                job.future.set_exception(exc)
                continue
            self.metrics.onboard_d2d.inc(res.loaded)
            job.future.set_result(res)

    def _read_into(self, keys: list[BlockKey], layout: BlockLayout, dst_ids: list[int]) -> StorageOnboardResult:
        assert self.store is not None
        direct = [direct_host_slot(layout, d) for d in dst_ids]
        chunk = len(keys) if all(s is not None for s in direct) else self.bounce_blocks
        t0 = time.perf_counter()
        sources: list[str] = []  # the volume each block was read from (per-volume onboard counters)
        try:
            return self._read_chunks(keys, layout, dst_ids, direct, chunk, sources)
        finally:
            self.metrics.onboard_storage_seconds.observe(time.perf_counter() - t0)
            self.metrics.count_onboards(sources)

    def _read_chunks(self, keys: list[BlockKey], layout: BlockLayout, dst_ids: list[int],
                     direct: list[torch.Tensor | None], chunk: int, sources: list[str]) -> StorageOnboardResult:
        assert self.store is not None
        loaded = 0
        for start in range(0, len(keys), chunk):
            ks = keys[start : start + chunk]
            outs = self._outs(direct[start : start + chunk])
            try:
                self.store.get(ks, out=outs, sources=sources)
            except Exception as batch_exc:  # noqa: BLE001 - find the first failing block
                dropped = list(getattr(batch_exc, "dropped", ()))
                for k, (key, out) in enumerate(zip(ks, outs, strict=True)):
                    try:
                        self.store.get([key], out=[out], sources=sources)
                    except Exception as exc:  # noqa: BLE001 - reading stops here (C17)
                        dropped.extend(getattr(exc, "dropped", ()))
                        # the failed batch may have quarantined the copy (checksum
                        # mismatch, or its segment is gone): then the batch error is the
                        # cause, "not found" only its consequence.  The quarantine is what
                        # lets the recomputed block be put (and published) again.
                        cause = (
                            batch_exc
                            if isinstance(exc, BlockNotFoundError) and not isinstance(batch_exc, BlockNotFoundError)
                            else exc
                        )
                        self._land(layout, dst_ids[start : start + k], direct[start : start + k], outs[:k])
                        return StorageOnboardResult(loaded=loaded + k, failed_index=start + k, error=cause,
                                                    dropped=dropped)
            self._land(layout, dst_ids[start : start + len(ks)], direct[start : start + len(ks)], outs)
            loaded += len(ks)
        return StorageOnboardResult(loaded=loaded)

    def _outs(self, direct: list[torch.Tensor | None]) -> list[torch.Tensor]:
        bounce = None
        outs: list[torch.Tensor] = []
        for k, slot in enumerate(direct):
            if slot is not None:
                outs.append(slot)
            else:
                bounce = self.bounce_buffer() if bounce is None else bounce
                outs.append(bounce[k])
        return outs

    @staticmethod
    def _land(layout: BlockLayout, dst_ids: list[int], direct: list[torch.Tensor | None], outs: list[torch.Tensor]) -> None:
        """Copy bounce-buffer rows into their blocks (direct reads are already there)."""
        for d, slot, out in zip(dst_ids, direct, outs, strict=True):
            if slot is None:
                layout.write_bytes(d, out)
        if layout.device.type == "cuda":
            torch.cuda.synchronize(layout.device)

    # ------------------------------------------------------------------ plumbing

    def _enqueue(
        self,
        path: TransferPath,
        size: int,
        run: Callable[[list[_Job]], None],
        future: Future[Any],
        step: StepEvent | None,
        payload: Any,
        cleanup: Callable[[], None] | None,
    ) -> None:
        job = _Job(path, size, run, future, step, payload, cleanup)
        if cleanup is not None:
            future.add_done_callback(lambda f: cleanup() if f.cancelled() else None)
        try:
            self._workers[path].submit(job)
        except TransferClosedError:
            future.cancel()
            raise

    def _check_open(self) -> None:
        if self._closed:
            raise TransferClosedError("transfer manager is closed")

    def close(self) -> None:
        """Cancel queued jobs (their reserved blocks are freed), finish running ones, stop
        the workers.  Idempotent."""
        if self._closed:
            return
        self._closed = True
        for worker in self._workers.values():
            worker.close()
