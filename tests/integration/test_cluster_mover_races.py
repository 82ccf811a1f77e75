"""Races and odd catalog contents against the scaled mover (advisor/cluster/mover.py), on a
private nats-server (JetStream, lease bucket), Redis (snapshots, placement catalog) and
POSIX volumes through NIXL; one in-process cluster advisor (:class:`ClusterNode` with
storage settings) and "workers" that put blocks into the shared catalog and announce them
through :class:`PartitionedPublisher`, as the worker simulator does.

An interleaving that needs a process to stop at one exact line (a worker's delete landing
right after the mover's commit, an advisor dying between two partitions' publishes) is
made by wrapping the mover's storage agent / publisher in the test, never by faking NATS,
Redis or the volumes.  Checked each time: every partition's index places each block on
exactly the volumes the catalog does (after at most two policy rounds: the mover's
anti-entropy repair acts on a difference seen in two consecutive rounds), and every block
the catalog holds reads back byte for byte.
"""

from __future__ import annotations

import json
import random
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from advisor.cluster.node import ClusterNode, ClusterSettings, wait_until
from advisor.cluster.mover import ClusterStorageSettings
from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_url
from event_plane.schema import remove, store
from event_plane.urls import make_publisher
from storage_backends import BlockKey, Fence, RedisCatalog, StorageAgent
from tests import polling

BLK = 16 << 10
KEY_NS = "m0"


def _data(h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h & 0x7FFFFFFF)
    return torch.randint(0, 256, (BLK,), dtype=torch.uint8, generator=g)


