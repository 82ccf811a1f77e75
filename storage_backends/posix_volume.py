"""POSIX volume: a directory of segment files, written and read through NIXL POSIX.

Layout: ``<root>/<encoded volume id>/seg-<id>.kvs`` (``keys.encode_component``: injective).
A segment is created with ``O_EXCL``, preallocated (``fallocate(FALLOC_FL_KEEP_SIZE)``, so
ENOSPC surfaces before any byte moves while the file size still only counts written
bytes; where the filesystem does not support it, case C16: zero-fill with page-aligned
buffers when ``desc.zerofill_fallback`` (the default), else only extend the file with
``ftruncate``, logged once per volume, as KVBM's ``DYN_KVBM_DISK_ZEROFILL_FALLBACK``), written through NIXL WRITEs of FILE memory (buffered: one per
:attr:`PosixVolume.write_piece_bytes`, each piece's writeback started right after it),
checked (the file must be exactly the written length: a short write is an error, case
C14), ``fsync``-ed, and its directory ``fsync``-ed, before the agent records any placement
in it.

O_DIRECT (``desc.o_direct``): block offsets and read lengths are padded to
``desc.alignment`` and staging buffers are aligned.  When the filesystem refuses
O_DIRECT, or a buffer/offset/length is not aligned, the I/O falls back to buffered mode,
``o_direct_fallbacks`` rises and the errno is logged (case C15).  With
``desc.require_o_direct`` (KVBM's ``open-direct`` disk allocator) a filesystem that refuses
O_DIRECT is a :class:`~storage_backends.types.VolumeConfigError` instead: checked when the
volume is created (a probe file is opened with O_DIRECT) and at every later open.
"""

from __future__ import annotations

import ctypes
import ctypes.util
import errno
import fcntl
import functools
import logging
import mmap
import os
import threading
from collections import OrderedDict
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import Any, ClassVar

import numpy as np
import torch

from .keys import encode_component, parse_segment_name, segment_file_name
from .nixl_engine import NixlEngine
from .types import SegmentMissingError, TransferError, VolumeConfigError, VolumeDescriptor, VolumeFullError, VolumeKind
from .volume import PageCacheFiles, Volume, align_up

logger = logging.getLogger(__name__)

_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
_ZERO_CHUNK = 1 << 20
_FALLBACK_ERRNOS = (errno.EOPNOTSUPP, errno.ENOTSUP, errno.EINVAL, errno.ENOSYS)
_FULL_ERRNOS = (errno.ENOSPC, errno.EDQUOT)
_FALLOC_FL_KEEP_SIZE = 0x01


