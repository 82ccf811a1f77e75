"""The ``Volume`` interface, descriptor validation and the kind -> class registry.

A volume stores *segments*: immutable byte strings (a file for ``posix``, an object for
``s3``) that pack many blocks.  Volumes know nothing about block keys or the catalog; the
:class:`~storage_backends.agent.StorageAgent` decides what goes into which segment.
Classes are imported lazily by kind (as SGLang does for its storage backends), so an S3
dependency problem never breaks a POSIX-only deployment.
"""

from __future__ import annotations

import importlib
import json
import os
from abc import ABC, abstractmethod
from collections.abc import Callable, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

from .keys import validate_volume_id
from .memory_budget import MemoryBudgetError, check_allocation
from .types import MediaClass, VolumeConfigError, VolumeDescriptor, VolumeKind

if TYPE_CHECKING:
    from .nixl_engine import NixlEngine

_VOLUME_CLASSES: dict[str, tuple[str, str]] = {
    VolumeKind.POSIX.value: ("storage_backends.posix_volume", "PosixVolume"),
    VolumeKind.S3.value: ("storage_backends.s3_volume", "S3Volume"),
}


def volume_class(kind: VolumeKind | str) -> type[Volume]:
    """The :class:`Volume` subclass serving ``kind`` (imported on first use).

    Raises:
        VolumeConfigError: unknown kind.
    """
    k = kind.value if isinstance(kind, VolumeKind) else kind
    entry = _VOLUME_CLASSES.get(k) if isinstance(k, str) else None
    if entry is None:
        raise VolumeConfigError(f"unknown volume kind {kind!r}; known kinds: {sorted(_VOLUME_CLASSES)}")
    module, name = entry
    cls: type[Volume] = getattr(importlib.import_module(module), name)
    return cls


def resolve_root(root: str | os.PathLike[str]) -> Path:
    """Absolute, symlink-free form of a directory path (``~`` expanded; need not exist)."""
    return Path(os.path.realpath(os.path.expanduser(os.fspath(root))))


def check_allowed_root(desc: VolumeDescriptor, allowed_roots: Sequence[str | os.PathLike[str]]) -> None:
    """Refuse a posix volume whose root is not inside one of ``allowed_roots``.

    Paths are compared after ``realpath`` (so ``..`` and symlinks cannot escape).

    Raises:
        VolumeConfigError: naming the volume's root and the allowed roots.
    """
    if not desc.root:
        return
    root = resolve_root(desc.root)
    allowed = [resolve_root(a) for a in allowed_roots]
    if not any(root == a or root.is_relative_to(a) for a in allowed):
        raise VolumeConfigError(
            f"volume {desc.id!r}: root {desc.root!r} (resolved {str(root)!r}) is outside the allowed roots "
            f"{[str(a) for a in allowed]}"
        )