class Rig:
    """One test's namespace, catalog, volumes, worker agent/publishers and advisors."""

    def __init__(self, tmp: Path, js_url: str, redis_url: str, partitions: int,
                 key_namespaces: list[str] | None = None, archive: dict[str, Any] | None = None,
                 slow_bytes: int = 16 << 20, demotion: dict[str, Any] | None = None) -> None:
        self.ns = "r" + uuid.uuid4().hex[:8]
        self.js_url, self.redis_url = js_url, redis_url
        self.scheme = PartitionScheme(partitions, 1, 8)
        for v in ("fast", "slow"):
            (tmp / v).mkdir(parents=True, exist_ok=True)
        self.conf = {
            "catalog_prefix": f"kvadvisor:{self.ns}:catalog",
            "key_namespaces": key_namespaces or [KEY_NS],
            "volumes": [
                {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 4 << 20,
                 "root": str(tmp / "fast"), "segment_bytes": 256 << 10},
                {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": slow_bytes,
                 "root": str(tmp / "slow"), "segment_bytes": 256 << 10},
                *([archive] if archive else []),
            ],
            "fast_volume": "fast", "slow_volumes": ["slow"],
            "archive_volume": archive["id"] if archive else None,
            "volume_roots": [str(tmp)],
            # rounds only when the test runs them (ClusterMover.run_round)
            "policy_interval_s": 3600.0,
            "policy": {"compaction": {"enabled": False}, "demotion": demotion or {}},
        }
        self.storage = ClusterStorageSettings.model_validate(self.conf)
        self.catalog = RedisCatalog(redis_url, prefix=str(self.conf["catalog_prefix"]))
        self.agent = StorageAgent(self.catalog, name="workers", allowed_roots=[str(tmp)])
        for v in self.storage.volumes:
            self.agent.register_volume(v.to_descriptor())
        host = js_url.split("//", 1)[1]
        base = f"jetstream://{host}?namespace={self.ns}"
        self.pubs: dict[str, PartitionedPublisher] = {}
        for w in ("w0", "w1"):
            e = random.getrandbits(63)
            # the workers announce before any advisor starts: their publishers make the stream
            self.pubs[w] = PartitionedPublisher(self.scheme, lambda k, w=w, e=e: make_publisher(
                partition_url(base, k), w, epoch=e, manage_stream=True))
        self.nodes: list[ClusterNode] = []
        self.started: list[ClusterNode] = []  # every advisor this rig started, stopped ones too

    # -------------------------------------------------------------- workers
    def announce(self, w: str, events: list[Any]) -> None:
        self.pubs[w].publish(events)
        self.pubs[w].flush()

    def offload(self, chain: list[int], key_ns: str = KEY_NS, announce_slow: bool = True, hot: bool = True) -> None:
        """Both workers compute the chain (w1 reports 2 more hits: hot enough to promote;
        ``hot=False``: only w0, cold), w0 puts it on ``slow`` and (unless told not to)
        announces that."""
        self.announce("w0", [store(h, chain[0], chain[d - 1] if d else None, BLK, "g1") for d, h in enumerate(chain)])
        if hot:
            self.announce("w1", [store(h, chain[0], chain[d - 1] if d else None, BLK, "g1", {"hits": 2})
                                 for d, h in enumerate(chain)])
        self.agent.put([(BlockKey(key_ns, h), _data(h)) for h in chain], "slow")
        if announce_slow:
            self.announce("w0", [store(h, chain[0], chain[d - 1] if d else None, BLK, "slow")
                                 for d, h in enumerate(chain)])

    # -------------------------------------------------------------- advisors
    def start(self, adv: str = "a0") -> ClusterNode:
        node = ClusterNode(ClusterSettings(
            nats_url=self.js_url, redis_url=self.redis_url, advisor_id=adv, scheme=self.scheme,
            namespace=self.ns, lease_ttl_s=3.0, heartbeat_s=0.5, snapshot_interval_s=3600.0), self.storage).start()
        self.nodes.append(node)
        self.started.append(node)
        assert wait_until(lambda: len(node.serving()) == self.scheme.partitions
                          and all(r.repaired or r.fenced for r in node.serving().values()), 30), node.status()
        return node

    def stop(self, node: ClusterNode) -> None:
        node.stop()
        self.nodes.remove(node)

    # -------------------------------------------------------------- checks
    def folded(self, node: ClusterNode, timeout: float = 60.0) -> None:
        """Wait until every partition ``node`` serves has folded every batch sent to it so
        far: the workers' and the movers' of every advisor this rig started (each source's
        last applied batch seq reaches what its publisher sent)."""
        feeds = [(k, pub) for w in self.pubs.values() for k, pub in enumerate(w.publishers)]
        feeds += [(k, pub) for n in self.started for k, pub in enumerate(n.mover._pubs or [])]

        def behind() -> list[tuple[int, str, int, int]]:
            late = []
            for p, rep in node.serving().items():
                with rep.lock:
                    known = {name: (st.epoch, st.last_seq) for name, st in rep.index.sources().items()}
                for k, pub in feeds:
                    sent = pub.next_seq - 1
                    got = known.get(pub.source)
                    if k == p and sent >= 0 and (got is None or got[0] != pub.epoch or got[1] < sent):
                        late.append((p, pub.source, got[1] if got else -1, sent))
            return late
        polling.wait_until(lambda: not behind(), timeout, f"the folds of {node.status()['advisor']} ({behind()})")

    @staticmethod
    def locations(node: ClusterNode, p: int, h: int) -> set[str] | None:
        rep = node.serving()[p]
        with rep.lock:
            b = rep.index.block(h)
            return set(b.locations) if b is not None else None

    @staticmethod
    def hits(node: ClusterNode, p: int, h: int) -> tuple[int, int]:
        rep = node.serving()[p]
        with rep.lock:
            b = rep.index.block(h)
            assert b is not None
            return b.hits, b.last_access_ns

    def mismatches(self, node: ClusterNode) -> list[tuple[int, str, int, int]]:
        """``(partition, volume, index-only, catalog-only)`` for every partition whose index
        disagrees with the catalog on a volume, over the blocks that index knows."""
        out = []
        for p, rep in sorted(node.serving().items()):
            for v in self.storage.managed_volumes():
                held = {pl.key.sequence_hash for pl in self.catalog.iter_volume(v)}
                with rep.lock:
                    known = set(rep.index.hashes())
                    placed = rep.index.blocks_at(v)
                extra, missing = placed - held, (held & known) - placed
                if extra or missing:
                    out.append((p, v, len(extra), len(missing)))
        return out

    def settle(self, node: ClusterNode, rounds: int = 3) -> list[tuple[int, str, int, int]]:
        """Policy rounds (each after the log is folded), then the mismatches left."""
        for _ in range(rounds):
            self.folded(node)
            node.mover.run_round()
        self.folded(node)
        return self.mismatches(node)

    def read_back(self) -> None:
        for v in self.storage.managed_volumes():
            pls = list(self.catalog.iter_volume(v))
            got = self.agent.get([pl.key for pl in pls])
            for pl, t in zip(pls, got):
                assert torch.equal(t, _data(pl.key.sequence_hash)), f"{pl.key} does not read back"

    def close(self) -> None:
        for node in list(self.nodes):
            node.stop()
        for pub in self.pubs.values():
            pub.close()
        self.agent.close()
        self.catalog.destroy()
        self.catalog.close()
        import redis

        r = redis.Redis.from_url(self.redis_url)
        for key in r.scan_iter(f"kvadvisor:{self.ns}:*"):
            r.delete(key)
        r.close()


@pytest.fixture
def rig_factory(tmp_path: Path, js_url: str, redis_url: str) -> Iterator[Any]:
    made: list[Rig] = []

    def make(partitions: int = 2, key_namespaces: list[str] | None = None, **kw: Any) -> Rig:
        r = Rig(tmp_path / f"rig{len(made)}", js_url, redis_url, partitions, key_namespaces, **kw)
        made.append(r)
        return r
    yield make
    for r in made:
        r.close()


def _chain(n: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.getrandbits(63) for _ in range(n)]


