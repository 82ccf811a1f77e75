"""Attack 1 (and 2 under load) on real processes: a paused partition owner.

A private nats-server (JetStream: the partition streams and the lease bucket), Redis (the
shared placement catalog and snapshots), two cluster advisor processes
(``python -m advisor.cluster --storage``) over 2 partitions, moving blocks between a small
``fast`` and a ``slow`` POSIX volume, and a worker thread that keeps offloading hot chains
to ``slow`` (so every round has promotions and demotions to do) and deleting older ones
from the shared volume (catalog delete + Remove at ``slow``, the volume it put them on,
whatever the movers did since).

Advisor ``adv-a`` is frozen (SIGSTOP) for three lease TTLs while its mover works, ``adv-b``
takes its partitions (raising their catalog fences) and moves their blocks, then
``adv-a`` resumes (SIGCONT), finds its leases gone and takes a partition back with a new
token.  This happens twice.  Checked at the end, after the workers stop and the movers had
a few rounds:

* no commit of the paused owner landed after the new owner's: along each block's
  announced moves, each catalog version is committed once and the fencing tokens never go
  back; each token belongs to one advisor;
* each partition, rebuilt as an owner does (Redis snapshot + stream tail), places on each
  volume exactly the blocks the catalog places there (no deleted block resurrected by a
  late or racing announcement);
* every block the catalog holds reads back byte for byte, and no block the workers still
  hold is lost.
"""

from __future__ import annotations

import json
import os
import random
import signal
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path
from typing import Any

import redis
import torch

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.jslog import JetStreamLog
from advisor.cluster.leases import lease_owners
from advisor.cluster.partition_fold import PartitionFold
from tests import polling
from tests.logs import read_log
from advisor.index.snapshot import RedisSnapshotStore, load_latest
from event_plane.codec import decode_batch
from event_plane.config import StreamLimits
from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_namespace, partition_url
from event_plane.schema import remove, store
from event_plane.urls import make_publisher
from storage_backends import BlockKey, RedisCatalog, StorageAgent, VolumeFullError

SCHEME = PartitionScheme(partitions=2, trunk_depth=1, stretch=8)
TTL = 2.0
BLK = 16 << 10
KEY_NS = "m0"


def _data(h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h & 0x7FFFFFFF)
    return torch.randint(0, 256, (BLK,), dtype=torch.uint8, generator=g)


def _advisor(url: str, redis_url: str, ns: str, name: str, tmp: Path, storage: Path) -> subprocess.Popen[str]:
    log = open(tmp / f"{name}.log", "w")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "advisor.cluster", "--nats", url, "--redis", redis_url, "--id", name,
         "--namespace", ns, "--partitions", str(SCHEME.partitions), "--trunk-depth", str(SCHEME.trunk_depth),
         "--stretch", str(SCHEME.stretch), "--lease-ttl", str(TTL), "--heartbeat", "0.5", "--replicas", "1",
         "--snapshot-interval", "2", "--storage", str(storage)],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=Path(__file__).resolve().parents[2],
        env={**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[2])})
    log.close()
    return proc


def _log(url: str, ns: str, start: int = 1) -> list[bytes]:
    return [payload for _seq, payload in read_log(url, ns, start_seq=start)]


def _rebuild(url: str, redis_url: str, ns: str, p: int) -> PrefixIndex:
    snaps = RedisSnapshotStore(redis_url, key_prefix=f"kvadvisor:{ns}:p{p}")
    loaded = load_latest(snaps)
    snaps.close()
    idx, pos = (loaded[1], loaded[0].position) if loaded else (PrefixIndex(), 0)
    fold = PartitionFold(idx)  # as the advisors fold: each batch once
    for payload in _log(url, partition_namespace(ns, p), pos + 1):
        fold.apply(payload)
    return idx


def _mismatches(url: str, redis_url: str, ns: str, catalog: RedisCatalog,
                deleted: set[int]) -> list[tuple[Any, ...]]:
    """Where a partition's index (rebuilt as an owner does) and the catalog disagree, per
    volume: ``(partition, volume, "index-only" | "catalog-only", blocks, note)``."""
    placed = {v: {pl.key.sequence_hash for pl in catalog.iter_volume(v)} for v in ("fast", "slow")}
    out: list[tuple[Any, ...]] = []
    for p in range(SCHEME.partitions):
        idx = _rebuild(url, redis_url, ns, p)
        known = set(idx.hashes())
        for v in ("fast", "slow"):
            at = idx.blocks_at(v)
            if at - placed[v]:
                out.append((p, v, "index-only", len(at - placed[v]), "deleted" if (at - placed[v]) & deleted else ""))
            if (placed[v] & known) - at:
                out.append((p, v, "catalog-only", len((placed[v] & known) - at), ""))
    return out