def validate_descriptor(
    desc: VolumeDescriptor, allowed_roots: Sequence[str | os.PathLike[str]] | None = None
) -> None:
    """Check the fields every kind needs, then the kind's own rules.

    Args:
        allowed_roots: when given, a posix volume's root must lie inside one of them.

    Raises:
        VolumeConfigError: with a message naming the volume and the bad field.
    """
    if not isinstance(desc, VolumeDescriptor):
        raise VolumeConfigError(f"expected a VolumeDescriptor, got {type(desc).__name__}")
    validate_volume_id(desc.id)
    try:
        VolumeKind(desc.kind)
    except ValueError:
        raise VolumeConfigError(
            f"volume {desc.id!r}: unknown kind {desc.kind!r} (expected one of {[k.value for k in VolumeKind]})"
        ) from None
    try:
        MediaClass(desc.media)
    except ValueError:
        raise VolumeConfigError(
            f"volume {desc.id!r}: unknown media class {desc.media!r} (expected one of {[m.value for m in MediaClass]})"
        ) from None
    if isinstance(desc.capacity_bytes, bool) or not isinstance(desc.capacity_bytes, int) or desc.capacity_bytes <= 0:
        raise VolumeConfigError(
            f"volume {desc.id!r}: capacity_bytes must be a positive size in bytes (int > 0), got {desc.capacity_bytes!r}"
        )
    a = desc.alignment
    if isinstance(a, bool) or not isinstance(a, int) or a <= 0 or a & (a - 1):
        raise VolumeConfigError(f"volume {desc.id!r}: alignment must be a power of two, got {a!r}")
    if isinstance(desc.segment_bytes, bool) or not isinstance(desc.segment_bytes, int) or desc.segment_bytes <= 0:
        raise VolumeConfigError(f"volume {desc.id!r}: segment_bytes must be a positive int, got {desc.segment_bytes!r}")
    try:  # a segment is staged whole in host memory when a put cannot write from the caller's tensors
        check_allocation(f"the staging buffer of volume {desc.id!r}", desc.segment_bytes,
                         f"segment_bytes={desc.segment_bytes}")
    except MemoryBudgetError as exc:
        raise VolumeConfigError(str(exc)) from None
    volume_class(desc.kind).validate(desc)
    if allowed_roots is not None and VolumeKind(desc.kind) is VolumeKind.POSIX:
        check_allowed_root(desc, allowed_roots)


def descriptor_identity(desc: VolumeDescriptor) -> str:
    """Canonical JSON of the fields that say *where* a volume's bytes are (no secrets).

    Two registrations of one volume id must agree on these; capacity, endpoint URL,
    credentials and tuning may differ between processes and restarts.
    """
    d = asdict(desc)
    keep = {k: d[k] for k in ("id", "kind", "root", "bucket", "prefix")}
    keep["kind"] = VolumeKind(desc.kind).value
    if desc.root:
        keep["root"] = os.path.abspath(os.path.expanduser(desc.root))
    return json.dumps(keep, sort_keys=True)


#: :meth:`Volume.segment_size` of a segment that is there but whose size is not known
UNKNOWN_SIZE = 1 << 62


