"""Mover end to end: real StorageAgent (NIXL POSIX on tmp_path, NIXL OBJ on a real HTTP S3
endpoint), promotion, demotion, compaction, crash reconciliation; bytes verified and
Store/Remove published in order."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from advisor import AdvisorService, AdvisorSettings, PlanItem, PlanKind, PlanStatus
from event_plane.schema import EventBatch, EventType, store
from storage_backends import BlockKey, SqliteCatalog, StorageAgent
from storage_backends.local_s3 import LocalS3

NS = "ns-advisor-test"
BLK = 64 << 10  # bytes per block


def data(h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (BLK,), dtype=torch.uint8, generator=g)


def chain(hashes: list[int], loc: str) -> list:
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BLK, loc))
        parent = h
    return out


class World:
    """An advisor service plus a 'worker' storage agent sharing its catalog."""

    def __init__(self, tmp: Path, s3: LocalS3, fast_blocks: int = 100) -> None:
        self.tmp = tmp
        bucket = f"adv-{uuid.uuid4().hex[:12]}"
        self.settings = AdvisorSettings(
            journal_path=str(tmp / "journal.sqlite"),
            catalog_path=str(tmp / "catalog.sqlite"),
            namespace=NS,
            volumes=[
                {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": fast_blocks * BLK,
                 "root": str(tmp / "fast")},
                {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 1 << 30, "root": str(tmp / "slow")},
                {"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30, "endpoint": s3.endpoint,
                 "bucket": bucket, "access_key": s3.access_key, "secret_key": s3.secret_key},
            ],
            fast_volume="fast",
            slow_volumes=["slow"],
            archive_volume="s3",
            policy_interval_s=0,
            api_enabled=False,
        )
        self.svc = AdvisorService(self.settings)
        self.svc.start()
        self.worker_catalog = SqliteCatalog(tmp / "catalog.sqlite")
        self.worker = StorageAgent(self.worker_catalog, name=f"worker-{uuid.uuid4().hex[:8]}")
        for v in self.settings.volumes:
            self.worker.register_volume(v.to_descriptor())
        self.seq: dict[str, int] = {}
        self.ts = 1_000

    def events(self, source: str, *evs) -> None:  # noqa: ANN002
        seq = self.seq.get(source, 0)
        self.seq[source] = seq + 1
        self.ts += 1_000
        assert self.svc.ingest(EventBatch(1, source, 1, seq, self.ts, list(evs)))

    def put(self, hashes: list[int], vol: str) -> None:
        self.worker.put([(BlockKey(NS, h), data(h)) for h in hashes], vol)

    def where(self, hashes: list[int]) -> list[str | None]:
        return [p.volume_id if p else None for p in self.worker.locate([BlockKey(NS, h) for h in hashes])]

    def advisor_events(self) -> list[tuple[str, int, str]]:
        assert self.svc.journal is not None
        return [(EventType(e.type).name, e.sequence_hash, e.storage_location)
                for _, b in self.svc.journal.read() if b.source == "advisor" for e in b.events]

    def close(self) -> None:
        self.svc.stop()
        self.worker.close()
        self.worker_catalog.close()


@pytest.fixture
def world(tmp_path: Path, local_s3: LocalS3) -> Iterator[World]:
    w = World(tmp_path, local_s3)
    try:
        yield w
    finally:
        w.close()


def test_promotion_of_hot_blocks_from_slow_to_fast(world: World) -> None:
    hs = [101, 102, 103]
    world.put(hs, "slow")
    world.events("w0", *chain(hs, "g1"), *chain(hs, "slow"))  # computed and offloaded by w0: no hits
    world.events("w0", store(200, 200, None, BLK, "g1"))
    world.events("w1", *chain(hs, "g1"))  # onboarded by w1 and w2: 2 hits each
    world.events("w2", *chain(hs, "g1"))
    results = world.svc.run_policies_once()
    assert [(r.item.kind, r.item.sequence_hash, r.status) for r in results] == [
        (PlanKind.PROMOTE, h, PlanStatus.DONE) for h in hs
    ]
    assert all("hits=2 >= min_hits=2 on slow volume 'slow'" in r.item.reason for r in results)
    assert world.where(hs) == ["fast"] * 3
    got = world.worker.get([BlockKey(NS, h) for h in hs])  # a worker reads the moved bytes, verified
    assert all(torch.equal(g, data(h)) for g, h in zip(got, hs))
    assert world.advisor_events() == [
        ("STORE", 101, "fast"), ("REMOVE", 101, "slow"),
        ("STORE", 102, "fast"), ("REMOVE", 102, "slow"),
        ("STORE", 103, "fast"), ("REMOVE", 103, "slow"),
    ]
    idx = world.svc.index
    assert idx.lookup(hs) == {"fast": 3, "w0/g1": 3, "w1/g1": 3, "w2/g1": 3}
    assert idx.blocks_at("slow") == set()
    assert [idx.block(h).hits for h in hs] == [2, 2, 2]  # a move is not an access
    assert {s.volume_id: s.segments for s in world.worker.stats()}["slow"] == 0  # emptied segment dropped
    st = world.svc.query().stats()
    assert (st["promotions"], st["bytes_moved"]) == (3, 3 * BLK)
    assert world.svc.run_policies_once() == []  # nothing left to do


def test_demotion_of_leaves_one_tier_down_then_compaction(tmp_path: Path, local_s3: LocalS3) -> None:
    w = World(tmp_path, local_s3, fast_blocks=12)
    try:
        a, b = [1, 2, 3, 4, 5], [11, 12, 13, 14, 15]
        w.put(a, "fast")
        w.put(b, "fast")
        w.events("w0", *chain(a, "g1"), *chain(a, "fast"))
        w.events("w0", *chain(b, "g1"), *chain(b, "fast"))  # B accessed later than A
        # 10 of 12 blocks used (83% > 80%): demote until live <= 60% (7.2 blocks) -> 3 blocks,
        # A's leaves first, one tier down: to the slow volume (it has room), not to S3
        results = w.svc.run_policies_once()
        assert [(r.item.kind, r.item.sequence_hash, r.status) for r in results] == [
            (PlanKind.DEMOTE, 5, PlanStatus.DONE), (PlanKind.DEMOTE, 4, PlanStatus.DONE),
            (PlanKind.DEMOTE, 3, PlanStatus.DONE),
        ]
        assert "83.3% > high watermark 80.0%" in results[0].item.reason
        assert w.where(a + b) == ["fast", "fast", "slow", "slow", "slow"] + ["fast"] * 5
        assert all(torch.equal(g, data(h)) for g, h in zip(w.worker.get([BlockKey(NS, h) for h in a]), a))
        assert w.advisor_events() == [
            ("STORE", 5, "slow"), ("REMOVE", 5, "fast"),
            ("STORE", 4, "slow"), ("REMOVE", 4, "fast"),
            ("STORE", 3, "slow"), ("REMOVE", 3, "fast"),
        ]
        assert w.svc.index.lookup(a) == {"fast": 2, "w0/g1": 5}
        assert w.svc.index.blocks_at("slow") == {3, 4, 5} and w.svc.index.blocks_at("s3") == set()
        # A's segment is now 2/5 live and the 2 free blocks hold its live bytes: the next round
        # compacts it (no location changes, no events)
        seg_a = w.worker.locate([BlockKey(NS, 1)])[0].segment_id
        results = w.svc.run_policies_once()
        assert [(r.item.kind, r.item.segment_id, r.status, r.blocks_moved) for r in results] == [
            (PlanKind.COMPACT, seg_a, PlanStatus.DONE, 2)
        ]
        assert "40.0% live < 50.0%" in results[0].item.reason
        assert seg_a not in {s.segment_id for s in w.worker.segments("fast")}
        assert not any(str(seg_a) in p.name for p in (tmp_path / "fast").rglob("*") if p.is_file())
        assert w.where(a[:2]) == ["fast", "fast"]
        assert all(torch.equal(g, data(h)) for g, h in zip(w.worker.get([BlockKey(NS, h) for h in a + b]), a + b))
        assert len(w.advisor_events()) == 6
        fast = {s.volume_id: s for s in w.worker.stats()}["fast"]
        assert (fast.used_bytes, fast.live_bytes, fast.blocks) == (7 * BLK, 7 * BLK, 7)
        st = w.svc.query().stats()
        assert (st["demotions"], st["compactions"], st["bytes_moved"]) == (3, 1, 5 * BLK)
        assert w.svc.run_policies_once() == []
    finally:
        w.close()


def test_stale_item_is_skipped_and_nothing_is_published(world: World) -> None:
    world.put([7], "slow")
    world.events("w0", store(7, 7, None, BLK, "slow"))
    world.worker.delete([BlockKey(NS, 7)])
    assert world.svc.mover is not None
    res = world.svc.mover.execute(PlanItem(PlanKind.PROMOTE, "test", "slow", "fast", sequence_hash=7, bytes=BLK))
    assert res.status is PlanStatus.SKIPPED and "no copy on 'slow'" in res.detail
    assert world.advisor_events() == []
    assert world.where([7]) == [None]


def test_restart_reconciles_a_move_committed_but_not_published(tmp_path: Path, local_s3: LocalS3) -> None:
    w = World(tmp_path, local_s3)
    try:
        w.put([31, 32], "slow")
        w.events("w0", *chain([31, 32], "slow"))
        # a crash right after commit_move: the catalog points at fast, no event went out
        agent = w.svc.agent
        old = agent.locate([BlockKey(NS, 32)])[0]
        agent.commit_move(old, agent.copy(old, "fast"))
        assert w.svc.index.blocks_at("slow") == {31, 32}
        w.svc.stop()
        w.svc = AdvisorService(w.settings)
        w.svc.start()  # replays the journal, then reconciles with the catalog
        assert w.svc.counters["reconciled_events"] == 2
        assert w.advisor_events() == [("STORE", 32, "fast"), ("REMOVE", 32, "slow")]
        assert w.svc.index.blocks_at("slow") == {31} and w.svc.index.blocks_at("fast") == {32}
        assert w.svc.index.lookup([31, 32]) == {"slow": 1}
    finally:
        w.close()


def test_rest_api_over_real_storage(world: World) -> None:
    from fastapi.testclient import TestClient

    from api import create_app

    hs = [301, 302]
    world.put(hs, "slow")
    world.events("w0", *chain(hs, "g1"), *chain(hs, "slow"))
    world.events("w1", *chain(hs, "g1"))
    world.events("w2", *chain(hs, "g1"))
    client = TestClient(create_app(world.svc.query()), base_url="http://127.0.0.1")
    vols = {v["id"]: v for v in client.get("/v1/volumes").json()["volumes"]}
    assert {k: (v["role"], v["kind"], v["media"]) for k, v in vols.items()} == {
        "fast": ("fast", "posix", "nvme"), "slow": ("slow", "posix", "hdd"), "s3": ("archive", "s3", "object")}
    assert (vols["slow"]["live_bytes"], vols["slow"]["blocks"], vols["slow"]["indexed_blocks"]) == (2 * BLK, 2, 2)
    run = client.post("/v1/plans/run").json()
    assert [(p["kind"], p["status"], p["sequence_hash"], p["src_volume"], p["dst_volume"]) for p in run["plans"]] == [
        ("promote", "done", 301, "slow", "fast"), ("promote", "done", 302, "slow", "fast")]
    assert run["summary"] == {"promote_done": 2}
    assert run["plans"][0]["reason"].startswith("hits=2 >= min_hits=2")
    assert client.get("/v1/plans").json()["plans"] == run["plans"]
    vols = {v["id"]: v for v in client.get("/v1/volumes").json()["volumes"]}
    assert (vols["fast"]["blocks"], vols["fast"]["indexed_blocks"], vols["slow"]["blocks"]) == (2, 2, 0)
    assert client.get("/v1/blocks/301").json()["locations"] == ["fast", "w0/g1", "w1/g1", "w2/g1"]
    text = client.get("/metrics").text
    assert 'kvadvisor_moves_total{kind="promote",status="done"} 2.0' in text
    assert f'kvadvisor_bytes_moved_total{{kind="promote"}} {float(2 * BLK)}' in text
    assert 'kvadvisor_index_blocks{location="fast"} 2.0' in text
    st = client.get("/v1/stats").json()
    assert (st["promotions"], st["bytes_moved"], st["sources"]["advisor"]["batches"]) == (2, 2 * BLK, 1)
    assert (st["moves"]["promotions"], st["moves"]["bytes_moved"], st["advisor_events"]) == (2, 2 * BLK, 4)
    assert client.get("/v1/locations/fast/blocks").json()["sequence_hashes"] == hs
    assert client.get("/v1/locations/slow/blocks").json()["sequence_hashes"] == []
