"""Plan items (what a policy wants done, and why) and plan results (what happened)."""

from __future__ import annotations

import enum
from dataclasses import dataclass


class PlanKind(str, enum.Enum):
    """Kind of a plan item."""

    PROMOTE = "promote"
    """Move a hot block one tier up (slow → fast, archive → slow)."""
    DEMOTE = "demote"
    """Move a cold block one tier down (fast → slow, slow → archive)."""
    COMPACT = "compact"
    """Rewrite the live blocks of a sparse segment into a new one (same volume)."""


class PlanStatus(str, enum.Enum):
    """Outcome of executing a plan item."""

    DONE = "done"
    SKIPPED = "skipped"
    """Nothing to do any more (the block moved or vanished, or a concurrent update won)."""
    FAILED = "failed"
    """An I/O or storage error; the catalog still points to the old verified copy."""


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One move or compaction a policy asks for.

    Attributes:
        kind: :class:`PlanKind`.
        reason: human-readable explanation (which rule, which numbers).
        src_volume: volume the block / segment is on now.
        dst_volume: target volume of a move; ``None`` for a compaction.
        sequence_hash: the block of a move; ``None`` for a compaction.
        namespace: the block's key namespace when the policy knows it, else ``None``
            (the mover then looks the block up in every namespace the advisor manages).
        segment_id: the segment of a compaction.
        bytes: bytes the item will copy (block length, or live bytes of the segment).
    """

    kind: PlanKind
    reason: str
    src_volume: str
    dst_volume: str | None = None
    sequence_hash: int | None = None
    namespace: str | None = None
    segment_id: int | None = None
    bytes: int = 0


@dataclass(slots=True)
class PlanResult:
    """What executing one :class:`PlanItem` did.

    Attributes:
        item: the plan item.
        status: :class:`PlanStatus`.
        detail: why it was skipped / failed, or a short summary when done.
        bytes_moved: bytes written at the destination (0 unless done).
        blocks_moved: blocks rewritten (1 for a move, N for a compaction).
        finished_ns: wall-clock time (ns since the Unix epoch) when it finished.
        duration_s: seconds it took.
    """

    item: PlanItem
    status: PlanStatus
    detail: str = ""
    bytes_moved: int = 0
    blocks_moved: int = 0
    finished_ns: int = 0
    duration_s: float = 0.0
