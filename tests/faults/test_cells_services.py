"""Fault cells: ENOSPC on the slow volume during a worker's offload, and the Redis
snapshot store killed mid-run then restarted (real ``redis-server`` on a private port)."""

from __future__ import annotations

from pathlib import Path

import pytest

from advisor import AdvisorService
from storage_backends import BlockKey, VolumeFullError, free_port
from tests.faults._invariants import acknowledged_read_back, catalog_equals_volumes, index_equals_fold
from tests.faults._mounts import small_tmpfs
from tests.faults._world import NS, Worker, chain, data, settings, start_redis


@pytest.mark.parametrize("vol", ["slow", "fast"])
def test_enospc_on_a_volume_during_offload(tmp_path: Path, vol: str) -> None:
    with small_tmpfs(tmp_path / "volfs", "1m") as volfs:
        s = settings(tmp_path, fast_blocks=1000)
        vols = [v.model_copy(update={"root": str(volfs / vol)}) if v.id == vol else v for v in s.volumes]
        s = s.model_copy(update={"volumes": vols, "volume_roots": [str(tmp_path)]})
        w = Worker(s)
        try:
            with AdvisorService(s) as svc:
                hashes = list(range(501, 533))  # 2 MiB into a 1 MiB filesystem
                with pytest.raises(VolumeFullError) as ei:
                    w.agent.put([(BlockKey(NS, h), data(h)) for h in hashes], vol)
                stored = [p.key.sequence_hash for p in ei.value.stored]
                assert len(stored) < len(hashes)
                if stored:  # a worker acknowledges what landed
                    w.send(svc, "w0", *chain(stored, vol))
                index_equals_fold(svc)
                assert svc.index.blocks_at(vol) == set(stored)
            acknowledged_read_back(w.agent, stored)
            assert w.agent.exists([BlockKey(NS, h) for h in hashes if h not in stored]) == [False] * (32 - len(stored))
            assert catalog_equals_volumes(s) == []
        finally:
            w.close()



def test_redis_snapshot_store_killed_and_restarted(tmp_path: Path) -> None:
    port = free_port()
    redis = start_redis(port)
    s = settings(tmp_path, snapshot_store="redis", redis_url=f"redis://127.0.0.1:{port}/0",
                 snapshot_key_prefix=f"faults:{port}", snapshot_every_batches=5, snapshot_every_s=0)
    w = Worker(s)
    try:
        svc = AdvisorService(s)
        svc.start()
        try:
            for h in range(1, 11):
                w.send(svc, "w0", *chain([h], "g1"))
            assert svc.counters["snapshots_taken"] >= 1
            redis.kill()
            redis.wait()
            for h in range(11, 21):  # ingest goes on; the snapshots fail and are counted
                w.send(svc, "w0", *chain([h], "g1"))
            assert svc.counters["snapshot_failures"] >= 1
            assert svc.query().health()["status"] == "ok"
            redis = start_redis(port)  # restarted, empty: snapshots resume
            taken = svc.counters["snapshots_taken"]
            for h in range(21, 31):
                w.send(svc, "w0", *chain([h], "g1"))
            assert svc.counters["snapshots_taken"] > taken
            index_equals_fold(svc)
            live = svc.index.dump()
        finally:
            svc.stop()
        with AdvisorService(s) as again:  # newest snapshot + the journal after it
            assert again.index.dump() == live
            index_equals_fold(again)
    finally:
        w.close()
        redis.kill()
        redis.wait()