def test_a_worker_delete_landing_after_the_move_commit_leaves_no_resurrected_block(rig_factory: Any) -> None:
    """Attack 2: the worker deletes a block (catalog delete + Remove at the volume it knows,
    ``slow``) right after the mover committed its promotion; the mover then announces Store
    ``fast`` / Remove ``slow``.  The index would place the block on ``fast`` for ever while
    the catalog has it nowhere, unless the mover repairs the difference."""
    rig = rig_factory(partitions=2)
    chain = _chain(4, 1)
    rig.offload(chain)
    node = rig.start()
    victim = chain[2]  # a non-trunk block
    real_commit = node.mover.agent.commit_move
    deleted: list[int] = []

    def commit_then_worker_deletes(old: Any, new: Any, fence: Any = None) -> Any:
        done = real_commit(old, new, fence)
        if old.key.sequence_hash == victim and not deleted:
            deleted.append(victim)
            assert rig.agent.delete([BlockKey(KEY_NS, victim)]) == 1
            rig.announce("w0", [remove(victim, chain[0], chain[1], BLK, "slow")])
        return done

    node.mover.agent.commit_move = commit_then_worker_deletes  # type: ignore[method-assign]
    rig.folded(node)
    results = node.mover.run_round()
    node.mover.agent.commit_move = real_commit  # type: ignore[method-assign]
    assert deleted == [victim], [(r.item.kind.value, r.status.value, r.detail) for r in results]
    assert rig.catalog.get(BlockKey(KEY_NS, victim)) is None
    assert rig.settle(node) == []
    home = rig.scheme.owners(chain)[2]
    assert not ({"fast", "slow"} & (rig.locations(node, home, victim) or set())), "the deleted block came back"
    rig.read_back()


def test_a_trunk_move_announced_in_some_partitions_only_is_repaired_everywhere(rig_factory: Any) -> None:
    """Attack 5: the mover dies between the publishes of a trunk block's move (its home
    partition heard Store ``fast`` / Remove ``slow``, the others did not).  A later owner
    must bring every partition's index to the catalog's placement, not only the home's."""
    rig = rig_factory(partitions=2)
    chain = _chain(3, 2)
    rig.offload(chain)
    node = rig.start()
    root = chain[0]  # depth 0: a trunk block, held in both partitions
    home, other = root % 2, 1 - root % 2
    rig.folded(node)
    pubs = node.mover._publishers()
    real = pubs[other].publish
    pubs[other].publish = lambda events: None  # type: ignore[method-assign]  # the advisor died before these
    try:
        node.mover.run_round()
    finally:
        pubs[other].publish = real  # type: ignore[method-assign]
    pl = rig.catalog.get(BlockKey(KEY_NS, root))
    assert pl is not None and pl.volume_id == "fast"
    rig.folded(node)
    assert "fast" in (rig.locations(node, home, root) or set())
    assert "slow" in (rig.locations(node, other, root) or set())  # the partial announcement
    rig.stop(node)  # its partitions go to the next owner, which repairs on take-over
    node = rig.start("a1")
    rig.folded(node)
    assert rig.mismatches(node) == [], "a take-over left a partition's trunk entry stale"
    for p in (home, other):
        assert {"fast", "slow"} & (rig.locations(node, p, root) or set()) == {"fast"}, p
    rig.read_back()


def test_a_repair_store_is_not_an_access(rig_factory: Any) -> None:
    """Attack 3/5: the take-over repair announces a block the catalog holds on ``slow``
    (the worker died between its put and its Store); that Store is a placement fact, not
    a reuse: the block's hits and last access must not change (they drive promotion)."""
    rig = rig_factory(partitions=2)
    chain = _chain(3, 3)
    evs = [store(h, chain[0], chain[d - 1] if d else None, BLK, "g1") for d, h in enumerate(chain)]
    rig.announce("w0", evs)  # one access each
    h, twin = chain[2], chain[1]  # announced alike, in one batch; only h was put
    rig.agent.put([(BlockKey(KEY_NS, h), _data(h))], "slow")  # never announced
    time.sleep(0.5)  # time passes: a Store counted as an access would show in last_access_ns
    node = rig.start()
    p = rig.scheme.owners(chain)[2]
    assert p == rig.scheme.owners(chain)[1]
    assert wait_until(lambda: "slow" in (rig.locations(node, p, h) or set()), 10)
    rig.folded(node)
    assert rig.hits(node, p, h) == rig.hits(node, p, twin), "the repair's Store counted as an access"
    assert node.mover.counters["repair_events"] >= 1


