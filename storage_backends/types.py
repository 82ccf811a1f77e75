"""Value types shared by the storage agent, its volumes and the placement catalog.

Sizes are in bytes.  A *block key* names one block of KV data under one model
fingerprint; a *placement* says where its bytes physically are (volume, segment,
offset, length) and carries the checksum and the catalog version used for
compare-and-set updates (docs/design.md §6).
"""

from __future__ import annotations

import enum
import errno as _errno
from dataclasses import dataclass, field


class StorageError(RuntimeError):
    """Base class of every error the storage layer raises on purpose.

    Attributes:
        dropped: when raised by ``StorageAgent.get``: the placements that call quarantined
            (bytes wrong, segment gone or cut short): their catalog entries are gone, so
            whoever announced those copies announces their removal (a Remove event at the
            placement's volume).  Empty elsewhere.
    """

    dropped: tuple[Placement, ...] = ()


class VolumeConfigError(StorageError, ValueError):
    """A volume descriptor is invalid (unknown kind, missing bucket, bad capacity...)."""


class S3EndpointUnreachableError(VolumeConfigError):
    """An S3 volume's endpoint did not answer when the volume was registered.

    Attributes:
        volume_id: the volume.
        endpoint: the endpoint URL it names.
    """

    def __init__(self, volume_id: str, endpoint: str | None, cause: BaseException) -> None:
        self.volume_id = volume_id
        self.endpoint = endpoint
        super().__init__(f"the S3 endpoint {endpoint} of volume {volume_id!r} is unreachable ({cause})")


class BlockNotFoundError(StorageError, KeyError):
    """No placement is recorded for a block key."""


class ChecksumMismatchError(StorageError):
    """Bytes read back do not match the stored checksum; the copy is never returned."""


class VolumeFullError(StorageError, OSError):
    """The volume has no room for the write (capacity or ENOSPC).

    Nothing of the segment that did not fit was recorded.  ``errno`` is ``ENOSPC`` (or the
    errno the filesystem reported, e.g. ``EDQUOT``); ``str()`` is ``[Errno 28] <message>``.

    Attributes:
        stored: when raised by ``StorageAgent.put``: the placements of the call's blocks
            that ARE stored despite the error (segments written before the volume filled
            up, and blocks that were already held), one per distinct key, in item order.
            Every other block of the call was not recorded.  Empty elsewhere.
    """

    def __init__(self, message: str, err: int = _errno.ENOSPC, stored: list[Placement] | None = None) -> None:
        super().__init__(err, message)
        self.errno = err
        self.strerror = message
        self.stored: list[Placement] = list(stored or [])


class TransferError(StorageError, OSError):
    """A NIXL transfer failed or was short; nothing was recorded for its blocks.

    Attributes:
        stored: when raised by ``StorageAgent.put``: the placements of the call's blocks
            that ARE stored despite the error (as :attr:`VolumeFullError.stored`).  Empty
            elsewhere.
    """

    def __init__(self, *args: object, stored: list[Placement] | None = None) -> None:
        super().__init__(*args)
        self.stored: list[Placement] = list(stored or [])


class SegmentMissingError(TransferError):
    """A read needed a segment whose file / object is gone (ENOENT, ``NoSuchKey``).

    Raised by ``StorageAgent.get`` only when the catalog still pointed at the lost
    segment after a fresh look-up (not a concurrent move); the affected entries were then
    quarantined, so the blocks read as absent and can be stored again.
    """


class SegmentTruncatedError(SegmentMissingError):
    """A read needed bytes past the end of a segment file / object that is shorter than
    the catalog's placements in it say (it was cut after it was written and sealed).

    Segments are immutable once their placements are recorded, so the blocks that lie
    past the end are lost for good: ``StorageAgent.get`` quarantines exactly those
    entries (after a fresh look-up, as for :class:`SegmentMissingError`, which this
    subclasses) so the blocks read as absent and can be stored again.  Blocks that lie
    wholly inside what is left are still read and verified as usual.
    """


class VersionConflictError(StorageError):
    """A compare-and-set on the catalog lost against a concurrent update."""


