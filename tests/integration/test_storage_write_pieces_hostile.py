"""Hostile review of the POSIX write path in pieces (d80e698, 9caa2ae, 1111384): segments
written in ``write_piece_bytes`` pieces (one NIXL WRITE each, ``sync_file_range`` writeback
hint after each), every block of a direct write hashed (XXH3) right before the WRITE of
the piece where it starts, the file and its directory ``fsync``-ed before any placement
is recorded.

Each test checks the bytes in the segment files (and their XXH3 against the recorded
checksums), the catalog, the counters, and that no segment file outlives a failed write.
Real NIXL POSIX, real files under ``tmp_path``, a real tmpfs where this process may mount
one (``small_fs`` of test_storage_enospc), real ``kill -9`` of a child process.  The four
bugs found (strict xfails at first) are fixed; each test says what it was.
"""

from __future__ import annotations

import errno
import fcntl
import multiprocessing as mp
import os
import signal
import stat
import threading
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from storage_backends import (
    BlockKey,
    ChecksumMismatchError,
    MediaClass,
    Placement,
    SqliteCatalog,
    StorageAgent,
    TransferError,
    VolumeDescriptor,
    VolumeFullError,
    VolumeKind,
)
from storage_backends.posix_volume import PosixVolume, start_writeback
from conftest import posix_agent
from test_storage_direct_writes import pool
from test_storage_enospc import _CAN_MOUNT, small_fs  # noqa: F401  (fixture)
from test_storage_write_pieces import _record, agent  # noqa: F401  (fixture)

NS = "wp-hostile-01234"
BB = 64 << 10
PIECE = 40_007  # odd: pieces end inside blocks, never on a page


def _pieced(agent: StorageAgent) -> PosixVolume:
    """The ``agent`` fixture's volume (1 MiB segments), written in pieces of PIECE bytes."""
    vol: PosixVolume = agent._vol("fast")  # type: ignore[attr-defined]
    vol.write_piece_bytes = PIECE
    return vol


def _check_files(agent: StorageAgent, vol: PosixVolume, items: list[tuple[BlockKey, torch.Tensor]],
                 places: list[Placement]) -> None:
    """Every placement's bytes in its segment file are the item's bytes, its checksum is
    their XXH3-64, the files hold nothing else, and get returns the same bytes."""
    files: dict[int, bytes] = {}
    for (k, t), p in zip(items, places):
        raw = files.setdefault(p.segment_id, vol.path(p.segment_id).read_bytes())
        want = bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy())
        assert p.key == k and p.length == len(want)
        assert raw[p.offset:p.offset + p.length] == want, (k, p)
        assert p.checksum == xxhash.xxh3_64_intdigest(raw[p.offset:p.offset + p.length]) == xxhash.xxh3_64_intdigest(want)
    for seg, raw in files.items():  # the file is the catalog's size; live blocks disjoint, inside it
        info = agent.catalog.segment("fast", seg)
        assert info is not None and info.sealed and len(raw) == info.size_bytes
        spans = sorted((p.offset, p.offset + p.length) for p in agent.catalog.iter_segment("fast", seg))
        assert all(e0 <= s1 for (_, e0), (s1, _) in zip(spans, spans[1:])) and spans[-1][1] <= len(raw)
    got = agent.get([k for k, _ in items])
    assert all(bytes(g.numpy()) == bytes(t.contiguous().view(torch.uint8).reshape(-1).numpy())
               for g, (_, t) in zip(got, items))


def _no_leftovers(agent: StorageAgent, vol: PosixVolume) -> None:
    """Segment files on disk are exactly the catalog's, each sealed with live blocks."""
    segs = agent.segments("fast")
    assert vol.list_segments() == sorted(s.segment_id for s in segs)
    assert all(s.sealed and s.live_blocks > 0 for s in segs)
    assert [p.name for p in vol.dir.iterdir() if not p.name.startswith("seg-")] == []


