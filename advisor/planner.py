"""Planner: rate-limits a round's plan items (moves, bytes, compactions per round)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from advisor.plan import PlanItem, PlanKind
from advisor.policies import PlannerSettings


@dataclass
class Plan:
    """The items a round will execute, and how many were held back by the limits.

    Attributes:
        items: accepted items, in execution order.
        deferred: items left for a later round (limits reached).
        duplicates: items dropped because the same block / segment was already planned.
    """

    items: list[PlanItem] = field(default_factory=list)
    deferred: int = 0
    duplicates: int = 0


class Planner:
    """Keeps the proposed order and accepts items while the round's budgets last."""

    def __init__(self, settings: PlannerSettings) -> None:
        self.settings = settings

    def plan(self, proposed: Sequence[PlanItem]) -> Plan:
        """Accept items in order until a limit is reached.

        Limits: ``max_moves_per_round`` (promote + demote), ``max_compactions_per_round``,
        ``max_bytes_per_round`` (all kinds).  An item that does not fit is deferred; later,
        smaller items may still fit.  A block or segment is planned at most once per round.
        """
        s = self.settings
        out = Plan()
        moves = compactions = 0
        nbytes = 0
        seen_blocks: set[int] = set()
        seen_segments: set[tuple[str, int]] = set()
        for it in proposed:
            if it.kind is PlanKind.COMPACT:
                key = (it.src_volume, it.segment_id if it.segment_id is not None else -1)
                if key in seen_segments:
                    out.duplicates += 1
                    continue
                if compactions >= s.max_compactions_per_round or nbytes + it.bytes > s.max_bytes_per_round:
                    out.deferred += 1
                    continue
                seen_segments.add(key)
                compactions += 1
            else:
                h = it.sequence_hash if it.sequence_hash is not None else -1
                if h in seen_blocks:
                    out.duplicates += 1
                    continue
                if moves >= s.max_moves_per_round or nbytes + it.bytes > s.max_bytes_per_round:
                    out.deferred += 1
                    continue
                seen_blocks.add(h)
                moves += 1
            nbytes += it.bytes
            out.items.append(it)
        return out
