"""``storage_backends._readcore``: the compiled copy + verify loop of hot POSIX gets.

Real files under tmp_path, real ``preadv2(RWF_NOWAIT)``, python-xxhash's own XXH3 bound
by address; results checked against ``xxhash.xxh3_64_intdigest`` and the file's bytes.
"""

from __future__ import annotations

import errno
import os
from pathlib import Path

import numpy as np
import pytest
import xxhash

from storage_backends import _readcore

RWF_NOWAIT = os.RWF_NOWAIT


def test_xxh3_is_bound_here() -> None:
    """The fast path is on with the pinned python-xxhash: a failed binding would silently
    send every hot get through NIXL (the import falls back), so it is asserted here."""
    assert _readcore.available


def arrays(bufs: list[np.ndarray], cks: list[int]) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    addrs = np.array([b.ctypes.data for b in bufs], dtype=np.int64)
    lens = np.array([b.nbytes for b in bufs], dtype=np.int64)
    return addrs, lens, np.array(cks, dtype=np.uint64), np.ones(len(bufs), dtype=np.uint8)


def test_hash_check_matches_xxhash_and_flags_only_the_bad_blocks() -> None:
    rng = np.random.default_rng(1)
    bufs = [rng.integers(0, 256, n, dtype=np.uint8) for n in (0, 1, 240, 241, 4096, 65536, 1 << 20, 3_000_001)]
    cks = [xxhash.xxh3_64_intdigest(b) for b in bufs]
    cks[3] ^= 1
    cks[6] ^= 1 << 63
    addrs, lens, ck, ok = arrays(bufs, cks)
    _readcore.hash_check(addrs, lens, ck, ok, 0, len(bufs))
    assert ok.tolist() == [1, 1, 1, 0, 1, 1, 0, 1]
    ok[:] = 1
    _readcore.hash_check(addrs, lens, ck, ok, 4, 6)  # only blocks 4..5
    assert ok.tolist() == [1] * 8


def segment(tmp_path: Path, sizes: list[int]) -> tuple[int, np.ndarray, list[int], list[int]]:
    rng = np.random.default_rng(2)
    data = rng.integers(0, 256, sum(sizes), dtype=np.uint8)
    path = tmp_path / "seg"
    path.write_bytes(data.tobytes())
    offs = np.concatenate(([0], np.cumsum(sizes)[:-1])).tolist()
    cks = [xxhash.xxh3_64_intdigest(data[o:o + n]) for o, n in zip(offs, sizes)]
    fd = os.open(path, os.O_RDONLY)
    return fd, data, offs, cks


def test_read_cached_copies_groups_and_streams_large_blocks_in_parts(tmp_path: Path) -> None:
    sizes = [512, 700, 1, 65536, 3 * (1 << 20) + 5, 4096, 4096]
    fd, data, offs, cks = segment(tmp_path, sizes)
    try:
        outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
        addrs, lens, ck, ok = arrays(outs, cks)
        # groups: blocks 0..3 in one preadv, block 4 alone (copied 1 MiB at a time), 5..6
        gstart = np.array([0, 4, 5], dtype=np.int64)
        gend = np.array([4, 5, 7], dtype=np.int64)
        gfd = np.full(3, fd, dtype=np.int32)
        goff = np.array([offs[0], offs[4], offs[5]], dtype=np.int64)
        r = _readcore.read_cached(gfd, goff, gstart, gend, addrs, lens, ck, ok, 0, 3, 1 << 20, RWF_NOWAIT)
        assert r == (3, -1, 0, 0, sum(sizes))  # the file was just written: all in the page cache
        assert ok.tolist() == [1] * 7
        assert all(np.array_equal(o, data[a:a + n]) for o, a, n in zip(outs, offs, sizes))
        # a wrong checksum on the large (streamed) block and on a small one
        ck2 = ck.copy()
        ck2[4] ^= 1
        ck2[1] ^= 1
        ok[:] = 1
        r = _readcore.read_cached(gfd, goff, gstart, gend, addrs, lens, ck2, ok, 0, 3, 1 << 20, RWF_NOWAIT)
        assert r[:2] == (3, -1) and ok.tolist() == [1, 0, 1, 1, 0, 1, 1]
    finally:
        os.close(fd)