def test_a_block_of_an_unmanaged_namespace_is_never_removed_by_the_repair(rig_factory: Any) -> None:
    """Attack 4: the catalog holds a block on ``slow`` under a key namespace the advisors do
    not manage (another model's), and a worker announced it there.  The block is not the
    mover's to move, but it IS on the volume: a repair must not announce it gone."""
    rig = rig_factory(partitions=2, key_namespaces=[KEY_NS])
    chain = _chain(3, 4)
    rig.offload(chain, key_ns="other-model")
    node = rig.start()
    rig.folded(node)
    node.mover.run_round()
    rig.folded(node)
    for d, h in enumerate(chain):
        for p in range(2):
            locs = rig.locations(node, p, h)
            if locs is not None:
                assert "slow" in locs, (d, p, locs)
    assert rig.catalog.get(BlockKey("other-model", chain[1])).volume_id == "slow"


def test_a_trunk_block_is_moved_by_its_home_partition_only(rig_factory: Any) -> None:
    """Attack 5 (found by test_cluster_mover_pause.py): a trunk block is in every
    partition's index, and the promotion policy picks its candidates from the index, so
    every partition's mover promoted it, each under its own fence: two writers of one block
    that the fences do not order (a former owner's stale commit of partition B is not
    refused by partition A's fence).  Only ``sequence_hash % P`` may plan it."""
    rig = rig_factory(partitions=4)
    chains = [_chain(3, 10 + i) for i in range(6)]
    for c in chains:
        rig.offload(c)
    node = rig.start()
    real_commit = node.mover.agent.commit_move
    fences: dict[int, list[str]] = {}  # block -> the fences its commits carried

    def commit(old: Any, new: Any, fence: Any = None) -> Any:
        fences.setdefault(old.key.sequence_hash, []).append(fence.name)
        return real_commit(old, new, fence)

    node.mover.agent.commit_move = commit  # type: ignore[method-assign]
    rig.folded(node)
    node.mover.run_round()
    roots = {c[0] for c in chains}
    assert roots <= fences.keys(), "the hot roots were not promoted"
    wrong = {h: f for h, f in fences.items() if h in roots and set(f) != {node.mover.fence_name(h % 4)}}
    assert not wrong, f"trunk blocks moved under another partition's fence: {wrong}"
    rig.folded(node)
    assert rig.settle(node, rounds=2) == []
    rig.read_back()


def test_a_take_over_repair_racing_a_worker_delete_leaves_no_stale_entry(rig_factory: Any) -> None:
    """Attack 3: the take-over repair read the catalog (the block on ``slow``, its Store not
    folded yet), then the worker deleted the block and announced the Remove, then the
    repair published its Store: a stale index entry is created.  It must not be left: the
    owner's rounds repair it (seen in two consecutive rounds)."""
    rig = rig_factory(partitions=2)
    chain = _chain(4, 7)
    node = rig.start()
    rig.offload(chain, announce_slow=False)  # put, the Store not sent yet
    rig.folded(node)
    h = chain[2]
    p = rig.scheme.owners(chain)[2]
    rep = node.serving()[p]
    view = node.mover._catalog_view()  # the repair reads the catalog ...
    assert rig.agent.delete([BlockKey(KEY_NS, h)]) == 1  # ... the worker deletes and says so ...
    rig.announce("w0", [remove(h, chain[0], chain[1], BLK, "slow")])
    rig.folded(node)
    with node.mover._lock:
        assert node.mover.repair(rep, view) >= 1  # ... and the repair announces what it read
    assert wait_until(lambda: "slow" in (rig.locations(node, p, h) or set()), 5), "no stale entry was made"
    assert rig.settle(node) == []
    assert "slow" not in (rig.locations(node, p, h) or set())
    rig.read_back()


def test_an_owner_frozen_mid_round_is_fenced_off_by_the_real_lease_tokens(rig_factory: Any) -> None:
    """Attack 1, at one exact line: advisor a0 is frozen between a move's copy and its
    commit (as SIGSTOP would freeze it), its leases expire (its keeper dies without a
    word), advisor b0 takes both partitions, raising their catalog fences to its JetStream
    lease revisions; then a0 wakes up and commits.  The catalog refuses it (FencedError),
    the copy's space is released, nothing is announced, the rest of a0's round is skipped;
    b0 then moves the same blocks, and the index matches the catalog."""
    rig = rig_factory(partitions=2)
    chains = [_chain(3, 20 + i) for i in range(4)]
    for c in chains:
        rig.offload(c)
    a0 = rig.start("a0")
    rig.folded(a0)
    real_commit = a0.mover.agent.commit_move
    frozen, wake = threading.Event(), threading.Event()
    first: list[Any] = []

    def freeze_then_commit(old: Any, new: Any, fence: Any = None) -> Any:
        if not first:
            first.append((old, fence))
            frozen.set()
            wake.wait(60)
        return real_commit(old, new, fence)

    a0.mover.agent.commit_move = freeze_then_commit  # type: ignore[method-assign]
    out: list[Any] = []
    t = threading.Thread(target=lambda: out.extend(a0.mover.run_round()), daemon=True)
    t.start()
    assert frozen.wait(30), "a0 planned no move"
    old, stale_fence = first[0]
    assert a0.keeper is not None
    a0.keeper.crash()  # its leases run out in the bucket; it does not notice (frozen)
    b0 = rig.start("b0")
    assert b0.keeper is not None
    new_tokens = {p: b0.keeper.token(p) for p in range(2)}
    assert all(tok is not None and tok > stale_fence.token for tok in new_tokens.values()), new_tokens
    wake.set()
    t.join(60)
    assert not t.is_alive()
    frozen_results = [r for r in out if r.item.sequence_hash == old.key.sequence_hash]
    assert [r.status.value for r in frozen_results] == ["skipped"], frozen_results
    assert "fenced off" in frozen_results[0].detail
    assert a0.mover.counters["fenced"] >= 1
    assert all(r.status.value != "done" for r in out), [(r.item, r.status, r.detail) for r in out]
    assert rig.catalog.get(old.key) == old, "a stale owner's commit landed"
    fast = {s.volume_id: s for s in rig.agent.stats()}["fast"]
    assert fast.live_bytes == 0, "the fenced copy is still live"
    rig.folded(b0)
    done = [r for r in b0.mover.run_round() if r.status.value == "done"]
    assert old.key.sequence_hash in {r.item.sequence_hash for r in done}
    assert rig.settle(b0) == []
    rig.read_back()


