"""Storage layer: the NIXL storage agent, POSIX and S3 volumes, the placement catalog.

Imports nothing else of kvadvisor (docs/design.md §2).  The contract is docs/design.md §6.
"""

from .agent import StorageAgent
from .catalog import PlacementCatalog
from .checksum import checksum
from .local_s3 import LocalS3, free_port, start_local_s3
from .metrics import StorageCollector, register_storage_metrics
from .redis_catalog import RedisCatalog
from .sqlite_catalog import SqliteCatalog
from .types import (
    BlockKey,
    BlockNotFoundError,
    ChecksumMismatchError,
    Fence,
    FencedError,
    InvalidRequestError,
    MediaClass,
    Placement,
    S3EndpointUnreachableError,
    SegmentInfo,
    SegmentMissingError,
    SegmentTruncatedError,
    StorageError,
    TransferError,
    VersionConflictError,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeFullError,
    VolumeKind,
    VolumeStats,
)
from .volume import Volume, validate_descriptor, volume_class

__all__ = [
    "BlockKey",
    "BlockNotFoundError",
    "ChecksumMismatchError",
    "Fence",
    "FencedError",
    "InvalidRequestError",
    "LocalS3",
    "MediaClass",
    "Placement",
    "PlacementCatalog",
    "RedisCatalog",
    "SegmentInfo",
    "SegmentMissingError",
    "SegmentTruncatedError",
    "SqliteCatalog",
    "StorageAgent",
    "StorageCollector",
    "StorageError",
    "TransferError",
    "VersionConflictError",
    "Volume",
    "VolumeConfigError",
    "S3EndpointUnreachableError",
    "VolumeDescriptor",
    "VolumeFullError",
    "VolumeKind",
    "VolumeStats",
    "checksum",
    "free_port",
    "register_storage_metrics",
    "start_local_s3",
    "validate_descriptor",
    "volume_class",
]


def __getattr__(name: str) -> object:
    # Volume classes load lazily (kind -> class registry), as do their dependencies.
    if name == "PosixVolume":
        from .posix_volume import PosixVolume

        return PosixVolume
    if name == "S3Volume":
        from .s3_volume import S3Volume

        return S3Volume
    raise AttributeError(f"module 'storage_backends' has no attribute {name!r}")