# ---------------------------------------------------------------------------- bytes
def test_fuzz_mixed_sizes_views_and_staged_blocks_land_byte_exact_with_their_hash(agent: StorageAgent) -> None:
    """Seeded: blocks of 1 B .. 2.5 pieces (1, 7, page +-1, exactly a piece, piece +- 1),
    views back to back into one big tensor (merged runs whose rows are cut by pieces),
    separate tensors, non-contiguous ones (staged: the whole segment goes through the
    staging buffer), float16 views; several segments per put, segments not a multiple of
    the piece.  Every file is written in ceil(size / PIECE) WRITEs, each hinted."""
    vol = _pieced(agent)
    writes, hints = _record(vol)
    rng = np.random.default_rng(20261129)
    sizes = [1, 7, 4095, 4096, 4097, PIECE - 1, PIECE, PIECE + 1, 2 * PIECE + PIECE // 2, 100_000]
    big = pool(31, 8 << 20)
    h = 0
    all_items: list[tuple[BlockKey, torch.Tensor]] = []
    all_places: list[Placement] = []
    for rnd in range(4):
        items: list[tuple[BlockKey, torch.Tensor]] = []
        pos = int(rng.integers(0, 4096))
        for _ in range(int(rng.integers(20, 40))):
            n = int(rng.choice(sizes))
            kind = rng.integers(0, 10) if rnd != 3 else 0  # round 3: all views (direct writes)
            if kind < 6:  # view of the big tensor, right after the previous one
                t = big[pos:pos + n]
                pos += n + (0 if rng.integers(0, 4) else int(rng.integers(1, 64)))  # mostly runs
            elif kind < 8:
                t = pool(1000 + h, n)
            elif kind < 9:  # non-contiguous: the agent hashes and stages a copy
                t = pool(2000 + h, 2 * n)[::2]
            else:  # float16 view of an even number of bytes
                t = pool(3000 + h, 2 * ((n + 1) // 2)).view(torch.float16)
            items.append((BlockKey(NS, h), t))
            h += 1
        before = (vol.counters.segments_written, vol.counters.bytes_written, vol.counters.blocks_written)
        ps = agent.put(items, "fast")
        segs = sorted({p.segment_id for p in ps})
        sizes_on_disk = [vol.path(s).stat().st_size for s in segs]
        assert vol.counters.segments_written - before[0] == len(segs)
        assert vol.counters.bytes_written - before[1] == sum(sizes_on_disk) == sum(p.length for p in ps)
        assert vol.counters.blocks_written - before[2] == len(items)
        all_items += items
        all_places += ps
    _check_files(agent, vol, all_items, all_places)
    # WRITEs and hints: pieces back to back over each file, in file order
    sizes_all = [vol.path(s).stat().st_size for s in sorted({p.segment_id for p in all_places})]
    want = [(p, min(PIECE, n - p)) for n in sizes_all for p in range(0, n, PIECE)]
    assert writes == want
    assert hints == [(p, min(PIECE, n - p)) for n in sizes_all if n > PIECE for p in range(0, n, PIECE)]
    assert vol.counters.extra.get("direct_writes", 0) >= 1
    _no_leftovers(agent, vol)


def test_real_4mib_pieces_blocks_larger_than_a_piece_and_of_one_byte(tmp_path: Path) -> None:
    """The shipped piece size (4 MiB): a 9 MiB block (three pieces, hashed once before the
    first), 1 B blocks on both sides of it, a 4 MiB block ending exactly on a piece end."""
    a = posix_agent(tmp_path, f"wph4-{tmp_path.name}")
    try:
        vol: PosixVolume = a._vol("fast")  # type: ignore[attr-defined]
        assert vol.write_piece_bytes == 4 << 20
        writes, hints = _record(vol)
        big = pool(41, 14 << 20)
        items = [(BlockKey(NS, 9000), big[:1]), (BlockKey(NS, 9001), big[1:1 + (9 << 20)]),
                 (BlockKey(NS, 9002), big[1 + (9 << 20):2 + (9 << 20)])]
        ps = a.put(items, "fast")
        assert len({p.segment_id for p in ps}) == 3  # 1 MiB segments: the 9 MiB block alone
        items2 = [(BlockKey(NS, 9003), pool(42, 4 << 20))]
        ps2 = a.put(items2, "fast")
        _check_files(a, vol, items + items2, ps + ps2)
        assert (0, 4 << 20) in writes and (8 << 20, 1 << 20) in writes
        assert hints == [(0, 4 << 20), (4 << 20, 4 << 20), (8 << 20, 1 << 20)]  # the 4 MiB block: one piece
    finally:
        a.close()
        a.catalog.close()  # type: ignore[attr-defined]


def test_a_block_changed_after_its_hash_while_its_tail_waits_for_the_next_piece_is_never_returned(
    agent: StorageAgent,
) -> None:
    """A block spanning pieces 0 and 1 is hashed before piece 0; a caller (or another
    thread) that changes its tail before piece 1's WRITE leaves a file that does not match
    the recorded checksum.  That is a caller race (put's contract: the tensors do not
    change during the call), but it must be caught on read, never returned."""
    vol = _pieced(agent)
    g2 = pool(51, 4 * BB)
    items = [(BlockKey(NS, 9100 + i), g2[i * BB:(i + 1) * BB]) for i in range(4)]

    def hint(fd: int, off: int, n: int) -> bool:
        if off == 0:
            g2[PIECE + 10] ^= 0xFF  # block 0 (0..BB) spans the piece end at PIECE
        return start_writeback(fd, off, n)

    vol.start_writeback = hint
    ps = agent.put(items, "fast")
    raw = vol.path(ps[0].segment_id).read_bytes()
    assert ps[0].checksum != xxhash.xxh3_64_intdigest(raw[:BB])  # hashed before the change
    assert raw[:BB] == bytes(g2[:BB].numpy())  # written after it
    with pytest.raises(ChecksumMismatchError):
        agent.get([items[0][0]])
    assert agent.exists([items[0][0]]) == [False]  # quarantined
    assert all(torch.equal(x, t) for x, (_, t) in zip(agent.get([k for k, _ in items[1:]]), items[1:]))


# ---------------------------------------------------------------------------- failures
@pytest.mark.parametrize("which", ["last", "middle"])
def test_writeback_hint_eio_on_the_last_or_a_middle_piece_records_nothing(agent: StorageAgent, which: str) -> None:
    vol = _pieced(agent)
    items = [(BlockKey(NS, 9200 + i), t) for i, t in enumerate(pool(61, 16 * BB).split(BB))]
    size = 16 * BB

    def hint(fd: int, off: int, n: int) -> bool:
        if (which == "last" and off + n == size) or (which == "middle" and off == 2 * PIECE):
            raise OSError(errno.EIO, os.strerror(errno.EIO))
        return start_writeback(fd, off, n)

    vol.start_writeback = hint
    before = dict(vol.describe())
    with pytest.raises(TransferError) as ei:
        agent.put(items, "fast")
    assert ei.value.stored == [] and agent.exists([k for k, _ in items]) == [False] * 16
    assert vol.list_segments() == [] and agent.segments("fast") == []
    after = vol.describe()
    assert after["segments_written"] == before["segments_written"] and after["bytes_written"] == before["bytes_written"]
    assert vol.counters.blocks_written == 0


@pytest.mark.parametrize("exc", [OSError(errno.EIO, "injected EIO"), KeyboardInterrupt()])
def test_a_failure_in_the_second_segment_keeps_the_first_and_reports_it(agent: StorageAgent, exc: BaseException) -> None:
    """32 blocks, two 1 MiB segments; the hint of the second segment's third piece fails
    (EIO) or the caller is interrupted there (KeyboardInterrupt).  The first segment stays
    stored and, for the EIO, is what ``stored`` names; the second leaves no trace."""
    vol = _pieced(agent)
    items = [(BlockKey(NS, 9250 + i), t) for i, t in enumerate(pool(63, 32 * BB).split(BB))]
    segs_seen: list[int] = []

    def hint(fd: int, off: int, n: int) -> bool:
        if off == 0:
            segs_seen.append(fd)
        if len(segs_seen) == 2 and off == 2 * PIECE:
            raise exc
        return start_writeback(fd, off, n)

    vol.start_writeback = hint
    with pytest.raises(type(exc)) as ei:
        agent.put(items, "fast")
    first = agent.locate([k for k, _ in items[:16]])
    assert agent.exists([k for k, _ in items]) == [True] * 16 + [False] * 16
    if isinstance(exc, OSError):
        assert isinstance(ei.value, TransferError) and ei.value.stored == first
    _no_leftovers(agent, vol)
    assert len(vol.list_segments()) == 1
    vol.start_writeback = start_writeback
    _check_files(agent, vol, items, first + agent.put(items[16:], "fast"))


def test_o_direct_write_failure_falls_back_to_buffered_pieces_with_right_checksums(tmp_path: Path) -> None:
    """An O_DIRECT WRITE that fails (EIO from NIXL) is retried buffered, in pieces: the
    blocks were all hashed before the O_DIRECT WRITE, none twice, none skipped."""
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"wphd-{tmp_path.name}")
    try:
        a.register_volume(VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 1 << 30,
                                           root=str(tmp_path / "d"), segment_bytes=1 << 20, o_direct=True))
        vol: PosixVolume = a._vol("fast")  # type: ignore[attr-defined]
        vol.write_piece_bytes = PIECE
        _fail_first_o_direct_write(vol)
        g2 = torch.zeros(16 * BB + 4096, dtype=torch.uint8)
        off = (-g2.data_ptr()) % 4096
        g2[off:off + 16 * BB] = pool(71, 16 * BB)
        items = [(BlockKey(NS, 9300 + i), g2[off + i * BB:off + (i + 1) * BB]) for i in range(16)]
        writes, _ = _record(vol)
        ps = a.put(items, "fast")
        assert vol.counters.extra.get("o_direct_fallbacks", 0) >= 1
        # the failed O_DIRECT WRITE (one, the whole file), then buffered pieces
        assert writes == [(0, 16 * BB)] + [(p, min(PIECE, 16 * BB - p)) for p in range(0, 16 * BB, PIECE)]
        _check_files(a, vol, items, ps)
        _no_leftovers(a, vol)
    finally:
        a.close()
        cat.close()


def test_a_filesystem_refusing_o_direct_opens_gets_buffered_pieces(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """open(O_DIRECT) fails with EINVAL after creating the file (tmpfs before Linux 6.6
    did so): the segment is re-created buffered and written in pieces, each hinted (aligned
    blocks written from the caller's memory), then unaligned blocks; nothing of the
    refused open is left."""
    real_open = os.open

    def open_(path, flags, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
        if flags & os.O_DIRECT:
            if flags & os.O_CREAT:
                os.close(real_open(path, flags & ~os.O_DIRECT, *args, **kw))
            raise OSError(errno.EINVAL, os.strerror(errno.EINVAL))
        return real_open(path, flags, *args, **kw)

    monkeypatch.setattr(os, "open", open_)
    a = StorageAgent(SqliteCatalog(tmp_path / "catalog.sqlite"), name=f"wpho-{tmp_path.name}")
    try:
        a.register_volume(VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 1 << 30,
                                           root=str(tmp_path / "d"), segment_bytes=1 << 20, o_direct=True))
        vol: PosixVolume = a._vol("fast")  # type: ignore[attr-defined]
        vol.write_piece_bytes = PIECE
        writes, hints = _record(vol)
        g2 = torch.zeros(16 * BB + 4096, dtype=torch.uint8)
        off = (-g2.data_ptr()) % 4096
        g2[off:off + 16 * BB] = pool(171, 16 * BB)
        items = [(BlockKey(NS, 9850 + i), g2[off + i * BB:off + (i + 1) * BB]) for i in range(16)]
        ps = a.put(items, "fast")
        small = [(BlockKey(NS, 9870 + i), pool(172 + i, 1000 + i)) for i in range(5)]
        ps += a.put(small, "fast")
        # the refusal turned the volume buffered for good (794c400): one fallback, and the
        # small blocks are packed without O_DIRECT padding
        assert vol.counters.extra["o_direct_fallbacks"] == 1 and vol.block_alignment == 1
        assert [p.offset for p in ps[16:]] == [0, 1000, 2001, 3003, 4006]
        assert writes[:len(hints)] == hints == [(p, min(PIECE, 16 * BB - p)) for p in range(0, 16 * BB, PIECE)]
        _check_files(a, vol, items + small, ps)
        _no_leftovers(a, vol)
    finally:
        a.close()
        a.catalog.close()  # type: ignore[attr-defined]


def _fail_first_o_direct_write(vol: PosixVolume) -> list[int]:
    """The first NIXL WRITE into a file opened with O_DIRECT raises TransferError (EIO)."""
    failed: list[int] = []
    orig = vol.engine.transfer

    def transfer(op, local, remote, mem, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        fd = int(np.asarray(remote)[0, 2])
        if op == "WRITE" and not failed and fcntl.fcntl(fd, fcntl.F_GETFL) & os.O_DIRECT:
            failed.append(fd)
            raise TransferError("injected: NIXL POSIX WRITE failed (EIO)")
        return orig(op, local, remote, mem, *a, **k)

    vol.engine.transfer = transfer  # type: ignore[method-assign]
    return failed


# Fixed finding (was a strict xfail): posix_volume.py _write_local: after an O_DIRECT WRITE fails
# it closes fd, then  `fd = os.open(path, O_RDWR)`; when that open fails, fd still holds the
# closed number and the  except block closes it AGAIN: an fd another thread got meanwhile is
# closed under it (or EBADF  escapes as a raw OSError and the segment file is left behind)
def test_o_direct_fallback_reopen_failure_closes_no_other_file(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"wphr-{tmp_path.name}")
    victim = -1
    try:
        a.register_volume(VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 1 << 30,
                                           root=str(tmp_path / "d"), segment_bytes=1 << 20, o_direct=True))
        vol: PosixVolume = a._vol("fast")  # type: ignore[attr-defined]
        failed = _fail_first_o_direct_write(vol)
        real_open = os.open

        def open_(path, flags, *args, **kw):  # noqa: ANN001, ANN002, ANN003, ANN202
            nonlocal victim
            if failed and str(path).startswith(str(vol.dir)) and not flags & os.O_CREAT:
                # another thread opens a file in the gap (it gets the freed fd number),
                # then this process runs out of descriptors
                victim = real_open(tmp_path / "other-thread-file", os.O_RDWR | os.O_CREAT, 0o644)
                raise OSError(errno.EMFILE, os.strerror(errno.EMFILE))
            return real_open(path, flags, *args, **kw)

        monkeypatch.setattr(os, "open", open_)
        items = [(BlockKey(NS, 9400 + i), t) for i, t in enumerate(pool(81, 4 * BB).split(BB))]
        with pytest.raises(OSError) as ei:
            a.put(items, "fast")
        monkeypatch.undo()
        assert victim >= 0
        try:
            os.fstat(victim)
            victim_open = True
        except OSError:
            victim_open = False  # closed by the volume's second close of its own old fd
        # want: a TransferError, no file, no catalog segment, and the other thread's file open
        assert (isinstance(ei.value, TransferError), vol.list_segments(), a.segments("fast"), victim_open) \
            == (True, [], [], True)
    finally:
        monkeypatch.undo()
        if victim >= 0:
            try:
                os.close(victim)
            except OSError:
                pass
        a.close()
        cat.close()


# Fixed finding (was a strict xfail): posix_volume.py _write_local: self._fsync_dir() runs after
# the try/except that removes the  file and maps OSError to TransferError; a directory fsync error
# (EIO) escapes as a raw  OSError (put's `stored` is never set) and the fsync-ed segment file
# stays on disk, unknown  to the catalog
def test_directory_fsync_eio_fails_the_put_cleanly(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    vol = _pieced(agent)
    items = [(BlockKey(NS, 9500 + i), t) for i, t in enumerate(pool(91, 8 * BB).split(BB))]
    exc = _put_failing_fsync(agent, monkeypatch, items, stat.S_ISDIR, errno.EIO, OSError)
    assert agent.exists([k for k, _ in items]) == [False] * 8 and agent.segments("fast") == []
    # want: a TransferError that says nothing was stored, and no segment file left
    assert (type(exc).__name__, getattr(exc, "stored", None), vol.list_segments()) == ("TransferError", [], [])


def _put_failing_fsync(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch, items: list[tuple[BlockKey, torch.Tensor]],
                       is_kind: Callable[[int], bool], err: int, raised: type) -> BaseException:
    """``agent.put(items)`` while ``os.fsync`` of every fd whose ``st_mode`` passes
    ``is_kind`` (``stat.S_ISDIR``, ``stat.S_ISREG``) fails with ``err``; the error raised,
    which must be a ``raised``."""
    real_fsync = os.fsync

    def fsync(fd: int) -> None:
        if is_kind(os.fstat(fd).st_mode):
            raise OSError(err, os.strerror(err))
        real_fsync(fd)

    monkeypatch.setattr(os, "fsync", fsync)
    try:
        with pytest.raises(raised) as ei:
            agent.put(items, "fast")
    finally:
        monkeypatch.undo()
    return ei.value


# Fixed finding (was a strict xfail): volume.py Volume.runs merges blocks contiguous in memory
# into one NIXL descriptor even when  they lie in two different storages; nixl_engine.py
# DramRegions.ensure registers each storage  as its own region and never joins regions that only
# touch (`self._sorted[k] < hi`), so the  merged descriptor spans two registrations:
# NIXL_ERR_NOT_FOUND, the whole put fails
def test_blocks_of_two_adjacent_storages_are_written(agent: StorageAgent) -> None:
    """Two caller tensors over back-to-back halves of one buffer (torch.frombuffer: two
    storages, the first ending where the second starts), e.g. per-layer pools carved from
    one allocation.  Each block is contiguous and is the caller's own memory."""
    vol = _pieced(agent)
    buf = np.random.default_rng(121).integers(0, 256, 4 * BB, dtype=np.uint8)
    t1 = torch.frombuffer(memoryview(buf[:2 * BB]), dtype=torch.uint8)
    t2 = torch.frombuffer(memoryview(buf[2 * BB:]), dtype=torch.uint8)
    assert t1.untyped_storage().data_ptr() != t2.untyped_storage().data_ptr()
    assert t1.data_ptr() + t1.nbytes == t2.data_ptr()
    items = [(BlockKey(NS, 9800), t1), (BlockKey(NS, 9801), t2)]
    try:
        ps = agent.put(items, "fast")
    except TransferError as exc:  # NIXL_ERR_NOT_FOUND
        assert vol.list_segments() == [] and agent.segments("fast") == []  # at least nothing left
        raise AssertionError(f"put of two adjacent storages failed: {exc}") from exc
    _check_files(agent, vol, items, ps)


def test_hint_unsupported_from_a_middle_piece_on_stops_asking_and_the_segment_lands(agent: StorageAgent) -> None:
    """The hint taken for pieces 0-2, then EINVAL (unsupported): the segment still lands
    whole, the volume stops asking (counter 1), later segments carry no hint."""
    vol = _pieced(agent)
    asked: list[int] = []

    def hint(fd: int, off: int, n: int) -> bool:
        asked.append(off)
        return start_writeback(fd, off, n) if off < 3 * PIECE else False

    vol.start_writeback = hint
    items = [(BlockKey(NS, 9900 + i), t) for i, t in enumerate(pool(131, 32 * BB).split(BB))]
    ps = agent.put(items, "fast")
    assert asked == [0, PIECE, 2 * PIECE, 3 * PIECE]
    assert vol.start_writeback is None and vol.counters.extra["writeback_hint_unsupported"] == 1
    _check_files(agent, vol, items, ps)
    _no_leftovers(agent, vol)


@pytest.mark.parametrize(("err", "raised"), [(errno.EIO, TransferError), (errno.ENOSPC, VolumeFullError)])
def test_file_fsync_error_after_the_pieces_records_nothing(
    agent: StorageAgent, monkeypatch: pytest.MonkeyPatch, err: int, raised: type
) -> None:
    """Writeback errors surface at the file's fsync (the hints only started it): EIO, or
    ENOSPC of delayed allocation.  Nothing recorded, no file, the volume still writes."""
    vol = _pieced(agent)
    items = [(BlockKey(NS, 9950 + i), t) for i, t in enumerate(pool(141, 8 * BB).split(BB))]
    exc = _put_failing_fsync(agent, monkeypatch, items, stat.S_ISREG, err, raised)
    assert exc.stored == [] and agent.exists([k for k, _ in items]) == [False] * 8  # type: ignore[attr-defined]
    assert vol.list_segments() == [] and agent.segments("fast") == [] and vol.counters.segments_written == 0
    _check_files(agent, vol, items, agent.put(items, "fast"))


def test_two_threads_putting_the_same_keys_leave_one_segment(agent: StorageAgent) -> None:
    """Both threads write a whole segment in pieces; one wins every key, the loser's
    segment (file and catalog entry) is dropped."""
    vol = _pieced(agent)
    g = pool(151, 16 * BB)
    items = [(BlockKey(NS, 9970 + i), g[i * BB:(i + 1) * BB]) for i in range(16)]
    barrier = threading.Barrier(2)
    out: list[list[Placement]] = []
    errors: list[BaseException] = []

    def put() -> None:
        try:
            barrier.wait()
            out.append(agent.put(items, "fast"))
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=put) for _ in range(2)]
    for t in ts:
        t.start()
    for t in ts:
        t.join(timeout=60)
    assert errors == [] and len(out) == 2 and out[0] == out[1]
    _check_files(agent, vol, items, out[0])
    _no_leftovers(agent, vol)
    assert len(vol.list_segments()) == 1


# ---------------------------------------------------------------------------- ENOSPC
def _tmpfs_agent(tmp_path: Path, root: Path, name: str) -> tuple[StorageAgent, PosixVolume]:
    """Catalog off the small filesystem; 512 KiB segments in pieces of 100,003 bytes."""
    a = StorageAgent(SqliteCatalog(tmp_path / "catalog.sqlite"), name=name)
    a.register_volume(VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.SSD, 1 << 30, root=str(root),
                                       segment_bytes=512 << 10))
    vol: PosixVolume = a._vol("fast")  # type: ignore[attr-defined]
    vol.write_piece_bytes = 100_003
    return a, vol


