"""Scaled mode's mover: policy rounds per owned partition, fenced catalog commits (docs/design.md §8).

Each cluster advisor (:class:`advisor.cluster.node.ClusterNode`) started with storage settings
(:class:`ClusterStorageSettings`, ``python -m advisor.cluster --storage FILE``) runs a
:class:`ClusterMover` next to its partition replicas.  It uses the same policy code, planner
and mover as the embedded advisor (``advisor.policy.policies.plan_all``, :class:`~advisor.moves.planner.Planner`,
:class:`~advisor.moves.mover.Mover`), on the shared Redis placement catalog:

* **Which blocks.**  A partition's mover acts only on the blocks of that partition: those
  its index holds, a trunk block (depth below the scheme's ``trunk_depth``; every partition
  holds it) only in partition ``sequence_hash % P``.  A block no owned index knows is left
  alone.  The policies get this rule as ``PolicyInput.movable`` (promotions and swaps pick
  their candidates from the index, where every partition sees the trunk), and every plan
  item is checked against it again: otherwise two partitions would move one trunk block,
  each under its own fence, which then orders nothing between them.  A compaction is done by the owner of partition ``segment_id % P``.
* **Capacity shares.**  Each partition plans against ``1/P`` of every volume's capacity and
  the bytes its own blocks take there, so P movers together keep the fill watermarks
  without talking to each other.
* **Ranking.**  Each partition's replica has its own expert selection
  (:class:`advisor.policy.eviction.experts.LiveSelector`, bounded by ``policy.selector``),
  fed the worker batches the replica folds (not the movers' own, ``<id>-mover``) through
  the embedded advisor's code path (:mod:`advisor.policy.live_selection`); each round
  replays it for the partition's share of the fast volume and ranks that partition's
  promotions and demotions in its leader's order.  The leader is in the partition's
  status (``policy``) and the cluster API's ``/v1/stats``.
* **Fencing.**  On taking partition ``p`` the advisor raises the catalog fence
  ``<namespace>.p<p>`` to its lease token (the JetStream KV revision of its lease,
  :meth:`advisor.cluster.leases.LeaseKeeper.token`, with the bucket's incarnation as the fence's
  epoch, so a lease bucket created again does not leave every owner fenced off), and
  every catalog commit it makes for ``p``
  carries that token (:class:`storage_backends.Fence`, checked in the same Lua script as the
  compare-and-set).  A former owner that has not noticed it lost the lease (paused, cut
  off) is refused by the catalog from then on, so two advisors never both move blocks of
  one partition; the compare-and-set on the placement version keeps any two writers of
  one block from both winning.
* **Announcing.**  A move's Store / Remove go to the block's partition namespace (every
  partition's for a trunk block) under the source ``<advisor id>-mover``, with the
  metadata ``mover`` (advisor id), ``fence`` (token) and ``catalog_version``.
* **Repair.**  Once a taken partition is rebuilt, its mover compares the catalog with the
  index for every block the partition's index knows (trunk blocks included) and publishes,
  to that partition, what a crash between commit and publish left out (a Store, marked
  ``reconciled``: never an access, where the catalog holds a block the index does not place
  there; a Remove where the index places a block on a volume that holds it under no key
  namespace), as the embedded advisor's ``reconcile`` does at start.  Every policy round
  then repairs the differences it saw in the previous round as well (anti-entropy): the
  catalog is the truth for the volumes, and announcements can still go wrong after a
  take-over (a paused former owner publishing a commit it made before the fence rose, a
  worker's delete landing between a move's commit and its publish, a trunk move announced
  in some partitions only); a difference seen once (events in flight) is left alone.  A
  repair publishes nothing once the partition's lease ended during it (the catalog it read
  may predate the next owner's moves); and an advisor that stops repairs every partition it
  still holds once more, without waiting for a second sighting, after its last round
  (:meth:`ClusterMover.repair_before_stop`), so that a stop leaves no difference in the
  logs for as long as nobody owns the partitions.
"""