def test_s3_down_mid_demotion_fails_the_items_clearly_and_loses_nothing(rig_factory: Any, local_s3: Any,
                                                                       proxy: Any) -> None:
    """Attack 4: the archive's S3 endpoint refuses every PUT while a round demotes cold
    blocks from a full ``slow`` to it, in both partitions.  The first group fails with the
    S3 error in its detail, the other partition's is not tried again this round (with a
    503 instead of a 403, each try of a group costs ~105 s of retries in the S3 client: an
    outage would stall the round that long per group), the round and the advisor go on,
    the blocks stay on ``slow`` (catalog, index, bytes); once S3 is back, the next round
    demotes them."""
    archive = {"id": "archive", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30,
               "endpoint": proxy.endpoint, "bucket": f"kvadvisor-races-{uuid.uuid4().hex[:8]}", "prefix": "kv",
               "segment_bytes": 256 << 10, "access_key": local_s3.access_key, "secret_key": local_s3.secret_key}
    # 512 KiB (32 blocks) of slow per partition, demoted from 30 % (10 blocks): each
    # partition's ~24 cold blocks are well above
    rig = rig_factory(partitions=2, archive=archive, slow_bytes=1 << 20,
                      demotion={"high_watermark": 0.3, "low_watermark": 0.1})
    chains = [_chain(4, 40 + i) for i in range(12)]
    for c in chains:
        rig.offload(c, hot=False)
    node = rig.start()
    rig.folded(node)
    before = {pl.key: pl for pl in rig.catalog.iter_volume("slow")}
    proxy.set_rule(lambda m, p, n: 403 if m == "PUT" else None)
    t0 = time.monotonic()
    results = node.mover.run_round()
    print(f"round with S3 down: {time.monotonic() - t0:.1f} s, {len(proxy.requests)} requests")
    demotes = [r for r in results if r.item.kind.value == "demote" and r.item.dst_volume == "archive"]
    assert demotes, [(r.item.kind.value, r.status.value, r.detail) for r in results]
    failed = [r for r in demotes if r.status.value == "failed"]
    # the first group tried S3 and failed with its error; the other partition's group was
    # not tried again in this round (an S3 outage costs one group's retries per round)
    assert failed and all("Error" in r.detail for r in failed), [(r.status.value, r.detail) for r in demotes]
    rest = demotes[len(failed):]
    assert demotes[:len(failed)] == failed
    assert rest and all(r.status.value == "skipped" and "failed earlier in this round" in r.detail for r in rest), \
        [(r.status.value, r.detail) for r in rest]
    assert {pl.key: pl for pl in rig.catalog.iter_volume("slow")} == before
    assert list(rig.catalog.iter_volume("archive")) == []
    assert node.mover.counters["moves_failed"] >= len(failed)
    assert node.mover.counters["moves_skipped"] >= len(rest)
    rig.folded(node)
    assert rig.mismatches(node) == []
    rig.read_back()
    proxy.set_rule(lambda m, p, n: None)
    t0 = time.monotonic()
    done = [r for r in node.mover.run_round() if r.status.value == "done" and r.item.dst_volume == "archive"]
    print(f"round with S3 back: {time.monotonic() - t0:.1f} s")
    assert done, "no demotion once S3 was back"
    assert rig.settle(node) == []
    rig.read_back()