def _fill(path: Path) -> int:
    """Another tenant takes every free byte of ``path``'s filesystem (bounded: 2 MiB)."""
    n = 0
    with open(path, "wb", buffering=0) as f:
        while n < 2 << 20:
            try:
                n += f.write(b"z" * 4096)
            except OSError as exc:
                assert exc.errno == errno.ENOSPC
                break
    return n


def test_a_tenant_filling_the_filesystem_between_pieces_cannot_break_a_reserved_segment(
    tmp_path: Path, small_fs: Path  # noqa: F811
) -> None:
    a, vol = _tmpfs_agent(tmp_path, small_fs, f"wphf-{tmp_path.name}")
    try:
        items = [(BlockKey(NS, 9600 + i), t) for i, t in enumerate(pool(101, 8 * BB).split(BB))]
        filled: list[int] = []

        def hint(fd: int, off: int, n: int) -> bool:
            if off == 0:
                filled.append(_fill(small_fs / "tenant"))
            return start_writeback(fd, off, n)

        vol.start_writeback = hint
        ps = a.put(items, "fast")  # fallocate reserved the segment before the first piece
        assert filled and filled[0] > 0
        _check_files(a, vol, items, ps)
        _no_leftovers(a, vol)
    finally:
        a.close()
        a.catalog.close()  # type: ignore[attr-defined]