from __future__ import annotations

import json
import logging
import random
import threading
import time
from collections import deque
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from advisor.index.prefix_index import PLACEMENT_KEYS, PrefixIndex
from advisor.moves.move_guard import MoveGuard
from advisor.moves.mover import Mover
from advisor.policy.plan import PlanKind, PlanResult, PlanStatus
from advisor.moves.planner import Planner
from advisor.policy.eviction.live_scoring import FinishView
from advisor.policy.live_selection import leader_for
from advisor.policy.policies import PolicyInput, PolicySettings, VolumeUsage, plan_all
from advisor.cluster.parts import MOVER_SUFFIX
from advisor.settings import SettingsError, VolumeSettings
from storage_backends.deployment import check_volume_roles
from event_plane.config import StreamLimits
from event_plane.nats_transport import JetStreamPublisher
from event_plane.partitioned import close_all, partition_namespace
from event_plane.schema import EventType, remove, store

if TYPE_CHECKING:
    from advisor.cluster.parts import NodeParts, Replica

__all__ = ["ClusterMover", "ClusterStorageSettings", "trunk_depth_of"]

logger = logging.getLogger(__name__)


class ClusterStorageSettings(BaseModel):
    """The storage a cluster advisor manages (a JSON file: ``--storage FILE``).

    Attributes:
        catalog_prefix: key prefix of the shared Redis placement catalog (the workers' too).
        key_namespaces: block key namespaces (model fingerprints) the advisors manage;
            ``["*"]`` (the default) = every namespace found on the volumes.
        volumes: the volumes to register (as the embedded advisor's ``volumes``).
        fast_volume, slow_volumes, archive_volume: the tiers the policies move between.
        volume_roots: directories the posix volumes must lie under (``None``: anywhere).
        policy: policy and planner settings (as the embedded advisor's).
        policy_interval_s: seconds between policy rounds; ``0`` runs none (repair only).
    """

    model_config = ConfigDict(extra="forbid")

    catalog_prefix: str = Field("kvadvisor:catalog", min_length=1)
    key_namespaces: list[str] = Field(default_factory=lambda: ["*"], min_length=1)
    volumes: list[VolumeSettings] = Field(default_factory=list)
    fast_volume: str | None = None
    slow_volumes: list[str] = Field(default_factory=list)
    archive_volume: str | None = None
    volume_roots: list[str] | None = None
    policy: PolicySettings = Field(default_factory=PolicySettings)
    policy_interval_s: float = Field(30.0, ge=0.0)

    @model_validator(mode="after")
    def _roles_name_volumes(self) -> ClusterStorageSettings:
        check_volume_roles([v.id for v in self.volumes], self.fast_volume, self.slow_volumes, self.archive_volume)
        return self

    @classmethod
    def load(cls, path: str | Path) -> ClusterStorageSettings:
        """Read and validate a JSON settings file.

        Raises:
            SettingsError: the file cannot be read, is not JSON, or does not validate
                (the message names the field; secrets are never echoed).
        """
        try:
            raw = json.loads(Path(path).read_text())
        except (OSError, ValueError) as exc:
            raise SettingsError(f"cluster storage settings {path}: {exc}") from exc
        try:
            return cls.model_validate(raw)
        except ValidationError as exc:
            errs = "; ".join(f"{'.'.join(str(x) for x in e['loc'])}: {e['msg']}" for e in exc.errors())
            raise SettingsError(f"cluster storage settings {path}: {errs}") from None

    def manages(self, key_namespace: str) -> bool:
        """Whether blocks of ``key_namespace`` are the advisors' to move."""
        return "*" in self.key_namespaces or key_namespace in self.key_namespaces

    def managed_volumes(self) -> list[str]:
        """The fast, slow and archive volumes, in that order (each once)."""
        out: list[str] = []
        for v in (self.fast_volume, *self.slow_volumes, self.archive_volume):
            if v is not None and v not in out:
                out.append(v)
        return out


