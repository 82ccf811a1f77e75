"""Prefetch hints end to end: a router's ``POST /v1/lookup`` over the real HTTP API makes the
live advisor promote that prefix from S3 (moto's HTTP endpoint, NIXL OBJ) to the POSIX
``fast`` volume before the request's blocks are read; used / wasted counters in
``/v1/stats`` and ``/metrics``."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from pathlib import Path

import httpx
import pytest

from advisor import AdvisorService, PlanItem, PlanKind, PlanStatus
from storage_backends.local_s3 import LocalS3
from tests.faults._world import BLK, Worker, chain, settings


def wait_for(pred: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not pred():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)


class World:
    """A live advisor (``fast`` posix, ``slow`` posix, ``s3`` archive on moto; the API on a
    free loopback port; no background policy rounds) and a worker on the same catalog."""

    def __init__(self, tmp: Path, s3: LocalS3) -> None:
        self.settings = settings(
            tmp, archive=(s3.endpoint, s3.access_key, s3.secret_key), api_enabled=True, api_port=0,
            policy={"planner": {"min_move_interval_s": 0}},
            prefetch={"bytes_per_s": 4 * BLK, "max_pending_blocks": 8})
        self.svc = AdvisorService(self.settings)
        self.svc.start()
        assert self.svc.api_url is not None
        self.http = httpx.Client(base_url=self.svc.api_url, timeout=30)
        self.worker = Worker(self.settings)

    def events(self, source: str, *evs) -> None:  # noqa: ANN002
        self.worker.send(self.svc, source, *evs)

    def where(self, hashes: list[int]) -> list[str | None]:
        return self.worker.where(hashes)

    def prefetch(self) -> dict[str, int]:
        return self.http.get("/v1/stats").json()["prefetch"]

    def close(self) -> None:
        self.http.close()
        self.svc.stop()
        self.worker.close()


@pytest.fixture
def world(tmp_path: Path, local_s3: LocalS3) -> Iterator[World]:
    w = World(tmp_path, local_s3)
    try:
        yield w
    finally:
        w.close()


def test_router_lookups_prefetch_the_prefix_from_s3_to_fast_and_count_used_and_wasted(world: World) -> None:
    used, wasted = [1, 2, 3, 4], [21, 22]
    world.worker.put(used + wasted, "s3")
    world.events("w0", *chain(used, "s3"), *chain(wasted, "s3"))  # offloaded to S3, evicted from G1/G2
    assert world.where(used + wasted) == ["s3"] * 6
    assert world.prefetch()["issued"] == 0

    # the router asks before it dispatches: the blocks go S3 -> fast (at 4 blocks/s)
    body = world.http.post("/v1/lookup", json={"sequence_hashes": used + [99]}).json()
    assert body["prefix_blocks"] == {"s3": 4}  # the answer describes the state at the lookup
    wait_for(lambda: world.where(used) == ["fast"] * 4, "the looked-up prefix on fast")
    # the engine then onboards the blocks: read from fast, bytes verified, Stored at g1
    assert world.worker.reads_back(used)
    world.events("w1", *chain(used, "g1"))
    wait_for(lambda: world.prefetch()["used"] == 4, "4 prefetches used")

    # a looked-up prefix the request never read: demoted again before any hit -> wasted
    world.http.post("/v1/lookup", json={"sequence_hashes": wasted})
    wait_for(lambda: world.where(wasted) == ["fast"] * 2, "the second prefix on fast")
    res = world.svc.execute_items([PlanItem(PlanKind.DEMOTE, "test: make room", "fast", "s3", sequence_hash=h,
                                            bytes=BLK) for h in wasted])
    assert [r.status for r in res] == [PlanStatus.DONE] * 2
    wait_for(lambda: world.prefetch()["wasted"] == 2, "2 prefetches wasted")

    # a lookup of blocks already on fast is no prefetch; one over the queue quota is refused
    world.http.post("/v1/lookup", json={"sequence_hashes": used})
    world.http.post("/v1/lookup", json={"sequence_hashes": list(range(1000, 1010))})  # 10 blocks > 8
    wait_for(lambda: world.prefetch()["hints"] == 4, "4 hints")
    st = world.prefetch()
    assert {k: st[k] for k in ("hints", "refused", "queued", "issued", "used", "wasted", "failed", "pending",
                               "tracked", "bytes")} == {
        "hints": 4, "refused": 1, "queued": 6, "issued": 6, "used": 4, "wasted": 2, "failed": 0, "pending": 0,
        "tracked": 0, "bytes": 6 * BLK}
    assert world.where(used + wasted) == ["fast"] * 4 + ["s3"] * 2
    plans = world.http.get("/v1/plans").json()["plans"]
    assert [(p["kind"], p["sequence_hash"], p["src_volume"], p["dst_volume"]) for p in plans[:4]] == [
        ("promote", h, "s3", "fast") for h in used]
    assert plans[0]["reason"].startswith("prefetch: a lookup named this prefix")
    text = world.http.get("/metrics").text
    for outcome, n in (("hint", 4), ("refused", 1), ("issued", 6), ("used", 4), ("wasted", 2)):
        assert f'kvadvisor_prefetch_total{{outcome="{outcome}"}} {float(n)}' in text
    assert f"kvadvisor_prefetch_bytes_total {float(6 * BLK)}" in text
    assert 'kvadvisor_moves_total{kind="promote",status="done"} 6.0' in text


def test_a_token_flooding_lookups_cannot_take_another_routers_share_of_the_prefetch_queue(
        tmp_path: Path, local_s3: LocalS3) -> None:
    # two read tokens, two clients: one floods the prefetch queue with long lookups; the other
    # router's lookup still gets its blocks queued, by taking room from the flood.  The budget
    # moves one block, then nothing for an hour (a full bucket lets one block larger than
    # its burst through, then refills at 1 byte/s), so what is checked is the queue
    from pydantic import SecretStr

    from api.auth import ApiSecuritySettings
    from api.server import serve_query

    flood_token, router_token = "flood-" + "f" * 24, "router-" + "r" * 24
    conf = settings(tmp_path, archive=(local_s3.endpoint, local_s3.access_key, local_s3.secret_key),
                    policy={"planner": {"min_move_interval_s": 0}},
                    prefetch={"bytes_per_s": 1.0, "burst_bytes": 1, "max_pending_blocks": 8})
    svc = AdvisorService(conf)
    svc.start()
    worker = Worker(conf)
    server = serve_query(svc.query(), security=ApiSecuritySettings(read_tokens=[SecretStr(flood_token),
                                                                                SecretStr(router_token)]))
    flood = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {flood_token}"})
    router = httpx.Client(base_url=server.url, timeout=30, headers={"Authorization": f"Bearer {router_token}"})
    try:
        flooded, mine = list(range(1, 25)), [101, 102, 103]
        worker.put(flooded + mine, "s3")
        worker.send(svc, "w0", *chain(flooded, "s3"), *chain(mine, "s3"))

        def prefetch() -> dict[str, int]:
            return router.get("/v1/stats").json()["prefetch"]

        for k in range(3):  # 8 blocks each: the first fills the queue, the others are refused
            assert flood.post("/v1/lookup", json={"sequence_hashes": flooded[8 * k: 8 * k + 8]}).status_code == 200
        wait_for(lambda: prefetch()["queued"] == 8 and prefetch()["issued"] == 1, "the flood queued, one moved")
        st = prefetch()
        assert (st["hints"], st["pending"], st["clients"], st["refused"], st["displaced"]) == (3, 7, 1, 2, 0), st
        # the other router: 3 blocks, made room for by the flood's 2 newest
        assert router.post("/v1/lookup", json={"sequence_hashes": mine}).status_code == 200
        wait_for(lambda: prefetch()["queued"] == 11, "the router's prefix queued")
        st = prefetch()
        assert (st["pending"], st["clients"], st["refused"], st["displaced"]) == (8, 2, 2, 2), st
        # the flooder, again: it holds the most (5 against 3), so nobody gives way to it
        assert flood.post("/v1/lookup", json={"sequence_hashes": flooded[8:9]}).status_code == 200
        wait_for(lambda: prefetch()["hints"] == 5, "the flooder's last hint")
        assert (prefetch()["refused"], prefetch()["displaced"], prefetch()["pending"]) == (3, 2, 8)
        text = router.get("/metrics").text
        assert 'kvadvisor_prefetch_total{outcome="displaced"} 2.0' in text
        assert flood_token not in text and router_token not in text
    finally:
        flood.close()
        router.close()
        server.stop()
        svc.stop()
        worker.close()
