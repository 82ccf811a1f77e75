"""The placement catalog interface: block key -> placement, plus segment accounting.

One catalog is shared by every process that reads or writes the same volumes (the
inference workers and the advisor).  Implementations must make each method atomic across
processes; ``compare_and_set`` is what lets a move and a concurrent put or delete never
both win (docs/design.md §6, §7).  ``SqliteCatalog`` is the embedded implementation
(``BEGIN IMMEDIATE`` transactions on one file); ``RedisCatalog`` the scaled one (one Lua
script per read-modify-write, ``INCR`` segment ids, per-segment live counters).  Both pass
the same contract tests (``tests/unit/test_storage_catalog.py``).
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Iterator, Sequence

from .types import BlockKey, Fence, Placement, SegmentInfo


class PlacementCatalog(ABC):
    """Where every stored block is, with versions for compare-and-set.

    Invariants kept by every implementation:

    * a placement only ever points at a recorded segment of its volume;
    * segment ids are unique across the catalog and never reused;
    * ``version`` rises by one on every committed change of a key.
    """

    # ------------------------------------------------------------------ placements
    @abstractmethod
    def get(self, key: BlockKey) -> Placement | None:
        """The placement of ``key``, or ``None``."""

    @abstractmethod
    def get_many(self, keys: Sequence[BlockKey]) -> list[Placement | None]:
        """Placements of ``keys`` in order (``None`` where absent); one consistent snapshot."""

    @abstractmethod
    def insert_if_absent(self, placements: Sequence[Placement]) -> list[Placement]:
        """Record each placement unless its key is already there; atomic for the batch.

        Returns:
            the winning placement per input, in order: the stored one for keys that were
            already present (or appeared earlier in the same batch), else the input.

        Raises:
            StorageError: a placement names a segment that is not recorded (nothing stored).
        """

    @abstractmethod
    def compare_and_set(self, expected: Placement, new: Placement, fence: Fence | None = None) -> Placement:
        """Replace ``expected`` by ``new`` if the stored entry is still ``expected``.

        The stored entry must have ``expected.version`` and ``expected``'s volume and
        segment.  ``new`` is stored with version ``expected.version + 1`` and returned.
        With a ``fence`` (:class:`~storage_backends.types.Fence`), the change is made only
        if no higher ``(epoch, token)`` was seen for ``fence.name``, and the stored one is
        raised to the fence's, in the same atomic step.

        Raises:
            FencedError: a higher token was seen for ``fence.name`` (nothing changed).
            VersionConflictError: the key is gone or changed since ``expected`` was read.
            InvalidRequestError: ``new`` is for another key.
            StorageError: ``new``'s segment is not recorded.
        """

    @abstractmethod
    def raise_fence(self, fence: Fence) -> int:
        """Raise the stored ``(epoch, token)`` of ``fence.name`` to the fence's (never lowers it).

        Returns:
            the stored token afterwards: ``fence.token`` when the caller holds the newest
            lease, a higher value when a newer holder has raised it already (of the same
            epoch; ``FENCE_NEWER_EPOCH``, above every token, when the stored epoch is higher).
        """

    @abstractmethod
    def delete(self, key: BlockKey, expected_version: int | None = None) -> Placement | None:
        """Remove ``key``; returns what was removed (``None`` if absent).

        Raises:
            VersionConflictError: ``expected_version`` is given and differs from the stored one.
        """

    def delete_many(self, keys: Sequence[BlockKey]) -> list[Placement | None]:
        """Remove each key (unconditionally); returns what was removed, in order."""
        return [self.delete(k) for k in keys]

    @abstractmethod
    def iter_volume(self, volume_id: str) -> Iterator[Placement]:
        """Every placement on ``volume_id``, ordered by (segment, offset)."""

    @abstractmethod
    def iter_segment(self, volume_id: str, segment_id: int) -> Iterator[Placement]:
        """Every live placement in one segment, ordered by offset."""

    @abstractmethod
    def quarantine(self, placement: Placement, reason: str) -> bool:
        """Move ``placement`` out of service (kept for inspection) if it is still current.

        Returns:
            ``True`` if the catalog still held exactly that placement and it was removed.
        """

    # ------------------------------------------------------------------ segments
    @abstractmethod
    def new_segment(self, volume_id: str, size_bytes: int, *, capacity_bytes: int | None = None) -> int:
        """Allocate a unique segment id on ``volume_id`` and record ``size_bytes`` for it.

        The segment starts unsealed (its writer will commit blocks into it).

        Raises:
            VolumeFullError: ``capacity_bytes`` is given and the volume's recorded segments
                plus ``size_bytes`` would exceed it (nothing recorded).
        """

    @abstractmethod
    def seal_segment(self, volume_id: str, segment_id: int) -> None:
        """Mark a segment complete: from now on it may be dropped once it has no live block."""

    @abstractmethod
    def segments(self, volume_id: str) -> list[SegmentInfo]:
        """Every recorded segment of ``volume_id`` with its live accounting, by id."""

    @abstractmethod
    def segment(self, volume_id: str, segment_id: int) -> SegmentInfo | None:
        """One segment's accounting, or ``None`` if not recorded."""

    @abstractmethod
    def drop_segment(self, volume_id: str, segment_id: int) -> bool:
        """Forget a segment that has no live block.

        Returns:
            ``True`` if it was dropped, ``False`` if it was not recorded.

        Raises:
            StorageError: live blocks still point into it.
        """

    @abstractmethod
    def drop_segment_if_empty(self, volume_id: str, segment_id: int) -> bool:
        """Forget a *sealed* segment with no live block; ``True`` if dropped."""

    # ------------------------------------------------------------------ volumes
    @abstractmethod
    def record_volume(self, volume_id: str, spec: str) -> str:
        """Record a volume's descriptor (a canonical JSON string) unless one is there.

        Returns:
            the stored spec (the caller compares it with its own for idempotence).
        """

    @abstractmethod
    def forget_volume(self, volume_id: str) -> None:
        """Remove a volume's descriptor (its placements and segments must be gone)."""

    @abstractmethod
    def volume_specs(self) -> dict[str, str]:
        """Every recorded volume id -> spec."""

    @abstractmethod
    def catalog_id(self) -> str | None:
        """A random id given to the catalog when it was created (the same for every
        process that opens it); volumes that may be shared with other catalogs (S3)
        scope their object keys with it and refuse a prefix another catalog owns.
        ``None``: this catalog has no id (its objects are not scoped)."""
        return None

    def close(self) -> None:
        """Release the connection (idempotent)."""
