"""What the engine's workers hold outside G1, as the scheduler process sees it.

vLLM (and any engine with the same process model) runs a connector twice: a scheduler
side in the engine-core process and a worker side in each worker process.  The worker
side owns the memory (the G2 host pool) and the storage agent; the scheduler side must
still answer "how many tokens of this prompt can be loaded" without touching either.

The worker side therefore reports, with every step's output, the residency changes that
step made (:class:`ResidencyReport`: Store / Remove per tier, and blocks whose load
failed), and the scheduler side folds them into a :class:`ResidencyDirectory`.  vLLM
carries the report in ``KVConnectorOutput.kv_connector_worker_meta`` in the same output
as ``finished_sending``, so by the time a request's blocks are freed the directory
already lists its saved blocks: a prompt that follows finds them, deterministically.

The directory can only be stale in one direction: a block it lists may have been evicted
since (a G2 eviction reported one step later, or a volume emptied by the advisor).  Such a
load fails on the worker, the engine recomputes the block, and the failure report removes
it from the directory.  It never lists a block that was not stored.

Tensor parallelism: each rank holds its own shard of a block; a block is resident at a
tier only when every rank reported it there (``ranks`` bit masks).
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

from event_plane.schema import EventType, KVEvent

STORAGE = "storage"
"""Tier name of the storage agent's volumes (G3 disk or G4 object): the agent finds the
volume that holds a key itself, so the directory does not track which one."""

HOST = "g2"
"""Tier name of the worker's host pool."""


STORED = "store"
"""Operation of a :class:`ResidencyReport` change: the blocks are now held at the tier."""

REMOVED = "remove"
"""Operation of a :class:`ResidencyReport` change: the blocks are no longer held there."""

Change = tuple[str, str, list[int]]
"""``(operation, tier, sequence hashes)``: :data:`STORED` or :data:`REMOVED`; ``"g2"``, the
id of the volume a storage change happened on, or ``"storage"`` (a storage block whose
volume is not known: a failed load); the blocks in the order the worker saw them."""

Transition = tuple[str, str, int]
"""``(operation, tier, sequence hash)``: one block that became held at a tier by every rank
(:data:`STORED`) or stopped being (:data:`REMOVED`); ``tier`` as in the :data:`Change`
that made it (``"g2"``, a volume id, or ``"storage"``)."""


def directory_tier(tier: str) -> str:
    """The directory's tier of a change's tier: ``"g2"`` stays, a volume id (or
    ``"storage"``) is ``"storage"``.

    Raises:
        ValueError: an empty tier, or ``"g1"`` (the engine's own tier is never reported).
    """
    if tier == HOST or tier == STORAGE:
        return tier
    if not isinstance(tier, str) or not tier or tier == "g1":
        raise ValueError(f"unknown tier {tier!r} (expected {HOST!r}, {STORAGE!r} or a volume id)")
    return STORAGE


@dataclass(slots=True)
class ResidencyReport:
    """Residency changes one worker rank made since its previous report (plain data: it
    crosses processes pickled inside vLLM's step output).

    Attributes:
        rank: the reporting rank (tensor-parallel rank; 0 for one worker).
        changes: Store / Remove runs (:data:`Change`) in the order they happened: a
            step that evicts block X from G2 and then saves X again reports
            ``[(REMOVED, "g2", [X]), (STORED, "g2", [X])]``, and X ends up held.  A
            Remove also stands for a load that found the block missing or corrupt.
        load_failures: blocks whose load failed on this rank since its previous report.
        others: reports of other ranks merged into this one (:meth:`merge`).
    """

    rank: int = 0
    changes: list[Change] = field(default_factory=list)
    load_failures: int = 0
    others: list[ResidencyReport] = field(default_factory=list)

    def __bool__(self) -> bool:
        return bool(self.changes or self.load_failures or self.others)

    def merge(self, other: ResidencyReport) -> ResidencyReport:
        """Append ``other`` (another rank's report of the same step); returns ``self``."""
        self.others.append(other)
        return self

    def flatten(self) -> list[ResidencyReport]:
        """This report and every merged one, each without ``others``."""
        out = [ResidencyReport(self.rank, self.changes, self.load_failures)]
        for o in self.others:
            out.extend(o.flatten())
        return out


