# cython: language_level=3, boundscheck=False, wraparound=False, initializedcheck=False
"""Compiled core of verified page-cache reads (``StorageAgent._read_direct``).

Copies the blocks of a get that the OS page cache already holds into their destinations
with ``preadv2(..., RWF_NOWAIT)`` and checks each block's XXH3-64 right after its copy,
while the bytes are in the CPU cache: the loop ``PosixVolume.read_cached`` + a hash per
block ran in Python before, ~2 us a block, as much as copying 64 KiB.  Every call runs
without the GIL, so two threads can copy and hash two halves of one get at once.

XXH3-64 is python-xxhash's own compiled implementation (the functions its extension
module exports: ``XXH3_64bits_dispatch`` and the streaming ``XXH3_*`` state API, the same
code ``xxhash.xxh3_64_intdigest`` runs), bound once at import and checked against
``xxhash.xxh3_64_intdigest`` on test buffers; when that fails :data:`available` is false
and the agent reads through NIXL and hashes in Python instead.
"""

from libc.errno cimport EAGAIN, EINTR, errno
from libc.stdint cimport int32_t, int64_t, uint8_t, uint64_t
from libc.string cimport memcpy

cdef extern from "<sys/uio.h>" nogil:
    struct iovec:
        void *iov_base
        size_t iov_len
    ssize_t preadv2(int fd, const iovec *iov, int iovcnt, long offset, int flags)

ctypedef ssize_t (*preadv2_t)(int, const iovec*, int, long, int) noexcept nogil
ctypedef uint64_t (*oneshot_t)(const void*, size_t) noexcept nogil
ctypedef void* (*create_t)() noexcept nogil
ctypedef int (*reset_t)(void*) noexcept nogil
ctypedef int (*update_t)(void*, const void*, size_t) noexcept nogil
ctypedef uint64_t (*digest_t)(const void*) noexcept nogil
ctypedef int (*free_t)(void*) noexcept nogil

cdef preadv2_t _preadv2 = <preadv2_t>preadv2
cdef oneshot_t _oneshot = NULL
cdef create_t _create = NULL
cdef reset_t _reset = NULL
cdef update_t _update = NULL
cdef digest_t _digest = NULL
cdef free_t _free = NULL

cdef enum:
    IOV_MAX = 1024

#: Whether XXH3-64 could be bound and checked (see the module docstring).
available = False