def _libc_function(name: str, argtypes: list[Any]) -> Callable[..., int] | None:
    """The libc function ``name`` (returning ``int``, errno kept), or ``None`` where the
    C library or the function is unavailable."""
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        fn = getattr(libc, name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = ctypes.c_int
    return fn  # type: ignore[no-any-return]


_LIBC_FALLOCATE = _libc_function("fallocate64", [ctypes.c_int, ctypes.c_int, ctypes.c_int64, ctypes.c_int64])
_LIBC_SYNC_FILE_RANGE = _libc_function("sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint])
_SYNC_FILE_RANGE_WRITE = 0x2
#: errnos of a filesystem (or kernel) that does not take the writeback hint
_HINT_UNSUPPORTED = (errno.EINVAL, errno.ENOSYS, errno.ESPIPE, errno.EOPNOTSUPP, errno.ENOTSUP)


def reserve_keep_size(fd: int, offset: int, length: int) -> None:
    """Reserve ``length`` bytes at ``offset`` of ``fd`` without changing the file size
    (Linux ``fallocate(FALLOC_FL_KEEP_SIZE)``; ``os.posix_fallocate`` where unavailable).

    Raises:
        OSError: with the filesystem's errno (ENOSPC, EOPNOTSUPP, ...).
    """
    if _LIBC_FALLOCATE is None:
        os.posix_fallocate(fd, offset, length)
        return
    if _LIBC_FALLOCATE(fd, _FALLOC_FL_KEEP_SIZE, offset, length) != 0:
        err = ctypes.get_errno()
        raise OSError(err, os.strerror(err))


def start_writeback(fd: int, offset: int, length: int) -> bool:
    """Ask the kernel to start writing ``length`` bytes at ``offset`` of ``fd`` back to
    the disk now, without waiting for it (Linux ``sync_file_range(SYNC_FILE_RANGE_WRITE)``).

    Only a hint: the bytes are durable after ``fsync``, which also reports any error of
    this writeback.

    Returns:
        ``False`` where the platform or the filesystem does not take the hint (no
        ``sync_file_range``; EINVAL, ENOSYS, ESPIPE, EOPNOTSUPP), ``True`` otherwise.

    Raises:
        OSError: any other errno (EIO, ENOSPC, ...): the write is failing.
    """
    if _LIBC_SYNC_FILE_RANGE is None:
        return False
    if _LIBC_SYNC_FILE_RANGE(fd, offset, length, _SYNC_FILE_RANGE_WRITE) == 0:
        return True
    err = ctypes.get_errno()
    if err in _HINT_UNSUPPORTED:
        return False
    raise OSError(err, os.strerror(err))


def write_pieces(local: np.ndarray, piece: int) -> list[tuple[np.ndarray, int]]:
    """Cut DRAM descriptors written back to back from file offset 0 into pieces.

    Args:
        local: ``K x 3`` int64 ``(address, length, 0)`` rows.
        piece: bytes per piece (> 0); the last piece may be shorter.

    Returns:
        ``(rows, file offset)`` per piece, in file order: ``rows`` (``k x 3`` int64) are
        the descriptors of the piece, a row split where a piece ends.
    """
    out: list[tuple[np.ndarray, int]] = []
    rows: list[tuple[int, int, int]] = []
    filled = pos = 0
    for addr, ln, dev in local.tolist():
        while ln > 0:
            take = min(ln, piece - filled)
            rows.append((addr, take, dev))
            addr, ln, filled = addr + take, ln - take, filled + take
            if filled == piece:
                out.append((np.array(rows, dtype=np.int64), pos))
                pos, rows, filled = pos + piece, [], 0
    if rows:
        out.append((np.array(rows, dtype=np.int64), pos))
    return out


class _OpenSegment:
    """A segment file opened for reading and registered as NIXL FILE memory."""

    __slots__ = ("fd", "reg", "size", "direct")

    def __init__(self, fd: int, reg: Any, size: int, direct: bool) -> None:
        self.fd, self.reg, self.size, self.direct = fd, reg, size, direct


class PosixVolume(Volume):
    """Segments as files under a root directory (NIXL POSIX backend, FILE memory).

    Attributes:
        fallocate: the preallocation call ``(fd, offset, length)``, :func:`reserve_keep_size`
            (replaceable for fault injection).
        max_open: segment files kept open and registered for reads (LRU).
    """

    kind: ClassVar[VolumeKind] = VolumeKind.POSIX
    max_open: int = 64
    #: buffered segment writes go out in pieces of this many bytes, one NIXL WRITE each,
    #: and the kernel starts writing each piece back to the disk as soon as it is in the
    #: page cache (:func:`start_writeback`): the disk works while the next piece is
    #: copied and the closing ``fsync`` waits for the last piece only.  128 MiB in two
    #: 64 MiB segments (pwrite, no hashing): 46 ms against 72 ms for whole-file writes,
    #: 66 ms for one plain ``write`` + ``fsync``.  4 MiB: puts of 256 KiB and 2 MiB blocks
    #: measured 2 and 4 MiB pieces within a few per cent (2 MiB ahead in 3 of 4 A/B
    #: runs), 8 MiB 3-10 % and 16 MiB ~10-20 % slower (docs/benchmarks-history.md); fewer NIXL
    #: requests than 2 MiB.  0: one WRITE per segment, no hint (O_DIRECT writes are
    #: always one WRITE: they bypass the page cache).
    write_piece_bytes: int = 4 << 20

    def __init__(self, desc: VolumeDescriptor, engine: NixlEngine) -> None:
        super().__init__(desc, engine)
        assert desc.root is not None
        self.dir = Path(desc.root).expanduser().resolve() / encode_component(desc.id)
        try:
            self.dir.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise VolumeConfigError(f"volume {desc.id!r}: cannot create {self.dir}: {exc}") from exc
        self.fallocate: Callable[[int, int, int], None] = reserve_keep_size
        #: the writeback hint ``(fd, offset, length) -> taken`` (:func:`start_writeback`;
        #: replaceable for fault injection); not called again once it says ``False``
        self.start_writeback: Callable[[int, int, int], bool] | None = start_writeback
        self._open: OrderedDict[int, _OpenSegment] = OrderedDict()
        # the engine's (nixl agent's) lock: opening or closing a segment file registers or
        # deregisters it with the agent, which takes that lock, and readers take it before
        # this one; one lock keeps a delete on one thread from deadlocking a read on another
        self._open_lock = engine.lock
        self._direct = bool(desc.o_direct and _O_DIRECT)
        self._nowait = bool(_RWF_NOWAIT)
        self._pinned = 0  # page_cache_files contexts open: no segment file is closed
        self._extend_logged = False  # the no-zero-fill fallback is logged once
        if desc.o_direct and not _O_DIRECT:
            if desc.require_o_direct:
                raise VolumeConfigError(f"volume {desc.id!r}: require_o_direct is set but O_DIRECT is not available "
                                        "on this platform")
            self._fallback("open", errno.EINVAL, "O_DIRECT is not available on this platform")
        elif self._direct and desc.require_o_direct:
            self._probe_direct()

    # ------------------------------------------------------------------ class-level
    @classmethod
    def validate(cls, desc: VolumeDescriptor) -> None:
        """A posix volume needs ``root``; ``require_o_direct`` needs ``o_direct``."""
        if not desc.root:
            raise VolumeConfigError(f"posix volume {desc.id!r} needs a root directory (root=...)")
        if desc.require_o_direct and not desc.o_direct:
            raise VolumeConfigError(f"posix volume {desc.id!r}: require_o_direct needs o_direct=True")
        root = Path(desc.root).expanduser()
        if root.exists() and not root.is_dir():
            raise VolumeConfigError(f"posix volume {desc.id!r}: root {root} exists and is not a directory")

    @classmethod
    def engine_spec(cls, desc: VolumeDescriptor) -> tuple[str, dict[str, str]]:
        """Every posix volume shares one POSIX backend with default parameters."""
        return "POSIX", {}

    @property
    def block_alignment(self) -> int:
        return self.desc.alignment if self._direct else 1

    @property
    def buffer_alignment(self) -> int:
        return max(self.desc.alignment, 64) if self._direct else 64

    def path(self, segment_id: int) -> Path:
        """File of a segment."""
        return self.dir / segment_file_name(segment_id)

    def _fallback(self, where: str, err: int, why: str) -> None:
        self.counters.bump("o_direct_fallbacks")
        logger.warning("volume %s: O_DIRECT %s fell back to buffered I/O (errno %d %s): %s",
                       self.desc.id, where, err, errno.errorcode.get(err, "?"), why)

    def _aligned(self, *values: int) -> bool:
        a = self.desc.alignment
        return all(v % a == 0 for v in values)

    # ------------------------------------------------------------------ write
    def write_segment(self, segment_id: int, buffer: torch.Tensor, size: int) -> None:
        """See :meth:`Volume.write_segment`."""
        local = np.array([[buffer.data_ptr(), size, 0]], dtype=np.int64)
        self._write_local(segment_id, local, size)

    def direct_write_ok(self, addrs: np.ndarray, lengths: np.ndarray, offsets: np.ndarray, size: int) -> bool:
        """When the blocks fill the segment without gaps (always for buffered volumes,
        whose blocks are packed back to back); with O_DIRECT also only when every address
        and length is a multiple of ``alignment`` (then no padding is planned either)."""
        if len(lengths) == 0 or int(lengths.sum()) != size:
            return False
        if not self._direct:
            return True
        a = self.desc.alignment
        return bool(np.all(addrs % a == 0) and np.all(lengths % a == 0))

    def write_segment_from(self, segment_id: int, addrs: np.ndarray, lengths: np.ndarray, size: int) -> None:
        """See :meth:`Volume.write_segment_from`."""
        self._write_local(segment_id, self.runs(addrs, lengths), size)

    #: :meth:`write_segments` takes ``before_piece``
    takes_before_piece: ClassVar[bool] = True

    def write_segments(
        self, jobs: Sequence[tuple[int, np.ndarray, int]], before_piece: Callable[[int, int], None] | None = None
    ) -> None:
        """See :meth:`Volume.write_segments` (one segment after the other).

        Args:
            before_piece: called as ``before_piece(j, end)`` right before the WRITE of the
                piece of job ``j``'s segment that ends at byte ``end`` (pieces of
                :attr:`write_piece_bytes`, or one piece of the whole segment), so the
                caller can read that memory (hash it) just before NIXL copies it.  An
                exception from it fails the segment like a failed write.
        """
        if before_piece is None:
            super().write_segments(jobs)
            return
        self._write_each(jobs, lambda j, seg, local, size: self._write_local(
            seg, self.runs(local[:, 0], local[:, 1]), size, functools.partial(before_piece, j)))

    def _write_local(
        self, segment_id: int, local: np.ndarray, size: int, before_piece: Callable[[int], None] | None = None
    ) -> None:
        """Write the DRAM descriptors ``local`` (``K x 3``, back to back, ``size`` bytes in
        all) as a new segment file: create, preallocate, NIXL WRITE(s) (:meth:`_write`,
        ``before_piece(end)`` before each), length check, fsync of the file, then of the
        directory.  Nothing is left behind on failure."""
        path = self.path(segment_id)
        direct = self._direct
        if direct and not self._aligned(size, *local[:, 0].tolist(), *local[:, 1].tolist()):
            self._fallback("write", errno.EINVAL,
                           f"buffer address {int(local[0, 0]):#x} or size {size} not aligned to {self.desc.alignment}")
            direct = False
        fd = -1
        created = False
        try:
            fd, direct = self._create(path, direct)
            created = True
            self._preallocate(fd, size, direct)
            # the segment's blocks are allocated (fallocate or zero-fill): its writes cannot
            # run out of space, so a failed write is not reported as a full volume
            reserved = os.fstat(fd).st_blocks * 512 >= size
            try:
                self._write(fd, path, local, size, before_piece)
            except TransferError as exc:
                if not direct:
                    raise self._classify(exc, size, reserved) from exc
                self._fallback("write", errno.EIO, f"NIXL write with O_DIRECT failed: {exc}")
                os.close(fd)
                fd = -1  # closed: never closed again below, even if the re-open fails
                fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
                direct = False
                try:
                    self._write(fd, path, local, size, before_piece)
                except TransferError as exc2:
                    raise self._classify(exc2, size, reserved) from exc2
            st = os.fstat(fd)
            if st.st_size != size:
                raise self._classify(TransferError(
                    f"volume {self.desc.id!r}: short write: segment {path.name} is {st.st_size} bytes "
                    f"after writing {size}"), size, reserved)
            os.fsync(fd)
            self._fsync_dir()  # inside: a failure removes the file and is mapped like the others
        except BaseException as exc:
            if fd >= 0:
                os.close(fd)
                fd = -1
            if created:
                path.unlink(missing_ok=True)
            if isinstance(exc, OSError) and not isinstance(exc, (TransferError, VolumeFullError)):
                if exc.errno in _FULL_ERRNOS:
                    raise VolumeFullError(f"volume {self.desc.id!r}: no space for {size} bytes ({exc})", exc.errno) from exc
                raise TransferError(f"volume {self.desc.id!r}: writing segment {segment_id} failed: {exc}") from exc
            raise
        finally:
            if fd >= 0:
                os.close(fd)
        self.counters.segments_written += 1
        self.counters.bytes_written += size

    def _create(self, path: Path, direct: bool) -> tuple[int, bool]:
        """Create a new segment file; returns ``(fd, opened with O_DIRECT)``.

        Raises:
            VolumeConfigError: the filesystem refuses O_DIRECT and ``require_o_direct``.
        """
        flags = os.O_RDWR | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
        if direct:
            try:
                return os.open(path, flags | _O_DIRECT, 0o644), True
            except OSError as exc:
                if exc.errno != errno.EINVAL:
                    raise
                path.unlink(missing_ok=True)  # some filesystems create the file, then refuse
                self._no_direct("open", exc)
        return os.open(path, flags, 0o644), False

    def _probe_direct(self) -> None:
        """Open (and remove) a probe file in the volume directory with O_DIRECT.

        Raises:
            VolumeConfigError: the filesystem refuses O_DIRECT (``require_o_direct``).
            OSError: any other errno of the probe.
        """
        probe = self.dir / f".o_direct-probe-{os.getpid()}-{threading.get_ident()}"
        try:
            fd = os.open(probe, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | _O_DIRECT, 0o600)
        except OSError as exc:
            probe.unlink(missing_ok=True)
            if exc.errno != errno.EINVAL:
                raise
            self._no_direct("open", exc)
        else:
            os.close(fd)
            probe.unlink(missing_ok=True)

    def _no_direct(self, where: str, exc: OSError) -> None:
        """The filesystem refused an ``O_DIRECT`` open (EINVAL): count and log the fallback,
        and use buffered I/O for every later segment of this volume (a refusal does not go
        away; the segments' reads would fail the same way).  Block offsets planned with
        the O_DIRECT alignment stay valid for buffered reads.

        Raises:
            VolumeConfigError: ``desc.require_o_direct``: no fallback.
        """
        if self.desc.require_o_direct:
            raise VolumeConfigError(
                f"volume {self.desc.id!r}: the filesystem of {self.dir} refuses O_DIRECT ({where}: {exc}) and "
                "require_o_direct is set (KVBM's open-direct disk allocator); use a filesystem that supports "
                "O_DIRECT or allow the buffered fallback"
            ) from exc
        self._fallback(where, exc.errno or errno.EINVAL, str(exc))
        self._direct = False

    def _preallocate(self, fd: int, size: int, direct: bool) -> None:
        """Reserve ``size`` bytes of a new segment: :attr:`fallocate`; where the filesystem
        does not support it (EOPNOTSUPP, EINVAL, ENOSYS) a zero-fill when
        ``desc.zerofill_fallback``, else only ``ftruncate`` to ``size`` (nothing allocated;
        logged once per volume).  ``fallocate_fallbacks`` counts either fallback.

        Raises:
            VolumeFullError: ENOSPC / EDQUOT from fallocate or the zero-fill.
            OSError: any other errno.
        """
        try:
            self.fallocate(fd, 0, size)
            return
        except OSError as exc:
            if exc.errno in _FULL_ERRNOS:
                raise VolumeFullError(f"volume {self.desc.id!r}: no space for {size} bytes ({exc})", exc.errno) from exc
            if exc.errno not in _FALLBACK_ERRNOS:
                raise
            self.counters.bump("fallocate_fallbacks")
            if not self.desc.zerofill_fallback:
                if not self._extend_logged:
                    self._extend_logged = True
                    logger.warning("volume %s: fallocate unsupported (errno %d) and zerofill_fallback is off: "
                                   "segments are only extended (ftruncate), their space is not reserved",
                                   self.desc.id, exc.errno)
                os.ftruncate(fd, size)
                return
            logger.info("volume %s: posix_fallocate unsupported (errno %d), zero-filling", self.desc.id, exc.errno)
        # Zero-fill with page-aligned buffers (valid for O_DIRECT as long as the chunk
        # lengths are aligned; the tail goes through a buffered descriptor).  Every view of
        # the mapping is released before it closes, also when a write fails (else the
        # close raises BufferError and hides the ENOSPC).
        a = self.desc.alignment if direct else 1
        pos = 0
        with mmap.mmap(-1, _ZERO_CHUNK) as zeros:
            view = memoryview(zeros)
            try:
                while pos < size:
                    n = min(_ZERO_CHUNK, size - pos)
                    if direct and n % a:
                        n = n - n % a
                        if n == 0:
                            break
                    with view[:n] as chunk:
                        try:
                            written = os.pwrite(fd, chunk, pos)
                        except OSError as exc:
                            if exc.errno in _FULL_ERRNOS:
                                raise VolumeFullError(f"volume {self.desc.id!r}: no space for {size} bytes ({exc})",
                                                      exc.errno) from exc
                            raise
                    if written <= 0:
                        raise VolumeFullError(f"volume {self.desc.id!r}: zero-fill stopped at {pos} of {size} bytes")
                    pos += written
            finally:
                view.release()
        if pos < size:  # unaligned tail under O_DIRECT: extend the file size only
            os.ftruncate(fd, size)

    def _write(
        self, fd: int, path: Path, local: np.ndarray, size: int, before_piece: Callable[[int], None] | None = None
    ) -> None:
        """Write the DRAM descriptors ``local`` (``K x 3``) back to back from offset 0 of
        ``fd`` (``size`` bytes in all): one NIXL WRITE, or when ``fd`` is not opened with
        O_DIRECT one per :attr:`write_piece_bytes`, each piece's writeback started right
        after its WRITE; ``before_piece(end)`` right before the WRITE of each piece
        (``end``: the file offset where the piece ends).

        Raises:
            TransferError: a WRITE failed.
            OSError: the writeback hint failed (EIO, ENOSPC, ...).
        """
        piece = self.write_piece_bytes
        if piece <= 0 or size <= piece or (_O_DIRECT and fcntl.fcntl(fd, fcntl.F_GETFL) & _O_DIRECT):
            pieces = [(local, 0)]
        else:
            pieces = write_pieces(local, piece)
        reg = self.engine.register([(0, size, fd, path.name)], "FILE")
        try:
            for rows, pos in pieces:
                n = int(rows[:, 1].sum())
                if before_piece is not None:
                    before_piece(pos + n)
                remote = np.empty_like(rows)
                remote[:, 1] = rows[:, 1]
                remote[:, 0] = np.cumsum(rows[:, 1]) - rows[:, 1] + pos
                remote[:, 2] = fd
                self.engine.transfer("WRITE", rows, remote, "FILE")
                if len(pieces) > 1 and self.start_writeback is not None \
                        and not self.start_writeback(fd, pos, n):
                    self.start_writeback = None
                    self.counters.bump("writeback_hint_unsupported")
        finally:
            self.engine.deregister(reg)

    def _classify(self, exc: TransferError, size: int, reserved: bool = False) -> Exception:
        """ENOSPC shows up from NIXL as a generic error (or a short file); tell it apart by
        free space.  A segment whose ``size`` bytes were ``reserved`` (allocated before the
        write) cannot have run out of space: ``exc`` as it is."""
        if reserved:
            return exc
        try:
            st = os.statvfs(self.dir)
            if st.f_bavail * st.f_frsize < size:
                return VolumeFullError(f"volume {self.desc.id!r}: no space for {size} bytes (ENOSPC): {exc}")
        except OSError:
            pass
        return exc

    def _fsync_dir(self) -> None:
        dfd = os.open(self.dir, os.O_RDONLY | os.O_DIRECTORY)
        try:
            os.fsync(dfd)
        finally:
            os.close(dfd)

    # ------------------------------------------------------------------ read
    def _segment(self, segment_id: int, direct: bool) -> _OpenSegment:
        with self._open_lock:
            seg = self._open.get(segment_id)
            if seg is not None and seg.direct == direct:
                self._open.move_to_end(segment_id)
                return seg
            if seg is not None:
                self._close_one(segment_id)
            path = self.path(segment_id)
            flags = os.O_RDONLY | os.O_CLOEXEC
            try:
                try:
                    fd = os.open(path, flags | (_O_DIRECT if direct else 0))
                except OSError as exc:
                    if not direct or exc.errno != errno.EINVAL:
                        raise
                    # the filesystem refuses O_DIRECT: buffered reads from now on
                    self._no_direct("open for reading", exc)
                    direct = False
                    fd = os.open(path, flags)
            except FileNotFoundError as exc:
                raise SegmentMissingError(f"volume {self.desc.id!r}: segment {segment_id} is missing ({path})") from exc
            try:
                size = os.fstat(fd).st_size
                reg = self.engine.register([(0, max(size, 1), fd, path.name)], "FILE")
            except BaseException:
                os.close(fd)
                raise
            seg = _OpenSegment(fd, reg, size, direct)
            self._open[segment_id] = seg
            return seg

    def _trim(self, keep: frozenset[int] = frozenset(), room: int = 0) -> None:
        """Close the least recently used segment files, other than ``keep``, until at most
        :attr:`max_open` - ``room`` stay open (not while :meth:`page_cache_files` holds
        them)."""
        with self._open_lock:
            if self._pinned:
                return
            for sid in [sid for sid in self._open if sid not in keep]:
                if len(self._open) + room <= self.max_open:
                    break
                self._close_one(sid)

    def _close_one(self, segment_id: int) -> None:
        seg = self._open.pop(segment_id, None)
        if seg is not None:
            self.engine.deregister(seg.reg)
            os.close(seg.fd)

    def read_many(self, items: Sequence[tuple[int, int, int]], out: torch.Tensor) -> list[torch.Tensor]:
        """See :meth:`Volume.read_many`."""
        starts = self.read_into(items, out)
        return [out[s : s + n] for s, (_, _, n) in zip(starts, items)]

    def read_into(self, items: Sequence[tuple[int, int, int]], out: torch.Tensor) -> list[int]:
        """See :meth:`Volume.read_into`."""
        starts = self._place([n for _, _, n in items], out)
        direct = self._direct
        if direct and not self._aligned(out.data_ptr(), *(o for _, o, _ in items)):
            self._fallback("read", errno.EINVAL, "read buffer or offsets not aligned")
            direct = False
        try:
            self._read(items, out, starts, direct)
        except TransferError as exc:
            if not direct:
                raise
            self._fallback("read", errno.EIO, f"NIXL read with O_DIRECT failed: {exc}")
            self._read(items, out, starts, False)
        self.counters.blocks_read += len(items)
        self.counters.bytes_read += sum(n for _, _, n in items)
        return starts

    def _read(self, items: Sequence[tuple[int, int, int]], out: torch.Tensor, starts: list[int], direct: bool) -> None:
        a = self.desc.alignment if direct else 1
        base = out.data_ptr()
        with self._open_lock:
            local: list[tuple[int, int]] = []
            remote: list[tuple[int, int, int]] = []
            opened: dict[int, _OpenSegment] = {}
            for (seg_id, off, n), s in zip(items, starts):
                seg = opened.get(seg_id)
                if seg is None:
                    seg = opened[seg_id] = self._segment(seg_id, direct)
                ln = align_up(n, a)
                if off + n > seg.size:
                    raise TransferError(
                        f"volume {self.desc.id!r}: segment {seg_id} is {seg.size} bytes, block at {off}+{n} is past its end"
                    )
                ln = min(ln, seg.size - off) if not direct else ln
                if remote and remote[-1][2] == seg.fd and remote[-1][0] + remote[-1][1] == off \
                        and local[-1][0] + local[-1][1] == base + s:
                    # contiguous in the file and in the buffer: one larger descriptor
                    local[-1] = (local[-1][0], local[-1][1] + ln)
                    remote[-1] = (remote[-1][0], remote[-1][1] + ln, seg.fd)
                    continue
                local.append((base + s, ln))
                remote.append((off, ln, seg.fd))
            try:
                self.engine.transfer("READ", local, remote, "FILE")
            finally:
                self._trim()  # only now: every segment of this batch stayed registered

    #: 4 MiB: measured best here (2 cores, 1 MiB L2, 32 MiB L3) against 1, 2, 8, 16 and
    #: 64 MiB, and against verifying on a second thread while the next piece is read
    read_piece_bytes: int = 4 << 20

    #: 256 MiB: batches are read a 4 MiB piece at a time (and staged a piece at a time),
    #: so a larger batch costs no memory; fewer batches cut per-batch work of hot gets
    read_batch_bytes: int = 256 << 20

    #: 1 MiB: a group read from the page cache is hashed while it is in L2 (1 MiB per
    #: core here); measured against 256 KiB, 512 KiB and 2 MiB (hot gets, 64 KiB..16 MiB blocks)
    cached_read_bytes: int = 1 << 20

    @contextmanager
    def page_cache_files(self, segment_ids: Iterable[int]) -> Iterator[PageCacheFiles | None]:
        """See :meth:`Volume.page_cache_files`: the segments' read fds, for
        ``preadv2(..., RWF_NOWAIT)`` (Linux >= 4.14), which copies what the page cache
        holds and returns short (or ``EAGAIN``) instead of reading the device.  Only
        buffered volumes: an O_DIRECT volume bypasses the page cache by design and yields
        ``None``, as does a platform or filesystem without ``RWF_NOWAIT`` (the first
        ``EOPNOTSUPP`` / ``EINVAL`` / ``ENOSYS`` reported to ``done`` turns it off for
        this volume).

        A hit is the same memory copy a buffered NIXL POSIX read makes, minus NIXL's
        per-descriptor work (~1.5 us a descriptor: the blocks of one get are rarely
        contiguous in memory).  The open-segment lock is held, and no segment file is
        closed (:attr:`max_open` is applied at exit), for the whole context: no fd can be
        closed or reused under a copy that runs without the GIL on another thread.
        """
        if self._direct or not self._nowait:
            yield None
            return
        with self._open_lock:
            ids = list(dict.fromkeys(segment_ids))
            # room first: the least recently used files not asked for are closed so that
            # these fit within max_open (when they can), not after
            self._trim(frozenset(ids), sum(1 for sid in ids if sid not in self._open))
            self._pinned += 1
            try:
                fds: dict[int, int] = {}
                for sid in ids:
                    try:
                        fds[sid] = self._segment(sid, False).fd
                    except (TransferError, OSError):
                        continue  # missing or unreadable: read_direct reports it
                yield PageCacheFiles(fds, _RWF_NOWAIT, self._page_cache_done)
            finally:
                self._pinned -= 1
                self._trim()

    def _page_cache_done(self, copied: int, err: int) -> None:
        """:attr:`PageCacheFiles.done`: count ``copied`` bytes; an errno saying the kernel
        or filesystem has no ``RWF_NOWAIT`` turns page-cache reads off for this volume."""
        if copied:
            self.counters.bytes_read += copied
            self.counters.bump("bytes_read_cached", copied)
        if err in (errno.EOPNOTSUPP, errno.EINVAL, errno.ENOSYS) and self._nowait:
            self._nowait = False
            logger.info("volume %s: no RWF_NOWAIT reads here (%s); every read goes through NIXL",
                        self.desc.id, os.strerror(err))

    def direct_read_ok(self, addrs: np.ndarray, lengths: np.ndarray) -> bool:
        """Always for buffered volumes; with O_DIRECT only when every address and length
        is a multiple of ``alignment`` (the offsets are, by :meth:`plan`)."""
        if not self._direct:
            return True
        a = self.desc.alignment
        return bool(np.all(addrs % a == 0) and np.all(lengths % a == 0))

    def read_direct(self, segments: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray) -> None:
        """See :meth:`Volume.read_direct` (O_DIRECT falls back to buffered I/O on EIO)."""
        direct = self._direct
        try:
            self._read_ranges(segments, offsets, lengths, addrs, direct)
        except TransferError as exc:
            if not direct:
                raise
            self._fallback("read", errno.EIO, f"NIXL read with O_DIRECT failed: {exc}")
            self._read_ranges(segments, offsets, lengths, addrs, False)
        self.counters.bytes_read += int(lengths.sum())

    def _read_ranges(
        self, segments: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray, direct: bool
    ) -> None:
        n = len(segments)
        with self._open_lock:
            try:
                if n == 1 or (segments == segments[0]).all():  # the common case: one segment
                    seg = self._segment(int(segments[0]), direct)
                    fds: np.ndarray | int = seg.fd
                    sizes: np.ndarray | int = seg.size
                else:
                    useg, at = np.unique(segments, return_inverse=True)
                    opened = [self._segment(int(x), direct) for x in useg.tolist()]
                    fds = np.array([o.fd for o in opened], dtype=np.int64)[at]
                    sizes = np.array([o.size for o in opened], dtype=np.int64)[at]
                ends = offsets + lengths
                past = np.flatnonzero(ends > sizes)
                if len(past):
                    i = int(past[0])
                    size = sizes if isinstance(sizes, int) else int(sizes[i])
                    raise TransferError(
                        f"volume {self.desc.id!r}: segment {int(segments[i])} is {size} bytes, "
                        f"range {int(offsets[i])}+{int(lengths[i])} is past its end"
                    )
                # one descriptor per run contiguous in the file and in memory
                if n > 1:
                    brk = (offsets[1:] != ends[:-1]) | (addrs[1:] != addrs[:-1] + lengths[:-1])
                    if not isinstance(fds, int):
                        brk |= fds[1:] != fds[:-1]
                    first = np.concatenate(([0], np.flatnonzero(brk) + 1))
                    if len(first) < n:
                        lengths = np.add.reduceat(lengths, first)
                        offsets, addrs = offsets[first], addrs[first]
                        if not isinstance(fds, int):
                            fds = fds[first]
                k = len(lengths)
                local = np.zeros((k, 3), dtype=np.int64)
                local[:, 0], local[:, 1] = addrs, lengths
                remote = np.empty((k, 3), dtype=np.int64)
                remote[:, 0], remote[:, 1], remote[:, 2] = offsets, lengths, fds
                self.engine.transfer("READ", local, remote, "FILE")
            finally:
                self._trim()  # only now: every segment of this transfer stayed registered

    # ------------------------------------------------------------------ admin
    def delete_segment(self, segment_id: int) -> None:
        """See :meth:`Volume.delete_segment`."""
        with self._open_lock:
            self._close_one(segment_id)
        try:
            self.path(segment_id).unlink()
            self.counters.segments_deleted += 1
        except FileNotFoundError:
            pass

    def segment_exists(self, segment_id: int) -> bool:
        """See :meth:`Volume.segment_exists` (the segment file is there)."""
        return self.path(segment_id).is_file()

    def segment_size(self, segment_id: int) -> int | None:
        """See :meth:`Volume.segment_size` (``stat`` of the segment file, not the size
        cached when it was opened for reads; a cached open file whose size changed is
        closed, so the next read opens it afresh)."""
        try:
            size = self.path(segment_id).stat().st_size
        except FileNotFoundError:
            size = None
        with self._open_lock:
            seg = self._open.get(segment_id)
            if seg is not None and seg.size != size:
                self._close_one(segment_id)
        return size

    def list_segments(self) -> list[int]:
        """See :meth:`Volume.list_segments`."""
        ids = (parse_segment_name(p.name) for p in self.dir.iterdir() if p.is_file())
        return sorted(i for i in ids if i is not None)

    def close(self) -> None:
        """Close and deregister every open segment file."""
        with self._open_lock:
            for seg_id in list(self._open):
                self._close_one(seg_id)