@pytest.mark.parametrize("case", ["bad bucket", "s3 down", "root outside"])
def test_storage_that_cannot_be_opened_stops_the_advisor_with_one_clear_line(tmp_path: Path, redis_url: str,
                                                                              case: str) -> None:
    """Attack 4: settings that validate but name storage that cannot be opened (a bucket
    name S3 refuses, an S3 endpoint that does not answer, a volume outside
    ``volume_roots``) stop the cluster advisor at start with ``error: ...`` naming the
    volume and exit code 2, as a malformed settings file does, not with a traceback."""
    vols: list[dict[str, Any]] = [{"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 1 << 20,
                                   "root": str(tmp_path / "fast")}]
    if case == "root outside":
        vols[0]["root"] = "/tmp/kvadvisor-outside-" + uuid.uuid4().hex[:6]
    else:
        vols.append({"id": "archive", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30,
                     "endpoint": "http://127.0.0.1:1", "bucket": "b" if case == "bad bucket" else "kv-archive",
                     "access_key": "k", "secret_key": "SECRET-never-echoed"})
    prefix = f"kvadvisor:start-{uuid.uuid4().hex[:8]}:catalog"
    conf = {"catalog_prefix": prefix, "volumes": vols, "fast_volume": "fast", "volume_roots": [str(tmp_path)]}
    f = tmp_path / "s.json"
    f.write_text(json.dumps(conf))
    try:
        r = subprocess.run([sys.executable, "-m", "advisor.cluster", "--nats", "nats://127.0.0.1:1", "--redis",
                            redis_url, "--id", "a", "--storage", str(f)], capture_output=True, text=True, timeout=120,
                           cwd=Path(__file__).resolve().parents[2])
    finally:
        cat = RedisCatalog(redis_url, prefix=prefix)
        cat.destroy()
        cat.close()
    expect = {"bad bucket": "not a valid S3 bucket name", "s3 down": "unreachable",
              "root outside": "allowed"}[case]
    assert r.returncode == 2, (r.returncode, r.stderr[-2000:])
    assert "Traceback" not in r.stderr and expect in r.stderr, r.stderr[-2000:]
    assert "SECRET-never-echoed" not in r.stderr
    last = r.stderr.strip().splitlines()[-1]
    assert last.startswith("error: ") and expect in last, last


def test_a_recreated_lease_bucket_does_not_fence_off_every_new_owner(rig_factory: Any) -> None:
    """Attack 5: the JetStream data is lost (a new NATS cluster, the lease bucket deleted),
    the Redis catalog, the storage's truth, is kept.  The fences in the catalog hold the old
    bucket's revisions; a new owner's lease revision is small again, and would be refused
    until the new bucket's revisions pass the old ones, unless the fence's epoch (the
    bucket's creation time) ranks the new bucket above."""
    import asyncio

    import nats

    rig = rig_factory(partitions=2)
    chains = [_chain(3, 60 + i) for i in range(3)]
    for c in chains:
        rig.offload(c)

    async def churn_then(delete: bool) -> None:
        nc = await nats.connect(rig.js_url)
        js = nc.jetstream()
        if delete:
            await js.delete_key_value("KVADVISOR_LEASES")
        else:  # a bucket that has lived a while: revisions in the hundreds
            from nats.js.api import KeyValueConfig

            kv = await js.create_key_value(KeyValueConfig(bucket="KVADVISOR_LEASES", history=1, ttl=3.0))
            for i in range(200):
                await kv.put("churn", str(i).encode())
        await nc.close()

    asyncio.run(churn_then(delete=False))
    a0 = rig.start("a0")
    assert a0.keeper is not None and min(a0.keeper.token(p) or 0 for p in range(2)) > 200
    old_epoch = a0.keeper.epoch(0)
    assert old_epoch, "the server did not report the bucket's creation time"
    rig.stop(a0)
    time.sleep(3.5)  # its leases and membership are gone
    asyncio.run(churn_then(delete=True))  # the lease bucket is lost; the catalog is kept
    b0 = rig.start("b0")
    assert b0.keeper is not None and max(b0.keeper.token(p) or 0 for p in range(2)) < 200
    rig.folded(b0)
    done = [r for r in b0.mover.run_round() if r.status.value == "done"]
    assert done, f"no move: partitions fenced {[r.fenced for r in b0.serving().values()]}"
    # and the former bucket's owner, were it still running, is fenced off by b0's fences
    a0_fence = Fence(b0.mover.fence_name(0), 10_000, old_epoch)
    assert rig.catalog.raise_fence(a0_fence) > a0_fence.token
    assert rig.settle(b0) == []
    rig.read_back()


