"""Operator changes survive a restart, and a drain holds policy moves off its volume: a
volume registered at run time is registered again (its blocks read back), a draining volume
stays draining, and no policy round promotes onto a draining volume until the drain is
cancelled (docs/reliability.md, docs/operations.md)."""

from __future__ import annotations

from pathlib import Path

from fastapi.testclient import TestClient

from advisor import AdvisorService, PlanKind, PlanStatus
from advisor.settings import VolumeSettings
from api import create_app
from storage_backends import BlockKey
from tests.faults._world import NS, Worker, data, hot, settings

HOT = [701, 702, 703, 704]


def _promoted(results: list) -> set[int]:
    return {r.item.sequence_hash for r in results if r.item.kind is PlanKind.PROMOTE and r.status is PlanStatus.DONE}


def test_runtime_volumes_and_drains_survive_a_restart(tmp_path: Path) -> None:
    w = Worker(settings(tmp_path))
    slow2 = VolumeSettings(id="slow2", kind="posix", media="hdd", capacity_bytes=1 << 30, root=str(tmp_path / "slow2"))
    try:
        with AdvisorService(settings(tmp_path)) as svc:
            q = svc.query()
            q.register_volume(slow2, "slow")
            hot(w, svc, HOT)
            assert q.drain("fast", "slow").counts["done"] == 0  # empty, but marked draining
            res = q.drain("slow", "slow2")
            assert res.counts["done"] == len(HOT)
            assert svc.draining == {"fast", "slow"}
            r = svc.run_policies_once()  # the hot blocks would be promoted to fast
            assert not _promoted(r), [(x.item, x.status) for x in r]
            assert svc.counters["moves_held_back_draining"] >= len(HOT)
        # a fresh configuration (slow2 is not in it): the run state brings it back
        with AdvisorService(settings(tmp_path)) as again:
            assert "slow2" in {v.id for v in again.settings.volumes} and "slow2" in again.settings.slow_volumes
            assert again.draining == {"fast", "slow"}
            got = again.agent.get([BlockKey(NS, h) for h in HOT])
            assert all(g.equal(data(h)) for g, h in zip(got, HOT))  # on slow2, opened again
            assert {p.volume_id for p in again.agent.locate([BlockKey(NS, h) for h in HOT])} == {"slow2"}
            c = TestClient(create_app(again.query()), base_url="http://127.0.0.1")
            vols = {v["id"]: (v["role"], v["draining"]) for v in c.get("/v1/volumes").json()["volumes"]}
            assert vols == {"fast": ("fast", True), "slow": ("slow", True), "slow2": ("slow", False)}
            assert not _promoted(again.run_policies_once())
            r = c.delete("/v1/volumes/fast/drain")
            assert r.status_code == 200 and r.json() == {"volume": "fast", "status": "active"}
            assert c.delete("/v1/volumes/fast/drain").status_code == 409
            assert _promoted(again.run_policies_once()) == set(HOT)
        with AdvisorService(settings(tmp_path)) as third:
            assert third.draining == {"slow"}
            assert c is not None and "slow2" in {v.id for v in third.settings.volumes}
            third.query().drain("slow2", "slow")  # emptied, then unregistered: gone for good
            third.query().unregister_volume("slow2")
        with AdvisorService(settings(tmp_path)) as fourth:
            assert "slow2" not in {v.id for v in fourth.settings.volumes} and fourth.draining == {"slow"}
    finally:
        w.close()
