"""The NIXL storage agent: volumes, packed segments, verified reads, moves and compaction.

Write path (``put``): skip keys the catalog already holds -> allocate a segment in the
catalog (capacity checked atomically across processes) -> NIXL WRITE (durable), straight
from the caller's tensors where the volume allows it (their storages stay registered, one
descriptor per run contiguous in memory, XXH3 from each block's own memory, on POSIX
volumes right before the WRITE of the 4 MiB piece where the block starts), else from a
registered staging buffer the blocks are packed into -> ``insert_if_absent`` -> seal.
POSIX volumes write a buffered segment in 4 MiB pieces, one NIXL WRITE each, and start
each piece's writeback right after it; the segment is ``fsync``-ed before it is recorded.
A block is visible only after its bytes are durable, so a crash at any step loses
nothing that was acknowledged; at worst it leaves an unreferenced segment that
:meth:`StorageAgent.collect_garbage` removes.

Read path (``get``): catalog snapshot -> per volume, batches of up to 64 MiB.  POSIX
volumes read each batch in 4 MiB pieces, one NIXL READ each (one descriptor per run
contiguous in the file and in memory), straight into the destination (the caller's
``out`` tensors, whose storages stay registered, or new tensors) and hash every piece
(XXH3-64 per block, streamed over the pieces of a larger block) right after its READ,
while it is in the CPU cache.  Bytes the page cache already holds are copied first,
without the device (``preadv2`` with ``RWF_NOWAIT``, buffered volumes), in 1 MiB groups
each hashed while in L2; NIXL reads the rest.  S3 volumes read a batch with one NIXL READ (a ranged GET
per segment, run in parallel by the backend's threads) into a registered staging
buffer, verify and copy out; blocks of 4 MiB or more are fetched straight into the
destination, one ranged GET each.  When a batch fails, every key of it is looked up
again: keys the catalog moved (a concurrent compaction or move) are read at their new
placement, the others are retried in batches of their own, so one moved block never fails
the others.  A placement that is still current and fails on its own is quarantined when
its bytes are wrong (checksum mismatch) or its segment is gone (ENOENT / NoSuchKey) or cut
short before the block ends (a truncated file / object: SegmentTruncatedError), so
the block reads as absent and the next ``put`` stores it again; then ``get`` raises.

Moves (``copy`` -> ``commit_move``) and ``compact`` keep the invariant of docs/design.md §7:
the catalog always points at a copy that was verified after it was written.
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import operator
import os
import threading
import time
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from dataclasses import dataclass, replace

import numpy as np
import torch
import xxhash

from . import _readcore
from .catalog import PlacementCatalog
from .checksum import as_bytes, byte_array, checksum, checksum_np, memory_at, pack
from .gcpause import gc_paused_call
from .keys import validate_block_key
from .nixl_engine import NixlHub
from .types import (
    BlockKey,
    BlockNotFoundError,
    ChecksumMismatchError,
    Fence,
    FencedError,
    InvalidRequestError,
    Placement,
    SegmentInfo,
    SegmentMissingError,
    SegmentTruncatedError,
    StorageError,
    TransferError,
    VersionConflictError,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeFullError,
    VolumeStats,
)
from .volume import UNKNOWN_SIZE, PageCacheFiles, Volume, align_up, descriptor_identity, validate_descriptor, volume_class

logger = logging.getLogger(__name__)

_IOV_MAX = 1024  # buffers one preadv takes (Linux UIO_MAXIOV)
_READ_BATCH_BYTES = 64 << 20
_SPLIT_MIN_BYTES = 2 << 20  # staged reads: check + copy on two threads from this size
_READ_RETRIES = 3


_IS_CPU = operator.attrgetter("is_cpu")
_NBYTES = operator.attrgetter("nbytes")


def _outs_fit(lengths: np.ndarray, dests: list[torch.Tensor]) -> bool:
    """Whether every ``dests[i]`` is a contiguous CPU tensor of ``lengths[i]`` bytes,
    checked a column at a time (``False``: check them one by one for the error)."""
    try:
        return (all(map(torch.Tensor.is_contiguous, dests)) and all(map(_IS_CPU, dests))
                and np.array_equal(np.fromiter(map(_NBYTES, dests), dtype=np.int64, count=len(dests)), lengths))
    except (TypeError, AttributeError, ValueError):  # not a tensor
        return False


def _overlapping(addrs: np.ndarray, lengths: np.ndarray) -> bool:
    """Whether any two byte ranges ``[addrs[i], addrs[i] + lengths[i])`` overlap."""
    if len(addrs) < 2:
        return False
    order = np.argsort(addrs, kind="stable")
    a = addrs[order]
    return bool((a[1:] < (a + lengths[order])[:-1]).any())


def _wait_through_interrupts(futures: Sequence[Future[object]], reraise: bool = True) -> None:
    """Wait until ``futures`` are done, even when an exception (``KeyboardInterrupt`` from
    a signal handler) interrupts the wait: work still running there uses memory or file
    descriptors the caller is about to give back.  The first such exception is raised once
    they are done (``reraise``; ``False`` when the caller is already raising its own)."""
    first: BaseException | None = None
    while True:
        try:
            wait(futures)
            break
        except BaseException as exc:  # noqa: BLE001 - raised below, once the work is done
            if first is None:
                first = exc
    if first is not None and reraise:
        raise first


def _in_halves(
    pool: ThreadPoolExecutor, first: Callable[[], object], second: Callable[[], object],
    abandoned: Callable[[object], None] | None = None,
) -> object:
    """Run ``second`` on ``pool`` while this thread runs ``first``; return ``second``'s
    result.  ``second`` works on memory or file descriptors the caller gives back when it
    returns, so it is always waited for, even through an interrupt: when ``first`` raises,
    ``second`` is waited for, its result (if it returned one) given to ``abandoned``, and
    ``first``'s exception raised."""
    other = pool.submit(second)
    try:
        first()
    except BaseException:
        _wait_through_interrupts([other], reraise=False)
        if abandoned is not None and other.exception() is None:
            abandoned(other.result())
        raise
    _wait_through_interrupts([other])
    return other.result()


def _many_cpus() -> bool:
    """Whether this process may run on more than one CPU (``os.sched_getaffinity``)."""
    try:
        return len(os.sched_getaffinity(0)) > 1
    except (AttributeError, OSError):  # pragma: no cover - not Linux
        return (os.cpu_count() or 1) > 1


class _PieceHasher:
    """XXH3-64 of every block of the segments of one write call, each block hashed right
    before the volume writes the piece of its segment where the block starts (called as
    ``hasher(j, end)`` by :meth:`PosixVolume.write_segments`): NIXL then copies bytes the
    hash just brought into the CPU cache, instead of hashing all blocks first (128 MiB put
    of 256 KiB blocks: the hash then the copy each read the whole put from memory).

    Args:
        jobs: per segment of the call, ``(addrs, lengths, offsets, checksums)``: the
            blocks' DRAM addresses (int64 array; ``None``: the checksums are all given),
            byte lengths and offsets in the segment, and the list the checksums are
            appended to (in block order).
    """

    __slots__ = ("_jobs",)

    def __init__(self, jobs: list[tuple[np.ndarray | None, list[int], list[int], list[int]]]) -> None:
        self._jobs = [(None if a is None else a.tolist(), lens, offs, cks) for a, lens, offs, cks in jobs]

    def __call__(self, j: int, end: int) -> None:
        """Hash the blocks of segment ``j`` that start before byte ``end`` (not hashed yet)."""
        addrs, lengths, offsets, cks = self._jobs[j]
        k = len(cks)
        if addrs is None or k == len(offsets) or offsets[k] >= end:
            return
        stop = bisect.bisect_left(offsets, end, lo=k)
        h = xxhash.xxh3_64_intdigest
        cks.extend([h(memory_at(a, ln)) for a, ln in zip(addrs[k:stop], lengths[k:stop])])

    def finish(self) -> None:
        """Hash every block not hashed yet (a volume that wrote without asking)."""
        for j, (_, _, offsets, _) in enumerate(self._jobs):
            if offsets:
                self(j, offsets[-1] + 1)


@dataclass
class AgentCounters:
    """Agent-level events since start."""

    checksum_mismatches: int = 0
    quarantined: int = 0
    read_retries: int = 0
    dedup_skipped: int = 0
    move_conflicts: int = 0
    segments_dropped: int = 0
    segments_missing: int = 0
    verified_aside: int = 0  # read pieces hashed on the verifier thread


