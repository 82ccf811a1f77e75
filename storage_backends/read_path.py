"""The storage agent's read path: verified reads, their strategies, retries and quarantine.

:class:`ReadPath` holds what :meth:`StorageAgent.get <storage_backends.agent.StorageAgent.get>`
runs after it has the catalog's placements (the agent inherits it; docs/design.md §6):

* **Batches.**  Per volume, batches of up to 64 MiB (:attr:`Volume.read_batch_bytes`).
* **Strategies.**  POSIX volumes read each batch in 4 MiB pieces, one NIXL READ each (one
  descriptor per run contiguous in the file and in memory), straight into the destination
  (the caller's ``out`` tensors, whose storages stay registered, or new tensors) and hash
  every piece (XXH3-64 per block, streamed over the pieces of a larger block) right after its
  READ, while it is in the CPU cache (:meth:`ReadPath._read_direct`).  Bytes the page cache
  already holds are copied first, without the device (``preadv2`` with ``RWF_NOWAIT``,
  buffered volumes), in 1 MiB groups each hashed while in L2 (:meth:`ReadPath._read_cached_first`);
  NIXL reads the rest.  S3 volumes read a batch with one NIXL READ (a ranged GET per segment,
  run in parallel by the backend's threads) into a registered staging buffer, verify and
  copy out (:meth:`ReadPath._read_staged`); blocks of 4 MiB or more are fetched straight
  into the destination, one ranged GET each.
* **Retries.**  When a batch fails, every key of it is looked up again: keys the catalog
  moved (a concurrent compaction or move) are read at their new placement, the others are
  retried in batches of their own, so one moved block never fails the others
  (:meth:`ReadPath._read_verified`, at most :data:`_READ_RETRIES` rounds).
* **Quarantine.**  A placement that is still current and fails on its own is quarantined
  when its bytes are wrong (checksum mismatch) or its segment is gone (ENOENT / NoSuchKey)
  or cut short before the block ends (a truncated file / object: SegmentTruncatedError), so
  the block reads as absent and the next ``put`` stores it again; then ``get`` raises
  (:meth:`ReadPath._triage`).
"""

from __future__ import annotations

import bisect
import ctypes
import itertools
import logging
import operator
import os
import threading
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from typing import Any

import numpy as np
import torch
import xxhash

from . import _readcore
from .catalog import PlacementCatalog
from .checksum import byte_array, memory_at
from .types import (
    BlockNotFoundError,
    ChecksumMismatchError,
    Placement,
    SegmentMissingError,
    SegmentTruncatedError,
    StorageError,
    TransferError,
)
from .volume import UNKNOWN_SIZE, PageCacheFiles, Volume

__all__ = ["ReadPath", "overlapping"]

logger = logging.getLogger("storage_backends.agent")  # the agent's log, as before the split

_IOV_MAX = 1024  # buffers one preadv takes (Linux UIO_MAXIOV)
_READ_BATCH_BYTES = 64 << 20
_SPLIT_MIN_BYTES = 2 << 20  # staged reads: check + copy on two threads from this size
_READ_RETRIES = 3


def overlapping(addrs: np.ndarray, lengths: np.ndarray) -> bool:
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


class ReadPath:
    """The read strategies, retries and quarantine of :class:`~storage_backends.agent.StorageAgent`
    (which inherits them; its ``get`` calls :meth:`_read_verified`).

    Uses of the agent: its catalog, counters and name, its volumes (``_vol``), its dropping
    of emptied segments (``_drop_if_empty``), the ``verify_aside`` / ``split_cached_reads``
    switches, and the verifier thread's executor (``_pool``, made under ``_pool_lock``).
    """

    catalog: PlacementCatalog
    counters: Any  # the agent's AgentCounters
    name: str
    verify_aside: bool | None
    split_cached_reads: bool | None
    _pool: ThreadPoolExecutor | None
    _pool_lock: threading.Lock
    _vol: Callable[[str], Volume]
    _drop_if_empty: Callable[[str, int], bool]

    def _read_verified(
        self, places: list[Placement], dests: list[torch.Tensor] | None, cols: tuple | None = None,
        deleted: set[int] | None = None, where: list[str] | None = None,
    ) -> list[torch.Tensor]:
        """Read and verify every placement into ``dests[i]`` (or a new tensor); ``cols``:
        :func:`_readcore.columns` of ``places`` when the caller has them.  ``deleted``: when
        given, the indexes of keys deleted while they were read are added to it (their
        result is ``None``) instead of raising :class:`BlockNotFoundError`.  ``where``:
        when given, extended on success with the volume id each block was read from (its
        placement after the retries).

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
        if where is not None:
            where.extend(p.volume_id for p in cur)
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
        if not vol.direct_read_ok(addrs, lengths) or overlapping(addrs, lengths):
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
                    and not overlapping(dst, lens)):  # overlapping outs: the later block wins, in order
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
