"""POSIX segment writes in pieces: one NIXL WRITE per ``write_piece_bytes`` of a buffered
segment, each piece's writeback started (``sync_file_range``) right after its WRITE, the
segment still ``fsync``-ed before any placement is recorded.  Real NIXL POSIX on files
under tmp_path."""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from storage_backends import (
    BlockKey,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    TransferError,
    VolumeDescriptor,
    VolumeFullError,
    VolumeKind,
)
from storage_backends.agent import _PieceHasher
from storage_backends.posix_volume import PosixVolume, start_writeback, write_pieces
from conftest import posix_agent
from test_storage_direct_writes import pool

NS = "write-pieces-0123"
BB = 64 << 10
PIECE = 3 * BB + 100  # not a multiple of the blocks: pieces end inside blocks


@pytest.fixture
def agent(tmp_path: Path) -> StorageAgent:
    """1 MiB segments of 64 KiB blocks (BB), written in pieces of PIECE bytes."""
    a = posix_agent(tmp_path, f"wp-{tmp_path.name}")
    a._vol("fast").write_piece_bytes = PIECE  # type: ignore[attr-defined]
    yield a
    a.close()
    a.catalog.close()  # type: ignore[attr-defined]


def _record(vol: PosixVolume) -> tuple[list[tuple[int, int]], list[tuple[int, int]]]:
    """Record every NIXL WRITE's file ranges and every writeback hint ``(offset, length)``
    of ``vol`` (the real calls still run)."""
    writes: list[tuple[int, int]] = []
    hints: list[tuple[int, int]] = []
    eng = vol.engine
    orig_transfer = eng.transfer

    def transfer(op, local, remote, mem, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        if op == "WRITE":
            r = np.asarray(remote)
            writes.append((int(r[0, 0]), int(r[:, 1].sum())))
        return orig_transfer(op, local, remote, mem, *a, **k)

    def hint(fd: int, off: int, n: int) -> bool:
        hints.append((off, n))
        return start_writeback(fd, off, n)

    eng.transfer = transfer  # type: ignore[method-assign]
    vol.start_writeback = hint
    return writes, hints


def test_write_pieces_split_rows_where_a_piece_ends() -> None:
    rng = np.random.default_rng(7)
    lens = rng.integers(1, 50_000, 40)
    local = np.zeros((40, 3), dtype=np.int64)
    local[:, 0] = rng.integers(1 << 20, 1 << 40, 40)
    local[:, 1] = lens
    pieces = write_pieces(local, PIECE)
    total = int(lens.sum())
    assert [pos for _, pos in pieces] == list(range(0, total, PIECE))
    assert [int(rows[:, 1].sum()) for rows, _ in pieces] == [min(PIECE, total - p) for p in range(0, total, PIECE)]
    # the pieces' rows, joined, are the same byte ranges in the same order
    spans = [(int(a), int(a) + int(n)) for rows, _ in pieces for a, n, _ in rows.tolist()]
    joined: list[tuple[int, int]] = []
    for lo, hi in spans:
        if joined and joined[-1][1] == lo:
            joined[-1] = (joined[-1][0], hi)
        else:
            joined.append((lo, hi))
    want = [(int(a), int(a) + int(n)) for a, n, _ in local.tolist()]
    assert all(x[0] < x[1] for x in spans)
    assert sum(hi - lo for lo, hi in joined) == total
    # rows of one descriptor stay inside it, in order
    flat = iter(spans)
    for lo, hi in want:
        pos = lo
        while pos < hi:
            a, b = next(flat)
            assert a == pos and b <= hi
            pos = b
    assert write_pieces(local[:0], PIECE) == []


def test_a_segment_is_written_in_pieces_each_hinted_then_read_back(agent: StorageAgent) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    writes, hints = _record(vol)
    bb = BB
    g2, g3 = pool(1, 20 * bb), pool(2, 20 * bb)
    # two runs in memory (two pools), 24 blocks in all: one 1 MiB segment and a tail
    items = [(BlockKey(NS, i), g2[i * bb:(i + 1) * bb]) for i in range(12)]
    items += [(BlockKey(NS, 100 + i), g3[i * bb:(i + 1) * bb]) for i in range(12)]
    ps = agent.put(items, "fast")
    segs = sorted({p.segment_id for p in ps})
    assert len(segs) == 2
    sizes = [vol.path(s).stat().st_size for s in segs]
    assert sizes == [16 * bb, 8 * bb]
    # per segment: pieces of PIECE bytes back to back over the whole file, one hint each
    want = [(p, min(PIECE, n - p)) for n in sizes for p in range(0, n, PIECE)]
    assert writes == want and hints == want
    assert all(torch.equal(x, t) for x, (_, t) in zip(agent.get([k for k, _ in items]), items))
    raw = vol.path(segs[0]).read_bytes()
    assert raw == b"".join(bytes(t.numpy()) for _, t in items[:16])


def test_a_segment_of_one_piece_or_less_is_one_write_without_hint(agent: StorageAgent) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    writes, hints = _record(vol)
    g2 = pool(3, 3 * BB)
    items = [(BlockKey(NS, 200 + i), g2[i * BB:(i + 1) * BB]) for i in range(3)]
    agent.put(items, "fast")
    assert writes == [(0, 3 * BB)] and hints == []
    vol.write_piece_bytes = 0  # off: one WRITE per segment, however large
    items = [(BlockKey(NS, 300 + i), t) for i, t in enumerate(pool(4, 16 * BB).split(BB))]
    agent.put(items, "fast")
    assert writes[1:] == [(0, 16 * BB)] and hints == []


def test_a_filesystem_without_the_hint_is_asked_once(agent: StorageAgent) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    asked: list[int] = []

    def unsupported(fd: int, off: int, n: int) -> bool:
        asked.append(off)
        return False

    vol.start_writeback = unsupported
    items = [(BlockKey(NS, 400 + i), t) for i, t in enumerate(pool(5, 32 * BB).split(BB))]
    agent.put(items, "fast")
    assert asked == [0] and vol.start_writeback is None
    assert vol.counters.extra["writeback_hint_unsupported"] == 1
    assert all(torch.equal(x, t) for x, (_, t) in zip(agent.get([k for k, _ in items]), items))


@pytest.mark.parametrize(("err", "raised"), [(errno.EIO, TransferError), (errno.ENOSPC, VolumeFullError)])
def test_a_failing_hint_fails_the_segment_and_leaves_nothing(agent: StorageAgent, err: int, raised: type) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    calls: list[int] = []

    def failing(fd: int, off: int, n: int) -> bool:
        calls.append(off)
        if len(calls) == 2:  # the second piece of the first segment
            raise OSError(err, os.strerror(err))
        return True

    vol.start_writeback = failing
    items = [(BlockKey(NS, 500 + i), t) for i, t in enumerate(pool(6, 16 * BB).split(BB))]
    with pytest.raises(raised) as ei:
        agent.put(items, "fast")
    assert ei.value.stored == []
    assert agent.exists([k for k, _ in items]) == [False] * 16
    assert vol.list_segments() == [] and agent.segments("fast") == []
    vol.start_writeback = start_writeback
    agent.put(items, "fast")
    assert all(torch.equal(x, t) for x, (_, t) in zip(agent.get([k for k, _ in items]), items))


def test_start_writeback_on_a_file_and_on_a_pipe(tmp_path: Path) -> None:
    fd = os.open(tmp_path / "f", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        os.pwrite(fd, b"x" * 8192, 0)
        assert start_writeback(fd, 0, 8192) is True
    finally:
        os.close(fd)
    r, w = os.pipe()
    try:
        assert start_writeback(w, 0, 1) is False  # ESPIPE: not taken, no error
    finally:
        os.close(r)
        os.close(w)
    with pytest.raises(OSError) as ei:
        start_writeback(-1, 0, 1)
    assert ei.value.errno == errno.EBADF


def test_o_direct_segments_are_one_write(tmp_path: Path) -> None:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"wpd-{tmp_path.name}")
    try:
        a.register_volume(VolumeDescriptor("d", VolumeKind.POSIX, MediaClass.NVME, 1 << 30, root=str(tmp_path / "d"),
                                           segment_bytes=1 << 20, o_direct=True))
        vol = a._vol("d")  # type: ignore[attr-defined]
        vol.write_piece_bytes = PIECE
        writes, hints = _record(vol)
        g2 = torch.zeros(16 * BB + 4096, dtype=torch.uint8)
        off = (-g2.data_ptr()) % 4096  # page-aligned blocks: the O_DIRECT write needs no staging
        g2[off:off + 16 * BB] = pool(7, 16 * BB)
        items = [(BlockKey(NS, 600 + i), g2[off + i * BB: off + (i + 1) * BB]) for i in range(16)]
        a.put(items, "d")
        if vol.counters.extra.get("o_direct_fallbacks", 0) == 0:  # O_DIRECT taken by tmp_path's filesystem
            assert writes == [(0, 16 * BB)] and hints == []
        else:  # buffered after all: pieces
            assert writes == [(p, min(PIECE, 16 * BB - p)) for p in range(0, 16 * BB, PIECE)]
        assert all(torch.equal(x, t) for x, (_, t) in zip(a.get([k for k, _ in items]), items))
    finally:
        a.close()
        cat.close()


def test_blocks_are_hashed_piece_by_piece_right_before_their_write(agent: StorageAgent) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    ends: list[tuple[int, int]] = []  # (job, end) of every before_piece call
    writes: list[int] = []  # hook calls seen when each WRITE starts
    orig_segments = vol.write_segments
    orig_transfer = vol.engine.transfer

    def segments(jobs, before_piece=None):  # noqa: ANN001, ANN202
        assert before_piece is not None  # the agent hands its hasher to a posix volume

        def hook(j: int, end: int) -> None:
            ends.append((j, end))
            before_piece(j, end)

        return orig_segments(jobs, before_piece=hook)

    def transfer(op, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        if op == "WRITE":
            writes.append(len(ends))
        return orig_transfer(op, *a, **k)

    vol.write_segments = segments
    vol.engine.transfer = transfer  # type: ignore[method-assign]
    g2 = pool(8, 24 * BB)
    items = [(BlockKey(NS, 700 + i), g2[i * BB:(i + 1) * BB]) for i in range(24)]
    ps = agent.put(items, "fast")
    # two segments (16 + 8 blocks), each job 0 of its own write call; one call per piece
    assert ends == [(0, min(p + PIECE, n)) for n in (16 * BB, 8 * BB) for p in range(0, n, PIECE)]
    assert writes == list(range(1, len(ends) + 1))  # each WRITE right after its piece's hook
    assert [p.checksum for p in ps] == [xxhash.xxh3_64_intdigest(t.numpy()) for _, t in items]


def test_piece_hasher_hashes_blocks_that_start_before_the_end() -> None:
    g2 = pool(9, 6 * 1000)
    addrs = np.array([g2.data_ptr() + i * 1000 for i in range(6)], dtype=np.int64)
    cks: list[int] = []
    given = [11, 22]
    h = _PieceHasher([(addrs, [1000] * 6, [0, 1000, 2000, 3000, 4000, 5000], cks), (None, [5, 5], [0, 5], given)])
    want = [xxhash.xxh3_64_intdigest(g2[i * 1000:(i + 1) * 1000].numpy()) for i in range(6)]
    h(0, 1)
    assert cks == want[:1]
    h(0, 1000)  # block 1 starts at 1000: not yet
    assert cks == want[:1]
    h(0, 2500)
    assert cks == want[:3]
    h(1, 10)  # checksums given: nothing to hash
    h.finish()
    assert cks == want and given == [11, 22]


def test_a_volume_that_writes_without_the_hook_still_gets_every_checksum(agent: StorageAgent) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    vol.takes_before_piece = False  # the agent calls write_segments(jobs) as on any volume
    g2 = pool(10, 20 * BB)
    items = [(BlockKey(NS, 800 + i), g2[i * BB:(i + 1) * BB]) for i in range(20)]
    ps = agent.put(items, "fast")
    assert [p.checksum for p in ps] == [xxhash.xxh3_64_intdigest(t.numpy()) for _, t in items]
    assert all(torch.equal(x, t) for x, (_, t) in zip(agent.get([k for k, _ in items]), items))


def test_a_failing_hook_fails_the_segment_and_leaves_no_file(agent: StorageAgent) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    g2 = pool(11, 8 * BB)
    jobs = [(1, np.array([[g2.data_ptr(), 4 * BB, 0]], dtype=np.int64), 4 * BB),
            (2, np.array([[g2.data_ptr() + 4 * BB, 4 * BB, 0]], dtype=np.int64), 4 * BB)]
    vol.engine.dram.ensure(np.array([g2.data_ptr()], dtype=np.int64), np.array([g2.data_ptr() + 8 * BB], dtype=np.int64),
                           lambda k: (g2.untyped_storage().data_ptr(), g2.untyped_storage().nbytes()))

    def hook(j: int, end: int) -> None:
        if j == 1 and end > PIECE:
            raise ValueError("injected: hashing failed")

    with pytest.raises(ValueError, match="injected"):
        vol.write_segments(jobs, before_piece=hook)
    assert vol.list_segments() == []  # segment 1 (written) and 2 (half written) removed
    vol.write_segments(jobs, before_piece=lambda j, end: None)
    assert vol.path(1).read_bytes() + vol.path(2).read_bytes() == bytes(g2.numpy())