class ResidencyDirectory:
    """Per sequence hash, the tiers (``"g2"``, ``"storage"``) where every rank holds it.

    Args:
        world_size: number of ranks that must all hold a block (tensor-parallel size).

    Thread-safe.
    """

    def __init__(self, world_size: int = 1) -> None:
        if world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {world_size}")
        self.world_size = world_size
        self._full = (1 << world_size) - 1
        # tier -> sequence hash -> bit mask of the ranks that hold it
        self._ranks: dict[str, dict[int, int]] = {HOST: {}, STORAGE: {}}
        self._lock = threading.Lock()

    def apply(self, report: ResidencyReport) -> list[Transition]:
        """Fold one (possibly merged) report in, each rank's changes in the order they
        happened (a Remove then a Store of one block leaves it held).

        Returns:
            The blocks whose residency changed, in the order they did (:data:`Transition`):
            held at a tier by every rank now, or no longer.  A Store of a block held
            already, or a Remove of one not held, is no transition.

        Raises:
            ValueError: a rank outside ``[0, world_size)``, an unknown tier or operation.
        """
        out: list[Transition] = []
        full = self._full
        with self._lock:
            for r in report.flatten():
                if not 0 <= r.rank < self.world_size:
                    raise ValueError(f"report from rank {r.rank}, world size is {self.world_size}")
                bit = 1 << r.rank
                for op, tier, hashes in r.changes:
                    ranks = self._tier(tier)
                    if op == STORED:
                        for h in hashes:
                            before = ranks.get(h, 0)
                            ranks[h] = before | bit
                            if before != full and before | bit == full:
                                out.append((STORED, tier, h))
                    elif op == REMOVED:
                        for h in hashes:
                            before = ranks.get(h, 0)
                            left = before & ~bit
                            if left:
                                ranks[h] = left
                            else:
                                ranks.pop(h, None)
                            if before == full and left != full:
                                out.append((REMOVED, tier, h))
                    else:
                        raise ValueError(f"unknown residency operation {op!r} (expected {STORED!r} or {REMOVED!r})")
        return out

    def _tier(self, tier: str) -> dict[int, int]:
        return self._ranks[directory_tier(tier)]

    def tier_of(self, sequence_hash: int) -> str | None:
        """``"g2"`` when every rank holds the block in G2, else ``"storage"`` when every rank
        stored it, else ``None``."""
        full = self._full
        if self._ranks[HOST].get(sequence_hash, 0) == full:
            return HOST
        if self._ranks[STORAGE].get(sequence_hash, 0) == full:
            return STORAGE
        return None

    def match(self, hashes: Sequence[int]) -> list[str]:
        """Tiers of the longest prefix of ``hashes`` held somewhere (one entry per block,
        stopping at the first block held nowhere)."""
        out: list[str] = []
        with self._lock:
            for h in hashes:
                tier = self.tier_of(h)
                if tier is None:
                    break
                out.append(tier)
        return out

    def held(self, tier: str) -> set[int]:
        """Sequence hashes every rank holds at ``tier`` (``"g2"``, or ``"storage"``: every
        volume; a copy).

        Raises:
            ValueError: unknown tier.
        """
        with self._lock:
            return {h for h, m in self._tier(tier).items() if m == self._full}

    def __len__(self) -> int:
        with self._lock:
            return len(self._ranks[HOST].keys() | self._ranks[STORAGE].keys())


class ReportingSink:
    """An event sink for a worker's pools and transfer manager that forwards every event
    to the worker's publisher and records the residency changes for the next
    :class:`ResidencyReport`.

    Store / Remove at ``"g2"`` are host changes; at any other location but ``"g1"`` (a
    volume id) storage changes, recorded under the volume id.  ``g1`` events and Cleared
    are forwarded only.

    Args:
        publisher: the worker's ``event_plane`` publisher (``publish``, ``flush``).
        rank: this worker's rank.
    """

    def __init__(self, publisher: Any, rank: int = 0) -> None:
        self.publisher = publisher
        self.rank = rank
        self.source = getattr(publisher, "source", "worker")
        self._lock = threading.Lock()
        self._changes: list[Change] = []
        self._failures = 0

    def _record(self, op: str, tier: str, sequence_hash: int) -> None:
        """Append one change (lock held), extending the last run when it has the same
        operation and tier."""
        if self._changes and self._changes[-1][0] == op and self._changes[-1][1] == tier:
            self._changes[-1][2].append(sequence_hash)
        else:
            self._changes.append((op, tier, [sequence_hash]))

    def publish(self, events: Sequence[KVEvent]) -> None:
        """Record the residency changes of ``events`` and forward them, in order."""
        with self._lock:
            for ev in events:
                loc = ev.storage_location
                if loc == "g1" or ev.type == EventType.CLEARED:
                    continue
                self._record(STORED if ev.type == EventType.STORE else REMOVED, loc, ev.sequence_hash)
        self.publisher.publish(events)

    def lost(self, tier: str, hashes: Iterable[int], failures: int = 0) -> None:
        """Record blocks found missing at ``tier`` (a failed load) whose Remove was
        published already (a G2 eviction), and count ``failures`` failed block loads."""
        with self._lock:
            for h in hashes:
                self._record(REMOVED, tier, h)
            self._failures += failures

    def flush(self) -> None:
        """Flush the publisher."""
        self.publisher.flush()

    def take_report(self) -> ResidencyReport | None:
        """The changes recorded since the last call, or ``None`` when there are none."""
        with self._lock:
            if not (self._changes or self._failures):
                return None
            report = ResidencyReport(self.rank, self._changes, self._failures)
            self._changes, self._failures = [], 0
        return report
