"""The scaled mover's safety parts on real storage: fenced commits in the Redis catalog
(POSIX volumes through NIXL), trunk ownership, and the storage settings' errors.

A mover holding an older lease token than the catalog's fence (a former partition owner
that was paused while another advisor took over) changes nothing: every item is skipped,
the copies it wrote are released, the catalog keeps the old placements and no event is
published.  The newer owner's mover then moves the same blocks.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from advisor.cluster.mover import ClusterStorageSettings, trunk_depth_of
from advisor.index.prefix_index import PrefixIndex
from advisor.moves.mover import Mover
from advisor.policy.plan import PlanItem, PlanKind, PlanStatus
from advisor.settings import SettingsError
from event_plane.schema import EventBatch, EventType, store
from event_plane.urls import make_publisher
from storage_backends import BlockKey, Fence, RedisCatalog, StorageAgent

NS = "m-fence"
BLK = 16 << 10


def _data(h: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (BLK,), dtype=torch.uint8, generator=g)


@pytest.fixture
def agent(tmp_path: Path, redis_url: str) -> Iterator[StorageAgent]:
    prefix = f"kvadvisor:test-fence:{uuid.uuid4().hex[:8]}"
    cat = RedisCatalog(redis_url, prefix=prefix)
    st = ClusterStorageSettings.model_validate({
        "catalog_prefix": prefix, "key_namespaces": [NS],
        "volumes": [{"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 16 << 20,
                     "root": str(tmp_path / "fast"), "segment_bytes": 1 << 20},
                    {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 16 << 20,
                     "root": str(tmp_path / "slow"), "segment_bytes": 1 << 20}],
        "fast_volume": "fast", "slow_volumes": ["slow"]})
    a = StorageAgent(cat, name="fence-test")
    for v in st.volumes:
        a.register_volume(v.to_descriptor())
    try:
        yield a
    finally:
        a.close()
        cat.destroy()
        cat.close()


def _mover(agent: StorageAgent, token: int, sink: list[EventBatch]) -> Mover:
    pub = make_publisher("null://", f"adv-{token}-mover", on_flush=lambda b, _p: sink.append(b))
    return Mover(agent, pub, [NS], lambda h: None, BlockKey, fence=Fence(f"{NS}.p0", token),
                 metadata={"mover": f"adv-{token}", "fence": token})


def test_a_stale_lease_holder_moves_nothing_and_the_new_one_moves(agent: StorageAgent) -> None:
    hs = [0x1000 + i for i in range(6)]
    agent.put([(BlockKey(NS, h), _data(h)) for h in hs], "slow")
    before = agent.locate([BlockKey(NS, h) for h in hs])
    items = [PlanItem(PlanKind.PROMOTE, "hot", "slow", "fast", h, NS, bytes=BLK) for h in hs]

    assert agent.catalog.raise_fence(Fence(f"{NS}.p0", 10)) == 10  # the new owner took the partition
    stale_events: list[EventBatch] = []
    stale = _mover(agent, 7, stale_events)
    results = stale.execute_many(items)
    assert [r.status for r in results] == [PlanStatus.SKIPPED] * len(hs)
    assert all("fenced off" in r.detail for r in results)
    assert stale.fenced
    assert agent.locate([BlockKey(NS, h) for h in hs]) == before  # the catalog did not change
    assert not stale_events  # nothing announced
    fast = next(s for s in agent.stats() if s.volume_id == "fast")
    assert fast.live_bytes == 0  # the copies it wrote were released
    # a compaction under the stale token is refused as well
    seg = before[0].segment_id
    agent.catalog.seal_segment("slow", seg)
    assert stale.execute(PlanItem(PlanKind.COMPACT, "sparse", "slow", segment_id=seg)).status is PlanStatus.SKIPPED
    assert agent.locate([BlockKey(NS, hs[0])]) == before[:1]

    fresh_events: list[EventBatch] = []
    fresh = _mover(agent, 10, fresh_events)
    results = fresh.execute_many(items)
    assert [r.status for r in results] == [PlanStatus.DONE] * len(hs)
    after = agent.locate([BlockKey(NS, h) for h in hs])
    assert [(p.volume_id, p.version) for p in after] == [("fast", 1)] * len(hs)
    assert [t.tolist() for t in agent.get([BlockKey(NS, h) for h in hs])] == [_data(h).tolist() for h in hs]
    evs = [e for b in fresh_events for e in b.events]
    assert [(EventType(e.type).name, e.sequence_hash, e.storage_location) for e in evs] == \
        [x for h in hs for x in (("STORE", h, "fast"), ("REMOVE", h, "slow"))]
    metas = [e.extra_metadata for e in evs if e.type == EventType.STORE]
    assert all(m == {"moved_from": "slow", "reason": "promote", "mover": "adv-10", "fence": 10,
                     "catalog_version": 1} for m in metas), metas
    # the fence stays at the newer token: the stale mover is still refused
    assert stale.execute(PlanItem(PlanKind.DEMOTE, "cold", "fast", "slow", hs[0], NS, bytes=BLK)).status \
        is PlanStatus.SKIPPED


def test_trunk_depth_follows_parents_inside_the_index() -> None:
    idx = PrefixIndex()
    chain = [11, 12, 13, 14]
    idx.apply_batch(EventBatch(1, "w", 1, 0, 1, [store(h, 11, chain[d - 1] if d else None, 8, "g1")
                                                 for d, h in enumerate(chain)]))
    idx.apply_batch(EventBatch(1, "w", 1, 1, 2, [store(99, 11, 98, 8, "g1")]))  # parent in another partition
    assert [trunk_depth_of(idx, h, 1) for h in chain] == [0, None, None, None]
    assert [trunk_depth_of(idx, h, 3) for h in chain] == [0, 1, 2, None]
    assert trunk_depth_of(idx, 99, 3) is None
    assert trunk_depth_of(idx, 12345, 3) is None


def test_storage_settings_errors_name_the_field(tmp_path: Path) -> None:
    bad = tmp_path / "s.json"
    bad.write_text(json.dumps({"volumes": [{"id": "a", "kind": "posix", "media": "nvme", "capacity_bytes": 1,
                                            "root": str(tmp_path)}], "fast_volume": "b"}))
    with pytest.raises(SettingsError, match="fast_volume 'b' is not one of the volumes"):
        ClusterStorageSettings.load(bad)
    bad.write_text(json.dumps({"volumes": [], "policy_interval_s": -1}))
    with pytest.raises(SettingsError, match="policy_interval_s"):
        ClusterStorageSettings.load(bad)
    bad.write_text("{not json")
    with pytest.raises(SettingsError, match="s.json"):
        ClusterStorageSettings.load(bad)
    with pytest.raises(SettingsError, match="missing.json"):
        ClusterStorageSettings.load(tmp_path / "missing.json")
    # the cluster advisor stops at start, naming the field, before it connects anywhere
    bad.write_text(json.dumps({"volumes": [], "archive_volume": "nope"}))
    r = subprocess.run([sys.executable, "-m", "advisor.cluster", "--nats", "nats://127.0.0.1:1", "--redis",
                        "redis://127.0.0.1:1/0", "--id", "a", "--storage", str(bad)],
                       capture_output=True, text=True, timeout=60, cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 2 and "archive_volume 'nope' is not one of the volumes" in r.stderr, r.stderr


def test_a_committed_move_whose_announcement_fails_stays_done(agent: StorageAgent) -> None:
    """The catalog changed and the bytes are on the destination: the move is done (not
    failed), counted as not announced, so the repair puts the index right later."""
    hs = [0x2000 + i for i in range(3)]
    agent.put([(BlockKey(NS, h), _data(h)) for h in hs], "slow")
    pub = make_publisher("null://", "adv-gone-mover")
    pub.close()  # every publish now raises PublisherClosedError
    mover = Mover(agent, pub, [NS], lambda h: None, BlockKey, fence=Fence(f"{NS}.p1", 1),
                  metadata={"mover": "adv-gone", "fence": 1})
    results = mover.execute_many([PlanItem(PlanKind.PROMOTE, "hot", "slow", "fast", h, NS, bytes=BLK) for h in hs])
    assert [r.status for r in results] == [PlanStatus.DONE] * len(hs)
    assert all("announcing it failed" in r.detail for r in results)
    assert mover.announce_failed == len(hs)
    assert [p.volume_id for p in agent.locate([BlockKey(NS, h) for h in hs])] == ["fast"] * len(hs)


def test_announcements_the_publisher_gives_up_on_are_counted_not_announced(agent: StorageAgent, js_url: str) -> None:
    """A JetStream publisher that gives a batch up (here the stream refuses it: full, with
    ``discard=new``) counts it in ``stats().dropped`` and its ``flush()`` returns normally;
    the mover must still count those committed moves as not announced, so the operator's
    ``announce_failed`` says the index waits for the catalog repair."""
    import asyncio

    import nats
    from nats.js import api

    async def full_stream() -> None:
        nc = await nats.connect(js_url)
        try:
            await nc.jetstream().add_stream(api.StreamConfig(
                name="KVADVISOR_EVENTS", subjects=["kvadvisor.events.>"], max_bytes=64,
                discard=api.DiscardPolicy.NEW))
        finally:
            await nc.close()

    asyncio.run(full_stream())
    hs = [0x3000 + i for i in range(4)]
    agent.put([(BlockKey(NS, h), _data(h)) for h in hs], "slow")
    pub = make_publisher(f"jetstream://{js_url.removeprefix('nats://')}?namespace={NS}", "adv-full-mover")
    try:
        mover = Mover(agent, pub, [NS], lambda h: None, BlockKey, fence=Fence(f"{NS}.p2", 1),
                      metadata={"mover": "adv-full", "fence": 1})
        results = mover.execute_many([PlanItem(PlanKind.PROMOTE, "hot", "slow", "fast", h, NS, bytes=BLK)
                                      for h in hs])
        assert [r.status for r in results] == [PlanStatus.DONE] * len(hs)
        assert pub.stats().dropped >= len(hs)
        assert mover.announce_failed == len(hs)
    finally:
        pub.close()