def align_up(n: int, a: int) -> int:
    """Smallest multiple of ``a`` that is >= ``n``."""
    return -(-n // a) * a


@dataclass
class PageCacheFiles:
    """What :meth:`Volume.page_cache_files` yields: per segment id the fd to copy cached
    bytes from, the ``preadv2`` flags to use, and :meth:`done` to report each copy.

    Attributes:
        fds: segment id -> open file descriptor (valid until the context exits).
        flags: ``preadv2`` flags (``RWF_NOWAIT``).
        done: ``done(copied, err)`` after each copy: ``copied`` bytes, ``err`` the errno
            of a failed call (0 for none or ``EAGAIN``); counts the bytes and turns the
            volume's page-cache reads off for an errno saying the kernel has none.
    """

    fds: dict[int, int]
    flags: int
    done: Callable[[int, int], None]


@dataclass
class VolumeCounters:
    """I/O counters of one volume in this process (blocks and bytes)."""

    blocks_read: int = 0
    blocks_written: int = 0
    bytes_read: int = 0
    bytes_written: int = 0
    segments_written: int = 0
    segments_deleted: int = 0
    extra: dict[str, int] = field(default_factory=dict)

    def bump(self, name: str, n: int = 1) -> None:
        """Add ``n`` to the free-form counter ``name``."""
        self.extra[name] = self.extra.get(name, 0) + n


class Volume(ABC):
    """A place that stores segments through one NIXL backend.

    Args:
        desc: a validated descriptor.
        engine: the NIXL engine (agent + backend + staging buffer) to use.
    """

    kind: ClassVar[VolumeKind]

    def __init__(self, desc: VolumeDescriptor, engine: NixlEngine) -> None:
        self.desc = desc
        self.engine = engine
        self.counters = VolumeCounters()

    def bind_catalog(self, catalog_id: str | None) -> None:
        """Called once by the agent before any I/O with the id of its catalog
        (:meth:`PlacementCatalog.catalog_id`).  Volumes that other deployments may share
        (S3) claim their place for that catalog and scope their keys with it; local
        volumes ignore it.

        Raises:
            VolumeConfigError: the place belongs to another catalog.
        """

    # ------------------------------------------------------------------ class-level
    @classmethod
    @abstractmethod
    def validate(cls, desc: VolumeDescriptor) -> None:
        """Kind-specific checks; raise VolumeConfigError."""

    @classmethod
    @abstractmethod
    def engine_spec(cls, desc: VolumeDescriptor) -> tuple[str, dict[str, str]]:
        """NIXL backend type and parameters this volume needs."""

    @classmethod
    def engine_env(cls, desc: VolumeDescriptor) -> dict[str, str]:
        """Environment variables the NIXL backend must see while it is created (settings
        its libraries read from the environment only); none by default."""
        return {}

    # ------------------------------------------------------------------ layout
    @property
    def block_alignment(self) -> int:
        """Alignment of block offsets and read lengths inside segments (1 = none)."""
        return 1

    @property
    def buffer_alignment(self) -> int:
        """Alignment the DRAM staging buffer's address must have."""
        return 64

    def plan(self, lengths: Sequence[int]) -> tuple[list[int], int]:
        """Offsets of blocks of ``lengths`` packed in a segment, and the segment's size."""
        a = self.block_alignment
        offsets: list[int] = []
        pos = 0
        for n in lengths:
            offsets.append(pos)
            pos = align_up(pos + n, a)
        return offsets, max(pos, a if a > 1 else 0)

    #: bytes of one read transfer that the agent verifies before it reads the next one
    #: (small enough that the bytes are still in the CPU cache when they are hashed)
    read_piece_bytes: int = 8 << 20

    def direct_read_ok(self, addrs: np.ndarray, lengths: np.ndarray) -> bool:
        """Whether :meth:`read_direct` can land ranges of ``lengths`` bytes straight at the
        DRAM addresses ``addrs`` (int64 arrays); ``False`` means the agent reads through
        a staging buffer with :meth:`read_into` instead."""
        return False

    def read_direct(self, segments: np.ndarray, offsets: np.ndarray, lengths: np.ndarray, addrs: np.ndarray) -> None:
        """Read ``lengths[i]`` bytes at ``offsets[i]`` of segment ``segments[i]`` into the
        registered DRAM at ``addrs[i]``, for every i, in ONE NIXL transfer (int64 arrays;
        a volume may merge ranges contiguous both in the segment and in memory into one
        descriptor).  Counts bytes, not blocks (the caller counts blocks).

        Raises:
            TransferError: a segment is missing, a range is past its end, or the transfer
                failed.
            NotImplementedError: the volume has no direct reads (see :meth:`direct_read_ok`).
        """
        raise NotImplementedError(f"{type(self).__name__} has no direct reads")

    #: bytes of blocks per read batch of ``StorageAgent.get`` (a batch is one
    #: :meth:`read_direct` pass, or the staging buffer's size when ``read_piece_bytes``
    #: is larger than a batch, as for S3)
    read_batch_bytes: int = 64 << 20

    #: bytes per page-cache copy (0: the volume has none, see :meth:`page_cache_files`);
    #: small enough that a group of blocks is still in the CPU's L2 cache when it is hashed
    cached_read_bytes: int = 0

    @contextmanager
    def page_cache_files(self, segment_ids: Iterable[int]) -> Iterator[PageCacheFiles | None]:
        """Open file descriptors through which bytes of these segments that are already in
        memory (the OS page cache) can be copied without waiting for the device
        (``preadv2(..., RWF_NOWAIT)``, :mod:`storage_backends._readcore`), held open and
        valid until the context exits.

        Yields:
            ``None`` when the volume has no such reads (the default; O_DIRECT or a kernel
            without ``RWF_NOWAIT``), else a :class:`PageCacheFiles` (segments that cannot
            be opened are left out: :meth:`read_direct` reports them).
        """
        yield None

    def read_buffer_bytes(self, items: Sequence[tuple[int, int, int]]) -> int:
        """Bytes of staging buffer :meth:`read_many` needs for ``[(segment_id, offset, length)]``."""
        a = self.block_alignment
        return sum(align_up(n, a) for _, _, n in items)

    # ------------------------------------------------------------------ I/O
    @abstractmethod
    def write_segment(self, segment_id: int, buffer: torch.Tensor, size: int) -> None:
        """Write ``buffer[:size]`` (registered uint8 DRAM) as segment ``segment_id`` in ONE
        NIXL transfer, durably.  The segment must not exist yet.

        Raises:
            VolumeFullError: no room (ENOSPC); nothing is left behind.
            TransferError: the transfer failed or was short; nothing is left behind.
        """

    def direct_write_ok(self, addrs: np.ndarray, lengths: np.ndarray, offsets: np.ndarray, size: int) -> bool:
        """Whether :meth:`write_segment_from` can write blocks of ``lengths`` bytes at the
        DRAM addresses ``addrs``, planned at ``offsets`` of a segment of ``size`` bytes
        (int64 arrays), straight from that memory; ``False`` means the agent packs them
        into a staging buffer and calls :meth:`write_segment` instead."""
        return False

    def write_segment_from(self, segment_id: int, addrs: np.ndarray, lengths: np.ndarray, size: int) -> None:
        """:meth:`write_segment` from registered caller DRAM instead of one buffer: the
        segment is the ``lengths[i]`` bytes at ``addrs[i]``, one after the other (no gap;
        ``size == lengths.sum()``), written in ONE NIXL transfer with one descriptor per
        run contiguous in memory.  Same durability and errors as :meth:`write_segment`.

        Raises:
            VolumeFullError, TransferError: as :meth:`write_segment`.
            NotImplementedError: the volume has no direct writes (see :meth:`direct_write_ok`).
        """
        raise NotImplementedError(f"{type(self).__name__} has no direct writes")

    #: segments one :meth:`write_segments` call may write at once (in one transfer);
    #: 1: one after the other
    write_concurrency: int = 1
    #: bytes of one :meth:`write_segments` call at most: a wave of blocks that cannot be
    #: written from the caller's memory is packed into ONE staging buffer, which the
    #: engine keeps (8 S3 segments of 16 MiB)
    write_wave_bytes: int = 128 << 20

    def write_segments(self, jobs: Sequence[tuple[int, np.ndarray, int]]) -> None:
        """Write several new segments, durably: job ``(segment_id, local, size)`` is the
        ``size`` bytes of the registered DRAM descriptors ``local`` (``K x 3`` int64
        ``(address, length, 0)`` rows, back to back) as segment ``segment_id``.

        The default writes them one after the other (:meth:`write_segment_from`: for
        posix, each file written, checked and fsync-ed before the next); a volume with
        :attr:`write_concurrency` > 1 writes them in ONE transfer.  All or
        nothing: on failure no segment of the call is left behind.

        Raises:
            VolumeFullError, TransferError: as :meth:`write_segment`.
        """
        self._write_each(jobs, lambda j, seg, local, size: self.write_segment_from(seg, local[:, 0], local[:, 1], size))

    def _write_each(
        self, jobs: Sequence[tuple[int, np.ndarray, int]], write_one: Callable[[int, int, np.ndarray, int], None]
    ) -> None:
        """:meth:`write_segments` one segment after the other: ``write_one(j, segment_id,
        local, size)`` for each job ``j``, all or nothing (on failure the segments already
        written by the call are deleted, then the error is raised)."""
        done: list[int] = []
        try:
            for j, (seg, local, size) in enumerate(jobs):
                write_one(j, seg, local, size)
                done.append(seg)
        except BaseException:
            for seg in done:
                self.delete_segment(seg)
            raise

    @staticmethod
    def runs(addrs: np.ndarray, lengths: np.ndarray) -> np.ndarray:
        """``K x 3`` int64 NIXL DRAM descriptors ``(address, length, 0)``: the ranges merged
        into runs contiguous in memory (consecutive blocks of one pool: one descriptor)."""
        n = len(addrs)
        if n > 1:
            first = np.concatenate(([0], np.flatnonzero(addrs[1:] != addrs[:-1] + lengths[:-1]) + 1))
            if len(first) < n:
                lengths = np.add.reduceat(lengths, first)
                addrs = addrs[first]
        local = np.zeros((len(addrs), 3), dtype=np.int64)
        local[:, 0], local[:, 1] = addrs, lengths
        return local

    @abstractmethod
    def read_many(self, items: Sequence[tuple[int, int, int]], out: torch.Tensor) -> list[torch.Tensor]:
        """Read ``[(segment_id, offset, length)]`` in one NIXL transfer into ``out``.

        Args:
            out: registered uint8 DRAM of at least ``read_buffer_bytes(items)`` bytes
                whose address is a multiple of :attr:`buffer_alignment`.

        Returns:
            one uint8 view of ``out`` per item, each of exactly ``length`` bytes.

        Raises:
            TransferError: a segment is missing or the transfer failed.
        """

    def read_into(self, items: Sequence[tuple[int, int, int]], out: torch.Tensor) -> list[int]:
        """:meth:`read_many`, returning where each item starts inside ``out`` instead of
        tensor views (cheaper for many small blocks)."""
        base = out.storage_offset()
        return [v.storage_offset() - base for v in self.read_many(items, out)]

    def read(self, segment_id: int, ranges: Sequence[tuple[int, int]], out: torch.Tensor) -> list[torch.Tensor]:
        """:meth:`read_many` for ``[(offset, length)]`` ranges of one segment."""
        return self.read_many([(segment_id, o, n) for o, n in ranges], out)

    def _place(self, lengths: Sequence[int], out: torch.Tensor) -> list[int]:
        """Start of each item inside ``out`` (aligned as :attr:`block_alignment` needs)."""
        a = self.block_alignment
        pos, starts = 0, []
        for n in lengths:
            starts.append(pos)
            pos += align_up(n, a)
        if pos > out.numel():
            raise ValueError(f"read buffer of {out.numel()} bytes is smaller than the {pos} needed")
        return starts

    @abstractmethod
    def delete_segment(self, segment_id: int) -> None:
        """Delete a segment (missing is fine)."""

    def segment_exists(self, segment_id: int) -> bool:
        """Whether segment ``segment_id``'s file / object is physically present.

        Used after a failed read to tell a lost segment (ENOENT, ``NoSuchKey``) from a
        transient failure.  The default answers ``True`` (unknown: never treated as lost).

        Raises:
            StorageError: the volume cannot be asked (e.g. the S3 endpoint is down).
        """
        return True

    def segment_size(self, segment_id: int) -> int | None:
        """Bytes segment ``segment_id``'s file / object holds now, or ``None`` when it is
        gone (ENOENT, ``NoSuchKey``).

        Used after a failed read to tell a lost or truncated segment (shorter than a
        placement in it needs) from a transient failure.  The default knows no size: it
        answers from :meth:`segment_exists`, with :data:`UNKNOWN_SIZE` for a present
        segment (never taken as truncated).

        Raises:
            StorageError: the volume cannot be asked (e.g. the S3 endpoint is down).
        """
        return UNKNOWN_SIZE if self.segment_exists(segment_id) else None

    @abstractmethod
    def list_segments(self) -> list[int]:
        """Ids of the segments physically present, ascending."""

    def close(self) -> None:
        """Release open files and registrations."""

    def describe(self) -> dict[str, Any]:
        """Counters as a flat dict (for stats)."""
        c = self.counters
        return {
            "bytes_read": c.bytes_read, "bytes_written": c.bytes_written,
            "segments_written": c.segments_written, "segments_deleted": c.segments_deleted, **c.extra,
        }
