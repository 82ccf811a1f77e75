"""Scaled mode on loopback: a 3-node NATS JetStream cluster (R3 stream and lease bucket),
Redis snapshots, 3 advisor processes owning 8 partitions, 2 workers publishing the bundled
Mooncake slice through PartitionedPublisher.  Faults mid-run: SIGKILL of an advisor (its
partitions are owned again within 15 s) and SIGKILL + restart of a NATS node.  Checked:

* every lookup answered during the run equals, piece by piece, a fold of that partition's
  log up to the stream position the answer carried (503s allowed, wrong answers not);
* at the end, the partitions rebuilt as an owner does (Redis snapshot + stream tail) hold
  exactly the blocks and locations of one index folding the whole, unpartitioned log.
"""

from __future__ import annotations

import os
import random
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

from advisor.cluster import ClusterClient, PartitionUnavailable
from advisor.index import PrefixIndex
from advisor.jslog import JetStreamLog
from advisor.leases import lease_owners
from advisor.snapshot import RedisSnapshotStore, load_latest
from event_plane.config import StreamLimits
from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_namespace, partition_url
from event_plane.schema import remove, store
from event_plane.urls import make_publisher
from kvadvisor.evaluate import load_trace
from kvadvisor.localcluster import NatsCluster
from kvadvisor.trace import bundled_trace

M64 = (1 << 64) - 1
SCHEME = PartitionScheme(partitions=8, trunk_depth=1, stretch=8)
REDIS = os.environ.get("KVADVISOR_TEST_REDIS", "redis://127.0.0.1:6379/0")
TTL = 3.0


def _u64(h: int) -> int:
    return (h * 0x9E3779B97F4A7C15 + 0x632BE59BD9B4E019) & M64


def _advisor(cluster: NatsCluster, ns: str, name: str, tmp: Path) -> subprocess.Popen[str]:
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "advisor.cluster", "--nats", cluster.url, "--redis", REDIS, "--id", name,
         "--namespace", ns, "--partitions", str(SCHEME.partitions), "--trunk-depth", str(SCHEME.trunk_depth),
         "--stretch", str(SCHEME.stretch), "--lease-ttl", str(TTL), "--heartbeat", "0.5", "--replicas", "3",
         "--snapshot-interval", "2"],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=Path(__file__).resolve().parents[2])
    log.close()
    return proc


def _fold_partition(url: str, ns: str, upto: list[tuple[int, list[int]]]) -> tuple[PrefixIndex, list[dict[str, int]]]:
    """Fold one namespace's log from seq 1; answer ``(position, piece)`` lookups at their
    positions (sorted by position); return the final index and the answers in input order."""
    log = JetStreamLog(url, ns, start_seq=1, stream=StreamLimits(replicas=3))
    log.start()
    idx = PrefixIndex()
    order = sorted(range(len(upto)), key=lambda i: upto[i][0])
    answers: list[dict[str, int]] = [{}] * len(upto)
    k = 0
    try:
        pending = log.pending_at_start
        for _ in range(pending):
            item = log.get(timeout=30)
            assert item is not None, f"{ns}: the log ended early"
            seq, payload = item
            while k < len(order) and upto[order[k]][0] < seq:
                answers[order[k]] = idx.lookup(upto[order[k]][1])
                k += 1
            idx.apply_payload(payload)
        while k < len(order):
            answers[order[k]] = idx.lookup(upto[order[k]][1])
            k += 1
    finally:
        log.close()
    return idx, answers


def _rebuild(url: str, ns: str, p: int) -> PrefixIndex:
    """Partition ``p`` as a new owner rebuilds it: newest Redis snapshot + stream tail."""
    snaps = RedisSnapshotStore(REDIS, key_prefix=f"kvadvisor:{ns}:p{p}")
    loaded = load_latest(snaps)
    snaps.close()
    idx, pos = (loaded[1], loaded[0].position) if loaded else (PrefixIndex(), 0)
    log = JetStreamLog(url, partition_namespace(ns, p), start_seq=pos + 1, stream=StreamLimits(replicas=3))
    log.start()
    try:
        for _ in range(log.pending_at_start):
            item = log.get(timeout=30)
            assert item is not None
            idx.apply_payload(item[1])
    finally:
        log.close()
    return idx


