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

Read path (``get``): catalog snapshot -> per volume, batches of up to 64 MiB read straight
into the destination where the volume allows it and verified (XXH3-64) while in the CPU
cache; a failed batch's keys are looked up again and read at their new placement or
retried alone, and a placement that fails on its own is quarantined.  The strategies,
retries and quarantine are :mod:`storage_backends.read_path` (:class:`ReadPath`, which the
agent inherits).

Moves (``copy`` -> ``commit_move``) and ``compact`` keep the invariant of docs/design.md §7:
the catalog always points at a copy that was verified after it was written.
"""

from __future__ import annotations

import bisect
import logging
import operator
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, replace

import numpy as np
import torch
import xxhash

from . import _readcore
from .catalog import PlacementCatalog
from .checksum import as_bytes, checksum, checksum_np, memory_at, pack
from .gcpause import gc_paused_call
from .keys import validate_block_key
from .nixl_engine import NixlHub
from .read_path import ReadPath, overlapping
from .types import (
    BlockKey,
    BlockNotFoundError,
    ChecksumMismatchError,
    Fence,
    FencedError,
    InvalidRequestError,
    Placement,
    SegmentInfo,
    StorageError,
    TransferError,
    VersionConflictError,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeFullError,
    VolumeStats,
)
from .volume import Volume, align_up, descriptor_identity, validate_descriptor, volume_class

logger = logging.getLogger(__name__)



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


class StorageAgent(ReadPath):
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
    #: docs/benchmarks-history.md; try it where cores are idle).  ``None``: when the process may
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
            vol = cls(desc, self._hub.engine(backend, params, cls.engine_env(desc)))
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
                if overlapping(addrs, lens) or not vol.direct_write_ok(addrs, lens, np.array(offsets, dtype=np.int64), size):
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
    def get(self, keys: Sequence[BlockKey], out: Sequence[torch.Tensor] | None = None, *,
            sources: list[str] | None = None) -> list[torch.Tensor]:
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
            sources: when given, extended (on success) with the id of the volume each
                block was read from, in key order: its placement at read time, after any
                move that happened during the read.

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
        results = self._read_verified(places, dests, cols, where=sources)
        if out is not None:
            return list(out)
        return results

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