class FencedError(VersionConflictError):
    """A writer with a newer fencing token has acted on the same fence: this writer's
    lease is stale, and the catalog refused its change (nothing was changed)."""


@dataclass(frozen=True, slots=True)
class Fence:
    """A fencing token for catalog writes made under a lease.

    The catalog keeps, per fence ``name``, the highest ``token`` it has seen; a fenced
    write with a lower token is refused (:class:`FencedError`), a write with an equal or
    higher one raises the stored token first, in the same atomic step.  A new lease holder
    raises the fence (``PlacementCatalog.raise_fence``) before its first write, so a former
    holder that has not noticed it lost the lease (a paused process, a network partition)
    can no longer change anything.  The scheme is the fencing token of M. Kleppmann, "How
    to do distributed locking" (2016); scaled mode uses the JetStream KV revision at which
    an advisor created its partition lease (revisions only grow), docs/design.md §8.

    Fences compare by ``(epoch, token)``: the epoch names the incarnation of what issues
    the tokens (scaled mode: the lease bucket's creation time, in microseconds), so the
    tokens of a lease bucket created again (NATS data lost, the bucket deleted), which
    start at 1 again, rank above every token of the former bucket instead of being
    refused until they catch up.

    Attributes:
        name: what the token fences (``"<namespace>.p<partition>"`` in scaled mode);
            printable, at most 200 characters.
        token: non-negative integer below 2**53 (exact in Redis' Lua numbers).
        epoch: non-negative integer below 2**53; ``0`` (the default) for a token source
            that never starts again.
    """

    name: str
    token: int
    epoch: int = 0

    def __post_init__(self) -> None:
        if not self.name or len(self.name) > 200 or not self.name.isprintable():
            raise InvalidRequestError(f"fence name must be 1-200 printable characters, got {self.name!r}")
        if not isinstance(self.token, int) or not 0 <= self.token < 1 << 53:
            raise InvalidRequestError(f"fence token must be an integer in [0, 2**53), got {self.token!r}")
        if not isinstance(self.epoch, int) or not 0 <= self.epoch < 1 << 53:
            raise InvalidRequestError(f"fence epoch must be an integer in [0, 2**53), got {self.epoch!r}")


FENCE_NEWER_EPOCH = 1 << 53
"""What ``PlacementCatalog.raise_fence`` returns when the stored fence has a higher epoch
than the caller's (above every token)."""


class InvalidRequestError(StorageError, ValueError):
    """A call's arguments are malformed (bad block key, wrong ``out`` size, unknown volume...)."""


class VolumeKind(str, enum.Enum):
    """Backend that serves a volume."""

    POSIX = "posix"
    S3 = "s3"


class MediaClass(str, enum.Enum):
    """Physical media of a volume, fastest first."""

    NVME = "nvme"
    SSD = "ssd"
    HDD = "hdd"
    OBJECT = "object"


@dataclass(frozen=True, slots=True)
class BlockKey:
    """Identity of a stored block.

    Attributes:
        namespace: model-fingerprint namespace (``ModelFingerprint.namespace()``), so blocks
            written under one model are never served to another.
        sequence_hash: the block's u64 sequence hash (docs/design.md §4).
    """

    namespace: str
    sequence_hash: int