def test_a_partition_released_mid_round_makes_no_more_moves(rig_factory: Any) -> None:
    """Attack 5: the lease keeper releases a partition (rebalance, loss) while the mover's
    round is moving its blocks.  The leases promise that a released partition is no longer
    used once ``on_release`` returned; the round must stop moving its blocks at the next
    commit (the fence alone only stops it once the next owner raised it)."""
    rig = rig_factory(partitions=1)
    chains = [_chain(3, 80 + i) for i in range(4)]
    for c in chains:
        rig.offload(c)
    node = rig.start()
    real_commit = node.mover.agent.commit_move
    commits: list[int] = []

    def commit(old: Any, new: Any, fence: Any = None) -> Any:
        commits.append(old.key.sequence_hash)
        if len(commits) == 1:
            node._release(0, "rebalance")  # what the keeper's on_release does
        return real_commit(old, new, fence)

    node.mover.agent.commit_move = commit  # type: ignore[method-assign]
    rig.folded(node)
    results = node.mover.run_round()
    assert len(results) > 2, [(r.item.kind.value, r.status.value) for r in results]
    assert len(commits) == 1, f"{len(commits)} commits after the partition was released"
    assert [r.status.value for r in results].count("done") == 1
    rest = [r for r in results if r.status.value != "done"]
    assert all(r.status.value == "skipped" and "released" in r.detail for r in rest), \
        [(r.status.value, r.detail) for r in rest]
    fast = {s.volume_id: s for s in rig.agent.stats()}["fast"]
    assert fast.blocks == 1 and fast.live_bytes == BLK, "copies of the skipped moves are still live"
    rig.read_back()


def test_stop_during_a_round_ends_it_after_the_partition_in_progress(rig_factory: Any) -> None:
    """Attack 5: ``ClusterNode.stop()`` while a round is moving partition 0's blocks.  Stop
    waits for the round (no move after the leases go), and the round starts no further
    partition once stop was asked; the advisor then stops, and what it committed is
    announced (index == catalog after the next owner's take-over)."""
    rig = rig_factory(partitions=2)
    chains = [_chain(3, 90 + i) for i in range(6)]
    for c in chains:
        rig.offload(c)
    node = rig.start()
    real_commit = node.mover.agent.commit_move
    fences: list[str] = []
    stopping = threading.Event()

    def commit(old: Any, new: Any, fence: Any = None) -> Any:
        fences.append(fence.name)
        if len(fences) == 1:
            threading.Thread(target=lambda: (stopping.set(), rig.stop(node)), daemon=True).start()
            assert wait_until(node._stop.is_set, 10)
        return real_commit(old, new, fence)

    node.mover.agent.commit_move = commit  # type: ignore[method-assign]
    rig.folded(node)
    node.mover.run_round()
    assert stopping.is_set()
    assert wait_until(lambda: node not in rig.nodes, 60), "stop did not finish after the round"
    assert set(fences) == {node.mover.fence_name(0)}, f"partitions moved after stop was asked: {sorted(set(fences))}"
    b0 = rig.start("b0")
    rig.folded(b0)
    assert rig.mismatches(b0) == []
    rig.read_back()


def _rebuilt(rig: Rig, p: int) -> Any:
    """Partition ``p`` as any later owner or reader rebuilds it: its newest Redis snapshot,
    then its log's tail."""
    from advisor.index.snapshot import RedisSnapshotStore, load_latest
    from event_plane.partitioned import partition_namespace
    from tests.logs import fold_log

    snaps = RedisSnapshotStore(rig.redis_url, key_prefix=f"kvadvisor:{rig.ns}:p{p}")
    try:
        loaded = load_latest(snaps)
    finally:
        snaps.close()
    pos = loaded[0].position if loaded else 0
    return fold_log(rig.js_url, partition_namespace(rig.ns, p), start_seq=pos + 1,
                    index=loaded[1] if loaded else None)


def test_a_move_whose_announcement_was_lost_is_in_the_log_after_a_graceful_stop(rig_factory: Any) -> None:
    """Attack 5, the scaled drill's end (test_cluster_scaled: blocks the catalog places on
    ``fast`` that no rebuilt partition places there): promotions committed in the catalog
    whose announcements reached no partition log (a NATS fail-over lost the batch), then
    the owner is stopped gracefully before its anti-entropy saw the difference a second
    time, and nobody takes the partitions over.  Every index rebuilt from a partition's
    snapshot and log tail must still place each block where the catalog does: the stop
    leaves the logs matching the catalog while it still holds the leases."""
    rig = rig_factory(partitions=2)
    for i in range(3):
        rig.offload(_chain(3, 100 + i))
    node = rig.start()
    rig.folded(node)
    pubs = node.mover._publishers()
    real = [pub.publish for pub in pubs]
    for pub in pubs:
        pub.publish = lambda events: None  # type: ignore[method-assign]  # the fail-over lost them
    try:
        results = node.mover.run_round()
    finally:
        for pub, publish in zip(pubs, real):
            pub.publish = publish  # type: ignore[method-assign]
    promoted = {r.item.sequence_hash for r in results if r.status.value == "done" and r.item.kind.value == "promote"}
    assert promoted, [(r.item.kind.value, r.status.value, r.detail) for r in results]
    on_fast = {pl.key.sequence_hash for pl in rig.catalog.iter_volume("fast")}
    assert promoted <= on_fast
    rig.folded(node)
    assert any(rig.mismatches(node)), "the lost announcements should leave the indexes behind the catalog"
    rig.stop(node)  # SIGTERM: the last round is over, nobody owns the partitions afterwards
    for p in range(rig.scheme.partitions):
        idx = _rebuilt(rig, p)
        known = set(idx.hashes())
        for v in rig.storage.managed_volumes():
            held = {pl.key.sequence_hash for pl in rig.catalog.iter_volume(v)}
            placed = idx.blocks_at(v)
            assert not placed - held and not (held & known) - placed, \
                (p, v, sorted(f"{h:#x}" for h in placed - held), sorted(f"{h:#x}" for h in (held & known) - placed))
    rig.read_back()


