"""Operator action: drain a volume, moving every block the advisor manages on it to another
volume (docs/operations.md, "Operator actions").

Each block of a managed namespace that the catalog places on the volume becomes a move item
(kind ``demote``, reason ``drain <volume>``) executed by the advisor's mover in groups of
:data:`DRAIN_GROUP` blocks: verified copy, catalog switch, Store on the destination and Remove
from the source published, exactly as a policy move (docs/design.md §7). It runs between
policy rounds (the round lock); the results join ``GET /v1/plans``. Afterwards the volume
holds no managed block, so it can be unregistered (``DELETE /v1/volumes/{id}``) or taken out
of ``volumes`` at the next restart.

A drain marks the volume *draining* before its first move: policy rounds then move nothing
onto it and compact nothing on it, until the volume is unregistered or the drain is
cancelled (:func:`undrain_volume`).  The mark is kept in the run state and survives a
restart.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from advisor.policy.plan import PlanItem, PlanKind, PlanResult, PlanStatus

if TYPE_CHECKING:
    from advisor.ops.operated import OperatedAdvisor

logger = logging.getLogger(__name__)

DRAIN_GROUP = 1024
"""Blocks copied per mover group (one new segment each on the destination)."""


HINT_NAMESPACES = 10
"""Namespaces a drain's hint names at most."""


class DrainError(RuntimeError):
    """The drain cannot start: no storage, unknown volume, or a bad destination."""


@dataclass(frozen=True)
class DrainResult:
    """What a drain did.

    Attributes:
        volume / to: source and destination volume ids.
        counts: plan status (``done``, ``skipped``, ``failed``) → blocks.
        bytes_moved: bytes written on the destination.
        results: every executed item's result, in order.
        other_namespaces: blocks on ``volume`` in namespaces this advisor does not manage
            (namespace → blocks): left in place; a drain that moved nothing names them, so
            the operator can add them to ``extra_namespaces``.
        managed: the namespaces the drain looked for (the advisor's managed ones then).
        seen: the catalog's placements per namespace and volume when the drain began.
    """

    volume: str
    to: str
    counts: dict[str, int] = field(default_factory=dict)
    bytes_moved: int = 0
    results: list[PlanResult] = field(default_factory=list)
    other_namespaces: dict[str, int] = field(default_factory=dict)
    managed: list[str] = field(default_factory=list)
    seen: dict[str, dict[str, int]] = field(default_factory=dict)

    def hint(self) -> str | None:
        """Why blocks stayed: the volume holds blocks of namespaces this advisor leaves out
        (what to set), or the drain found nothing to move (the namespaces it looked for, and
        those the catalog holds, per volume); ``None`` when it moved everything it found."""
        if self.other_namespaces:
            names = ", ".join(f"{ns} ({n:,} blocks)" for ns, n in sorted(self.other_namespaces.items()))
            return (f"volume {self.volume!r} also holds blocks of namespaces this advisor does not manage: {names}; "
                    "add them to its extra_namespaces setting (or raise max_namespaces) to move them")
        if sum(self.counts.values()) == 0:
            shown = sorted(self.seen.items())[:HINT_NAMESPACES]
            seen = "; ".join(f"{ns} ({', '.join(f'{v}={n:,}' for v, n in sorted(vols.items()))})"
                             for ns, vols in shown) or "none"
            if len(self.seen) > len(shown):
                seen += f"; and {len(self.seen) - len(shown):,} more"
            return (f"0 blocks of namespace(s) {', '.join(self.managed)} on volume {self.volume!r}: nothing to move; "
                    f"namespaces seen in the catalog: {seen}")
        return None


def default_destination(service: OperatedAdvisor, volume: str) -> str | None:
    """Where a drain of ``volume`` goes by default: the fast volume's blocks to the first slow
    volume, a slow volume's to another slow one, else to the archive volume; ``None`` when
    no other volume is configured."""
    s = service.settings
    others = [v for v in [*s.slow_volumes, s.archive_volume, s.fast_volume] if v and v != volume]
    return others[0] if others else None


def drain_volume(service: OperatedAdvisor, volume: str, to: str | None = None) -> DrainResult:
    """Move every managed block off ``volume`` onto ``to`` (default: :func:`default_destination`).

    Raises:
        DrainError: no storage attached, ``volume`` or ``to`` unknown, or the same volume.
    """
    agent, mover = service.agent, service.mover
    if agent is None or mover is None:
        raise DrainError("this advisor has no storage attached: nothing to drain")
    known = {v.id for v in service.settings.volumes}
    if volume not in known:
        raise DrainError(f"unknown volume {volume!r} (configured: {sorted(known)})")
    dst = to if to is not None else default_destination(service, volume)
    if dst is None or dst not in known or dst == volume:
        raise DrainError(f"cannot drain {volume!r} to {dst!r}: give another configured volume")
    managed = service.managed_namespaces(max_age_s=0.0)  # a connector's namespace stored just now counts
    namespaces = set(managed)
    with service.round_lock:
        if volume not in service.draining:
            service.draining.add(volume)
            service.save_admin_state()
        placements = []
        others: dict[str, int] = {}
        for p in agent.catalog.iter_volume(volume):
            if p.key.namespace in namespaces:
                placements.append(p)
            else:
                others[p.key.namespace] = others.get(p.key.namespace, 0) + 1
        items = [PlanItem(PlanKind.DEMOTE, f"drain {volume}", volume, dst, p.key.sequence_hash, p.key.namespace,
                          bytes=p.length) for p in placements]
        results: list[PlanResult] = []
        for i in range(0, len(items), DRAIN_GROUP):
            results.extend(mover.execute_many(items[i : i + DRAIN_GROUP]))
        with service.lock:
            service.plans.extend(results)
        service.metrics.record_results(results)
    counts = {s.value: 0 for s in PlanStatus}
    for r in results:
        counts[r.status.value] += 1
    moved = sum(r.bytes_moved for r in results)
    logger.warning("advisor: drained volume %s to %s: %s (it stays draining)", volume, dst, counts)
    res = DrainResult(volume, dst, counts, moved, results, others, managed, dict(service.namespace_counts))
    if res.hint():
        logger.warning("advisor: %s", res.hint())
    return res


def undrain_volume(service: OperatedAdvisor, volume: str) -> bool:
    """Cancel a drain: policy rounds may move blocks onto ``volume`` again.  Returns whether
    it was draining."""
    with service.round_lock:
        if volume not in service.draining:
            return False
        service.draining.discard(volume)
        service.save_admin_state()
    logger.warning("advisor: volume %s no longer draining", volume)
    return True