def trunk_depth_of(index: PrefixIndex, sequence_hash: int, trunk_depth: int) -> int | None:
    """Depth of a block (0 = a chain's first block) if it is below ``trunk_depth``, else ``None``.

    Walks the block's parents in ``index``; a block whose ancestry leaves the index before
    reaching a root (its parent lives in another partition) is not in the trunk.
    """
    info = index.block(sequence_hash)
    d = 0
    while info is not None and d < trunk_depth:
        if info.parent is None:
            return d
        info = index.block(info.parent)
        d += 1
    return None


class ClusterMover:
    """Policy rounds, moves and repairs for the partitions one cluster advisor owns.

    Args:
        node: the advisor (its settings, lease keeper and replicas).
        storage: :class:`ClusterStorageSettings`.

    Raises:
        StorageError, SettingsError: the catalog or a volume cannot be opened.
    """

    def __init__(self, node: NodeParts, storage: ClusterStorageSettings) -> None:
        from storage_backends import RedisCatalog, StorageAgent

        s = node.settings
        self.node = node
        self.storage = storage
        self.scheme = s.scheme
        self.source = f"{s.advisor_id}{MOVER_SUFFIX}"
        self.epoch = random.getrandbits(63)
        self.catalog = RedisCatalog(s.redis_url, prefix=storage.catalog_prefix)
        self.agent = StorageAgent(self.catalog, name=f"kvadvisor-{s.advisor_id}",
                                  allowed_roots=[str(Path(r).resolve()) for r in storage.volume_roots]
                                  if storage.volume_roots is not None else None)
        for vol in storage.volumes:
            self.agent.register_volume(vol.to_descriptor())
        self.planner = Planner(storage.policy.planner)
        self.guards: dict[int, MoveGuard] = {}
        self._pubs: list[JetStreamPublisher] | None = None
        self._lock = threading.Lock()  # one round or repair at a time
        # moves_<status>: plan items by result (a compaction that was not done counts there
        # too); compactions: segments rewritten
        self.counters: dict[str, int] = {"rounds": 0, "moves_done": 0, "moves_skipped": 0, "moves_failed": 0,
                                         "compactions": 0, "fenced": 0, "repairs": 0, "repair_events": 0,
                                         "announce_failed": 0}
        self.recent: deque[PlanResult] = deque(maxlen=200)
        # per partition, since this advisor took it: {"done"|"skipped"|"failed": {kind: n},
        # "bytes_moved": {kind: bytes}, "events": announcements published}
        self.by_partition: dict[int, dict[str, dict[str, int]]] = {}

    # ------------------------------------------------------------------ partitions
    def fence_name(self, partition: int) -> str:
        """The catalog fence of ``partition``: ``"<namespace>.p<partition>"``."""
        return f"{self.node.settings.namespace}.p{partition}"

    def take(self, rep: Replica, token: int, epoch: int = 0) -> None:
        """Fence a newly taken partition: raise its catalog fence to ``(epoch, token)`` (the
        lease bucket's incarnation and the lease's revision).  A replica whose fence is
        already higher (a newer owner exists) makes no moves."""
        from storage_backends import Fence

        kinds = {k.value: 0 for k in PlanKind}
        self.by_partition[rep.partition] = {"done": dict(kinds), "skipped": dict(kinds), "failed": dict(kinds),
                                            "bytes_moved": dict(kinds), "rounds": {"policy": 0}}
        rep.fence = Fence(self.fence_name(rep.partition), token, epoch)
        stored = self.catalog.raise_fence(rep.fence)
        rep.fenced = stored > token
        if rep.fenced:
            logger.warning("partition %d: fence at %d above this lease's %d (epoch %d); no moves", rep.partition,
                           stored, token, epoch)

    def raise_fence(self, rep: Replica) -> None:
        """:meth:`take` with the token and epoch of this advisor's lease on ``rep``'s partition,
        when the partition is taken and again while that failed (``rep.take_failed``).

        A replica whose fence could not be raised (the catalog did not answer, the lease was
        gone) serves lookups and makes no moves (``rep.fenced``); each later repair pass and
        policy round calls this again (:meth:`_repairs`).  Without the retry it made none
        for as long as this advisor held the lease, for good on a stable cluster."""
        keeper = self.node.keeper
        token = keeper.token(rep.partition) if keeper is not None else None
        epoch = keeper.epoch(rep.partition) if keeper is not None else None
        retry = rep.take_failed
        try:
            if token is None:
                raise RuntimeError("the lease is gone already")
            self.take(rep, token, epoch or 0)
        except Exception as exc:  # noqa: BLE001 - serve lookups, make no moves until a retry succeeds
            rep.fenced = rep.take_failed = True
            (logger.warning if retry else logger.error)(
                "advisor %s: partition %d: cannot raise its catalog fence, no moves until a retry succeeds: %s",
                self.node.settings.advisor_id, rep.partition, exc)
            return
        rep.take_failed = False
        if retry:
            logger.info("partition %d: catalog fence raised on a retry%s", rep.partition,
                        "; a newer owner holds it, no moves" if rep.fenced else "")

    def _mine(self, rep: Replica, h: int, volume: str | None = None) -> bool:
        """Whether ``h`` is a block of ``rep``'s partition to act on (module docstring); with
        ``volume``, also whether the index already places it there: a block whose Store has
        not been folded yet is not moved, so a move's events always follow the Store they
        supersede in the partition's stream."""
        info = rep.index.block(h)
        if info is None or (volume is not None and volume not in info.locations):
            return False
        if trunk_depth_of(rep.index, h, self.scheme.trunk_depth) is not None:
            return h % self.scheme.partitions == rep.partition
        return True

    def _is_trunk(self, rep: Replica, h: int) -> bool:
        return trunk_depth_of(rep.index, h, self.scheme.trunk_depth) is not None

    def _publishers(self) -> list[JetStreamPublisher]:
        if self._pubs is None:
            s = self.node.settings
            self._pubs = [JetStreamPublisher(self.source, s.nats_url, partition_namespace(s.namespace, k),
                                             epoch=self.epoch, stream=StreamLimits(replicas=s.replicas),
                                             **s.connect_options)
                          for k in range(self.scheme.partitions)]
        return self._pubs

    def _route(self, rep: Replica, trunk: set[int]) -> Any:
        pubs = self._publishers()

        def publish_to(h: int) -> Sequence[JetStreamPublisher]:
            return pubs if h in trunk else [pubs[rep.partition]]
        return publish_to

    # ------------------------------------------------------------------ repair
    def _catalog_view(self) -> dict[str, list[Any]]:
        """Every placement on each managed volume, whatever its key namespace."""
        return {vol: list(self.catalog.iter_volume(vol)) for vol in self.storage.managed_volumes()}

    def repair(self, rep: Replica, view: dict[str, list[Any]] | None = None, confirm: bool = False) -> int:
        """Bring ``rep``'s index to the catalog on the managed volumes (module docstring).

        Every block the partition's index knows is compared, trunk blocks included whatever
        their home partition (a trunk move announced in some partitions only, an advisor
        having died between their publishes, is repaired in each), and the events go to
        this partition only:

        * a Store (metadata ``reconciled``: a placement fact, never an access) where the
          catalog holds the block on a volume (under a managed key namespace) and the index
          does not place it there;
        * a Remove where the index places the block on a volume and the catalog holds it
          there under no key namespace at all (a block of an unmanaged namespace is not
          the mover's to move, but it is on the volume), read again just before.

        ``confirm``: act only on the differences that the previous ``confirm`` call of this
        replica saw as well (policy rounds run it every round: events still in flight, a
        worker's Store after its put, a move announced just now, are never "repaired";
        a difference that stays, a late or lost announcement, a worker's delete landing
        between a move's commit and its publish, is repaired on the next round), and only
        once the replica's fold has applied everything its log holds
        (:meth:`Replica.caught_up`; a fold that lags makes the sighting not count).

        Args:
            view: the catalog's placements per managed volume, read once for a round
                (``None``: read now).

        Returns:
            events published.
        """
        from storage_backends import BlockKey

        st = self.storage
        view = self._catalog_view() if view is None else view
        diffs: set[tuple[str, int, str]] = set()
        lengths: dict[tuple[int, str], int] = {}
        nss = sorted({p.key.namespace for pls in view.values() for p in pls}
                     | {ns for ns in st.key_namespaces if ns != "*"})
        for vol, pls in view.items():
            managed = {p.key.sequence_hash for p in pls if st.manages(p.key.namespace)}
            held = {p.key.sequence_hash for p in pls}
            for p in pls:
                lengths[(p.key.sequence_hash, vol)] = p.length
            with rep.lock:
                placed = rep.index.blocks_at(vol)
                diffs |= {("store", h, vol) for h in managed - placed if rep.index.block(h) is not None}
            gone = sorted(placed - held)
            if gone:  # read again: a put may have landed meanwhile
                keys = [BlockKey(ns, h) for h in gone for ns in nss]
                now = {p.key.sequence_hash for p in self.catalog.get_many(keys) if p is not None and p.volume_id == vol}
                diffs |= {("remove", h, vol) for h in gone if h not in now}
        todo = sorted(diffs & rep.suspects) if confirm else sorted(diffs)
        if confirm and todo and not rep.caught_up():
            # a fold that lags behind its log (a consumer that stalls for seconds after a
            # fail-over, seen in the scaled drill) shows every move announced since as a
            # difference in two rounds running: that is the log's unfolded tail, not a lost
            # announcement.  This sighting does not count (the suspects stay as they were).
            logger.debug("partition %d: fold behind its log; %d differences not confirmed this round",
                         rep.partition, len(todo))
            return 0
        rep.suspects = diffs if confirm else set()
        with rep.lock:
            infos = {h: rep.index.block(h) for _, h, _ in todo}
        if todo and not self._holds(rep):
            # the lease ended while the catalog was being compared (a round can take long:
            # each partition's repair waits for its publish to be acknowledged): the catalog
            # read here may be older than a newer owner's moves, and facts published now
            # would land after them.  The newer owner repairs on take-over.
            logger.warning("partition %d: lease gone during the repair; %d differences left to the next owner",
                           rep.partition, len(todo))
            return 0
        pub = self._publishers()[rep.partition]
        events = []
        for kind, h, vol in todo:
            info = infos.get(h)
            if info is None:
                continue
            if kind == "store":
                events.append(store(h, info.prefix_hash, info.parent, lengths.get((h, vol), info.size), vol,
                                    {PLACEMENT_KEYS[1]: True, "repair": "catalog",
                                     "mover": self.node.settings.advisor_id}))
            else:
                events.append(remove(h, info.prefix_hash, info.parent, info.size, vol))
        if events:
            pub.publish(events)
            pub.flush()
        n = len(events)
        self.counters["repairs"] += 1
        self.counters["repair_events"] += n
        if n:
            logger.warning("partition %d: repaired %d index entries from the catalog (%d stores, %d removes)",
                           rep.partition, n, sum(e.type == EventType.STORE for e in events),
                           sum(e.type == EventType.REMOVE for e in events))
        return n

    def _holds(self, rep: Replica) -> bool:
        """Whether this advisor still acts for ``rep``'s partition: the replica is not
        released and the lease is within its local expiry."""
        if rep.stop_flag.is_set():
            return False
        keeper = self.node.keeper
        return keeper is None or rep.partition in keeper.owned()

    def repair_before_stop(self, timeout_s: float) -> int:
        """The last repair of every partition this advisor still holds, before it stops
        (:meth:`ClusterNode.stop`, after the last policy round, while the leases are held).

        The periodic repair acts on a difference only at its second sighting, so a
        difference that arose in the last round or two before a stop (a move whose
        announcement a NATS fail-over lost, a former owner's announcement that landed
        late, a round slow enough that the second sighting never came) would be left in
        the partition's log for as long as nobody takes the partition over: every index
        rebuilt from the log (snapshot + tail) would miss it.  Here, once a partition's
        fold has applied everything its log holds (waited for up to ``timeout_s`` seconds
        in all; the own announcements are flushed by then), the catalog is compared with
        the index and every difference is repaired at once, as a take-over repair does.
        A partition whose fold does not catch up in time is left to its next owner
        (logged).

        Returns:
            events published.
        """
        deadline = time.monotonic() + timeout_s
        n = 0
        with self._lock:
            for p, rep in sorted(self.node.serving().items()):
                if rep.fenced or not self._holds(rep):
                    continue
                while True:  # the whole wait stays within timeout_s, whatever the server's answers take
                    left = deadline - time.monotonic()
                    if left <= 0 or rep.caught_up(min(0.5, left)):
                        break
                    time.sleep(min(0.05, left))
                if left <= 0:
                    logger.warning("partition %d: its fold did not catch up with the log before the stop; the "
                                   "last repair is left to the next owner", p)
                    continue
                try:
                    n += self.repair(rep)
                except Exception as exc:  # noqa: BLE001 - stopping: the next owner repairs on take-over
                    logger.warning("partition %d: last repair before the stop failed: %s: %s", p,
                                   type(exc).__name__, exc)
        return n

    def run_repairs(self) -> int:
        """Repair every served partition not repaired since it was taken; returns events published."""
        with self._lock:
            return self._repairs(self.node.serving())

    def _repairs(self, reps: dict[int, Replica], view: dict[str, list[Any]] | None = None,
                 periodic: bool = False) -> int:
        """Take-over repairs (at once) of the replicas not repaired yet; with ``periodic``,
        the confirmed repair (:meth:`repair` ``confirm``) of the others too.  Only
        partitions this advisor still holds (local lease expiry) and is not fenced off."""
        n = 0
        owned = self.node.keeper.owned() if self.node.keeper is not None else frozenset()
        for p, rep in sorted(reps.items()):
            if p in owned and rep.take_failed:
                self.raise_fence(rep)
            if rep.fenced or p not in owned:
                continue
            if not rep.repaired:
                n += self.repair(rep, view)
                rep.repaired = True
            elif periodic:
                n += self.repair(rep, view, confirm=True)
        return n

    # ------------------------------------------------------------------ policy rounds
    def run_round(self) -> list[PlanResult]:
        """One policy round over every partition this advisor serves now (repairs first).

        A move route (source, destination) whose copy failed in one partition is not tried
        again in the others this round (``Mover.execute_many``'s ``failed_routes``: an S3
        outage costs one group's client retries per round, ~105 s against 503s, not one
        per partition); once :meth:`ClusterNode.stop` was asked, no further partition
        starts (it waits for the round).

        Returns:
            the results of the executed items, partition by partition.
        """
        with self._lock:
            reps = self.node.serving()
            if not reps:
                return []
            st = self.storage
            view = self._catalog_view()
            self._repairs(reps, view, periodic=True)
            if st.policy_interval_s <= 0:
                return []
            stats = {v.volume_id: v for v in self.agent.stats()}
            managed = st.managed_volumes()
            placements = {v: [p for p in view[v] if st.manages(p.key.namespace)] for v in managed}
            nss = {p.key.namespace for pls in placements.values() for p in pls} | \
                {ns for ns in st.key_namespaces if ns != "*"}
            segments = {v: list(self.agent.segments(v)) for v in managed}
            out: list[PlanResult] = []
            parts = self.scheme.partitions
            failed_routes: set[tuple[str, str | None]] = set()  # shared by the partitions (Mover.execute_many)
            for p, rep in sorted(reps.items()):
                if self.node.stopping():  # stop() waits for the round: end it between partitions
                    break
                owned = self.node.keeper.owned() if self.node.keeper is not None else frozenset()
                if rep.fenced or p not in owned:
                    continue
                # the partition's own expert selection: replayed outside the index lock, for
                # the partition's share of the fast volume (module docstring)
                fast_cap = stats[st.fast_volume].capacity_bytes // parts if st.fast_volume in stats else 0
                leader = leader_for(rep.selector, fast_cap) if rep.selector is not None else None
                guard = self.guards.setdefault(p, MoveGuard(st.policy.planner.min_move_interval_s,
                                                            self._serving_last_access(p)))
                # the guard's view reads the index unlocked: it is asked under rep.lock
                inp = PolicyInput(st.fast_volume, list(st.slow_volumes), st.archive_volume,
                                  movable=lambda h, rep=rep: self._mine(rep, h),  # type: ignore[misc]
                                  held=guard.view(self._last_access(rep, locked=False)),
                                  superseded=rep.selector.superseded if rep.selector is not None else frozenset(),
                                  finish=(FinishView(rep.selector.finish_states(), rep.selector.returns,
                                                     rep.selector.latest_s)
                                          if rep.selector is not None else None))
                with rep.lock:
                    mine = {v: [pl for pl in pls if self._mine(rep, pl.key.sequence_hash, v)]
                            for v, pls in placements.items()}
                    for v in managed:
                        used = sum(pl.length for pl in mine[v])
                        cap = stats[v].capacity_bytes // parts if v in stats else 0
                        inp.usage[v] = VolumeUsage(cap, used, used)
                    if st.fast_volume is not None:
                        inp.fast_placements = mine[st.fast_volume]
                    inp.placements = {v: mine[v] for v in st.slow_volumes}
                    inp.segments = {v: [sg for sg in segs if sg.segment_id % parts == p] for v, segs in segments.items()}
                    proposed = plan_all(st.policy, inp, rep.index, leader)
                    # every move is of a block of this partition, from where the index places it
                    # (the policies' own filter is inp.movable; this keeps any policy honest)
                    proposed = [it for it in proposed if it.sequence_hash is None
                                or self._mine(rep, it.sequence_hash, it.src_volume)]
                    trunk = {it.sequence_hash for it in proposed
                             if it.sequence_hash is not None and self._is_trunk(rep, it.sequence_hash)}
                proposed, _held = guard.filter(proposed)
                plan = self.planner.plan(proposed)
                assert rep.fence is not None
                mover = Mover(self.agent, self._publishers()[p], sorted(nss) or ["default"], self._block_info(rep),
                              self._key_factory(), fence=rep.fence,
                              metadata={"mover": self.node.settings.advisor_id, "fence": rep.fence.token},
                              publish_to=self._route(rep, trunk), abort=self._abort(rep))
                try:
                    results = mover.execute_many(plan.items, failed_routes)
                finally:
                    self.planner.release(len(plan.items))
                guard.record(results)
                self.counters["announce_failed"] += mover.announce_failed
                if mover.fenced:
                    rep.fenced = True
                    self.counters["fenced"] += 1
                part = self.by_partition.get(p)
                for r in results:
                    if part is not None:
                        part[r.status.value][r.item.kind.value] += 1
                        part["bytes_moved"][r.item.kind.value] += r.bytes_moved
                    compacted = r.item.kind is PlanKind.COMPACT and r.status is PlanStatus.DONE
                    kind = "compactions" if compacted else f"moves_{r.status.value}"
                    self.counters[kind] += 1
                    self.recent.append(r)
                if part is not None:
                    part["rounds"]["policy"] += 1
                out.extend(results)
            self.counters["rounds"] += 1
            return out

    def _abort(self, rep: Replica) -> Any:
        """``Mover``'s ``abort``: the partition was released (rebalance, stop, lost) or its
        lease is past its local expiry (a process paused mid-round wakes up): no more moves."""
        keeper = self.node.keeper

        def why() -> str | None:
            if rep.stop_flag.is_set():
                return "partition released: no more moves in this round"
            if keeper is not None and rep.partition not in keeper.owned():
                return "partition lease past its local expiry: no more moves in this round"
            return None
        return why

    @staticmethod
    def _key_factory() -> Any:
        from storage_backends import BlockKey

        return BlockKey

    @staticmethod
    def _block_info(rep: Replica) -> Any:
        def info(h: int) -> Any:
            with rep.lock:
                return rep.index.block(h)
        return info

    @staticmethod
    def _last_access(rep: Replica, locked: bool = True) -> Any:
        """A reader of a block's last access (ns) in ``rep``'s index; ``locked=False`` for a
        caller that holds ``rep.lock`` already."""
        def last(h: int) -> int | None:
            if not locked:
                b = rep.index.block(h)
            else:
                with rep.lock:
                    b = rep.index.block(h)
            return b.last_access_ns if b is not None else None
        return last

    def _serving_last_access(self, p: int) -> Any:
        """A reader of a block's last access (ns) in the replica that serves partition ``p``
        when it is called (``None`` while none does).  A partition's move guard outlives its
        replicas (its record of recent moves holds across a release and a take-back): bound
        to the first replica it read, it compared the accesses of a stopped index, and kept
        that whole index in memory."""
        def last(h: int) -> int | None:
            rep = self.node.serving().get(p)
            return self._last_access(rep)(h) if rep is not None else None
        return last

    def partition_moves(self, partition: int) -> dict[str, dict[str, int]]:
        """What this advisor's mover did for ``partition`` since it took it:
        ``{"done"|"skipped"|"failed"|"bytes_moved": {"promote"|"demote"|"compact": n},
        "rounds": {"policy": n}}`` (``rounds``: the policy rounds that planned this partition,
        so a reader can wait for a round that began after some point; empty when it holds no
        such partition)."""
        got = self.by_partition.get(partition)
        return {k: dict(v) for k, v in got.items()} if got is not None else {}

    def indexed_counts(self, rep: Replica) -> dict[str, int]:
        """Per managed volume, the blocks ``rep``'s index places there that are ``rep``'s own
        (a trunk block, kept by every partition, only in partition ``sequence_hash % P``),
        so that the counts of all partitions add up to the blocks indexed there, each once.
        The caller holds ``rep.lock``; one pass over the blocks placed on each volume."""
        return {v.id: sum(1 for h in rep.index.blocks_at(v.id) if self._mine(rep, h))
                for v in self.storage.volumes}

    def volume_views(self) -> list[dict[str, Any]]:
        """The volumes this mover registered, with their role and usage: ``[{"id", "kind",
        "media", "capacity_bytes", "role" ("fast" | "slow" | "archive" | "none"), "stats":
        storage_backends.VolumeStats fields}]`` by id (usage from the shared catalog's segments,
        so every advisor of a cluster answers the same; ``reads``/``writes`` are this process's)."""
        from dataclasses import asdict

        st = self.storage
        roles = {v: "slow" for v in st.slow_volumes}
        if st.fast_volume is not None:
            roles[st.fast_volume] = "fast"
        if st.archive_volume is not None:
            roles[st.archive_volume] = "archive"
        usage = {u.volume_id: asdict(u) for u in self.agent.stats()}
        return [{"id": v.id, "kind": str(v.kind), "media": str(v.media), "capacity_bytes": int(v.capacity_bytes),
                 "role": roles.get(v.id, "none"), "stats": usage.get(v.id, {})}
                for v in sorted(st.volumes, key=lambda v: v.id)]

    def status(self) -> dict[str, Any]:
        """Counters and the last results (``{"counters", "recent": [[kind, status, detail], ...]}``)."""
        return {"counters": dict(self.counters),
                "recent": [[r.item.kind.value, r.status.value, r.detail] for r in list(self.recent)[-20:]]}

    def close(self) -> None:
        """Flush and close the publishers, then the storage agent."""
        with self._lock:
            if self._pubs is not None:
                try:
                    close_all(self._pubs)
                except Exception as exc:  # noqa: BLE001 - stopping
                    logger.warning("mover publishers: %s", exc)
            self.agent.close()