def _one_partition_started(rig_factory: Any, seed: int) -> tuple[Rig, ClusterNode, Any]:
    """A one-partition rig with three hot 3-block chains offloaded (chains ``seed`` ..
    ``seed + 2``), its advisor started and folded: ``(rig, node, the partition's replica)``."""
    rig = rig_factory(partitions=1)
    for i in range(3):
        rig.offload(_chain(3, seed + i))
    node = rig.start()
    rig.folded(node)
    return rig, node, node.serving()[0]


def test_a_fold_lagging_behind_its_log_makes_no_repairs(rig_factory: Any) -> None:
    """Attack 5 (seen in the scaled drill: a partition's consumer delivers nothing for
    seconds after a fail-over, while the owner's rounds go on): the owner's moves are in
    the partition's log, its fold has not applied them yet.  Two rounds running then see
    the same difference between the catalog and the index; that is the log's tail not yet
    folded, not a lost announcement, and the anti-entropy must not publish catalog reads
    into the log again for it (each round, as long as the fold lags).  Once the fold
    catches up, index == catalog without any repair."""
    rig, node, rep = _one_partition_started(rig_factory, 110)
    real_get = rep.log.get
    stalled = threading.Event()
    stalled.set()

    def get(timeout: float | None = None) -> Any:  # the consumer delivers nothing meanwhile
        if stalled.is_set():
            time.sleep(timeout or 0.0)
            return None
        return real_get(timeout)

    rep.log.get = get  # type: ignore[method-assign]
    try:
        results = node.mover.run_round()
        assert any(r.status.value == "done" for r in results), [(r.item.kind.value, r.status.value) for r in results]
        before = node.mover.counters["repair_events"]
        for _ in range(3):
            node.mover.run_round()
        assert node.mover.counters["repair_events"] == before, "moves in the log's unfolded tail were 'repaired'"
    finally:
        stalled.clear()
        rep.log.get = real_get  # type: ignore[method-assign]
    rig.folded(node)
    assert rig.mismatches(node) == []
    rig.read_back()


def test_a_partition_taken_back_is_guarded_with_its_new_index(rig_factory: Any) -> None:
    """A partition's move guard outlives its replica (its record of recent moves holds across
    a release and a take-back).  It must read block accesses from the replica that serves
    the partition now: bound to the first one, it compared a stopped index's accesses and
    kept that whole index alive."""
    import gc
    import weakref

    rig = rig_factory(partitions=1)
    rig.offload(_chain(3, 120))
    node = rig.start()
    rig.folded(node)
    node.mover.run_round()  # the partition's guard is made here
    first = weakref.ref(node.serving()[0])
    node._release(0, "rebalance")
    assert node._acquire(0)
    assert wait_until(lambda: 0 in node.serving(), 60), "the partition served again"
    rig.folded(node)
    node.mover.run_round()
    gc.collect()
    assert first() is None, "the stopped replica is still referenced"
    h = _chain(3, 120)[0]
    with node.serving()[0].lock:
        want = node.serving()[0].index.block(h)
    assert want is not None
    assert node.mover.guards[0]._last_access(h) == want.last_access_ns
    rig.read_back()


def test_a_fence_that_could_not_be_raised_at_take_over_is_raised_on_a_later_round(
        rig_factory: Any, monkeypatch: Any) -> None:
    """The catalog does not answer when a partition is taken (a Redis hiccup): the replica
    serves lookups and makes no moves.  Without a retry it made none for as long as the
    advisor held the lease; the next round raises the fence and moves."""
    real = RedisCatalog.raise_fence
    calls: list[str] = []

    def fails_once(self: Any, fence: Any) -> int:
        calls.append(fence.name)
        if len(calls) == 1:
            raise ConnectionError("redis did not answer")
        return real(self, fence)

    monkeypatch.setattr(RedisCatalog, "raise_fence", fails_once)
    rig, node, rep = _one_partition_started(rig_factory, 130)
    assert rep.fenced and rep.take_failed and len(calls) == 1
    results = node.mover.run_round()
    assert not rep.fenced and not rep.take_failed and len(calls) == 2
    assert any(r.status.value == "done" and r.item.kind.value == "promote" for r in results), \
        [(r.item.kind.value, r.status.value, r.detail) for r in results]
    rig.folded(node)
    assert rig.mismatches(node) == []
    rig.read_back()
