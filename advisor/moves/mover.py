"""Mover: executes plan items with the crash-safe protocol of docs/design.md §7.

A block move is:

1. ``agent.locate`` — the catalog's current placement; the block must still be on the
   item's source volume (otherwise the item is stale and skipped);
2. ``agent.copy_many(placements, dst)`` — read + verify the checksums, write one new
   segment on the destination for the group, read back + verify; the new copies are
   *not* yet in the catalog;
3. ``agent.commit_move(old, new)`` — compare-and-set on the catalog version; the old
   bytes become dead space (a concurrent update wins: the item is skipped and the
   agent discards the new copy);
4. publish ``Store(new volume)`` with ``extra_metadata={"moved_from": old volume}``;
5. publish ``Remove(old volume)``, then flush.

A crash before step 3 leaves the old verified copy in the catalog; after it, the new
verified copy.  Events go through the advisor's own publisher, whose ``on_flush``
journals and applies them, so the index sees the move like every other subscriber.

A compaction (``agent.compact``) rewrites a segment's live blocks on the same volume: the
locations do not change, so no events are published.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from advisor.index.prefix_index import MOVE_KEY, BlockInfo
from advisor.policy.plan import PlanItem, PlanKind, PlanResult, PlanStatus
from event_plane.schema import remove, store

logger = logging.getLogger(__name__)

_GROUP_RETRIES = 2
"""Copies of a group tried again after blocks vanished from it (each retry drops at least one)."""


class MoverAgent(Protocol):
    """The part of ``storage_backends.StorageAgent`` the mover uses."""

    def locate(self, keys: Sequence[Any]) -> list[Any]: ...
    def copy_many(self, placements: Sequence[Any], dst_volume: str, skip_deleted: bool = False) -> list[Any]: ...
    def commit_move(self, old: Any, new: Any, fence: Any = None) -> Any: ...
    def compact(self, volume_id: str, segment_id: int, fence: Any = None) -> int: ...


class MoverPublisher(Protocol):
    """The part of ``event_plane.EventPublisher`` the mover uses."""

    def publish(self, events: Sequence[Any]) -> None: ...
    def flush(self) -> None: ...
    def stats(self) -> Any: ...
    """Counters with ``dropped``: events the transport gave up on (``event_plane.PublisherStats``)."""


@dataclass
class MoverCounters:
    """What the mover did since start (bytes are bytes written at the destination)."""

    done: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in PlanKind})
    skipped: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in PlanKind})
    failed: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in PlanKind})
    bytes_moved: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in PlanKind})
    blocks_moved: dict[str, int] = field(default_factory=lambda: {k.value: 0 for k in PlanKind})
    routes: dict[str, int] = field(default_factory=dict)
    """Completed promotions and demotions per ``"<kind> <source volume>-><destination volume>"``
    (e.g. ``"demote slow->s3"``), so a report can say how many blocks went down to S3."""


def route_key(item: PlanItem) -> str | None:
    """``"<kind> <src>-><dst>"`` of a move item, ``None`` for a compaction (no destination)."""
    if item.dst_volume is None:
        return None
    return f"{item.kind.value} {item.src_volume}->{item.dst_volume}"


class Mover:
    """Executes :class:`~advisor.policy.plan.PlanItem` s against a storage agent.

    Args:
        agent: the advisor's ``StorageAgent``.
        publisher: the advisor's event publisher (its ``on_flush`` journals + applies).
        namespaces: key namespaces the advisor manages (tried in order when an item
            does not name one).
        block_info: returns the index's view of a block (parent, prefix) or ``None``;
            called without holding any publisher lock.
        key_factory: builds a block key from ``(namespace, sequence_hash)``
            (``storage_backends.BlockKey``).
        fence: the fencing token every catalog commit carries (scaled mode: the
            partition lease, ``storage_backends.Fence``); ``None`` commits unfenced.
            Once a commit is fenced off, the rest of the batch is skipped.
        metadata: extra metadata put on every Store a move publishes (scaled mode: the
            mover's advisor id and fencing token).
        publish_to: ``publish_to(sequence_hash)`` -> the publishers a move of that block
            is announced on (scaled mode: its partition's, or every partition's for a
            trunk block); ``None`` = ``[publisher]``.
        abort: ``abort()`` -> why the caller may no longer move these blocks (scaled
            mode: the partition was released or its lease expired locally), or ``None``;
            asked before each group, compaction and commit.  Once it answers, the rest of
            the batch is SKIPPED with that reason and uncommitted copies are released, so
            a round never outlives the ownership it was planned under by more than the
            commit in progress (the fence still refuses what a paused process commits
            after a newer owner raised it).
    """

    def __init__(
        self,
        agent: MoverAgent,
        publisher: MoverPublisher,
        namespaces: Sequence[str],
        block_info: Callable[[int], BlockInfo | None],
        key_factory: Callable[[str, int], Any],
        *,
        fence: Any = None,
        metadata: dict[str, Any] | None = None,
        publish_to: Callable[[int], Sequence[MoverPublisher]] | None = None,
        abort: Callable[[], str | None] | None = None,
    ) -> None:
        if not namespaces:
            raise ValueError("the mover needs at least one namespace")
        self.agent = agent
        self.publisher = publisher
        self.namespaces = list(namespaces)
        self.block_info = block_info
        self.key_factory = key_factory
        self.fence = fence
        self.metadata = dict(metadata or {})
        self.publish_to = publish_to
        self.abort = abort
        self.counters = MoverCounters()
        # moves committed (done) whose Store/Remove could not be published or flushed: the
        # catalog is right; the index learns it from the next repair or a publisher re-send
        self.announce_failed = 0
        self.fenced = False
        self.aborted: str | None = None

    def _stopped(self) -> str | None:
        """Why no more item may be carried out (fenced off, or ``abort``'s reason), or ``None``."""
        if self.fenced:
            return "fenced off: a newer lease holder acts on this partition"
        if self.aborted is None and self.abort is not None:
            self.aborted = self.abort()
        return self.aborted

    def execute(self, item: PlanItem) -> PlanResult:
        """Carry out one item (see :meth:`execute_many`)."""
        return self.execute_many([item])[0]

    def execute_many(self, items: Sequence[PlanItem],
                     failed_routes: set[tuple[str, str | None]] | None = None) -> list[PlanResult]:
        """Carry out items in order; never raises for storage errors (they become FAILED).

        Consecutive moves with the same source and destination are copied together
        (``agent.copy_many``: one new segment for the group), then committed and
        published block by block in item order, with one flush per group.

        A block that vanishes from the source under the group (evicted, moved, or
        quarantined between the locate and the copy) drops only itself from the group:
        it is SKIPPED, and the rest of the group is copied (the copy is tried again
        without the blocks the catalog shows changed, at most ``_GROUP_RETRIES`` times).

        Once a group failed as a whole with every block still where it was located (a
        fault of the route itself: a volume or its endpoint is down, full, refusing), the
        later moves with the same source and destination are SKIPPED without being tried:
        an S3 endpoint that does not answer costs one group's retries per round, not one
        per group.  ``failed_routes`` holds those
        ``(source, destination)`` pairs; pass one set to several calls to share it (the
        cluster mover does, across the partitions of a round); ``None``: this call's own.

        Returns:
            One :class:`PlanResult` per item, in item order.
        """
        failed = set() if failed_routes is None else failed_routes
        results: list[PlanResult] = []
        i = 0
        while i < len(items):
            item = items[i]
            t0 = time.monotonic()
            if item.kind is PlanKind.COMPACT:
                group = [item]
                res = [self._guard(self._compact, item)]
            else:
                j = i + 1
                while (j < len(items) and items[j].kind is not PlanKind.COMPACT
                       and (items[j].src_volume, items[j].dst_volume) == (item.src_volume, item.dst_volume)):
                    j += 1
                group = list(items[i:j])
                route = (item.src_volume, item.dst_volume)
                if route in failed:
                    res = [PlanResult(it, PlanStatus.SKIPPED, f"moves {item.src_volume} -> {item.dst_volume} "
                                      "failed earlier in this round; not tried again") for it in group]
                else:
                    try:
                        res, fault = self._move_group(group)
                    except Exception as exc:  # noqa: BLE001 - a failed group must not stop the round
                        res, fault = [PlanResult(it, PlanStatus.FAILED, f"{type(exc).__name__}: {exc}")
                                      for it in group], exc
                    if fault is not None:
                        logger.warning("mover: moving %d blocks %s -> %s failed: %s", len(group), item.src_volume,
                                       item.dst_volume, fault)
                        failed.add(route)
            elapsed = time.monotonic() - t0
            now = time.time_ns()
            for r in res:
                r.duration_s = elapsed
                r.finished_ns = now
                self._count(r)
            results.extend(res)
            i += len(group)
        return results

    def _guard(self, fn: Callable[[PlanItem], PlanResult], item: PlanItem) -> PlanResult:
        try:
            return fn(item)
        except Exception as exc:  # noqa: BLE001
            logger.warning("mover: %s %s failed: %s", item.kind.value, item, exc)
            return PlanResult(item, PlanStatus.FAILED, f"{type(exc).__name__}: {exc}")

    def _count(self, res: PlanResult) -> None:
        kind = res.item.kind.value
        if res.status is PlanStatus.DONE:
            self.counters.done[kind] += 1
            self.counters.bytes_moved[kind] += res.bytes_moved
            self.counters.blocks_moved[kind] += res.blocks_moved
            route = route_key(res.item)
            if route is not None:
                self.counters.routes[route] = self.counters.routes.get(route, 0) + 1
        elif res.status is PlanStatus.SKIPPED:
            self.counters.skipped[kind] += 1
        else:
            self.counters.failed[kind] += 1

    def _compact(self, item: PlanItem) -> PlanResult:
        from storage_backends.types import FencedError  # storage is optional for the index

        if item.segment_id is None:
            return PlanResult(item, PlanStatus.FAILED, "compaction item without a segment id")
        why = self._stopped()
        if why is not None:
            return PlanResult(item, PlanStatus.SKIPPED, why)
        try:
            moved = (self.agent.compact(item.src_volume, item.segment_id, fence=self.fence) if self.fence is not None
                     else self.agent.compact(item.src_volume, item.segment_id))
        except FencedError as exc:
            self.fenced = True
            return PlanResult(item, PlanStatus.SKIPPED, f"fenced off: {exc}")
        return PlanResult(
            item, PlanStatus.DONE, f"rewrote {moved} live blocks of segment {item.segment_id}",
            bytes_moved=item.bytes if moved else 0, blocks_moved=moved,
        )

    def _move_group(self, group: list[PlanItem]) -> tuple[list[PlanResult], Exception | None]:
        """Move one group (same source and destination); returns the results in item
        order, and the route's fault when the copy failed with every block still in place."""
        from storage_backends.types import FencedError, VersionConflictError  # storage is optional for the index

        src, dst = group[0].src_volume, group[0].dst_volume
        why = self._stopped()
        if why is not None:
            return [PlanResult(it, PlanStatus.SKIPPED, why) for it in group], None
        out: list[PlanResult | None] = [None] * len(group)
        todo: list[tuple[int, Any]] = []  # (index in group, old placement)
        keys: list[Any] = []
        spans: list[tuple[int, int]] = []
        for it in group:
            if it.sequence_hash is None or it.dst_volume is None:
                spans.append((len(keys), len(keys)))
                continue
            nss = [it.namespace] if it.namespace is not None else self.namespaces
            spans.append((len(keys), len(keys) + len(nss)))
            keys.extend(self.key_factory(ns, it.sequence_hash) for ns in nss)
        located = self.agent.locate(keys) if keys else []
        for n, (it, (a, b)) in enumerate(zip(group, spans)):
            if a == b:
                out[n] = PlanResult(it, PlanStatus.FAILED, "move item without a sequence hash or destination")
                continue
            found = [p for p in located[a:b] if p is not None]
            old = next((p for p in found if p.volume_id == src), None)
            if old is None:
                where = sorted({p.volume_id for p in found})
                out[n] = PlanResult(it, PlanStatus.SKIPPED, f"no copy on '{src}' any more (catalog: {where})")
            else:
                todo.append((n, old))
        fault: Exception | None = None
        if todo:
            assert dst is not None
            todo, news, fault = self._copy_group(group, todo, dst, out)  # verified, not committed
            used: dict[int, tuple[MoverPublisher, list[int]]] = {}  # publisher -> (it, items it announced)
            dropped_before: dict[int, int] = {}  # publisher -> its dropped events before this group
            for (n, old), new in zip(todo, news):
                it = group[n]
                why = self._stopped()
                if why is not None:
                    self._discard(new)
                    out[n] = PlanResult(it, PlanStatus.SKIPPED, why)
                    continue
                try:
                    committed = (self.agent.commit_move(old, new, fence=self.fence) if self.fence is not None
                                 else self.agent.commit_move(old, new))
                except FencedError as exc:  # the agent released the copy
                    self.fenced = True
                    logger.warning("mover: fenced off (%s); the rest of this round is skipped", exc)
                    out[n] = PlanResult(it, PlanStatus.SKIPPED, f"fenced off: {exc}")
                    continue
                except VersionConflictError as exc:
                    out[n] = PlanResult(it, PlanStatus.SKIPPED, f"concurrent catalog update won: {exc}")
                    continue
                except Exception as exc:  # noqa: BLE001 - the old copy stays in the catalog
                    self._discard(new)
                    out[n] = PlanResult(it, PlanStatus.FAILED, f"commit failed: {type(exc).__name__}: {exc}")
                    continue
                h = old.key.sequence_hash
                info = self.block_info(h)
                parent = info.parent if info is not None else None
                prefix = info.prefix_hash if info is not None else h
                size = committed.length
                meta = {MOVE_KEY: src, "reason": it.kind.value, **self.metadata}
                if self.metadata:
                    meta["catalog_version"] = committed.version
                detail = f"{src} -> {dst} (catalog version {committed.version})"
                try:
                    for pub in self._publishers(h):
                        if id(pub) not in dropped_before:  # once per publisher and group
                            dropped_before[id(pub)] = pub.stats().dropped
                        pub.publish([store(h, prefix, parent, size, dst, meta)])
                        pub.publish([remove(h, prefix, parent, size, src)])
                        used.setdefault(id(pub), (pub, []))[1].append(n)
                except Exception as exc:  # noqa: BLE001 - committed: the move is done, only its news is late
                    self.announce_failed += 1
                    detail += f"; announcing it failed ({type(exc).__name__}: {exc}): the index is repaired " \
                              "from the catalog"
                    logger.warning("mover: block %#x moved %s -> %s but not announced: %s", h, src, dst, exc)
                out[n] = PlanResult(it, PlanStatus.DONE, detail, bytes_moved=size, blocks_moved=1)
            for key, (pub, members) in used.items():
                try:
                    pub.flush()
                except Exception as exc:  # noqa: BLE001 - the moves are committed; the publisher may still deliver
                    self.announce_failed += len(members)
                    logger.warning("mover: flushing the announcements of %d moves failed (%s); the index is "
                                   "repaired from the catalog if they are lost", len(members), exc)
                    continue
                # a transport that gives a batch up (JetStream: no ack within retry_for_s, or a
                # full stream) counts it in stats().dropped and flush() returns normally; each
                # move published two events, so the dropped events bound the moves not announced
                lost = pub.stats().dropped - dropped_before[key]
                if lost > 0:
                    n_lost = min(len(members), lost)
                    self.announce_failed += n_lost
                    logger.warning("mover: the publisher dropped %d events of %d moves' announcements; the index "
                                   "is repaired from the catalog", lost, len(members))
        return [r for r in out if r is not None], fault

    def _copy_group(
        self, group: list[PlanItem], todo: list[tuple[int, Any]], dst: str, out: list[PlanResult | None],
    ) -> tuple[list[tuple[int, Any]], list[Any], Exception | None]:
        """Copy the located blocks ``todo`` ((index in group, old placement)) to ``dst``.

        A block deleted before its read is left out by the agent; when the copy raises,
        the blocks are located again and those the catalog shows changed (deleted, moved,
        quarantined) are SKIPPED and the copy is tried again without them.  A failure with
        every block unchanged is the route's: the rest is FAILED.  Fills ``out`` for the
        blocks dropped; returns the blocks copied, their new placements, and the route's
        fault (or ``None``)."""
        for attempt in range(_GROUP_RETRIES + 1):
            olds = [old for _, old in todo]
            try:
                news = self.agent.copy_many(olds, dst, skip_deleted=True)
            except Exception as exc:  # noqa: BLE001 - sorted below: a block's fault or the route's
                now = self.agent.locate([old.key for old in olds])
                keep = [(t, p) for t, p in zip(todo, now) if p == t[1]]
                if len(keep) == len(todo) or attempt == _GROUP_RETRIES:
                    for n, _ in todo:
                        out[n] = PlanResult(group[n], PlanStatus.FAILED, f"{type(exc).__name__}: {exc}")
                    return [], [], exc
                for (n, old), p in zip(todo, now):
                    if p != old:
                        where = "deleted" if p is None else f"now {p.volume_id} segment {p.segment_id}"
                        out[n] = PlanResult(group[n], PlanStatus.SKIPPED,
                                            f"changed on '{old.volume_id}' while being copied ({where})")
                todo = [t for t, _ in keep]
                if not todo:
                    return [], [], None
                continue
            pairs = []
            for (n, old), new in zip(todo, news):
                if new is None:
                    out[n] = PlanResult(group[n], PlanStatus.SKIPPED,
                                        f"deleted from '{old.volume_id}' before its copy")
                else:
                    pairs.append(((n, old), new))
            return [t for t, _ in pairs], [new for _, new in pairs], None
        raise AssertionError("unreachable")  # pragma: no cover

    def _publishers(self, h: int) -> Sequence[MoverPublisher]:
        return self.publish_to(h) if self.publish_to is not None else [self.publisher]

    def _discard(self, new: Any) -> None:
        discard = getattr(self.agent, "discard", None)
        if discard is not None:
            try:
                discard(new)
            except Exception:  # noqa: BLE001
                logger.exception("mover: could not release an uncommitted copy")