def _bind():
    """Bind python-xxhash's exported XXH3 functions and check them; sets :data:`available`."""
    global _oneshot, _create, _reset, _update, _digest, _free, available
    import ctypes

    import xxhash
    try:
        lib = ctypes.CDLL(xxhash._xxhash.__file__)
        def addr(*names):
            for name in names:
                try:
                    return ctypes.cast(getattr(lib, name), ctypes.c_void_p).value
                except AttributeError:
                    continue
            raise AttributeError(names[0])
        _oneshot = <oneshot_t><size_t>addr("XXH3_64bits_dispatch", "XXH3_64bits")
        _update = <update_t><size_t>addr("XXH3_64bits_update_dispatch", "XXH3_64bits_update")
        _create = <create_t><size_t>addr("XXH3_createState")
        _reset = <reset_t><size_t>addr("XXH3_64bits_reset")
        _digest = <digest_t><size_t>addr("XXH3_64bits_digest")
        _free = <free_t><size_t>addr("XXH3_freeState")
    except (AttributeError, OSError):
        available = False
        return
    import random
    rnd = random.Random(0)
    cdef bytes data
    cdef const unsigned char* p
    cdef void* st
    cdef Py_ssize_t n
    for n in (0, 1, 3, 16, 17, 128, 129, 240, 241, 1000, 4096, 65536, 100003):
        data = bytes(rnd.getrandbits(8) for _ in range(n))
        p = data
        want = xxhash.xxh3_64_intdigest(data)
        if _oneshot(p, n) != want:
            available = False
            return
        st = _create()
        if st == NULL:
            available = False
            return
        _reset(st)
        _update(st, p, n // 3)
        _update(st, p + n // 3, n - n // 3)
        got = _digest(st)
        _free(st)
        if got != want:
            available = False
            return
    available = True


_bind()


def _set_preadv2(size_t address):
    """Tests only: call the function at ``address`` (a ``preadv2`` with libc's signature,
    e.g. a ctypes callback that cuts copies short) instead of libc's; 0 restores libc's."""
    global _preadv2
    _preadv2 = <preadv2_t>address if address else <preadv2_t>preadv2


cdef inline ssize_t _pread(int fd, const iovec* iov, int cnt, long off, int flags, int* err) noexcept nogil:
    """``preadv2``, retried on EINTR; -1 with ``err[0]`` = errno (0 for EAGAIN) on failure."""
    cdef ssize_t got
    while True:
        got = _preadv2(fd, iov, cnt, off, flags)
        if got >= 0:
            return got
        if errno != EINTR:
            err[0] = 0 if errno == EAGAIN else errno
            return -1


def hash_check(const int64_t[:] addrs, const int64_t[:] lens, const uint64_t[:] cks, uint8_t[:] ok,
               Py_ssize_t lo, Py_ssize_t hi):
    """XXH3-64 of blocks ``lo:hi`` (``lens[k]`` bytes at address ``addrs[k]``, live memory
    the caller keeps alive) against ``cks[k]``; ``ok[k] = 0`` where it differs (without
    the GIL).

    Raises:
        RuntimeError: XXH3 is not :data:`available`.
    """
    check_copy(addrs, None, lens, cks, ok, lo, hi)


def check_copy(const int64_t[:] src, const int64_t[:] dst, const int64_t[:] lens, const uint64_t[:] cks,
               uint8_t[:] ok, Py_ssize_t lo, Py_ssize_t hi):
    """Verify blocks ``lo:hi`` read into a staging buffer and copy the good ones out:
    XXH3-64 of the ``lens[k]`` bytes at ``src[k]`` against ``cks[k]``; on a match they
    are copied to ``dst[k]`` (while still in the CPU cache; ``dst`` ``None``: only
    verified), else ``ok[k] = 0`` and ``dst[k]`` is left untouched.  Without the GIL;
    the caller keeps the memory alive.

    Raises:
        RuntimeError: XXH3 is not :data:`available`.
    """
    if not available:
        raise RuntimeError("XXH3 is not bound")
    cdef Py_ssize_t k
    cdef bint copy = dst is not None
    with nogil:
        for k in range(lo, hi):
            if _oneshot(<void*>src[k], <size_t>lens[k]) != cks[k]:
                ok[k] = 0
            elif copy:
                memcpy(<void*>dst[k], <void*>src[k], <size_t>lens[k])


def read_cached(const int32_t[:] gfd, const int64_t[:] goff, const int64_t[:] gstart, const int64_t[:] gend,
                const int64_t[:] addrs, const int64_t[:] lens, const uint64_t[:] cks, uint8_t[:] ok,
                Py_ssize_t g0, Py_ssize_t g1, int64_t part, int flags):
    """Copy groups ``g0:g1`` of blocks from the page cache and verify each block.

    Group ``g`` is blocks ``gstart[g]:gend[g]`` (at most 1024), contiguous in the file
    open as ``gfd[g]`` from byte ``goff[g]``: one ``preadv2(gfd[g], ..., goff[g], flags)``
    into their destinations ``addrs[k]`` (``lens[k]`` bytes each).  A group of one block
    longer than ``part`` is copied ``part`` bytes at a time, its hash streamed over the
    parts.  Each block whose copy completed is hashed at once and ``ok[k]`` set to 0
    when its XXH3-64 is not ``cks[k]``.  Stops at the first short copy (bytes not in
    memory: ``EAGAIN`` / a short count with ``RWF_NOWAIT``, end of file, or an error).
    Runs without the GIL; the caller keeps the fds open and the memory alive.

    Returns:
        ``(g, k, have, err, copied)``: ``g`` the group it stopped in (``g1`` when every
        group was copied), ``k`` the first block not copied whole (-1 when done), ``have``
        how many of its first bytes were copied (not verified), ``err`` the errno of a
        failed call (0 for a short count or ``EAGAIN``: bytes not in memory) and ``copied`` the
        bytes copied in all.

    Raises:
        RuntimeError: XXH3 is not :data:`available`.
        ValueError: a group of more than 1024 blocks.
    """
    if not available:
        raise RuntimeError("XXH3 is not bound")
    cdef iovec iov[IOV_MAX]
    cdef Py_ssize_t g, k = -1, lo, hi
    cdef ssize_t got
    cdef int err = 0
    cdef int64_t have = 0, copied = 0, pos, ln, step
    cdef void* st = NULL
    cdef bint stopped = False
    for g in range(g0, g1):
        if gend[g] - gstart[g] > IOV_MAX or gend[g] <= gstart[g]:
            raise ValueError(f"group {g} has {gend[g] - gstart[g]} blocks (1..{IOV_MAX})")
    with nogil:
        g = g0
        while g < g1:
            lo = gstart[g]
            hi = gend[g]
            if hi - lo == 1 and lens[lo] > part:
                # one large block, copied and hashed a part at a time
                ln = lens[lo]
                if st == NULL:
                    st = _create()
                    if st == NULL:
                        err = 12  # ENOMEM
                        k = lo
                        have = 0
                        stopped = True
                        break
                _reset(st)
                pos = 0
                while pos < ln:
                    step = part if ln - pos > part else ln - pos
                    iov[0].iov_base = <void*>(addrs[lo] + pos)
                    iov[0].iov_len = <size_t>step
                    got = _pread(gfd[g], iov, 1, goff[g] + pos, flags, &err)
                    if got < 0:
                        got = 0
                    copied += got
                    if got < step:
                        pos += got
                        break
                    _update(st, iov[0].iov_base, <size_t>step)
                    pos += step
                if pos < ln:
                    k = lo
                    have = pos
                    stopped = True
                    break
                if _digest(st) != cks[lo]:
                    ok[lo] = 0
                g += 1
                continue
            for k in range(lo, hi):
                iov[k - lo].iov_base = <void*>addrs[k]
                iov[k - lo].iov_len = <size_t>lens[k]
            got = _pread(gfd[g], iov, <int>(hi - lo), goff[g], flags, &err)
            if got < 0:
                got = 0
            copied += got
            k = lo
            while k < hi and got >= lens[k]:
                if _oneshot(<void*>addrs[k], <size_t>lens[k]) != cks[k]:
                    ok[k] = 0
                got -= lens[k]
                k += 1
            if k < hi:
                have = got
                stopped = True
                break
            g += 1
        if st != NULL:
            _free(st)
    if stopped:
        return g, k, have, err, copied
    return g1, -1, 0, 0, copied


def columns(list places):
    """The columns of a get's placements, in one pass (~20 ns a field instead of a
    Python generator per column).

    Args:
        places: ``Placement`` objects (any object with ``volume_id``, ``segment_id``,
            ``offset``, ``length`` and ``checksum``).

    Returns:
        ``(one_volume, segment_ids, offsets, lengths, checksums)``: whether every
        placement is on the first one's volume, then int64 arrays and a uint64 array.

    Raises:
        OverflowError: a field out of its type's range.
    """
    import numpy as np

    cdef Py_ssize_t i, n = len(places)
    segs = np.empty(n, dtype=np.int64)
    offs = np.empty(n, dtype=np.int64)
    lens = np.empty(n, dtype=np.int64)
    cks = np.empty(n, dtype=np.uint64)
    cdef int64_t[:] s = segs
    cdef int64_t[:] o = offs
    cdef int64_t[:] ln = lens
    cdef uint64_t[:] c = cks
    cdef bint one = True
    cdef object first = places[0].volume_id if n else None
    cdef object v
    for i in range(n):
        p = places[i]
        s[i] = p.segment_id
        o[i] = p.offset
        ln[i] = p.length
        c[i] = p.checksum
        if one:
            v = p.volume_id
            if v is not first and v != first:
                one = False
    return one, segs, offs, lens, cks
