"""Invalidating a namespace through the API (admin): its blocks are deleted on every volume
(POSIX and S3), Removes are published for them, other namespaces and workers' G1 are kept."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from fastapi.testclient import TestClient

from api import create_app
from event_plane.schema import EventType
from kvbm_runtime.hashing import ModelFingerprint
from storage_backends import BlockKey
from storage_backends.local_s3 import LocalS3

from tests.integration.test_advisor_mover import NS, World, chain, data

FP = ModelFingerprint("m", "float16", "FullyContiguous", 16)
OTHER = FP.namespace()


@pytest.fixture
def world(tmp_path: Path, local_s3: LocalS3) -> Iterator[World]:
    w = World(tmp_path, local_s3)
    try:
        yield w
    finally:
        w.close()


def test_invalidate_deletes_everywhere_and_publishes_removes(world: World) -> None:
    w = world
    fast, slow, s3 = [101, 102], [201, 202, 203], [301]
    w.put(fast, "fast")
    w.put(slow, "slow")
    w.put(s3, "s3")
    w.worker.put([(BlockKey(OTHER, 900), data(900))], "slow")  # another model's block stays
    w.events("w0", *chain(fast, "fast"), *chain(slow, "slow"), *chain(s3, "s3"), *chain([900], "slow"),
             *chain(fast, "g1"))
    c = TestClient(create_app(w.svc.query()), base_url="http://127.0.0.1")
    r = c.post("/v1/actions/invalidate", json={"namespace": NS})
    assert r.status_code == 200, r.text
    assert r.json() == {"namespace": NS, "deleted": {"fast": 2, "slow": 3, "s3": 1}, "removes_published": 6}
    assert w.where(fast + slow + s3) == [None] * 6
    assert w.worker.locate([BlockKey(OTHER, 900)])[0] is not None
    removes = {(h, loc) for kind, h, loc in w.advisor_events() if kind == EventType.REMOVE.name}
    assert removes == {(h, v) for v, hs in (("fast", fast), ("slow", slow), ("s3", s3)) for h in hs}
    locs = c.get("/v1/locations").json()["locations"]
    assert locs == {"slow": 1, "w0/g1": 2}  # the index followed; workers' own G1 untouched
    # by model fingerprint: the other namespace goes too; a second run finds nothing
    model = {"name": "m", "dtype": "float16", "layout": "FullyContiguous", "block_size": 16}
    r = c.post("/v1/actions/invalidate", json={"model": model}).json()
    assert r == {"namespace": OTHER, "deleted": {"slow": 1}, "removes_published": 1}
    assert c.post("/v1/actions/invalidate", json={"namespace": NS}).json()["deleted"] == {}
    r = c.post("/v1/actions/invalidate", json={"namespace": NS, "model": model})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"


def test_drain_moves_every_block_off_a_volume(world: World) -> None:
    w = world
    fast = [401, 402, 403]
    w.put(fast, "fast")
    w.events("w0", *chain(fast, "fast"))
    c = TestClient(create_app(w.svc.query()), base_url="http://127.0.0.1")
    r = c.post("/v1/volumes/fast/drain", json={"to": "slow"})
    assert r.status_code == 200, r.text
    assert r.json() == {"volume": "fast", "to": "slow", "counts": {"done": 3, "skipped": 0, "failed": 0},
                        "bytes_moved": 3 * len(data(1)), "other_namespaces": {}, "hint": None}
    assert w.where(fast) == ["slow"] * 3
    for h in fast:  # the bytes came along, verified
        assert w.worker.get([BlockKey(NS, h)])[0].equal(data(h))
    evs = [(k, h, loc) for k, h, loc in w.advisor_events() if h in fast]
    assert {(h, loc) for k, h, loc in evs if k == EventType.STORE.name} == {(h, "slow") for h in fast}
    assert {(h, loc) for k, h, loc in evs if k == EventType.REMOVE.name} == {(h, "fast") for h in fast}
    assert c.get("/v1/locations").json()["locations"] == {"slow": 3}
    segs = c.get("/v1/volumes/slow/segments").json()
    assert sum(g["live_blocks"] for g in segs["segments"]) == 3 and segs["count"] == len(segs["segments"])
    assert sum(g["live_blocks"] for g in c.get("/v1/volumes/fast/segments").json()["segments"]) == 0
    assert [p["reason"] for p in c.get("/v1/plans").json()["plans"]] == ["drain fast"] * 3
    # nothing left: a second drain moves nothing; the default destination is a slow volume
    assert c.post("/v1/volumes/fast/drain").json()["counts"] == {"done": 0, "skipped": 0, "failed": 0}
    for bad, why in (("nope", "unknown volume"), ("s3x", "unknown volume")):
        r = c.post(f"/v1/volumes/{bad}/drain")
        assert r.status_code == 409 and r.json()["error"] == "cannot_drain" and why in r.json()["detail"]
    r = c.post("/v1/volumes/slow/drain", json={"to": "slow"})
    assert r.status_code == 409 and "give another configured volume" in r.json()["detail"]


def test_a_drain_that_finds_only_other_namespaces_names_them(world: World) -> None:
    """A vLLM worker's connector keys its blocks by its model fingerprint's namespace; an
    advisor left on another one (here: not following its catalog's namespaces) drained
    nothing and did not say why."""
    w = world
    w.svc.settings = w.svc.settings.model_copy(update={"follow_catalog_namespaces": False})
    w.worker.put([(BlockKey(OTHER, h), data(h)) for h in (501, 502)], "fast")
    c = TestClient(create_app(w.svc.query()), base_url="http://127.0.0.1")
    r = c.post("/v1/volumes/fast/drain", json={"to": "slow"}).json()
    assert r["counts"] == {"done": 0, "skipped": 0, "failed": 0}
    assert r["other_namespaces"] == {OTHER: 2}
    assert OTHER in r["hint"] and "extra_namespaces" in r["hint"]
    assert w.worker.locate([BlockKey(OTHER, 501)])[0].volume_id == "fast"  # left where it was


def test_register_drain_and_unregister_a_volume_at_run_time(world: World, tmp_path: Path) -> None:
    w = world
    c = TestClient(create_app(w.svc.query()), base_url="http://127.0.0.1")
    vol = {"id": "slow2", "kind": "posix", "media": "hdd", "capacity_bytes": 1 << 30, "root": str(tmp_path / "slow2")}
    r = c.post("/v1/volumes", json={"volume": vol, "role": "slow"})
    assert r.status_code == 200 and r.json() == {"volume": "slow2", "status": "registered"}
    listed = {v["id"]: v["role"] for v in c.get("/v1/volumes").json()["volumes"]}
    assert listed == {"fast": "fast", "slow": "slow", "s3": "archive", "slow2": "slow"}
    r = c.post("/v1/volumes", json={"volume": vol})
    assert r.status_code == 409 and "already registered" in r.json()["detail"]
    r = c.post("/v1/volumes", json={"volume": {**vol, "id": "x", "kind": "tape"}})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request" and "kind" in r.json()["detail"]
    # blocks go onto the new volume by a drain, then it refuses to leave until drained again
    hs = [501, 502]
    w.put(hs, "fast")
    w.events("w0", *chain(hs, "fast"))
    assert c.post("/v1/volumes/fast/drain", json={"to": "slow2"}).json()["counts"]["done"] == 2
    assert w.where(hs) == ["slow2", "slow2"]
    r = c.delete("/v1/volumes/slow2")
    assert r.status_code == 409 and "still holds 2 blocks: drain it first" in r.json()["detail"]
    for fixed in ("fast", "s3"):
        assert "fast or archive" in c.delete(f"/v1/volumes/{fixed}").json()["detail"]
    assert c.post("/v1/volumes/slow2/drain", json={"to": "slow"}).json()["counts"]["done"] == 2
    assert w.where(hs) == ["slow", "slow"]
    assert c.delete("/v1/volumes/slow2").json() == {"volume": "slow2", "status": "unregistered"}
    assert "slow2" not in {v["id"] for v in c.get("/v1/volumes").json()["volumes"]}
    assert "slow2" not in {d.id for d in w.svc.agent.volumes()}
    assert c.delete("/v1/volumes/slow2").status_code == 409  # unknown now


def test_stats_and_status_list_the_namespaces_on_the_volumes(world: World) -> None:
    """Which namespace to set was found only by reading catalog.sqlite: /v1/stats and
    `kvadvisor status` list the managed ones and those the catalog holds blocks in."""
    from rich.console import Console

    from kvadvisor.status import Status, print_status

    w = world
    w.put([601, 602], "fast")
    w.worker.put([(BlockKey(OTHER, 603), data(603))], "slow")
    c = TestClient(create_app(w.svc.query()), base_url="http://127.0.0.1")
    seen = {NS: {"fast": 2}, OTHER: {"slow": 1}}
    end = time.monotonic() + 60
    while c.get("/v1/stats").json()["namespaces"]["seen"] != seen and time.monotonic() < end:
        time.sleep(0.2)  # /v1/stats looks at the catalog every few seconds
    ns = c.get("/v1/stats").json()["namespaces"]
    # the advisor follows the catalog's namespaces: the other model's is managed too
    assert ns == {"managed": [NS, OTHER], "seen": seen, "left": {}}

    def rows() -> tuple[list[str], str]:
        console = Console(record=True, width=200)
        print_status(Status("http://x", {"status": "ok"}, c.get("/v1/stats").json(), []), console)
        text = console.export_text()
        return [" ".join(ln.replace("│", " ").split()) for ln in text.splitlines()], text

    got, text = rows()
    assert f"{NS} yes fast=2" in got and f"{OTHER} yes slow=1" in got, text
    w.svc.settings = w.svc.settings.model_copy(update={"follow_catalog_namespaces": False})
    w.svc.managed_namespaces(max_age_s=0.0)
    assert c.get("/v1/stats").json()["namespaces"] == {"managed": [NS], "seen": seen, "left": {OTHER: 1}}
    got, text = rows()
    assert f"{NS} yes fast=2" in got and f"{OTHER} no: add to extra_namespaces slow=1" in got, text