def test_enospc_on_a_middle_piece_without_reservation_leaves_nothing(tmp_path: Path, small_fs: Path) -> None:  # noqa: F811
    """A filesystem whose preallocation reserves nothing (copy-on-write): a tenant takes
    the space after piece 1, piece 2 runs out.  VolumeFullError (ENOSPC) where the real
    tmpfs is mounted (TransferError from the injected failure otherwise), nothing recorded,
    no file; once the tenant leaves, the same put lands."""
    a, vol = _tmpfs_agent(tmp_path, small_fs, f"wphn-{tmp_path.name}")
    try:
        vol.fallocate = lambda fd, off, n: None  # type: ignore[assignment]
        first = [(BlockKey(NS, 9700 + i), t) for i, t in enumerate(pool(111, 2 * BB).split(BB))]
        a.put(first, "fast")  # acknowledged before
        items = [(BlockKey(NS, 9710 + i), t) for i, t in enumerate(pool(112, 8 * BB).split(BB))]
        tenant = small_fs / "tenant"
        if _CAN_MOUNT:
            def hint(fd: int, off: int, n: int) -> bool:
                if off == 100_003:
                    _fill(tenant)
                return start_writeback(fd, off, n)

            vol.start_writeback = hint
            expected: type = VolumeFullError
        else:
            orig = vol.engine.transfer
            seen: list[int] = []

            def transfer(op, local, remote, mem, *x, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
                if op == "WRITE" and int(np.asarray(remote)[0, 0]) == 2 * 100_003 and not seen:
                    seen.append(1)
                    raise TransferError("injected: NIXL POSIX WRITE of piece 2 failed")
                return orig(op, local, remote, mem, *x, **k)

            vol.engine.transfer = transfer  # type: ignore[method-assign]
            expected = TransferError
        before = dict(vol.describe())
        with pytest.raises(expected) as ei:
            a.put(items, "fast")
        assert ei.value.stored == []
        assert a.exists([k for k, _ in items]) == [False] * 8
        assert vol.describe()["segments_written"] == before["segments_written"]
        assert len(a.segments("fast")) == 1
        _no_leftovers(a, vol)
        tenant.unlink(missing_ok=True)
        vol.start_writeback = start_writeback
        ps = a.put(items, "fast")
        _check_files(a, vol, first + items, a.locate([k for k, _ in first]) + ps)
    finally:
        a.close()
        a.catalog.close()  # type: ignore[attr-defined]


# Fixed finding (was a strict xfail): posix_volume.py _classify (called from _write_local on any
# failed NIXL WRITE) says ENOSPC  whenever statvfs free space < the segment size, but the
# segment's own fallocate reservation  already took that space: an EIO on a middle piece of a
# reserved segment on a half-full  filesystem is raised as VolumeFullError (volume full) instead
# of TransferError
def test_eio_on_a_middle_piece_of_a_reserved_segment_is_not_reported_as_full(
    tmp_path: Path, small_fs: Path, monkeypatch: pytest.MonkeyPatch  # noqa: F811
) -> None:
    """512 KiB segment on the 1 MiB tmpfs (a 4 KiB tenant): fallocate reserves it (so no
    WRITE of it can run out of space), leaving ~508 KiB free; piece 2's WRITE fails with
    an I/O error.  Without a mountable tmpfs, statvfs reports those 508 KiB."""
    a, vol = _tmpfs_agent(tmp_path, small_fs, f"wphe-{tmp_path.name}")
    try:
        if not _CAN_MOUNT:
            real_statvfs = os.statvfs

            def statvfs(path):  # noqa: ANN001, ANN202
                st = real_statvfs(path)
                return os.statvfs_result((st.f_bsize, 4096, 256, 127, 127) + tuple(st)[5:])

            monkeypatch.setattr(os, "statvfs", statvfs)
        orig = vol.engine.transfer

        def transfer(op, local, remote, mem, *x, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
            if op == "WRITE" and int(np.asarray(remote)[0, 0]) == 2 * 100_003:
                raise TransferError("injected: NIXL POSIX WRITE failed (an io completed with EIO)")
            return orig(op, local, remote, mem, *x, **k)

        vol.engine.transfer = transfer  # type: ignore[method-assign]
        items = [(BlockKey(NS, 9990 + i), t) for i, t in enumerate(pool(161, 8 * BB).split(BB))]
        with pytest.raises(OSError) as ei:
            a.put(items, "fast")
        assert vol.list_segments() == [] and a.segments("fast") == []  # nothing left, either way
        assert type(ei.value).__name__ == "TransferError", ei.value
    finally:
        a.close()
        a.catalog.close()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- crashes
def _crash_child(root: str, ack_path: str, mode: str) -> None:
    """Put acknowledged 1 MiB segments (16 x 64 KiB, pieces of PIECE) forever; after three
    acknowledged puts, SIGKILL at ``mode``: ``between-pieces`` (after piece 2's WRITE),
    ``before-fsync`` (after the last piece's WRITE and hint, before the fsync),
    ``after-fsync`` (file and directory fsync-ed, before the catalog insert)."""
    os.environ["NIXL_LOG_LEVEL"] = "WARN"
    a = posix_agent(root, "wph-crash")
    vol: PosixVolume = a._vol("fast")  # type: ignore[attr-defined]
    vol.write_piece_bytes = PIECE
    acked = [0]
    die = lambda: os.kill(os.getpid(), signal.SIGKILL)  # noqa: E731

    def hint(fd: int, off: int, n: int) -> bool:
        ok = start_writeback(fd, off, n)
        if acked[0] >= 3 and ((mode == "between-pieces" and off == PIECE)
                              or (mode == "before-fsync" and off + n == 16 * BB)):
            die()
        return ok

    vol.start_writeback = hint
    if mode == "after-fsync":
        insert = a.catalog.insert_if_absent
        a.catalog.insert_if_absent = lambda ps: die() if acked[0] >= 3 else insert(ps)  # type: ignore[method-assign]
    with open(ack_path, "a") as ack:
        for r in range(100):
            keys = list(range(r * 16, r * 16 + 16))
            a.put([(BlockKey(NS, h), pool(h, BB)) for h in keys], "fast")
            ack.write(" ".join(map(str, keys)) + "\n")
            ack.flush()
            acked[0] += 1


@pytest.mark.timeout(120)
@pytest.mark.parametrize("mode", ["between-pieces", "before-fsync", "after-fsync"])
def test_kill_9_inside_a_pieced_write_loses_no_acknowledged_block_and_records_nothing_half(
    tmp_path: Path, mode: str
) -> None:
    ack = tmp_path / "acks"
    p = mp.get_context("spawn").Process(target=_crash_child, args=(str(tmp_path), str(ack), mode))
    p.start()
    p.join(timeout=90)
    assert p.exitcode == -signal.SIGKILL, p.exitcode
    acked = [int(x) for line in ack.read_text().splitlines(keepends=True) if line.endswith("\n") for x in line.split()]
    assert len(acked) == 48  # three puts, then killed inside the fourth
    a = posix_agent(tmp_path, "wph-recover")
    try:
        vol: PosixVolume = a._vol("fast")  # type: ignore[attr-defined]
        items = [(BlockKey(NS, h), pool(h, BB)) for h in acked]
        _check_files(a, vol, items, a.locate([k for k, _ in items]))
        lost = [BlockKey(NS, h) for h in range(48, 64)]
        assert a.exists(lost) == [False] * 16  # the killed put: nothing recorded
        # its segment: allocated, unsealed, no block; its file there (partial or whole)
        segs = a.segments("fast")
        orphan = [s for s in segs if not s.sealed]
        assert len(segs) == 4 and len(orphan) == 1 and orphan[0].live_blocks == 0
        size = vol.segment_size(orphan[0].segment_id)
        assert size == {"between-pieces": 2 * PIECE, "before-fsync": 16 * BB, "after-fsync": 16 * BB}[mode]
        assert a.collect_garbage("fast", min_age_s=0) == 1
        _no_leftovers(a, vol)
        ps = a.put([(k, pool(k.sequence_hash, BB)) for k in lost], "fast")  # the retry lands
        _check_files(a, vol, items + [(k, pool(k.sequence_hash, BB)) for k in lost],
                     a.locate([k for k, _ in items]) + ps)
    finally:
        a.close()
        a.catalog.close()  # type: ignore[attr-defined]


# ---------------------------------------------------------------------------- concurrency
@pytest.mark.timeout(120)
def test_threads_putting_in_pieces_while_another_compacts(agent: StorageAgent) -> None:
    """Two threads put 1 MiB segments in pieces (views of one pool each: merged runs),
    a third deletes a block of each and compacts; every surviving block reads back with
    its bytes and hash, the files and the catalog agree."""
    vol = _pieced(agent)
    errors: list[BaseException] = []
    done = threading.Event()
    stored: dict[int, list[tuple[BlockKey, torch.Tensor]]] = {0: [], 1: []}
    deleted: set[BlockKey] = set()
    lock = threading.Lock()

    def writer(w: int) -> None:
        try:
            for r in range(6):
                g = pool(500 + 10 * w + r, 16 * BB)
                items = [(BlockKey(NS, 100_000 * (w + 1) + 16 * r + i), g[i * BB:(i + 1) * BB]) for i in range(16)]
                agent.put(items, "fast")
                with lock:
                    stored[w] += items
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    def compactor() -> None:
        try:
            while not done.is_set():
                with lock:
                    victims = [items[-1][0] for items in stored.values() if items and items[-1][0] not in deleted]
                    deleted.update(victims)
                if victims:
                    agent.delete(victims)
                for s in agent.segments("fast"):
                    if s.sealed and s.live_blocks < 16:
                        agent.compact("fast", s.segment_id)
        except BaseException as exc:  # noqa: BLE001
            errors.append(exc)

    ts = [threading.Thread(target=writer, args=(w,)) for w in (0, 1)]
    c = threading.Thread(target=compactor)
    for t in ts + [c]:
        t.start()
    for t in ts:
        t.join(timeout=100)
    done.set()
    c.join(timeout=100)
    assert errors == []
    live = [(k, t) for items in stored.values() for k, t in items if k not in deleted]
    assert len(live) + len(deleted) == 192 and deleted
    _check_files(agent, vol, live, agent.locate([k for k, _ in live]))
    assert agent.exists(list(deleted)) == [False] * len(deleted)
    assert vol.list_segments() == sorted(s.segment_id for s in agent.segments("fast"))


def _racing_child(root: str, w: int, go: str) -> None:
    """5 puts of 16 x 64 KiB in pieces of PIECE: 8 blocks of its own, 8 the other
    writer puts too (same keys, same bytes), started together."""
    os.environ["NIXL_LOG_LEVEL"] = "WARN"
    a = posix_agent(root, f"wph-race-{w}")
    _pieced(a)
    while not os.path.exists(go):
        time.sleep(0.001)
    for r in range(5):
        own = [10_000 * (w + 1) + 8 * r + i for i in range(8)]
        shared = [50_000 + 8 * r + i for i in range(8)]
        a.put([(BlockKey(NS, h), pool(h, BB)) for h in (own + shared if w else shared + own)], "fast")
    a.close()
    a.catalog.close()  # type: ignore[attr-defined]


@pytest.mark.timeout(120)
def test_two_processes_putting_in_pieces_into_one_volume_overlapping_keys(tmp_path: Path) -> None:
    posix_agent(tmp_path, "wph-race-init").close()  # the catalog's tables, once
    go = str(tmp_path / "go")
    ctx = mp.get_context("spawn")
    ps = [ctx.Process(target=_racing_child, args=(str(tmp_path), w, go)) for w in (0, 1)]
    for p in ps:
        p.start()
    Path(go).touch()
    for p in ps:
        p.join(timeout=90)
    assert [p.exitcode for p in ps] == [0, 0]
    a = posix_agent(tmp_path, "wph-race-check")
    try:
        vol: PosixVolume = a._vol("fast")  # type: ignore[attr-defined]
        hs = [10_000 * (w + 1) + i for w in (0, 1) for i in range(40)] + [50_000 + i for i in range(40)]
        items = [(BlockKey(NS, h), pool(h, BB)) for h in hs]
        _check_files(a, vol, items, a.locate([k for k, _ in items]))
        _no_leftovers(a, vol)
        assert sum(s.live_blocks for s in a.segments("fast")) == 120 == len(list(a.catalog.iter_volume("fast")))
    finally:
        a.close()
        a.catalog.close()  # type: ignore[attr-defined]