class StorageAgent:
    """Block store over registered volumes, backed by a shared placement catalog.

    Args:
        catalog: the placement catalog (shared with other processes); not closed by
            :meth:`close`.
        name: name of the NIXL agent.
        allowed_roots: directories posix volumes must live under (``None``: anywhere).

    Thread-safe; several processes may use agents on the same catalog and volumes.
    """

    #: puts write straight from the callers' tensors where the volume can (see
    #: :meth:`_write_segments`); ``False`` always packs into a staging buffer (A/B benches)
    direct_writes: bool = True
    #: direct reads hash each piece on a verifier thread while NIXL reads the next one
    #: (``True``), or on the calling thread right after its READ (``False``, the
    #: default: on the shared 2-core box the hand-off measured 5-15 % slower, see
    #: docs/BENCHMARKS.md; try it where cores are idle).  ``None``: when the process may
    #: run on more than one CPU (``os.sched_getaffinity``).
    verify_aside: bool | None = False
    #: hot direct reads (page-cache copies, :meth:`_read_cached_first`) copy and hash the
    #: second half of a batch on the verifier thread while the calling thread does the
    #: first (``True``), or all on the calling thread (``False``).  ``None`` (default):
    #: when the process may run on more than one CPU.  Unlike ``verify_aside``, both
    #: threads copy and hash without the GIL (measured 1.3-1.4x a single thread here).
    split_cached_reads: bool | None = None

    def __init__(
        self, catalog: PlacementCatalog, name: str = "kvadvisor-storage",
        allowed_roots: Sequence[str | os.PathLike[str]] | None = None,
    ) -> None:
        self.catalog = catalog
        self.name = name
        self.allowed_roots: tuple[str, ...] | None = (
            None if allowed_roots is None else tuple(os.fspath(r) for r in allowed_roots)
        )
        self.counters = AgentCounters()
        self._hub = NixlHub(name)
        self._volumes: dict[str, Volume] = {}
        self._lock = threading.RLock()
        # uncommitted copies per (volume, segment): keys still expected to be committed
        self._pending: dict[tuple[str, int], set[BlockKey]] = {}
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # guards _pool's creation only (see _verifier)
        self._closed = False

    # ================================================================== volumes
    def register_volume(self, desc: VolumeDescriptor) -> Volume:
        """Validate and open a volume (idempotent for an identical descriptor).

        Raises:
            VolumeConfigError: invalid descriptor (unknown kind, posix without root or with
                a root outside ``allowed_roots``, s3 without endpoint/bucket, capacity not a
                positive int, ...), or the id is already registered (here or in the shared
                catalog) for another place.
        """
        validate_descriptor(desc, self.allowed_roots)
        ident = descriptor_identity(desc)
        with self._lock:
            self._check_open()
            cur = self._volumes.get(desc.id)
            if cur is not None:
                if cur.desc == desc:
                    return cur
                raise VolumeConfigError(f"volume {desc.id!r} is already registered with another descriptor: {cur.desc}")
            stored = self.catalog.record_volume(desc.id, ident)
            if stored != ident:
                raise VolumeConfigError(
                    f"volume {desc.id!r} is recorded in the catalog as {stored}, not {ident}; "
                    "unregister it (drain=True) before reusing the id"
                )
            cls = volume_class(desc.kind)
            backend, params = cls.engine_spec(desc)
            vol = cls(desc, self._hub.engine(backend, params))
            try:
                vol.bind_catalog(self.catalog.catalog_id())
            except BaseException:
                vol.close()
                raise
            self._volumes[desc.id] = vol
            return vol

    def unregister_volume(self, volume_id: str, drain: bool = False) -> None:
        """Close a volume and forget it in the catalog.

        Args:
            drain: delete the blocks that still live there (their bytes and entries).

        Raises:
            StorageError: blocks live on the volume and ``drain`` is false.
            InvalidRequestError: unknown volume.
        """
        with self._lock:
            vol = self._vol(volume_id)
            live = [p.key for p in self.catalog.iter_volume(volume_id)]
            if live and not drain:
                raise StorageError(
                    f"volume {volume_id!r} still holds {len(live)} blocks; unregister with drain=True to delete them"
                )
            if live:
                self.catalog.delete_many(live)
            for seg in self.catalog.segments(volume_id):
                if self.catalog.drop_segment(volume_id, seg.segment_id):
                    vol.delete_segment(seg.segment_id)
            self.catalog.forget_volume(volume_id)
            vol.close()
            del self._volumes[volume_id]

    def volumes(self) -> list[VolumeDescriptor]:
        """Descriptors of the volumes registered in this agent, by id."""
        with self._lock:
            return [self._volumes[k].desc for k in sorted(self._volumes)]

    def volume(self, volume_id: str) -> VolumeDescriptor:
        """Descriptor of one registered volume.

        Raises:
            InvalidRequestError: unknown volume.
        """
        return self._vol(volume_id).desc

    def _vol(self, volume_id: str) -> Volume:
        vol = self._volumes.get(volume_id)
        if vol is None:
            raise InvalidRequestError(f"volume {volume_id!r} is not registered (known: {sorted(self._volumes)})")
        return vol

    def _check_open(self) -> None:
        if self._closed:
            raise StorageError("storage agent is closed")

    # ================================================================== put
    @gc_paused_call
    def put(self, items: Sequence[tuple[BlockKey, torch.Tensor]], volume_id: str) -> list[Placement]:
        """Store blocks on a volume, packed into new segments (one per ``segment_bytes``).

        Args:
            items: ``(key, tensor)``; any dtype/shape of CPU tensor, the block is its
                contiguous bytes.  A key repeated in ``items`` is stored once.
            volume_id: destination volume.

        Returns:
            the placement of each item, in order; for keys already stored (anywhere), the
            existing placement (not rewritten).

        Raises:
            InvalidRequestError: bad key, non-CPU or empty tensor, unknown volume (nothing
                written).
            VolumeFullError: the volume filled up (its capacity, or ENOSPC / EDQUOT).
            TransferError: a write failed or was short.

        A put may fail part-way: segments are written one after the other (on volumes
        with :attr:`Volume.write_concurrency` > 1, in waves of several segments, each
        wave one transfer), and those written before the failing one (wave) stay stored
        (they were durable and recorded).  The
        ``VolumeFullError`` / ``TransferError`` then says which blocks landed: its
        ``stored`` lists the placement of every block of the call that is stored (written
        by this call or already held), one per distinct key, in item order; nothing of the
        other blocks was recorded (``stored`` is empty when none of them is stored).
        """
        vol = self._vol(volume_id)
        keys: list[BlockKey] = []
        datas: list[torch.Tensor] = []
        copied: set[BlockKey] = set()  # blocks whose tensor was not contiguous (a fresh copy)
        for key, t in items:
            validate_block_key(key)
            if not isinstance(t, torch.Tensor):
                raise InvalidRequestError(f"block {key} is a {type(t).__name__}, not a torch.Tensor")
            try:
                b = as_bytes(t)
            except ValueError as exc:
                raise InvalidRequestError(f"block {key}: {exc}") from exc
            if b.numel() == 0:
                raise InvalidRequestError(f"block {key} is empty")
            if not t.is_contiguous():
                copied.add(key)
            keys.append(key)
            datas.append(b)
        result: dict[BlockKey, Placement] = {}
        unique: dict[BlockKey, torch.Tensor] = {}
        for k, b in zip(keys, datas):
            unique.setdefault(k, b)
        ukeys = list(unique)
        for k, p in zip(ukeys, self.catalog.get_many(ukeys)):
            if p is not None:
                result[k] = p
        todo = [(k, unique[k]) for k in ukeys if k not in result]
        self.counters.dedup_skipped += len(ukeys) - len(todo)
        try:
            for wave in self._write_waves(vol, list(self._segment_groups(vol, todo))):
                direct = [self.direct_writes and (not copied or all(k not in copied for k, _ in g)) for g in wave]
                written, late = self._write_segments(vol, wave, version=0, direct=direct)
                for placed in written:
                    winners = self.catalog.insert_if_absent(placed)
                    seg = placed[0].segment_id
                    self.catalog.seal_segment(volume_id, seg)
                    if all(w.segment_id != seg or w.volume_id != volume_id for w in winners):
                        self._drop_if_empty(volume_id, seg)
                    for w in winners:
                        result[w.key] = w
                if late is not None:
                    raise late
        except (VolumeFullError, TransferError) as exc:
            exc.stored = [result[k] for k in ukeys if k in result]
            raise
        return [result[k] for k in keys]

    def _segment_groups(
        self, vol: Volume, todo: list[tuple[BlockKey, torch.Tensor]]
    ) -> Iterator[list[tuple[BlockKey, torch.Tensor]]]:
        limit = vol.desc.segment_bytes
        group: list[tuple[BlockKey, torch.Tensor]] = []
        size = 0
        for item in todo:
            n = item[1].numel()
            if group and size + n > limit:
                yield group
                group, size = [], 0
            group.append(item)
            size += n
        if group:
            yield group

    @staticmethod
    def _write_waves(
        vol: Volume, groups: list[list[tuple[BlockKey, torch.Tensor]]]
    ) -> Iterator[list[list[tuple[BlockKey, torch.Tensor]]]]:
        """Cut a put's segment groups into waves written with one transfer each: up to
        :attr:`Volume.write_concurrency` segments and :attr:`Volume.write_wave_bytes`
        bytes (a staged wave is one staging buffer)."""
        k = max(1, vol.write_concurrency)
        wave: list[list[tuple[BlockKey, torch.Tensor]]] = []
        size = 0
        for g in groups:
            n = sum(b.numel() for _, b in g)
            if wave and (len(wave) >= k or size + n > vol.write_wave_bytes):
                yield wave
                wave, size = [], 0
            wave.append(g)
            size += n
        if wave:
            yield wave

    def _write_segment(
        self, vol: Volume, group: Sequence[tuple[BlockKey, torch.Tensor]], version: int,
        checksums: Sequence[int] | None = None, direct: bool = False,
    ) -> list[Placement]:
        """:meth:`_write_segments` of one group: its (unrecorded) placements."""
        written, late = self._write_segments(
            vol, [group], version, None if checksums is None else [checksums], [direct])
        if late is not None:
            raise late
        return written[0]

    def _write_segments(
        self, vol: Volume, groups: Sequence[Sequence[tuple[BlockKey, torch.Tensor]]], version: int,
        checksums: Sequence[Sequence[int]] | None = None, direct: Sequence[bool] | None = None,
    ) -> tuple[list[list[Placement]], VolumeFullError | None]:
        """Allocate one segment per group and write them all with ONE volume call
        (:meth:`Volume.write_segments`: one transfer on volumes that write segments
        concurrently); return the (unrecorded) placements per group written.

        With ``direct[j]`` (group j's tensors are the caller's own memory, not temporary
        copies), a volume that can (:meth:`Volume.direct_write_ok`) writes straight from
        the tensors, whose storages stay registered with NIXL (one descriptor per run
        contiguous in memory, e.g. consecutive blocks of one pool), and every block is
        hashed from its own memory (:class:`_PieceHasher`: right before the volume writes
        it, where the volume takes ``before_piece``).  Otherwise the blocks are hashed,
        then packed into a registered staging buffer (one for the whole call).
        Overlapping tensors always take the staging path.

        Returns:
            ``(placements per group written, error)``: when the volume's capacity runs
            out at group j > 0, groups ``< j`` are still written and the
            :class:`VolumeFullError` is returned for the caller to raise after it
            recorded them.

        Raises:
            VolumeFullError: no room for the first group.
            TransferError: the write failed; every segment of the call is released.
        """
        vid = vol.desc.id
        eng = vol.engine
        plans = []
        for j, group in enumerate(groups):
            n = len(group)
            lengths = [b.numel() for _, b in group]
            offsets, size = vol.plan(lengths)
            addrs: np.ndarray | None = None
            lens = np.array(lengths, dtype=np.int64)
            if direct is not None and direct[j]:
                addrs = np.fromiter((b.data_ptr() for _, b in group), dtype=np.int64, count=n)
                if _overlapping(addrs, lens) or not vol.direct_write_ok(addrs, lens, np.array(offsets, dtype=np.int64), size):
                    addrs = None
            if checksums is not None:
                cks = list(checksums[j])
            elif addrs is not None:
                cks = []  # hashed by _PieceHasher, right before the volume writes each block
            else:
                cks = [checksum_np(b.numpy()) for _, b in group]
            plans.append((group, lengths, offsets, size, addrs, lens, cks))
        segs: list[int] = []
        late: VolumeFullError | None = None
        for plan in plans:
            try:
                segs.append(self.catalog.new_segment(vid, plan[3], capacity_bytes=vol.desc.capacity_bytes))
            except VolumeFullError as exc:
                if not segs:
                    raise
                late = exc  # write what has room, then raise
                break
        plans = plans[: len(segs)]
        hasher = _PieceHasher([(pl[4], pl[1], pl[2], pl[6]) for pl in plans])
        try:
            with eng.lock:
                jobs: list[tuple[int, np.ndarray, int]] = []
                staged = [i for i, pl in enumerate(plans) if pl[4] is None]
                starts: dict[int, int] = {}
                need = 0
                for i in staged:
                    starts[i] = need
                    need += align_up(plans[i][3], vol.buffer_alignment)
                buf = eng.staging(need, vol.buffer_alignment) if staged else None
                for i, (seg, (group, lengths, offsets, size, addrs, lens, _)) in enumerate(zip(segs, plans)):
                    if addrs is not None:
                        tensors = [b for _, b in group]

                        def storage_of(k: int, tensors: list[torch.Tensor] = tensors) -> tuple[int, int]:
                            st = tensors[k].untyped_storage()
                            return st.data_ptr(), st.nbytes()

                        eng.dram.ensure(addrs, addrs + lens, storage_of)
                        jobs.append((seg, Volume.runs(addrs, lens), size))
                    else:
                        assert buf is not None
                        part = buf[starts[i] : starts[i] + size]
                        pack(part, offsets, [b for _, b in group], size)
                        jobs.append((seg, np.array([[part.data_ptr(), size, 0]], dtype=np.int64), size))
                if getattr(vol, "takes_before_piece", False):
                    vol.write_segments(jobs, before_piece=hasher)  # type: ignore[call-arg]
                else:
                    vol.write_segments(jobs)
            hasher.finish()  # blocks the volume did not ask for (none when it took the hook)
        except BaseException:
            for seg in segs:
                try:
                    self.catalog.drop_segment(vid, seg)
                except Exception as exc:  # the write error matters more
                    logger.warning("cannot release segment %d of %s: %s", seg, vid, exc)
            raise
        out: list[list[Placement]] = []
        for seg, (group, lengths, offsets, _, addrs, _, cks) in zip(segs, plans):
            vol.counters.blocks_written += len(group)
            if addrs is not None:
                vol.counters.bump("direct_writes")
            out.append([
                Placement(key=k, volume_id=vid, segment_id=seg, offset=off, length=ln, checksum=ck, version=version)
                for (k, _), off, ln, ck in zip(group, offsets, lengths, cks)
            ])
        return out, late

    # ================================================================== get
    @gc_paused_call
    def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor] | None = None) -> list[torch.Tensor]:
        """Read and verify blocks.

        Every block's XXH3-64 is checked before ``get`` returns; a block that fails the
        check is never returned.  Posix volumes (and S3 blocks of 4 MiB or more) are read
        straight into the destination (the ``out`` tensors, whose storages stay
        registered with NIXL for the next calls, or new tensors) and verified there, 4 MiB
        at a time while the bytes are still in the CPU cache.

        Args:
            keys: blocks to read.
            out: optional destination per key (CPU, contiguous, exactly the block's size in
                bytes, any dtype); filled and returned instead of new tensors.

        Returns:
            per key (none for no keys), a 1-D uint8 CPU tensor with the block's bytes (or ``out[i]``).  New
            tensors of blocks a volume reads through a buffer (S3 blocks under 4 MiB) are
            views of one buffer per read when they fill at least half of it (no copy; the
            buffer lives as long as any of them); pass ``out`` to own the memory.

        Raises:
            BlockNotFoundError: a key has no placement.
            ChecksumMismatchError: stored bytes do not match their checksum (the placement
                is quarantined).  The ``out`` tensors of the call may then hold partial or
                wrong bytes, like after any failed read: only a normal return means they
                are right.
            SegmentMissingError: a block's segment file / object is gone while the catalog
                still points there (the entry is quarantined, as above).
            SegmentTruncatedError: (a :class:`SegmentMissingError`) a block's segment is
                shorter than the block's end (the entries past its end are quarantined).
            TransferError: a read failed on its own at the block's current placement
                (``out`` contents undefined, as above).
            InvalidRequestError: bad key or ``out``.

        Every error raised after reading began lists in ``dropped``
        (:attr:`StorageError.dropped`) the placements the call quarantined, so the caller
        can announce their removal.
        """
        keys = list(keys)
        if out is not None and len(out) != len(keys):
            raise InvalidRequestError(f"{len(out)} out tensors for {len(keys)} keys")
        if not keys:
            return []
        placements = self.catalog.get_many(keys)
        if not all(placements):  # a Placement is always true
            for k, p in zip(keys, placements):
                if p is None:
                    raise BlockNotFoundError(f"no stored block for {k}")
        places: list[Placement] = placements  # type: ignore[assignment]
        cols = _readcore.columns(places)
        dests: list[torch.Tensor] | None = None
        if out is not None:
            dests = list(out)
            if not _outs_fit(cols[3], dests):
                for k, p, t in zip(keys, places, dests):
                    if not isinstance(t, torch.Tensor) or not t.is_cpu or not t.is_contiguous():
                        raise InvalidRequestError(f"out tensor for {k} must be a contiguous CPU tensor")
                    if t.nbytes != p.length:
                        raise InvalidRequestError(f"out tensor for {k} has {t.nbytes} bytes, the block has {p.length}")
        results = self._read_verified(places, dests, cols)
        if out is not None:
            return list(out)
        return results

    def _read_verified(
        self, places: list[Placement], dests: list[torch.Tensor] | None, cols: tuple | None = None,
        deleted: set[int] | None = None,
    ) -> list[torch.Tensor]:
        """Read and verify every placement into ``dests[i]`` (or a new tensor); ``cols``:
        :func:`_readcore.columns` of ``places`` when the caller has them.  ``deleted``: when
        given, the indexes of keys deleted while they were read are added to it (their
        result is ``None``) instead of raising :class:`BlockNotFoundError`.

        A failed batch is not given up as a whole.  Every key of it (and every key whose
        checksum failed) is looked up again in the catalog:

        * moved meanwhile (a concurrent move or compaction dropped the old segment): read
          again at the new placement;
        * unchanged, read failed, segment still there: retried in a batch of its own (the
          failure may have been another block's, or transient);
        * unchanged, segment gone (ENOENT / ``NoSuchKey``) or cut short before the
          block's end (:meth:`Volume.segment_size`), and still unchanged at a second
          look-up: the entry is quarantined (compare-and-set on the exact placement, so a
          move that wins the race is never undone);
        * unchanged, checksum mismatch: read again on its own (a reply cut short in
          transit looks the same), quarantined when it fails that second read too.

        Every key is attempted before the call fails, so one call quarantines every bad
        entry it meets.

        Raises:
            BlockNotFoundError: a key was deleted while it was being read (``deleted`` is
                ``None``).
            ChecksumMismatchError: a block failed verification at its current placement.
            SegmentMissingError: a block's segment is gone (its entry was quarantined).
            SegmentTruncatedError: a block's segment ends before the block does (its entry
                was quarantined).
            TransferError: a block kept failing on its own at its current placement (the
                first such error), or blocks kept moving for ``_READ_RETRIES`` retries.
        """
        n = len(places)
        results: list[torch.Tensor | None] = [None] * n
        cur = list(places)
        todo = list(range(n))
        alone: set[int] = set()  # read in a batch of their own (their batch failed)
        mismatched: list[int] = []
        lost: list[int] = []
        truncated: list[int] = []
        broken: list[tuple[int, TransferError]] = []
        rechecked: set[int] = set()  # failed their checksum once, read again on their own
        dropped: list[Placement] = []  # quarantined by this call (StorageError.dropped)
        for attempt in range(_READ_RETRIES + 1):
            if attempt:
                self.counters.read_retries += 1
            if attempt or cols is None:
                cols = _readcore.columns(cur)
            segs, offs, lens, cks = cols[1:]
            failed: list[tuple[int, TransferError]] = []
            bad: list[int] = []
            batches: list[Sequence[int]]
            if alone:
                batches = list(self._batches(cur, [i for i in todo if i not in alone], cols, self._read_batch_bytes))
                batches += [[i] for i in todo if i in alone]
            else:
                batches = list(self._batches(cur, todo if attempt else range(n), cols, self._read_batch_bytes))
            for batch in batches:
                if isinstance(batch, range):  # blocks lo..hi-1 in their own order: slices
                    lo, hi = batch.start, batch.stop
                    b_places, b_dests = cur[lo:hi], None if dests is None else dests[lo:hi]
                    b_cols = (segs[lo:hi], offs[lo:hi], lens[lo:hi], cks[lo:hi])
                else:
                    b_places = [cur[i] for i in batch]
                    b_dests = None if dests is None else [dests[i] for i in batch]
                    ix = np.fromiter(batch, dtype=np.int64, count=len(batch))
                    b_cols = (segs[ix], offs[ix], lens[ix], cks[ix])
                vol = self._vol(b_places[0].volume_id)
                try:
                    got = self._read_batch(vol, b_places, b_dests, b_cols)
                except TransferError as exc:
                    failed.extend((i, exc) for i in batch)
                    continue
                if isinstance(batch, range) and not any(map(operator.is_, got, itertools.repeat(None))):
                    results[batch.start : batch.stop] = got
                    continue
                for i, data in zip(batch, got):
                    if data is None:
                        bad.append(i)
                    else:
                        results[i] = data
            if not failed and not bad:
                todo = []
                break
            try:
                todo = self._triage(cur, failed, bad, alone, mismatched, lost, broken, truncated,
                                    rechecked if attempt < _READ_RETRIES else None, dropped,
                                    deleted)
            except StorageError as exc:  # a key deleted meanwhile, a volume that cannot be asked
                exc.dropped = tuple(dropped)
                raise
            if not todo:
                break
        if todo:  # still moving after every retry
            err = TransferError(f"{len(todo)} block(s) kept moving while being read ({_READ_RETRIES} retries)")
            broken.extend((i, err) for i in todo)
        failure = self._read_failure(cur, mismatched, truncated, lost, broken)
        if failure is not None:
            failure.dropped = tuple(dropped)
            raise failure
        assert sum(map(operator.is_, results, itertools.repeat(None))) == len(deleted or ())
        return results  # type: ignore[return-value]


    @staticmethod
    def _read_failure(
        cur: list[Placement], mismatched: list[int], truncated: list[int], lost: list[int],
        broken: list[tuple[int, TransferError]],
    ) -> StorageError | None:
        """The error a read ends with (see :meth:`_read_verified`), ``None`` when every
        block was read."""
        if mismatched:
            p = cur[mismatched[0]]
            return ChecksumMismatchError(
                f"{len(mismatched)} block(s) failed verification, first {p.key} on {p.volume_id!r} "
                f"segment {p.segment_id} offset {p.offset}: copy quarantined"
            )
        if truncated:
            p = cur[truncated[0]]
            return SegmentTruncatedError(
                f"{len(lost)} block(s) live in segments that are gone or cut short, first truncated: {p.key} "
                f"on {p.volume_id!r} segment {p.segment_id} at {p.offset}+{p.length}, past the segment's end: "
                "entries quarantined"
            )
        if lost:
            p = cur[lost[0]]
            return SegmentMissingError(
                f"{len(lost)} block(s) live in segments that are gone, first {p.key} on {p.volume_id!r} "
                f"segment {p.segment_id}: entries quarantined"
            )
        if broken:
            if len(broken) == 1:
                return broken[0][1]
            err = TransferError(f"{len(broken)} block(s) failed to read, first: {broken[0][1]}")
            err.__cause__ = broken[0][1]
            return err
        return None

    def _triage(
        self, cur: list[Placement], failed: list[tuple[int, TransferError]], bad: list[int], alone: set[int],
        mismatched: list[int], lost: list[int], broken: list[tuple[int, TransferError]],
        truncated: list[int] | None = None, rechecked: set[int] | None = None,
        quarantined: list[Placement] | None = None, deleted: set[int] | None = None,
    ) -> list[int]:
        """Sort the failures of one read round (see :meth:`_read_verified`): updates
        ``cur``, ``alone`` and the outcome lists (``truncated``: the part of ``lost``
        whose segment is there but too short; ``rechecked``: the blocks whose checksum
        failed once and that were read again, on their own: a block is quarantined for a
        mismatch only when it fails a second read, when ``rechecked`` is given); returns
        the indexes to read again; ``quarantined`` receives every placement it quarantined; ``deleted``: see
        :meth:`_read_verified`."""
        if truncated is None:
            truncated = []
        retry_idx = [i for i, _ in failed] + bad
        fresh = self.catalog.get_many([cur[i].key for i in retry_idx])
        moved: set[int] = set()
        gone: set[int] = set()
        for i, f in zip(retry_idx, fresh):
            if f is None:
                if deleted is None:
                    raise BlockNotFoundError(f"{cur[i].key} was deleted while it was being read")
                gone.add(i)
            elif f != cur[i]:
                cur[i] = f
                moved.add(i)
                alone.discard(i)
        if gone:
            assert deleted is not None
            deleted |= gone
            moved |= gone  # neither wrong nor stuck: nothing to read any more
        again = [i for i in retry_idx if i in moved and i not in gone]
        wrong = [i for i in bad if i not in moved]
        stuck = [(i, e) for i, e in failed if i not in moved]
        if not stuck and not wrong:
            return again
        # the segments' sizes now: a wrong or failed read past the end of a segment that
        # was cut short (or of one that is gone) is a loss, not a bad copy or a hiccup
        sizes: dict[tuple[str, int], int | None] = {}
        for vid, seg in sorted({(cur[i].volume_id, cur[i].segment_id) for i in [*wrong, *(i for i, _ in stuck)]}):
            try:
                sizes[(vid, seg)] = self._vol(vid).segment_size(seg)
            except StorageError:
                if stuck:
                    raise stuck[0][1] from None  # the volume cannot even be asked: give up now
                sizes[(vid, seg)] = UNKNOWN_SIZE  # a plain mismatch then

        def lost_at(p: Placement) -> str | None:
            """Why ``p``'s bytes are gone for good (``None``: they may still be there)."""
            size = sizes[(p.volume_id, p.segment_id)]
            if size is None:
                return "segment missing on read"
            if p.offset + p.length > size:  # sealed segments never shrink: cut for good
                return "segment truncated on read"
            return None

        for i in wrong:
            if lost_at(cur[i]) is None:
                if rechecked is not None and i not in rechecked:
                    # read it once more, on its own, before condemning the copy: a reply cut
                    # short in transit (a 206 of part of the range, which NIXL OBJ does not
                    # report) or a bad read looks the same as bad stored bytes
                    rechecked.add(i)
                    alone.add(i)
                    again.append(i)
                    continue
                self.counters.checksum_mismatches += 1
                if self.catalog.quarantine(cur[i], "checksum mismatch on read"):
                    self.counters.quarantined += 1
                    if quarantined is not None:
                        quarantined.append(cur[i])
                mismatched.append(i)
        suspects = [i for i in wrong if lost_at(cur[i]) is not None]
        suspects += [i for i, _ in stuck if lost_at(cur[i]) is not None]
        if suspects:
            # a second look: a move that committed after the first one is not a loss
            second = self.catalog.get_many([cur[i].key for i in suspects])
            dropped: set[tuple[str, int]] = set()
            for i, f in zip(suspects, second):
                if f is not None and f == cur[i]:
                    why = lost_at(f)
                    assert why is not None
                    if self.catalog.quarantine(f, why):
                        self.counters.segments_missing += 1
                        self.counters.quarantined += 1
                        if quarantined is not None:
                            quarantined.append(f)
                        lost.append(i)
                        dropped.add((f.volume_id, f.segment_id))
                        if sizes[(f.volume_id, f.segment_id)] is not None:
                            truncated.append(i)
                        continue
                    f = self.catalog.get_many([f.key])[0]  # it changed in between
                if f is None:
                    if deleted is None:
                        raise BlockNotFoundError(f"{cur[i].key} was deleted while it was being read")
                    deleted.add(i)
                    continue
                cur[i] = f
                alone.discard(i)
                again.append(i)
            for vid, seg in sorted(dropped):
                size = sizes[(vid, seg)]
                if size is None:
                    logger.warning("volume %s: segment %d is missing; the entries read there were quarantined", vid, seg)
                else:
                    logger.warning("volume %s: segment %d is truncated to %d bytes; the entries read past its end "
                                   "were quarantined", vid, seg, size)
                self._drop_if_empty(vid, seg)
        suspect = set(suspects)
        for i, e in stuck:
            if i in suspect:
                continue
            if i in alone:
                broken.append((i, e))  # failed on its own at a placement still current
            else:
                alone.add(i)
                again.append(i)
        return again

    @staticmethod
    def _batches(
        places: Sequence[Placement], idx: Sequence[int], cols: tuple, cap_of: Callable[[str], int] | None = None,
    ) -> Iterator[Sequence[int]]:
        """Group the indexes ``idx`` of ``places`` by volume (ordered by segment, offset: a
        stable sort) and cap each batch's bytes: a batch takes blocks while their sum stays
        within ``cap_of(volume_id)`` (default ``_READ_BATCH_BYTES``; at least one block).  A batch of consecutive indexes
        in their own order (``idx`` a ``range`` already sorted: a whole get's first
        round, as usual) is a ``range``.  ``cols``: :func:`_readcore.columns` of
        ``places`` (column-wise: no Python work per block on the usual path)."""
        one, segs, offs, lens = cols[:4]
        whole = isinstance(idx, range) and idx == range(len(places))
        if whole and one:
            groups: list[Sequence[int]] = [idx]
        else:
            by_vol: dict[str, list[int]] = {}
            for i in idx:
                by_vol.setdefault(places[i].volume_id, []).append(i)
            groups = list(by_vol.values())
            if len(groups) == 1 and isinstance(idx, range):
                groups = [idx]
        for group in groups:
            cap = _READ_BATCH_BYTES if cap_of is None else cap_of(places[group[0]].volume_id)
            ix = np.arange(group.start, group.stop) if isinstance(group, range) else \
                np.fromiter(group, dtype=np.int64, count=len(group))
            s, o, ln = segs[ix], offs[ix], lens[ix]
            if len(ix) > 1 and not bool(np.all((s[1:] > s[:-1]) | ((s[1:] == s[:-1]) & (o[1:] >= o[:-1])))):
                order = np.lexsort((o, s))  # stable: by segment, then offset
                group, ln = [group[j] for j in order.tolist()], ln[order]
            ends = np.cumsum(ln)
            lo, base, m = 0, 0, len(group)
            while lo < m:
                hi = max(lo + 1, int(np.searchsorted(ends, base + cap, side="right")))
                yield group[lo:hi]  # a range stays a range
                lo, base = hi, int(ends[hi - 1])

    def _read_batch(
        self, vol: Volume, places: Sequence[Placement], dests: Sequence[torch.Tensor] | None = None,
        cols: tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray] | None = None,
    ) -> list[torch.Tensor | None]:
        """Read, verify and hand out ``places`` (one volume, sorted by segment and offset).

        Returns per placement the tensor (``dests[i]`` or a new one), or ``None`` on a
        checksum mismatch.  Volumes that can (:meth:`Volume.direct_read_ok`) read straight
        into the destination (:meth:`_read_direct`); the others go through staging
        buffers (:meth:`_read_staged`), or, for new tensors, into a new buffer whose
        views they are.
        """
        n = len(places)
        segs, offs, lengths, cks = cols if cols is not None else _readcore.columns(list(places))[1:]
        eng = vol.engine
        if dests is None and not vol.direct_read_ok(np.zeros(n, dtype=np.int64), lengths):
            # read through a buffer whatever the addresses (S3 blocks under 4 MiB): new
            # blocks are views of a new buffer per piece, no copy out (_read_piece)
            return self._read_staged(vol, places, None)
        if dests is None:
            # one tensor per block: the allocator recycles freed blocks, so their memory is
            # already faulted in and registered (one 64 MiB buffer per call would be a fresh
            # mmap, 16k page faults, every time: measured 5x slower)
            dests = [torch.empty(ln, dtype=torch.uint8) for ln in lengths.tolist()]
        addrs = np.fromiter(map(torch.Tensor.data_ptr, dests), dtype=np.int64, count=n)
        if not vol.direct_read_ok(addrs, lengths) or _overlapping(addrs, lengths):
            # overlapping destinations: a block read in place could be overwritten by
            # another one before it is hashed (and a good copy quarantined)
            return self._read_staged(vol, places, dests)

        def storage_of(i: int) -> tuple[int, int]:
            st = dests[i].untyped_storage()
            return st.data_ptr(), st.nbytes()

        with eng.lock:
            eng.dram.ensure(addrs, addrs + lengths, storage_of)
            ok = self._read_direct(vol, places, lengths, addrs, segs, offs, cks)
        if all(ok):
            return list(dests)
        return [t if good else None for t, good in zip(dests, ok)]

    def _read_direct(
        self, vol: Volume, places: Sequence[Placement], lengths: np.ndarray, addrs: np.ndarray,
        segs: np.ndarray, offs: np.ndarray, cks: np.ndarray,
    ) -> list[bool]:
        """Read every block straight to ``addrs`` (registered) and verify it in place.

        A volume with page-cache reads (:meth:`Volume.page_cache_files`) first copies
        what the OS already holds in memory, each block hashed right after its copy
        (:meth:`_read_cached_first`); NIXL reads the rest.  Otherwise the blocks are cut
        into chunks of at most :attr:`Volume.read_piece_bytes` and grouped into pieces of
        about that size; each piece is one NIXL READ, after which its chunks are hashed
        (XXH3-64, streamed over the chunks of a block larger than a piece) while they are
        still in the CPU cache: on the calling thread right after the READ, or, when the
        process may run on more than one CPU (:attr:`verify_aside`), on the verifier
        thread while the next piece is read.
        Returns per block whether its checksum matched.  The engine lock is held by the
        caller.
        """
        n = len(places)
        piece = vol.read_piece_bytes
        if vol.cached_read_bytes and _readcore.available:
            # runs of blocks on at most max_open segments (the batch is sorted by segment):
            # page_cache_files holds every segment of a run open at once
            cap = max(1, int(getattr(vol, "max_open", 64)))
            runs = (np.flatnonzero(segs[1:] != segs[:-1]) + 1)[cap - 1 :: cap].tolist()
            ok_arr = np.ones(n, dtype=np.uint8)
            for lo, hi in zip([0, *runs], [*runs, n]):
                with vol.page_cache_files(np.unique(segs[lo:hi]).tolist()) as files:
                    if files is None:
                        break
                    ok_arr[lo:hi] = self._read_cached_first(vol, files, lengths[lo:hi], addrs[lo:hi], segs[lo:hi],
                                                            offs[lo:hi], cks[lo:hi])
            else:
                vol.counters.blocks_read += n
                return ok_arr.view(np.bool_).tolist()
        if int(lengths.max()) <= piece:  # one chunk per block
            blk = np.arange(n)
            c_len, c_seg, c_off, c_addr = lengths, segs, offs, addrs
        else:
            nch = (lengths + piece - 1) // piece
            blk = np.repeat(np.arange(n), nch)
            within = (np.arange(len(blk)) - np.repeat(np.cumsum(nch) - nch, nch)) * piece
            c_len = np.minimum(piece, lengths[blk] - within)
            c_seg, c_off, c_addr = segs[blk], offs[blk] + within, addrs[blk] + within
        c_end = np.cumsum(c_len)
        cuts = (np.flatnonzero(np.diff((c_end - c_len) // piece)) + 1).tolist()
        bounds = list(zip([0, *cuts], [*cuts, len(blk)]))
        blk_l, len_l, addr_l = blk.tolist(), c_len.tolist(), c_addr.tolist()
        whole = (c_len == lengths[blk]).tolist()
        cks = cks.tolist()
        ok = [True] * n
        streams: dict[int, xxhash.xxh3_64] = {}
        h = xxhash.xxh3_64_intdigest
        last = len(blk_l) - 1
        # blocks of one length, none larger than a piece (the common case): chunk k is
        # block k, hashed through one ctypes type's from_address (no call per block)
        at = byte_array(len_l[0]).from_address if len(blk_l) == n and int(lengths.min()) == int(lengths.max()) else None

        def finish(k: int, st: xxhash.xxh3_64) -> None:
            """Chunk k's bytes all went into ``st`` (its block's stream so far): check the
            block at its last chunk, else keep the stream for the next one."""
            i = blk_l[k]
            if k == last or blk_l[k + 1] != i:
                streams.pop(i, None)
                if st.intdigest() != cks[i]:
                    ok[i] = False
            else:
                streams[i] = st

        def verify(lo: int, hi: int) -> None:
            """Hash chunks ``lo:hi``."""
            if at is not None:
                for k in [k for k, m, c in zip(range(lo, hi), map(at, addr_l[lo:hi]), cks[lo:hi]) if h(m) != c]:
                    ok[k] = False
                return
            for k in range(lo, hi):
                mem = memory_at(addr_l[k], len_l[k])
                i = blk_l[k]
                if whole[k]:
                    if h(mem) != cks[i]:
                        ok[i] = False
                    continue
                st = streams.get(i)
                if st is None:
                    st = xxhash.xxh3_64()
                st.update(mem)
                finish(k, st)

        pool = self._verifier() if len(bounds) > 1 and self._verify_aside() else None
        if pool is None:
            for lo, hi in bounds:
                vol.read_direct(c_seg[lo:hi], c_off[lo:hi], c_len[lo:hi], c_addr[lo:hi])
                verify(lo, hi)
        else:
            # piece k is hashed on the verifier thread (FIFO: streams stay in order) while
            # NIXL reads piece k+1 (both release the GIL while they work)
            futures: list[Future[None]] = []
            try:
                for lo, hi in bounds:
                    vol.read_direct(c_seg[lo:hi], c_off[lo:hi], c_len[lo:hi], c_addr[lo:hi])
                    futures.append(pool.submit(verify, lo, hi))
            finally:
                wait(futures)
            for f in futures:
                f.result()
            self.counters.verified_aside += len(futures)
        vol.counters.blocks_read += n
        return ok

    def _read_cached_first(
        self, vol: Volume, files: PageCacheFiles, lengths: np.ndarray, addrs: np.ndarray,
        segs: np.ndarray, offs: np.ndarray, cks: np.ndarray,
    ) -> np.ndarray:
        """:meth:`_read_direct` of a volume with page-cache reads: what the page cache
        holds is copied and verified by :func:`_readcore.read_cached` (no GIL, each block
        hashed right after its copy, in groups of about :attr:`Volume.cached_read_bytes`
        contiguous in one segment); from the first byte not in memory NIXL reads to the
        end of that block's piece (:attr:`Volume.read_piece_bytes` of the batch, or the
        block alone when it is larger), those blocks are hashed (on the verifier thread
        when :attr:`verify_aside`, while the next group is tried), and copying resumes at
        the next piece.  With :attr:`split_cached_reads` the second half of the groups
        is copied on the verifier thread while this one copies the first (two cores copy
        and hash at once).  Every byte is read once, by one of the two.

        Returns:
            per block, 1 if its checksum matched else 0 (uint8 array).
        """
        n = len(lengths)
        sub, piece = vol.cached_read_bytes, vol.read_piece_bytes
        ok = np.ones(n, dtype=np.uint8)
        ends = np.cumsum(lengths)
        starts = ends - lengths
        pid = starts // piece
        big = lengths > sub
        # group breaks: another segment, not contiguous in it, another sub window or
        # piece of the batch, or a block larger than a group (alone, copied in parts)
        brk = (segs[1:] != segs[:-1]) | (offs[1:] != offs[:-1] + lengths[:-1])
        brk |= (starts[1:] // sub != starts[:-1] // sub) | (pid[1:] != pid[:-1]) | big[1:] | big[:-1]
        cuts = np.flatnonzero(brk) + 1
        gstart = np.concatenate(([0], cuts)).astype(np.int64)
        gend = np.concatenate((cuts, [n])).astype(np.int64)
        if int((gend - gstart).max()) > _IOV_MAX:  # at most _IOV_MAX buffers a preadv
            gstart = np.concatenate([np.arange(a, b, _IOV_MAX) for a, b in zip(gstart.tolist(), gend.tolist())])
            gend = np.append(gstart[1:], n)
        fd_of = files.fds
        gfd = np.fromiter((fd_of.get(s, -1) for s in segs[gstart].tolist()), dtype=np.int32, count=len(gstart))
        goff = offs[gstart]
        piece_ends = (np.flatnonzero(np.diff(pid)) + 1).tolist() + [n]
        flags, done = files.flags, files.done
        pool = self._verifier() if self._verify_aside() else None
        splitter = self._verifier() if self._split_cached_reads() else None
        hashing: list[Future[None]] = []
        ng = len(gstart)

        def copy(g: int, g_hi: int) -> tuple[int, int, int, int, int]:
            return _readcore.read_cached(gfd, goff, gstart, gend, addrs, lengths, cks, ok, g, g_hi, sub, flags)

        def run(state: tuple[int, int, int, int, int], g_hi: int) -> None:
            """From a stop of :func:`_readcore.read_cached` (``(g, k, have, err,
            copied)``), read to the end of block k's piece with NIXL, then copy on."""
            while True:
                g, k, have, err, copied = state
                done(copied, err)
                if k < 0:
                    return
                # to the end of k's piece, never into the groups of the other half
                e = min(piece_ends[bisect.bisect_right(piece_ends, k)], int(gstart[g_hi]) if g_hi < ng else n)
                o, ln, a = offs[k:e], lengths[k:e], addrs[k:e]
                if have:
                    o, ln, a = o.copy(), ln.copy(), a.copy()
                    o[0] += have
                    ln[0] -= have
                    a[0] += have
                vol.read_direct(segs[k:e], o, ln, a)
                if pool is not None:
                    hashing.append(pool.submit(_readcore.hash_check, addrs, lengths, cks, ok, k, e))
                else:
                    _readcore.hash_check(addrs, lengths, cks, ok, k, e)
                g = int(np.searchsorted(gstart, e))  # groups never cross a piece: one starts at e
                if g >= g_hi:
                    return
                state = copy(g, g_hi)

        try:
            if splitter is not None and ng > 1 and int(ends[-1]) > 2 * sub:
                # halves cut at the piece start nearest the middle byte (a NIXL read after
                # a miss still runs to the end of its piece), or mid-piece for one piece
                half = int(ends[-1]) // 2
                cut = min(piece_ends[:-1], key=lambda b: abs(int(starts[b]) - half)) if len(piece_ends) > 1 \
                    else int(np.searchsorted(ends, half))
                mid = min(max(int(np.searchsorted(gstart, cut)), 1), ng - 1)
                # the other half copies through fds that close when the caller's context
                # exits; if this half fails, its copied bytes are still counted
                state = _in_halves(splitter, lambda: run(copy(0, mid), mid), lambda: copy(mid, ng),
                                   lambda st: done(st[4], st[3]))  # type: ignore[index]
                self.counters.verified_aside += 1
                run(state, ng)
            else:
                run(copy(0, ng), ng)
        except BaseException:
            _wait_through_interrupts(hashing, reraise=False)
            raise
        _wait_through_interrupts(hashing)
        for f in hashing:
            f.result()
        self.counters.verified_aside += len(hashing)
        return ok

    def _read_staged(
        self, vol: Volume, places: Sequence[Placement], dests: Sequence[torch.Tensor] | None = None
    ) -> list[torch.Tensor | None]:
        """Read, verify and copy out ``places`` through staging buffers.

        The batch is cut into pieces of about :attr:`Volume.read_piece_bytes`; each piece
        is one NIXL READ into staging slot 0 or 1, and while the next piece is being read,
        a worker thread verifies the previous one (XXH3) and copies its blocks into
        ``dests[i]`` (or fresh uint8 tensors).  Returns per placement the tensor, or
        ``None`` on a checksum mismatch (the destination is then left untouched).
        """
        out: list[torch.Tensor | None] = [None] * len(places)
        pieces: list[list[int]] = [[]]
        size = 0
        limit = vol.read_piece_bytes
        for i, p in enumerate(places):
            if pieces[-1] and size + p.length > limit:
                pieces.append([])
                size = 0
            pieces[-1].append(i)
            size += p.length
        eng = vol.engine
        with eng.lock:
            if len(pieces) == 1:
                self._read_piece(vol, places, pieces[0], dests, out, 0)
                return out
            pending: dict[int, Future[None]] = {}
            try:
                for k, idx in enumerate(pieces):
                    slot = k % 2
                    f = pending.pop(slot, None)
                    if f is not None:
                        f.result()  # that slot's buffer is free again
                    pending[slot] = self._read_piece(vol, places, idx, dests, out, slot, self._verifier())
            finally:
                for f in pending.values():
                    f.result()
        return out

    def _read_piece(
        self, vol: Volume, places: Sequence[Placement], idx: list[int], dests: Sequence[torch.Tensor] | None,
        out: list[torch.Tensor | None], slot: int, pool: ThreadPoolExecutor | None = None,
    ) -> Future[None]:
        """Read ``places[idx]`` into staging ``slot``; verify + copy now, or on ``pool``.

        Without ``dests`` (new tensors wanted) the piece is read into a new buffer instead
        and its verified blocks are handed out as views of it (no copy: the blocks of one
        piece share that buffer's memory for as long as any of them lives), when they
        fill at least half of it (the volume may read the gaps between blocks too: a
        sparse piece is copied out, so that a kept block never holds much more memory
        than its own).  A block asked for twice gets a copy the second time."""
        items = [(places[i].segment_id, places[i].offset, places[i].length) for i in idx]
        need, align = vol.read_buffer_bytes(items), vol.buffer_alignment
        fresh = dests is None and _readcore.available and 2 * sum(ln for _, _, ln in items) >= need
        if fresh:
            raw = torch.empty(max(need, 1) + align, dtype=torch.uint8)
            pad = (-raw.data_ptr()) % align
            buf = raw[pad : pad + max(need, 1)]
            vol.engine.register_tensor(buf)
        else:
            buf = vol.engine.staging(need, align, slot=slot)
        starts = vol.read_into(items, buf)
        base = buf.data_ptr()

        def verify() -> None:
            if _readcore.available:
                m = len(idx)
                lens = np.fromiter((places[i].length for i in idx), dtype=np.int64, count=m)
                cks = np.fromiter((places[i].checksum for i in idx), dtype=np.uint64, count=m)
                src = np.asarray(starts, dtype=np.int64) + base
                (hand_out_views if fresh else check_copy)(lens, cks, src)
                return
            # raw addresses: a tensor or array per block costs more than hashing 64 KiB
            for i, start in zip(idx, starts):
                p = places[i]
                src = base + start
                if xxhash.xxh3_64_intdigest(memory_at(src, p.length)) != p.checksum:
                    out[i] = None
                    continue
                dst = dests[i] if dests is not None else torch.empty(p.length, dtype=torch.uint8)
                ctypes.memmove(dst.data_ptr(), src, p.length)
                out[i] = dst

        def hand_out_views(lens: np.ndarray, cks: np.ndarray, src: np.ndarray) -> None:
            """The verified blocks of the new buffer, as views of it."""
            ok = np.ones(len(idx), dtype=np.uint8)
            _readcore.hash_check(src, lens, cks, ok, 0, len(idx))
            seen: set[int] = set()
            for j, (i, st, ln) in enumerate(zip(idx, starts, lens.tolist())):
                if not ok[j]:
                    out[i] = None
                elif st in seen:  # the same block again (one copy read): its own memory
                    out[i] = buf[st : st + ln].clone()
                else:
                    seen.add(st)
                    out[i] = buf[st : st + ln]

        def check_copy(lens: np.ndarray, cks: np.ndarray, src: np.ndarray) -> None:
            """:func:`_readcore.check_copy` of every block (no GIL); read inline with
            :attr:`split_cached_reads`, the second half on the verifier thread."""
            m = len(idx)
            dst_t = [dests[i] for i in idx] if dests is not None else \
                [torch.empty(ln, dtype=torch.uint8) for ln in lens.tolist()]
            dst = np.fromiter(map(torch.Tensor.data_ptr, dst_t), dtype=np.int64, count=m)
            ok = np.ones(m, dtype=np.uint8)
            total = int(lens.sum())
            if (pool is None and m > 1 and total >= _SPLIT_MIN_BYTES and self._split_cached_reads()
                    and not _overlapping(dst, lens)):  # overlapping outs: the later block wins, in order
                mid = int(np.searchsorted(np.cumsum(lens), total // 2)) or 1
                _in_halves(self._verifier(), lambda: _readcore.check_copy(src, dst, lens, cks, ok, 0, mid),
                           lambda: _readcore.check_copy(src, dst, lens, cks, ok, mid, m))  # both write into dst
            else:
                _readcore.check_copy(src, dst, lens, cks, ok, 0, m)
            for j, i in enumerate(idx):
                out[i] = dst_t[j] if ok[j] else None

        if pool is not None:
            return pool.submit(verify)
        done: Future[None] = Future()
        verify()
        done.set_result(None)
        return done

    def _read_batch_bytes(self, volume_id: str) -> int:
        """Bytes per read batch of a volume (:attr:`Volume.read_batch_bytes`)."""
        return self._vol(volume_id).read_batch_bytes

    def _verify_aside(self) -> bool:
        """Whether direct reads hash on the verifier thread (see :attr:`verify_aside`)."""
        return self.verify_aside if self.verify_aside is not None else _many_cpus()

    def _split_cached_reads(self) -> bool:
        """Whether page-cache copies run on two threads (see :attr:`split_cached_reads`)."""
        return self.split_cached_reads if self.split_cached_reads is not None else _many_cpus()

    def _verifier(self) -> ThreadPoolExecutor:
        """The verifier thread's executor (made on first use).  Takes only its own lock,
        never held while another is taken: reads call it while they hold a volume's and
        the engine's locks, which :meth:`close` takes under the agent's lock."""
        pool = self._pool
        if pool is not None:
            return pool
        with self._pool_lock:
            if self._pool is None:
                self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix=f"{self.name}-verify")
            return self._pool

    # ================================================================== queries
    def exists(self, keys: Sequence[BlockKey]) -> list[bool]:
        """Whether each key has a placement (catalog only, no I/O)."""
        return [p is not None for p in self.catalog.get_many(list(keys))]

    def locate(self, keys: Sequence[BlockKey]) -> list[Placement | None]:
        """Placement of each key, or ``None``."""
        return self.catalog.get_many(list(keys))

    def delete(self, keys: Sequence[BlockKey]) -> int:
        """Forget blocks; their bytes become dead space, and a sealed segment left without
        live blocks is deleted.  Returns how many keys were stored."""
        removed = self.catalog.delete_many(list(keys))
        segs = {(p.volume_id, p.segment_id) for p in removed if p is not None}
        for vid, seg in sorted(segs):
            self._drop_if_empty(vid, seg)
        return sum(p is not None for p in removed)

    def _drop_if_empty(self, volume_id: str, segment_id: int) -> bool:
        if not self.catalog.drop_segment_if_empty(volume_id, segment_id):
            return False
        self.counters.segments_dropped += 1
        vol = self._volumes.get(volume_id)
        if vol is not None:
            vol.delete_segment(segment_id)
        else:
            logger.warning("segment %d of unregistered volume %s dropped; its bytes stay until collect_garbage",
                           segment_id, volume_id)
        return True

    # ================================================================== moves
    def copy(self, placement: Placement, dst_volume: str) -> Placement:
        """Copy one block to a new segment on ``dst_volume`` and verify it there.

        Returns:
            the new placement, NOT committed (``version`` = ``placement.version``); pass it
            to :meth:`commit_move` (or :meth:`discard`).

        Raises:
            ChecksumMismatchError: the source copy is bad (quarantined) or the new copy
                does not read back right (its segment is released).
        """
        return self.copy_many([placement], dst_volume)[0]

    def copy_many(self, placements: Sequence[Placement], dst_volume: str,
                  skip_deleted: bool = False) -> list[Placement]:
        """:meth:`copy` for many blocks, packed into as few new segments as possible.

        ``skip_deleted``: a block deleted before its bytes were read (its segment may be
        gone) is left out, its entry in the result is ``None`` (the result stays aligned
        with ``placements``); without it such a block raises :class:`BlockNotFoundError`
        and nothing is copied.  A block deleted after its read is copied, and its commit
        answers :class:`VersionConflictError`.
        """
        dst = self._vol(dst_volume)
        src = list(placements)
        if not src:
            return []
        gone: set[int] | None = set() if skip_deleted else None
        datas = self._read_verified(src, None, deleted=gone)
        out: list[Placement] = []
        group = [(p.key, d) for p, d in zip(src, datas) if d is not None]
        cks = {p.key: p.checksum for p in src}
        for chunk in self._segment_groups(dst, group):
            new = self._write_segment(dst, chunk, version=0, checksums=[cks[k] for k, _ in chunk])
            seg = new[0].segment_id
            try:
                with dst.engine.lock:
                    buf = dst.engine.staging(dst.read_buffer_bytes([(p.segment_id, p.offset, p.length) for p in new]), dst.buffer_alignment)
                    views = dst.read_many([(p.segment_id, p.offset, p.length) for p in new], buf)
                    for p, v in zip(new, views):
                        if checksum(v) != p.checksum:
                            raise ChecksumMismatchError(f"copy of {p.key} to {dst_volume!r} did not read back right")
            except BaseException:
                self._release_segment(dst_volume, seg)
                raise
            with self._lock:
                self._pending[(dst_volume, seg)] = {p.key for p in new}
            out.extend(new)
        version = {p.key: p.version for p in src}
        copied = {p.key: replace(p, version=version[p.key]) for p in out}
        return [copied.get(p.key) for p in src] if gone else [copied[p.key] for p in src]  # type: ignore[misc]

    def commit_move(self, old: Placement, new: Placement, fence: Fence | None = None) -> Placement:
        """Point the catalog at ``new`` if it still points at ``old`` (compare-and-set).

        ``fence``: the writer's fencing token (:class:`~storage_backends.types.Fence`), checked
        and raised in the same atomic catalog step (scaled mode: the partition lease).

        Returns:
            the committed placement (version ``old.version + 1``).  The old bytes become
            dead space; the old segment is deleted when no live block remains in it.

        Raises:
            FencedError: a newer lease holder raised the fence; nothing changed and the new
                copy's space is released.
            VersionConflictError: the block changed or was deleted since ``old`` was read;
                the new copy's space is released.
        """
        try:
            committed = self.catalog.compare_and_set(old, new, fence)
        except VersionConflictError:
            self.counters.move_conflicts += 1
            self._settle(new, committed=False)
            raise
        except StorageError as exc:  # the new segment was released meanwhile
            self.counters.move_conflicts += 1
            self._settle(new, committed=False)
            raise VersionConflictError(f"cannot commit {new.key}: {exc}") from exc
        self._settle(new, committed=True)
        self._drop_if_empty(old.volume_id, old.segment_id)
        return committed

    def discard(self, new: Placement) -> None:
        """Give up an uncommitted copy from :meth:`copy`; its space is released."""
        self._settle(new, committed=False)

    def _settle(self, new: Placement, committed: bool) -> None:
        """Bookkeeping of an uncommitted copy's segment once the copy is committed or not."""
        sk = (new.volume_id, new.segment_id)
        with self._lock:
            pending = self._pending.get(sk)
            if pending is not None:
                pending.discard(new.key)
                if pending:
                    return
                del self._pending[sk]
        self.catalog.seal_segment(new.volume_id, new.segment_id)
        if not committed or pending is not None:
            self._drop_if_empty(new.volume_id, new.segment_id)

    def _release_segment(self, volume_id: str, segment_id: int) -> None:
        try:
            if self.catalog.drop_segment(volume_id, segment_id):
                self.counters.segments_dropped += 1
        except StorageError as exc:
            logger.warning("cannot release segment %d of %s: %s", segment_id, volume_id, exc)
            return
        vol = self._volumes.get(volume_id)
        if vol is not None:
            vol.delete_segment(segment_id)

    def compact(self, volume_id: str, segment_id: int, fence: Fence | None = None) -> int:
        """Rewrite the live blocks of a segment into a new one and drop the old one.

        Crash-safe: the new segment is written and verified before any catalog entry
        moves (compare-and-set per block), and the old segment is dropped only when no
        entry points into it.

        Only a sealed segment is compacted: an unsealed one may still receive the blocks
        of an in-flight put or copy (of any process sharing the catalog), which dropping
        it would destroy.

        Returns:
            blocks moved (blocks deleted or moved concurrently are skipped).

            A segment the catalog does not know (dropped meanwhile) gives 0.

        ``fence``: the writer's fencing token; once a newer holder has raised it, the
        remaining blocks are left in place and :class:`FencedError` is raised (the segment
        is kept).

        Raises:
            InvalidRequestError: unknown volume, or a segment not sealed yet (nothing is
                changed).
            FencedError: see ``fence``.
        """
        vol = self._vol(volume_id)
        seg = self.catalog.segment(volume_id, segment_id)
        if seg is None:
            return 0
        with self._lock:
            pending = (volume_id, segment_id) in self._pending
        if not seg.sealed or pending:
            raise InvalidRequestError(
                f"cannot compact segment {segment_id} of {volume_id!r}: it is not sealed "
                "(a put or copy may still commit blocks into it)")
        live = list(self.catalog.iter_segment(volume_id, segment_id))
        moved = 0
        if live:
            copies = self.copy_many(live, volume_id, skip_deleted=True)
            pairs = [(old, new) for old, new in zip(live, copies) if new is not None]
            news = [new for _, new in pairs]
            for i, (old, new) in enumerate(pairs):
                try:
                    self.commit_move(old, new, fence)
                    moved += 1
                except FencedError:
                    for rest in news[i + 1:]:
                        self.discard(rest)
                    raise
                except VersionConflictError:
                    pass
        try:
            if self.catalog.drop_segment(volume_id, segment_id):
                self.counters.segments_dropped += 1
                vol.delete_segment(segment_id)
        except StorageError as exc:  # a block landed there meanwhile: keep the segment
            logger.info("compaction of %s/%d: segment kept: %s", volume_id, segment_id, exc)
        return moved

    def collect_garbage(self, volume_id: str, min_age_s: float = 600.0) -> int:
        """Remove leftovers of crashed writers on one volume.

        * unsealed segments without live blocks older than ``min_age_s`` (a writer died
          between allocating and committing);
        * segment files/objects the catalog does not know (a process died between
          dropping a segment and deleting its bytes).

        Returns:
            segments removed.
        """
        vol = self._vol(volume_id)
        now = time.time()
        removed = 0
        known = set()
        for seg in self.catalog.segments(volume_id):
            known.add(seg.segment_id)
            with self._lock:
                mine = (volume_id, seg.segment_id) in self._pending
            if not seg.sealed and seg.live_blocks == 0 and now - seg.created_at >= min_age_s and not mine:
                self._release_segment(volume_id, seg.segment_id)
                known.discard(seg.segment_id)
                removed += 1
        for seg_id in vol.list_segments():
            if seg_id not in known and self.catalog.segment(volume_id, seg_id) is None:
                vol.delete_segment(seg_id)
                removed += 1
        return removed

    # ================================================================== stats
    def segments(self, volume_id: str) -> list[SegmentInfo]:
        """Segments of a volume with live accounting (from the shared catalog)."""
        return self.catalog.segments(volume_id)

    def stats(self) -> list[VolumeStats]:
        """Usage per registered volume: capacity, used (segment sizes), live, dead, counts,
        and this process's read/write counters (blocks)."""
        out: list[VolumeStats] = []
        with self._lock:
            vols = [self._volumes[k] for k in sorted(self._volumes)]
        for vol in vols:
            segs = self.catalog.segments(vol.desc.id)
            used = sum(s.size_bytes for s in segs)
            live = sum(s.live_bytes for s in segs)
            extra = {k: int(v) for k, v in vol.describe().items()}
            out.append(VolumeStats(
                volume_id=vol.desc.id, kind=str(getattr(vol.desc.kind, "value", vol.desc.kind)),
                media=str(getattr(vol.desc.media, "value", vol.desc.media)),
                capacity_bytes=vol.desc.capacity_bytes, used_bytes=used, live_bytes=live,
                dead_bytes=used - live, segments=len(segs), blocks=sum(s.live_blocks for s in segs),
                reads=vol.counters.blocks_read, writes=vol.counters.blocks_written, extra=extra,
            ))
        return out

    def close(self) -> None:
        """Close volumes and NIXL registrations (idempotent); the catalog stays open."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            for vol in self._volumes.values():
                vol.close()
            self._hub.close()
            with self._pool_lock:
                pool, self._pool = self._pool, None
            if pool is not None:
                pool.shutdown(wait=True)

    def __enter__(self) -> StorageAgent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