def test_a_paused_owner_lands_nothing_and_the_index_matches_the_catalog(tmp_path: Path, js_url: str,
                                                                        redis_url: str) -> None:
    ns = "z" + uuid.uuid4().hex[:8]
    vols = tmp_path / "volumes"
    conf = {
        "catalog_prefix": f"kvadvisor:{ns}:catalog", "key_namespaces": [KEY_NS],
        "volumes": [
            {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 1 << 20,
             "root": str(vols / "fast"), "segment_bytes": 128 << 10},
            {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 64 << 20,
             "root": str(vols / "slow"), "segment_bytes": 128 << 10},
        ],
        "fast_volume": "fast", "slow_volumes": ["slow"], "volume_roots": [str(vols)],
        "policy_interval_s": 0.5,
        "policy": {"planner": {"max_moves_per_round": 16, "min_move_interval_s": 2.0}},
    }
    for v in ("fast", "slow"):
        (vols / v).mkdir(parents=True)
    storage = tmp_path / "storage.json"
    storage.write_text(json.dumps(conf))
    catalog = RedisCatalog(redis_url, prefix=str(conf["catalog_prefix"]))
    agent = StorageAgent(catalog, name="workers", allowed_roots=[str(vols)])
    from advisor.cluster.mover import ClusterStorageSettings

    for v in ClusterStorageSettings.model_validate(conf).volumes:
        agent.register_volume(v.to_descriptor())
    host = js_url.split("//", 1)[1]
    base = f"jetstream://{host}?namespace={ns}"
    pubs = {w: PartitionedPublisher(SCHEME, lambda k, w=w, e=random.getrandbits(63): make_publisher(
        partition_url(base, k), w, epoch=e)) for w in ("w0", "w1")}
    advisors = {n: _advisor(js_url, redis_url, ns, n, tmp_path, storage) for n in ("adv-a", "adv-b")}
    final: dict[str, dict[str, int]] = {}
    stop = threading.Event()
    live: set[int] = set()  # blocks the workers stored and did not delete
    deleted: set[int] = set()
    errors: list[BaseException] = []

    def work() -> None:
        rng = random.Random(5)
        chains: list[list[int]] = []
        try:
            while not stop.is_set():
                chain = [rng.getrandbits(63) for _ in range(4)]
                evs = [store(h, chain[0], chain[d - 1] if d else None, BLK, "g1") for d, h in enumerate(chain)]
                pubs["w0"].publish(evs)
                pubs["w1"].publish([store(h, chain[0], chain[d - 1] if d else None, BLK, "g1", {"hits": 2})
                                    for d, h in enumerate(chain)])
                try:
                    agent.put([(BlockKey(KEY_NS, h), _data(h)) for h in chain], "slow")
                except VolumeFullError:
                    continue
                pubs["w0"].publish([store(h, chain[0], chain[d - 1] if d else None, BLK, "slow")
                                    for d, h in enumerate(chain)])
                live.update(chain)
                chains.append(chain)
                if len(chains) % 3 == 0:  # delete an older chain's tail from the shared volume
                    old = chains[rng.randrange(len(chains))]
                    gone = [(d, h) for d, h in enumerate(old) if d and h in live]
                    if gone:
                        agent.delete([BlockKey(KEY_NS, h) for _, h in gone])
                        live.difference_update(h for _, h in gone)
                        deleted.update(h for _, h in gone)
                        pubs["w0"].publish([remove(h, old[0], old[d - 1], BLK, "slow") for d, h in gone])
                pubs["w0"].flush()
                pubs["w1"].flush()
                time.sleep(0.05)
        except BaseException as exc:  # noqa: BLE001 - reported by the test
            errors.append(exc)

    try:
        for name, proc in advisors.items():
            assert proc.stdout is not None and proc.stdout.readline().strip() == f"advisor {name} ready", name
        worker = threading.Thread(target=work, daemon=True)
        worker.start()
        for cycle in range(2):
            deadline = time.monotonic() + 20
            while time.monotonic() < deadline:  # adv-a owns a partition (and its mover works)
                owners = lease_owners(js_url)
                if "adv-a" in owners.values() and len(owners) == SCHEME.partitions:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"cycle {cycle}: adv-a never owned a partition: {lease_owners(js_url)}")
            time.sleep(2.0)
            advisors["adv-a"].send_signal(signal.SIGSTOP)
            t0 = time.monotonic()
            while time.monotonic() - t0 < 15:  # adv-b owns everything while adv-a sleeps
                owners = lease_owners(js_url)
                if len(owners) == SCHEME.partitions and set(owners.values()) == {"adv-b"}:
                    break
                time.sleep(0.2)
            else:
                raise AssertionError(f"cycle {cycle}: no take-over: {lease_owners(js_url)}")
            time.sleep(3 * TTL)  # adv-b moves adv-a's blocks meanwhile
            advisors["adv-a"].send_signal(signal.SIGCONT)
            time.sleep(4.0)
        stop.set()
        worker.join(30)
        assert not errors, errors
        # the movers finish, and repair what stayed different over two rounds (their rounds
        # run every 0.5 s; the deadline only bounds the wait)
        polling.wait_until(lambda: not _mismatches(js_url, redis_url, ns, catalog, deleted), 180,
                           "the partitions' index == the catalog", every=1.0)
    finally:
        stop.set()
        for proc in advisors.values():
            proc.send_signal(signal.SIGCONT)
            proc.terminate()
        for name, proc in advisors.items():
            try:
                out, _ = proc.communicate(timeout=60)
            except subprocess.TimeoutExpired:
                proc.kill()
                continue
            line = next((ln for ln in out.splitlines() if ln.startswith(f"advisor {name} stopped: mover ")), None)
            if line is not None:
                final[name] = json.loads(line.split(" mover ", 1)[1])
        for pub in pubs.values():
            pub.close()
    try:
        assert set(final) == {"adv-a", "adv-b"}, (final, (tmp_path / "adv-a.log").read_text()[-3000:])
        assert sum(c["moves_done"] for c in final.values()) > 0, final
        assert deleted, "the workers deleted nothing"

        # no commit of a stale owner after a newer one's, no token of two advisors
        token_owner: dict[int, str] = {}
        per_block: dict[int, dict[int, tuple[int, str]]] = {}
        trail: dict[int, list[tuple[int, int, int, str, str, str]]] = {}  # h -> (partition, version, token, mover, from, to)
        for p in range(SCHEME.partitions):
            for payload in _log(js_url, partition_namespace(ns, p)):
                for ev in decode_batch(payload).events:
                    meta = ev.extra_metadata or {}
                    if "moved_from" not in meta:
                        continue
                    tok, who, ver = int(meta["fence"]), str(meta["mover"]), int(meta["catalog_version"])
                    assert token_owner.setdefault(tok, who) == who, f"token {tok} used by two advisors"
                    trail.setdefault(ev.sequence_hash, []).append(
                        (p, ver, tok, who, str(meta["moved_from"]), ev.storage_location))
                    seen = per_block.setdefault(ev.sequence_hash, {})
                    assert seen.setdefault(ver, (tok, who)) == (tok, who), \
                        f"block {ev.sequence_hash:#x} version {ver} committed twice"
        for h, by_version in per_block.items():
            tokens = [by_version[v][0] for v in sorted(by_version)]
            assert tokens == sorted(tokens), f"block {h:#x}: a stale owner committed after a newer one: {trail[h]}"
        assert {w for w in token_owner.values()} == {"adv-a", "adv-b"}, token_owner

        # each partition (rebuilt as an owner does) == the catalog, per volume
        assert _mismatches(js_url, redis_url, ns, catalog, deleted) == []

        # nothing lost, every block byte-exact
        placed = {v: {pl.key.sequence_hash for pl in catalog.iter_volume(v)} for v in ("fast", "slow")}
        in_catalog = placed["fast"] | placed["slow"]
        assert live <= in_catalog, f"{len(live - in_catalog)} blocks the workers hold are gone"
        assert not (deleted & in_catalog)
        hs = sorted(in_catalog)
        for i in range(0, len(hs), 128):
            chunk = hs[i:i + 128]
            for h, t in zip(chunk, agent.get([BlockKey(KEY_NS, h) for h in chunk])):
                assert torch.equal(t, _data(h)), f"block {h:#x} does not read back"
    finally:
        agent.close()
        catalog.destroy()
        catalog.close()
        r = redis.Redis.from_url(redis_url)
        for key in r.scan_iter(f"kvadvisor:{ns}:*"):
            r.delete(key)
        r.close()