def test_read_cached_stops_at_the_first_byte_not_in_memory(tmp_path: Path) -> None:
    """Pages dropped from the page cache (POSIX_FADV_DONTNEED of a 2 MiB-aligned window:
    ext4 caches in folios of up to 2 MiB): the copy stops at the hole and says where
    (group, block, bytes of it copied); the blocks before it are copied and verified."""
    sizes = [64 << 10] * 64  # 4 MiB
    fd, data, offs, cks = segment(tmp_path, sizes)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 2 << 20, 2 << 20, os.POSIX_FADV_DONTNEED)  # blocks 32..63
        outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
        addrs, lens, ck, ok = arrays(outs, cks)
        gstart = np.arange(0, 64, 16, dtype=np.int64)
        gend = gstart + 16
        gfd = np.full(4, fd, dtype=np.int32)
        goff = np.array([offs[i] for i in gstart.tolist()], dtype=np.int64)
        r = _readcore.read_cached(gfd, goff, gstart, gend, addrs, lens, ck, ok, 0, 4, 1 << 20, RWF_NOWAIT)
        assert r == (2, 32, 0, 0, 2 << 20)
        assert ok.tolist() == [1] * 64
        assert all(np.array_equal(o, data[a:a + n]) for o, a, n in zip(outs[:32], offs, sizes))
        assert not any(outs[32].tolist())  # not touched
    finally:
        os.close(fd)


def test_read_cached_reports_errors_and_refuses_oversized_groups(tmp_path: Path) -> None:
    sizes = [4096] * 4
    fd, _, _, cks = segment(tmp_path, sizes)
    try:
        outs = [np.zeros(n, dtype=np.uint8) for n in sizes]
        addrs, lens, ck, ok = arrays(outs, cks)
        one = (np.array([0], dtype=np.int64), np.array([4], dtype=np.int64))
        r = _readcore.read_cached(np.array([-1], dtype=np.int32), np.zeros(1, dtype=np.int64), *one,
                                  addrs, lens, ck, ok, 0, 1, 1 << 20, RWF_NOWAIT)
        assert r == (0, 0, 0, errno.EBADF, 0)  # a bad fd: the error, nothing copied
        r = _readcore.read_cached(np.array([fd], dtype=np.int32), np.zeros(1, dtype=np.int64), *one,
                                  addrs, lens, ck, ok, 0, 1, 1 << 20, 1 << 30)
        assert r[:2] == (0, 0) and r[3] == errno.EOPNOTSUPP  # a flag the kernel does not know
        many = np.zeros(1025, dtype=np.int64)
        with pytest.raises(ValueError, match="1025 blocks"):
            _readcore.read_cached(np.array([fd], dtype=np.int32), np.zeros(1, dtype=np.int64),
                                  np.array([0], dtype=np.int64), np.array([1025], dtype=np.int64),
                                  many, many, many.astype(np.uint64), np.ones(1025, dtype=np.uint8),
                                  0, 1, 1 << 20, RWF_NOWAIT)
    finally:
        os.close(fd)


def test_check_copy_copies_only_verified_blocks() -> None:
    """Staged reads: a block whose XXH3 differs is not copied (its destination keeps its
    old bytes) and is flagged; the others are copied byte for byte."""
    rng = np.random.default_rng(3)
    src = [rng.integers(0, 256, n, dtype=np.uint8) for n in (1, 777, 65536, 300_001)]
    dst = [np.full(b.nbytes, 0xAB, dtype=np.uint8) for b in src]
    cks = [xxhash.xxh3_64_intdigest(b) for b in src]
    cks[2] += 1
    s_addrs, lens, ck, ok = arrays(src, cks)
    d_addrs = np.array([b.ctypes.data for b in dst], dtype=np.int64)
    _readcore.check_copy(s_addrs, d_addrs, lens, ck, ok, 0, 4)
    assert ok.tolist() == [1, 1, 0, 1]
    assert [np.array_equal(d, s) for d, s in zip(dst, src)] == [True, True, False, True]
    assert (dst[2] == 0xAB).all()