@dataclass(frozen=True, slots=True)
class VolumeDescriptor:
    """What ``StorageAgent.register_volume`` needs to know about a volume.

    Attributes:
        id: volume id; also the ``storage_location`` used in events.
        kind: ``posix`` (directory, NIXL POSIX backend) or ``s3`` (NIXL OBJ backend).
        media: media class, used by policies to rank volumes.
        capacity_bytes: usable capacity (> 0).
        root: directory for posix volumes.
        endpoint: S3 endpoint URL (``http://127.0.0.1:9000``) for s3 volumes.
        bucket: S3 bucket name for s3 volumes.
        prefix: object-key prefix inside the bucket.
        region: S3 region.
        alignment: I/O alignment in bytes for O_DIRECT (power of two).
        o_direct: open segment files with O_DIRECT (falls back to buffered I/O when the
            filesystem refuses it, unless ``require_o_direct``).
        segment_bytes: target size of one segment file / object; a ``put`` larger than this
            is split into several segments.
        access_key / secret_key: S3 credentials; ``None`` uses the standard AWS chain
            (environment, shared config, instance profile) as resolved by boto3.
        require_o_direct: with ``o_direct``, a filesystem (or platform) that refuses
            O_DIRECT is an error (``VolumeConfigError`` at registration, no fallback);
            KVBM's ``DYN_KVBM_DISK_ALLOCATOR_TYPE=open-direct``.
        zerofill_fallback: where the filesystem has no ``fallocate``, zero-fill a new
            segment so its space is really allocated before the write (``True``), or only
            extend the file (``ftruncate``: no allocation, ENOSPC can surface during the
            write; logged once per volume); KVBM's ``DYN_KVBM_DISK_ZEROFILL_FALLBACK``.
        s3_sdk_max_attempts: s3 volumes: tries of one request by the aws-sdk inside NIXL OBJ
            (the data path: segment PUTs and ranged GETs), in its ``standard`` retry mode;
            1 = no retry of its own (the volume still tries each transfer
            ``S3Volume.attempts`` times with its backoff).  ``None`` (default): the SDK's
            own choice, i.e. the ``AWS_RETRY_MODE`` / ``AWS_MAX_ATTEMPTS`` environment, else
            its legacy strategy (10 retries over about 25 s, so a refused connection
            fails a transfer after about 25 s a try).
        s3_connect_timeout_s / s3_read_timeout_s: s3 volumes: seconds the boto3 client of
            the admin calls (bucket, ``HEAD`` of a segment, listing, deletes) waits to
            connect and for an answer (> 0; default 60 each, botocore's own).
    """

    id: str
    kind: VolumeKind
    media: MediaClass
    capacity_bytes: int
    root: str | None = None
    endpoint: str | None = None
    bucket: str | None = None
    prefix: str = ""
    region: str = "us-east-1"
    alignment: int = 4096
    o_direct: bool = False
    segment_bytes: int = 64 << 20
    access_key: str | None = None
    secret_key: str | None = field(default=None, repr=False)
    require_o_direct: bool = False
    zerofill_fallback: bool = True
    s3_sdk_max_attempts: int | None = None
    s3_connect_timeout_s: float = 60.0
    s3_read_timeout_s: float = 60.0


@dataclass(frozen=True, slots=True)
class Placement:
    """Where one block's bytes are.

    Attributes:
        key: the block.
        volume_id: volume holding the bytes.
        segment_id: segment (file or object) inside the volume.
        offset: byte offset of the block inside the segment.
        length: block length in bytes.
        checksum: XXH3-64 of the block's bytes.
        version: catalog version, +1 on every committed change of this key.
    """

    key: BlockKey
    volume_id: str
    segment_id: int
    offset: int
    length: int
    checksum: int
    version: int = 0


@dataclass(frozen=True, slots=True)
class SegmentInfo:
    """Accounting of one segment (file or object) of a volume.

    Attributes:
        segment_id: id, unique across every volume of a catalog (never reused).
        volume_id: volume holding the segment.
        size_bytes: bytes the segment occupies (blocks, padding and dead space).
        live_bytes: sum of the lengths of the blocks the catalog still points at.
        live_blocks: number of those blocks.
        sealed: ``False`` while its writer may still commit blocks into it.
        created_at: creation time (Unix seconds).
    """

    segment_id: int
    volume_id: str
    size_bytes: int
    live_bytes: int
    live_blocks: int
    sealed: bool = True
    created_at: float = 0.0

    @property
    def dead_bytes(self) -> int:
        """Bytes no live block uses any more."""
        return self.size_bytes - self.live_bytes

    @property
    def live_fraction(self) -> float:
        """``live_bytes / size_bytes`` (0.0 for an empty segment)."""
        return self.live_bytes / self.size_bytes if self.size_bytes else 0.0


@dataclass(slots=True)
class VolumeStats:
    """Usage of one volume (bytes unless stated)."""

    volume_id: str
    kind: str
    media: str
    capacity_bytes: int
    used_bytes: int
    live_bytes: int
    dead_bytes: int
    segments: int
    blocks: int
    reads: int = 0
    writes: int = 0
    extra: dict[str, int] = field(default_factory=dict)