def test_cluster_survives_advisor_and_nats_kills(tmp_path: Path) -> None:
    ns = "c" + uuid.uuid4().hex[:8]
    requests = load_trace(bundled_trace())[:2000]
    with NatsCluster(tmp_path / "nats", nodes=3) as cluster:
        advisors = {f"adv-{i}": _advisor(cluster, ns, f"adv-{i}", tmp_path) for i in range(3)}
        try:
            for name, proc in advisors.items():
                assert proc.stdout is not None and proc.stdout.readline().strip() == f"advisor {name} ready", name
            # the two workers publish through node 0 (its clients learn the others and fail over)
            url0 = f"jetstream://127.0.0.1:{cluster.client_ports[0]}?namespace={ns}&replicas=3"
            pubs, whole = {}, {}
            for w in ("w0", "w1"):
                epoch = random.getrandbits(63)
                pubs[w] = PartitionedPublisher(SCHEME, lambda k, w=w, e=epoch: make_publisher(
                    partition_url(url0, k), w, epoch=e))
                whole[w] = make_publisher(f"jetstream://127.0.0.1:{cluster.client_ports[0]}?namespace={ns}-all&replicas=3",
                                          w, epoch=epoch)
            client = ClusterClient(cluster.url, SCHEME, ns, timeout_s=1.0)
            answered: list[tuple[int, list[int], dict[str, int], int]] = []  # partition, piece, answer, position
            unavailable = [0]
            stop = threading.Event()
            recent: list[list[int]] = []

            def ask_loop() -> None:
                rng = random.Random(3)
                while not stop.is_set():
                    if not recent:
                        time.sleep(0.05)
                        continue
                    chain = rng.choice(recent[-200:])
                    pieces = SCHEME.pieces(chain)
                    trunk_owner = next((pc.partition for pc in pieces if pc.partition >= 0), 0)
                    for piece in pieces:
                        p = trunk_owner if piece.partition < 0 else piece.partition
                        hs = chain[piece.start:piece.end]
                        try:
                            locs, pos = client.ask(p, hs)
                        except PartitionUnavailable:
                            unavailable[0] += 1
                            continue
                        answered.append((p, hs, locs, pos))
                    time.sleep(0.01)

            asker = threading.Thread(target=ask_loop, daemon=True)
            asker.start()
            rng = random.Random(11)
            held: dict[str, list[tuple[int, int | None, int]]] = {"w0": [], "w1": []}
            takeover_s = None
            for i, req in enumerate(requests):
                w = "w0" if i % 2 == 0 else "w1"
                chain = [_u64(h) for h in req]
                events = []
                for d, h in enumerate(chain):
                    parent = chain[d - 1] if d else None
                    events.append(store(h, chain[0], parent, 4096, "g1"))
                    held[w].append((h, parent, chain[0]))
                if len(held[w]) > 3000:  # the worker's G1 is full: evict the oldest eighth
                    cut = len(held[w]) // 8
                    for h, parent, first in held[w][:cut]:
                        events.append(remove(h, first, parent, 4096, "g1"))
                    del held[w][:cut]
                pubs[w].publish(events)
                whole[w].publish(events)
                recent.append(chain)
                if i % 50 == 0:
                    pubs[w].flush()
                    whole[w].flush()
                if i == 600:  # an advisor dies without a word
                    victim = advisors.pop("adv-0")
                    victim.kill()
                    victim.wait(10)
                    t0 = time.monotonic()
                    while time.monotonic() - t0 < 20:
                        owners = lease_owners(cluster.url)
                        if len(owners) == SCHEME.partitions and "adv-0" not in owners.values():
                            takeover_s = time.monotonic() - t0
                            break
                        time.sleep(0.2)
                if i == 1000:  # a NATS node dies, then comes back
                    cluster.kill(2)
                if i == 1300:
                    cluster.start_node(2)
                rng.random()
            for w in pubs:
                pubs[w].close()
                whole[w].close()
            # nothing was lost on the way in, NATS node kill included
            assert [s.dropped for w in pubs for s in pubs[w].stats()] == [0] * 2 * SCHEME.partitions
            assert [whole[w].stats().dropped for w in whole] == [0, 0]
            cluster.wait_ready(30)
            time.sleep(2.0)
            stop.set()
            asker.join(10)
            assert takeover_s is not None and takeover_s <= 15, f"take-over took {takeover_s} s"
            assert len(answered) > 50, (len(answered), unavailable[0])

            # every answer = that partition's fold at the answer's position
            for p in range(SCHEME.partitions):
                mine = [(pos, hs) for q, hs, _, pos in answered if q == p]
                _, truth = _fold_partition(cluster.url, partition_namespace(ns, p), mine)
                got = [locs for q, _, locs, _ in answered if q == p]
                assert got == truth, f"partition {p}: an answer differs from the log at its position"
        finally:
            for proc in advisors.values():
                proc.terminate()
            for proc in advisors.values():
                try:
                    proc.wait(20)
                except subprocess.TimeoutExpired:
                    proc.kill()
        client.close()

        # union of the partitions (rebuilt as an owner does) == one fold of the whole log
        reference, _ = _fold_partition(cluster.url, f"{ns}-all", [])
        parts = [_rebuild(cluster.url, ns, p) for p in range(SCHEME.partitions)]
        ref_hashes = set(reference.hashes())
        assert ref_hashes, "the reference fold is empty"
        union: set[int] = set()
        for p, idx in enumerate(parts):
            for h in idx.hashes():
                union.add(h)
                assert h in ref_hashes, (p, h)
                assert idx.block(h).locations == reference.block(h).locations, (p, h)
        assert union == ref_hashes
        import redis

        r = redis.Redis.from_url(REDIS)
        for key in r.scan_iter(f"kvadvisor:{ns}:*"):
            r.delete(key)
