"""Hostile review of the compiled hot-read path of POSIX gets (commit e29e5c6):
``storage_backends/_readcore.pyx`` (``read_cached`` / ``hash_check``: preadv2(RWF_NOWAIT)
and python-xxhash's XXH3 bound by address, no GIL), ``StorageAgent._read_cached_first``
(groups, NIXL from a miss to the end of its piece, two copying threads with
``split_cached_reads``) and ``PosixVolume.page_cache_files`` (fds pinned under the
open-segment lock for the whole copy).

Real files under tmp_path, real NIXL POSIX, a real SQLite catalog.  Every ``preadv2`` of the
compiled loop goes through a ctypes callback (``_readcore._set_preadv2``) that calls libc's
real one and records which file the fd names at that moment (``/proc/self/fd``), the
calling thread, the range and what it copied: that shows bytes read twice, copies on a
closed or reused fd, and copies that outlive the ``get``.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import os
import random
import signal
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
import xxhash

from storage_backends import BlockKey, StorageAgent, TransferError, _readcore
from storage_backends.posix_volume import PosixVolume
from tests.integration.test_storage_page_cache_hostile import _PREADV2, _agent, _Iovec
from tests.integration.test_storage_page_cache_reads import Reads, block, cached_bytes, evict

NS = "readcore-hostile"
KiB, MiB = 1 << 10, 1 << 20


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    a, cat = _agent(tmp_path, "rc-hostile")
    yield a
    a.close()
    cat.close()


def _healthy(a: StorageAgent) -> None:
    assert (a.counters.quarantined, a.counters.checksum_mismatches) == (0, 0)


def _wrong(got: list[torch.Tensor], want: list[torch.Tensor]) -> list[int]:
    return [i for i, (g, w) in enumerate(zip(got, want)) if not torch.equal(g, w)]


class Hook:
    """libc's ``preadv2`` behind a ctypes callback: records per call ``(thread, fd,
    target, offset, asked, got, late)`` (target: what ``/proc/self/fd/<fd>`` names, None
    for a closed fd; late: the call began after :attr:`returned` was set).  ``before``
    may act first (sleep, fail: a non-None return is the call's result)."""

    def __init__(self, before: Callable[[int, object, int, int, int], int | None] | None = None) -> None:
        libc = ctypes.CDLL(None, use_errno=True)
        self.real = libc.preadv2
        self.real.restype = ctypes.c_ssize_t
        self.real.argtypes = [ctypes.c_int, ctypes.POINTER(_Iovec), ctypes.c_int, ctypes.c_long, ctypes.c_int]
        self.before = before
        self.calls: list[tuple[int, int, str | None, int, int, int, bool]] = []
        self.lock = threading.Lock()
        self.returned = threading.Event()
        self.cb = _PREADV2(self._call)

    def _call(self, fd, iov, cnt, offset, flags):  # type: ignore[no-untyped-def]
        if self.before is not None:
            r = self.before(fd, iov, cnt, offset, flags)
            if r is not None:
                return r
        late = self.returned.is_set()
        try:
            target: str | None = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            target = None
        asked = sum(iov[i].iov_len for i in range(cnt))
        got = self.real(fd, iov, cnt, offset, flags)
        with self.lock:
            self.calls.append((threading.get_ident(), fd, target, offset, asked, got, late))
        return got

    def copied(self) -> int:
        return sum(max(c[5], 0) for c in self.calls)


@contextlib.contextmanager
def installed(hook: Hook, a: StorageAgent) -> Iterator[Hook]:
    _readcore._set_preadv2(ctypes.cast(hook.cb, ctypes.c_void_p).value)
    try:
        yield hook
    finally:
        a._verifier().submit(lambda: None).result(timeout=30)  # type: ignore[attr-defined]  # the pool is idle
        _readcore._set_preadv2(0)


def _no_byte_twice(vol: PosixVolume, hook: Hook, nixl_ranges: list[tuple[int, int, int]], total: int) -> None:
    """Copied ranges (hook) and NIXL ranges never overlap, and add up to ``total``."""
    by_path = {str(vol.path(s)): s for s in vol.list_segments()}
    spans: dict[int, list[tuple[int, int]]] = {}
    for _, _, target, off, _, got, _ in hook.calls:
        if got > 0:
            assert target in by_path, target  # the fd named a segment of this volume
            spans.setdefault(by_path[target], []).append((off, off + got))
    for s, o, ln in nixl_ranges:
        spans.setdefault(s, []).append((o, o + ln))
    for s, sp in spans.items():
        sp.sort()
        assert all(a[1] <= b[0] for a, b in zip(sp, sp[1:])), f"segment {s}: a byte read twice"
    assert sum(e - b for sp in spans.values() for b, e in sp) == total


def _nixl_ranges(
    vol: PosixVolume, monkeypatch: pytest.MonkeyPatch, fail_first: bool = False,
) -> list[tuple[int, int, int]]:
    got: list[tuple[int, int, int]] = []
    orig = vol.read_direct
    first = [fail_first]

    def rec(segments, offsets, lengths, addrs):  # type: ignore[no-untyped-def]
        if first[0]:
            first[0] = False
            time.sleep(0.05)  # the other half is still copying
            raise TransferError("injected: NIXL read failed mid-batch")
        got.extend(zip(segments.tolist(), offsets.tolist(), lengths.tolist()))
        return orig(segments, offsets, lengths, addrs)

    monkeypatch.setattr(vol, "read_direct", rec)
    return got


# ----------------------------------------------------------------------------- the compiled core
def test_bound_xxh3_equals_python_xxhash_one_shot_and_streamed_over_odd_parts(tmp_path: Path) -> None:
    """read_cached against python-xxhash on a real file: blocks of 0..241 bytes and around
    the XXH3 stripe/block sizes in groups, and single blocks longer than ``part`` streamed
    in parts of 1, 63, 1000 and 4096 + 1 bytes; one wrong checksum is the only 0."""
    rng = random.Random(1)
    sizes = [0, 1, 3, 16, 17, 128, 129, 240, 241, 1023, 1024, 1025, 4096, 65537, 100003]
    data = bytes(rng.getrandbits(8) for _ in range(sum(sizes)))
    path = tmp_path / "f"
    path.write_bytes(data)
    fd = os.open(path, os.O_RDONLY)
    try:
        n = len(sizes)
        lens = np.array(sizes, dtype=np.int64)
        offs = np.concatenate(([0], np.cumsum(lens)[:-1])).astype(np.int64)
        bufs = [np.full(max(s, 1), 0xAB, dtype=np.uint8) for s in sizes]
        addrs = np.array([b.ctypes.data for b in bufs], dtype=np.int64)
        cks = np.array([xxhash.xxh3_64_intdigest(data[o : o + s]) for o, s in zip(offs, sizes)], dtype=np.uint64)
        cks[7] ^= np.uint64(1)
        for part in (1, 63, 1000, 4097, 1 << 20):
            for b in bufs:
                b[:] = 0xAB
            ok = np.ones(n, dtype=np.uint8)
            big = lens > part
            # groups: a block longer than ``part`` alone, the others one group each run
            gs = [k for k in range(n) if k == 0 or big[k] or big[k - 1]]
            gstart = np.array(gs, dtype=np.int64)
            gend = np.append(gstart[1:], n).astype(np.int64)
            gfd = np.full(len(gs), fd, dtype=np.int32)
            g, k, have, err, copied = _readcore.read_cached(
                gfd, offs[gstart], gstart, gend, addrs, lens, cks, ok, 0, len(gs), part, 0)
            assert (g, k, have, err, copied) == (len(gs), -1, 0, 0, len(data))
            assert np.flatnonzero(ok == 0).tolist() == [7], part
            assert all(bytes(b[:s]) == data[o : o + s] for b, o, s in zip(bufs, offs, sizes))
            ok[:] = 1
            _readcore.hash_check(addrs, lens, cks, ok, 0, n)
            assert np.flatnonzero(ok == 0).tolist() == [7]
    finally:
        os.close(fd)


def test_read_cached_refuses_bad_groups_and_reports_a_bad_fd(tmp_path: Path) -> None:
    """1025 buffers to one preadv, an empty group: ValueError before any copy; fd -1 (a
    segment page_cache_files could not open): a stop at the group's first block, EBADF."""
    path = tmp_path / "f"
    path.write_bytes(bytes(range(256)) * 8)
    buf = np.zeros(2048, dtype=np.uint8)
    n = 1025
    lens = np.ones(n, dtype=np.int64)
    addrs = (buf.ctypes.data + np.arange(n)).astype(np.int64)
    cks = np.zeros(n, dtype=np.uint64)
    ok = np.ones(n, dtype=np.uint8)
    fd = os.open(path, os.O_RDONLY)
    try:
        one = np.array([fd], dtype=np.int32)
        zero = np.zeros(1, dtype=np.int64)
        with pytest.raises(ValueError, match="1025 blocks"):
            _readcore.read_cached(one, zero, zero, np.array([n], dtype=np.int64), addrs, lens, cks, ok, 0, 1, MiB, 0)
        with pytest.raises(ValueError, match="0 blocks"):
            _readcore.read_cached(one, zero, zero, zero, addrs, lens, cks, ok, 0, 1, MiB, 0)
        assert not buf.any() and ok.all()
        res = _readcore.read_cached(np.array([fd, -1], dtype=np.int32), np.array([0, 5], dtype=np.int64),
                                    np.array([0, 1024], dtype=np.int64), np.array([1024, 1025], dtype=np.int64),
                                    addrs, lens, cks, ok, 0, 2, MiB, 0)
        assert res == (1, 1024, 0, errno.EBADF, 1024)
        assert bytes(buf[:1024]) == (bytes(range(256)) * 4)
    finally:
        os.close(fd)


def test_an_unbound_xxh3_falls_back_to_nixl(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """``_readcore.available`` false (the XXH3 binding check failed): the compiled loop
    refuses to run and gets go through NIXL + Python hashing, bytes right."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, i), block(i, 64 * KiB + i)) for i in range(20)]
    agent.put(items, "v")
    monkeypatch.setattr(_readcore, "available", False)
    with pytest.raises(RuntimeError, match="not bound"):
        _readcore.hash_check(np.zeros(1, np.int64), np.zeros(1, np.int64), np.zeros(1, np.uint64),
                             np.ones(1, np.uint8), 0, 1)
    nixl = Reads(vol, monkeypatch)
    before = cached_bytes(vol)
    assert _wrong(agent.get([k for k, _ in items]), [t for _, t in items]) == []
    assert cached_bytes(vol) == before and nixl.calls >= 1
    _healthy(agent)


# ----------------------------------------------------------------------------- the agent's loop
@pytest.mark.parametrize("split", [False, True])
def test_odd_sizes_unaligned_pool_views_holes_in_both_halves_each_byte_read_once(
    agent: StorageAgent, monkeypatch: pytest.MonkeyPatch, split: bool,
) -> None:
    """~6 000 tiny blocks (groups of over 1 024 buffers) then blocks of odd sizes up to
    9 MiB + 1 (larger than a piece), out tensors at odd addresses of one pool (1-byte
    gaps), holes in the first and the second half; copied ranges and NIXL ranges never
    overlap and add up to the batch, every block right."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    agent.split_cached_reads = agent.verify_aside = split
    rng = random.Random(4)
    sizes = [rng.choice([1, 7, 300, 513]) for _ in range(6000)]
    sizes += [rng.choice([4093, 65537, 256 * KiB + 3, MiB + 5, 3 * MiB + 1]) for _ in range(10)] + [9 * MiB + 1]
    items = [(BlockKey(NS, 100 + i), block(100 + i, s)) for i, s in enumerate(sizes)]
    ps = agent.put(items, "v")
    assert len({p.segment_id for p in ps}) == 1
    path, total = vol.path(ps[0].segment_id), sum(sizes)
    pool = torch.zeros(total + len(sizes) + 1, dtype=torch.uint8)
    outs, pos = [], 1
    for s in sizes:
        outs.append(pool[pos : pos + s])
        pos += s + 1
    for holes in ([(0, 2 * MiB)], [(2 * MiB, 2 * MiB), (total - total % (2 * MiB) - 2 * MiB, 2 * MiB)]):
        # a busy kernel may read the evicted pages back before the get (readahead of
        # another process): up to 3 tries must show a NIXL read; every try must be right
        for _ in range(3):
            for o, ln in holes:
                evict(path, o, ln)
            ranges = _nixl_ranges(vol, monkeypatch)
            with installed(Hook(), agent) as hook:
                agent.get([k for k, _ in items], out=outs)
            monkeypatch.undo()
            assert _wrong(outs, [t for _, t in items]) == []
            if ranges:
                break
        assert ranges and hook.copied() > 0
        _no_byte_twice(vol, hook, ranges, total)
        if split:
            assert len({c[0] for c in hook.calls}) == 2  # both threads copied
    _healthy(agent)


def test_split_over_one_piece_of_blocks_larger_than_a_group_misses_everywhere(
    agent: StorageAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """Three 1.25 MiB blocks (each a group of its own, copied in parts): one piece cut in
    two halves; cold, then a hole inside the second block only."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    agent.split_cached_reads = True
    items = [(BlockKey(NS, 9000 + i), block(9000 + i, MiB + MiB // 4)) for i in range(3)]
    ps = agent.put(items, "v")
    path = vol.path(ps[0].segment_id)
    for cold in (0, 2 * MiB):
        evict(path, cold, 0 if cold == 0 else 2 * MiB)
        ranges = _nixl_ranges(vol, monkeypatch)
        with installed(Hook(), agent) as hook:
            got = agent.get([k for k, _ in items])
        monkeypatch.undo()
        assert _wrong(got, [t for _, t in items]) == []
        _no_byte_twice(vol, hook, ranges, 3 * (MiB + MiB // 4))
    _healthy(agent)


def test_eintr_from_every_other_preadv2_is_retried_and_counted_once(agent: StorageAgent) -> None:
    """The kernel's preadv2 interrupted by a signal before copying (-1, EINTR) on every
    other call, on both threads: retried, nothing lost or counted twice, RWF_NOWAIT stays on."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    agent.split_cached_reads = True
    items = [(BlockKey(NS, 200 + i), block(200 + i, (4 * KiB, 64 * KiB + 1, 2 * MiB + 3)[i % 3])) for i in range(24)]
    agent.put(items, "v")
    flip = [0]

    def eintr(fd, iov, cnt, offset, flags):  # type: ignore[no-untyped-def]
        flip[0] += 1
        if flip[0] % 2:
            ctypes.set_errno(errno.EINTR)
            return -1
        return None

    before = cached_bytes(vol)
    with installed(Hook(eintr), agent) as hook:
        got = agent.get([k for k, _ in items])
    assert _wrong(got, [t for _, t in items]) == []
    assert flip[0] >= 2 * len(hook.calls) - 1 and len(hook.calls) > 2
    assert cached_bytes(vol) - before == hook.copied() == sum(t.numel() for _, t in items)
    assert vol._nowait  # type: ignore[attr-defined]
    _healthy(agent)


def _slow_other_thread(main: int, seconds: float) -> Callable[..., None]:
    first = [True]

    def slow(fd, iov, cnt, offset, flags):  # type: ignore[no-untyped-def]
        if threading.get_ident() != main and first[0]:
            first[0] = False
            time.sleep(seconds)  # the GIL is free: the calling thread goes on
        return None

    return slow


def test_a_nixl_error_in_the_first_half_waits_for_the_second_half_copy(
    agent: StorageAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """NIXL fails on the calling thread (first half, after a miss) while the verifier
    thread is still copying the second half: the get does not leave (nor close an fd)
    before that copy ends; the batch is retried and every block comes back right."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    vol.max_open = 0  # every fd closed when the pin goes
    agent.split_cached_reads = True
    items = [(BlockKey(NS, 300 + i), block(300 + i, 256 * KiB)) for i in range(32)]  # 8 MiB, 2 pieces
    ps = agent.put(items, "v")
    evict(vol.path(ps[0].segment_id), 0, 2 * MiB)
    _nixl_ranges(vol, monkeypatch, fail_first=True)
    hook = Hook(_slow_other_thread(threading.get_ident(), 0.3))
    with installed(hook, agent):
        got = agent.get([k for k, _ in items])
        hook.returned.set()
    assert _wrong(got, [t for _, t in items]) == []
    seg = str(vol.path(ps[0].segment_id))
    assert [c for c in hook.calls if c[6] or c[2] != seg] == []  # none late, none on another file
    assert agent.counters.read_retries >= 1
    _healthy(agent)


def test_delete_and_puts_from_other_threads_never_move_an_fd_under_a_copy(tmp_path: Path) -> None:
    """While the second half is copied slowly, another thread deletes a segment of the
    same volume (not read by this get) and another one puts new blocks (new segment files
    open and close, fd numbers churn), ``max_open`` 1: every copy reads the file its fd
    named when the get began."""
    agent, cat = _agent(tmp_path, "rc-meddle", segment_bytes=4 * MiB)
    vol = agent._vol("v")  # type: ignore[attr-defined]
    vol.max_open = 1
    agent.split_cached_reads = True
    spare = agent.put([(BlockKey(NS, 399), block(399, 64 * KiB))], "v")[0].segment_id
    items = [(BlockKey(NS, 400 + i), block(400 + i, 512 * KiB)) for i in range(24)]
    ps = []
    for lo in range(0, 24, 8):
        ps += agent.put(items[lo : lo + 8], "v")
    segs = sorted({p.segment_id for p in ps})
    paths = {str(vol.path(s)) for s in segs}
    main = threading.get_ident()
    errors: list[BaseException] = []
    started = threading.Event()

    def meddle() -> None:
        try:
            started.set()
            vol.delete_segment(spare)
            for j in range(3):
                agent.put([(BlockKey(NS, 500 + j), block(500 + j, 64 * KiB))], "v")
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    th: list[threading.Thread] = []
    first = [True]

    def slow(fd, iov, cnt, offset, flags):  # type: ignore[no-untyped-def]
        if threading.get_ident() != main and first[0]:
            first[0] = False
            th.append(threading.Thread(target=meddle))
            th[0].start()
            started.wait(5)
            time.sleep(0.2)
        return None

    with installed(Hook(slow), agent) as hook:
        got = agent.get([k for k, _ in items])
    for t in th:
        t.join(30)
    assert th and errors == []
    assert _wrong(got, [t for _, t in items]) == []
    assert [c for c in hook.calls if c[2] not in paths] == []
    assert spare not in segs and not vol.path(spare).exists()
    _healthy(agent)
    agent.close()
    cat.close()


class _Interrupted(Exception):
    pass


# Was a bug (strict xfail until fixed by the same change): _read_cached_first: an exception raised
# in the calling thread while it waits in `state = other.result()` (a signal handler:
# KeyboardInterrupt, a timeout alarm) leaves the second half's read_cached running on the verifier
# thread after get() has raised: page_cache_files has exited (pin dropped, _trim closed the fds,
# max_open=0), so the copy runs on a closed or reused fd into out tensors the caller owns again
# (freed ones when out=None); the wait is not shielded (no loop on other.result() / wait(other))
def test_an_exception_while_waiting_for_the_other_half_leaves_no_copy_running(tmp_path: Path) -> None:
    a, cat = _agent(tmp_path, "rc-async")
    vol = a._vol("v")  # type: ignore[attr-defined]
    vol.max_open = 0
    a.split_cached_reads = True
    items = [(BlockKey(NS, 600 + i), block(600 + i, 256 * KiB)) for i in range(32)]
    a.put(items, "v")
    outs = [torch.zeros(256 * KiB, dtype=torch.uint8) for _ in items]  # kept alive: no write to freed memory
    main = threading.get_ident()
    go = threading.Event()
    first = [True]

    def interrupt_then_copy(fd, iov, cnt, offset, flags):  # type: ignore[no-untyped-def]
        if threading.get_ident() != main and first[0]:
            first[0] = False
            deadline = time.monotonic() + 5
            while time.monotonic() < deadline:  # the calling thread waits for this half
                f = sys._current_frames().get(main)
                names = []
                while f is not None:
                    names.append(f.f_code.co_name)
                    f = f.f_back
                if "_wait_through_interrupts" in names or names[:2] == ["wait", "result"]:
                    break
                time.sleep(0.001)
            signal.pthread_kill(main, signal.SIGUSR1)
            go.wait(1.0)  # until get() has raised (at most 1 s)
        return None

    def handler(signum: int, frame: object) -> None:
        raise _Interrupted

    old = signal.signal(signal.SIGUSR1, handler)
    hook = Hook(interrupt_then_copy)
    reused = -1
    try:
        with installed(hook, a):
            with pytest.raises(_Interrupted):
                a.get([k for k, _ in items], out=outs)
            hook.returned.set()
            reused = os.open(tmp_path / "catalog.sqlite", os.O_RDONLY)  # takes the lowest free fd
            go.set()
    finally:
        signal.signal(signal.SIGUSR1, old)
        if reused >= 0:
            os.close(reused)
        a.close()
        cat.close()
    late = [(fd, target) for _, fd, target, _, _, _, is_late in hook.calls if is_late]
    assert late == []  # today: [(fd, None or '.../catalog.sqlite')]: a copy after get() raised


# Was a bug (strict xfail until fixed by the same change): _read_cached_first: when run() raises
# on the calling thread (a NIXL error after a miss in the first half), the second half's state
# from other.result() is dropped without files.done(copied, err): the bytes the verifier thread
# copied from the page cache are never added to bytes_read / bytes_read_cached (and an
# EOPNOTSUPP/EINVAL it met is not reported)
def test_bytes_copied_by_the_second_half_of_a_failed_batch_are_counted(
    agent: StorageAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    vol = agent._vol("v")  # type: ignore[attr-defined]
    agent.split_cached_reads = True
    items = [(BlockKey(NS, 700 + i), block(700 + i, 256 * KiB)) for i in range(32)]  # 8 MiB, 2 pieces
    ps = agent.put(items, "v")
    evict(vol.path(ps[0].segment_id), 0, 2 * MiB)
    ranges = _nixl_ranges(vol, monkeypatch, fail_first=True)
    before, b0 = cached_bytes(vol), vol.counters.bytes_read
    hook = Hook(_slow_other_thread(threading.get_ident(), 0.1))
    with installed(hook, agent):
        got = agent.get([k for k, _ in items])
    assert _wrong(got, [t for _, t in items]) == [] and agent.counters.read_retries >= 1
    assert len({c[0] for c in hook.calls}) == 2  # the failed batch was split
    nixl = sum(ln for _, _, ln in ranges)
    # every byte copied (the failed batch's and the retry's) is counted once
    assert (cached_bytes(vol) - before, vol.counters.bytes_read - b0) == (hook.copied(), hook.copied() + nixl)


def test_the_same_block_twice_into_one_out_and_into_two_views(agent: StorageAgent) -> None:
    """Overlapping outs (the same tensor twice for the same key) go through the staging
    path; the same key into two disjoint views of one pool is copied twice, right both times."""
    items = [(BlockKey(NS, 900 + i), block(900 + i, 300 * KiB + i)) for i in range(12)]
    agent.put(items, "v")
    agent.split_cached_reads = True
    k0, t0 = items[3]
    same = torch.zeros_like(t0)
    keys = [k for k, _ in items] + [k0]
    outs = [torch.zeros_like(t) for _, t in items] + [same]
    outs[3] = same
    agent.get(keys, out=outs)
    assert _wrong(outs, [t for _, t in items] + [t0]) == []
    pool = torch.zeros(2 * t0.numel() + 1, dtype=torch.uint8)
    two = [pool[1 : 1 + t0.numel()], pool[1 + t0.numel() :]]
    agent.get([k0, k0], out=two)
    assert _wrong(two, [t0, t0]) == []
    _healthy(agent)


_CLOSE_DURING_GET = r'''
import contextlib, faulthandler, os, sys, threading, time
from pathlib import Path
faulthandler.enable()
from storage_backends import BlockKey
from tests.integration.test_storage_page_cache_hostile import _agent
from tests.integration.test_storage_page_cache_reads import block

a, cat = _agent(Path(sys.argv[1]), "rc-close")
a.split_cached_reads = True
vol = a._vol("v")
items = [(BlockKey("readcore-hostile", i), block(i, 256 << 10)) for i in range(16)]
a.put(items, "v")
orig = vol.page_cache_files
entered = threading.Event()

@contextlib.contextmanager
def pinned(ids):
    with orig(ids) as files:  # the open-segment lock is held from here
        entered.set()
        time.sleep(0.3)  # close() starts meanwhile
        yield files

vol.page_cache_files = pinned
errors = []

def get():
    try:
        a.get([k for k, _ in items])
    except BaseException as exc:
        errors.append(exc)

g = threading.Thread(target=get, daemon=True)
c = threading.Thread(target=a.close, daemon=True)
g.start()
entered.wait(10)
c.start()
g.join(4)
c.join(1)
stuck = g.is_alive() or c.is_alive()
print("STUCK" if stuck else "DONE", [type(e).__name__ for e in errors], flush=True)
if stuck:
    faulthandler.dump_traceback(all_threads=True)
os._exit(0)
'''


# Was a bug (strict xfail until fixed by the same change): lock-order inversion:
# _read_cached_first calls self._verifier() (takes the agent's _lock) inside vol.page_cache_files
# (the volume's _open_lock held), while StorageAgent.close() holds the agent's _lock and then
# takes _open_lock in vol.close(): a close() during a hot get deadlocks both threads (stacks: get
# at agent._verifier `with self._lock`, close at PosixVolume.close `with self._open_lock`). Fetch
# the verifier before page_cache_files / the engine lock, or close volumes outside _lock (close()
# also reaches each engine's lock via _hub.close() while holding _lock)
def test_close_during_a_hot_get_does_not_deadlock(tmp_path: Path) -> None:
    """Run in a child interpreter (a deadlock would leave the locks held here)."""
    _child(_CLOSE_DURING_GET, tmp_path, "DONE", 60)


def test_eopnotsupp_on_the_other_thread_turns_page_cache_reads_off_bytes_right(agent: StorageAgent) -> None:
    """A filesystem without RWF_NOWAIT seen first by the verifier thread's half: the get
    still returns every block right (NIXL reads the rest), the volume stops trying."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    agent.split_cached_reads = True
    items = [(BlockKey(NS, 1100 + i), block(1100 + i, 256 * KiB + 5)) for i in range(24)]
    agent.put(items, "v")
    main = threading.get_ident()

    def refuse(fd, iov, cnt, offset, flags):  # type: ignore[no-untyped-def]
        if threading.get_ident() != main:
            ctypes.set_errno(errno.EOPNOTSUPP)
            return -1
        return None

    with installed(Hook(refuse), agent) as hook:
        got = agent.get([k for k, _ in items])
        assert _wrong(got, [t for _, t in items]) == [] and not vol._nowait  # type: ignore[attr-defined]
        n = len(hook.calls)
        got = agent.get([k for k, _ in items])
        assert _wrong(got, [t for _, t in items]) == [] and len(hook.calls) == n  # no copy tried
    _healthy(agent)


def test_a_segment_gone_in_the_second_half_is_quarantined_alone(tmp_path: Path) -> None:
    """Two segments, the second unlinked behind the volume's back while no fd is open
    (``max_open`` 0): page_cache_files leaves it out (fd -1, EBADF in the compiled loop),
    NIXL reports it missing, only its blocks are quarantined; the first half's are right."""
    from storage_backends import SegmentMissingError
    a, cat = _agent(tmp_path, "rc-gone", segment_bytes=4 * MiB)
    try:
        vol = a._vol("v")  # type: ignore[attr-defined]
        vol.max_open = 0
        a.split_cached_reads = True
        items = [(BlockKey(NS, 1200 + i), block(1200 + i, 512 * KiB)) for i in range(16)]
        ps = a.put(items[:8], "v") + a.put(items[8:], "v")
        segs = sorted({p.segment_id for p in ps})
        assert len(segs) == 2 and not vol._open  # type: ignore[attr-defined]
        os.unlink(vol.path(segs[1]))
        gone = [p.segment_id == segs[1] for p in ps]
        with pytest.raises(SegmentMissingError):
            a.get([k for k, _ in items])
        assert a.exists([k for k, _ in items]) == [not g for g in gone]
        assert a.counters.quarantined == sum(gone) and a.counters.checksum_mismatches == 0
        keep = [it for it, g in zip(items, gone) if not g]
        assert _wrong(a.get([k for k, _ in keep]), [t for _, t in keep]) == []
    finally:
        a.close()
        cat.close()


_MANY_SEGMENTS = r'''
import os, resource, sys
from pathlib import Path
from storage_backends import BlockKey
from tests.integration.test_storage_page_cache_hostile import _agent
from tests.integration.test_storage_page_cache_reads import block

a, cat = _agent(Path(sys.argv[1]), "rc-emfile")
a.split_cached_reads = False
vol = a._vol("v")
items = [(BlockKey("readcore-hostile", 1300 + i), block(1300 + i, 4096)) for i in range(250)]
for it in items:
    a.put([it], "v")  # a segment each
assert len(vol.list_segments()) == 250 and len(vol._open) <= vol.max_open == 64
nfd = len(os.listdir("/proc/self/fd"))
resource.setrlimit(resource.RLIMIT_NOFILE, (nfd + 100, resource.getrlimit(resource.RLIMIT_NOFILE)[1]))
try:
    got = a.get([k for k, _ in items])
    print("OK" if all(g.equal(t) for g, (_, t) in zip(got, items)) else "WRONG", flush=True)
except OSError as exc:
    print("FAIL", type(exc).__name__, exc, flush=True)
os._exit(0)
'''


# Was a bug (strict xfail until fixed by the same change): PosixVolume.page_cache_files opens and
# pins every segment of a read batch at once (LRU trimming suspended until exit), so a hot get
# holds one fd per segment of its batch (up to 64 MiB of blocks), not max_open (64): 250 one-block
# segments with 100 fds to spare -> a raw OSError(EMFILE) out of get() (not a TransferError,
# nothing retried). The NIXL path has the same per-piece behaviour with 4 MiB pieces (_read_ranges
# opens all segments of a piece); before e29e5c6 page-cache hits opened one segment per group
def test_a_hot_get_over_many_segments_stays_within_max_open_fds(tmp_path: Path) -> None:
    """Run in a child interpreter (RLIMIT_NOFILE lowered there only)."""
    _child(_MANY_SEGMENTS, tmp_path, "OK", 120)


def _child(script: str, tmp_path: Path, want: str, timeout: float) -> None:
    """Run ``script`` (argv[1]: ``tmp_path``) in a child interpreter from the repo root;
    it must exit 0 and print ``want`` first."""
    import subprocess
    res = subprocess.run([sys.executable, "-c", script, str(tmp_path)], cwd=Path(__file__).parents[2],
                         capture_output=True, text=True, timeout=timeout)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.startswith(want), res.stdout + res.stderr[-2000:]
