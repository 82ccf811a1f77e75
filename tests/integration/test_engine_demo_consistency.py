"""The engine demo's volume check (``kvadvisor.engine_demo.run.check_consistency``) against a
live advisor that subscribes to a real ZMQ publisher, as it subscribes to each engine's
connector: blocks written to a POSIX volume (real NIXL writes, the SQLite placement
catalog) and their Stores published the way the connector publishes them.

A publisher sends its pending batch after its flush time limit (up to ``max_delay_s``,
10 s at rest; docs/events.md §3.1), so the catalog has the engines' last blocks seconds
before the advisor hears of them: the check must wait for that, and still fail, naming the
blocks, when a Store never comes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from advisor import AdvisorService
from event_plane import EventPublisher, PublisherConfig, make_publisher
from event_plane.schema import store
from kvadvisor.demo import AdvisorClient
from kvadvisor.engine_demo.run import DRAIN_TIMEOUT_S, check_consistency
from storage_backends.local_s3 import free_port
from tests.faults._world import BLK, Worker, chain, settings

HOLD_S = 5.0
"""The test publisher's flush time limit (fixed: no adaptive lowering): a Store it takes
waits this long in the pending batch, like a connector's last ones at the end of a replay."""


@dataclass
class World:
    svc: AdvisorService
    worker: Worker
    pub: EventPublisher
    client: AdvisorClient
    catalog: Path


@pytest.fixture
def world(tmp_path: Path) -> Iterator[World]:
    url = f"zmq://127.0.0.1:{free_port()}?replay={free_port()}"
    pub = make_publisher(url, "kvbm-0", config=PublisherConfig(max_delay_s=HOLD_S, adaptive_delay=False))
    s = settings(tmp_path, api_enabled=True, api_port=0, subscribe_urls=[url])
    svc = AdvisorService(s)
    svc.start()
    assert svc.api_url is not None and s.catalog_path is not None
    w = World(svc, Worker(s), pub, AdvisorClient(svc.api_url), Path(s.catalog_path))
    try:
        yield w
    finally:
        w.client.close()
        svc.stop()
        w.worker.close()
        pub.close()


def test_check_waits_for_the_stores_a_publisher_still_holds(world: World) -> None:
    # the check outwaits the connectors' publishers (their default flush ceiling)
    assert DRAIN_TIMEOUT_S > PublisherConfig().max_delay_s
    hashes = [101, 102, 103, 104]
    world.worker.put(hashes, "fast")  # the catalog has them now
    world.pub.publish(chain(hashes, "fast"))  # their Stores wait HOLD_S in the pending batch
    cons = check_consistency(world.client, world.catalog, 0, "model", "volumes")
    assert cons["fast"]["equal"] and cons["fast"]["index"] == cons["fast"]["held"] == 4, cons
    assert world.pub.stats().batches == 1  # sent by the flush timer, not by this test
    assert "missing" not in cons["fast"] and cons["archive"]["equal"]


def test_check_names_the_blocks_whose_store_never_came(world: World) -> None:
    world.worker.put([201, 202], "fast")
    # 202's Store is lost; 203 is announced but never written (the catalog does not have it)
    world.pub.publish([store(201, 201, None, BLK, "fast"), store(203, 203, None, BLK, "fast")])
    world.pub.flush()
    cons = check_consistency(world.client, world.catalog, 0, "model", "volumes", timeout_s=HOLD_S)
    fast = cons["fast"]
    assert not fast["equal"] and (fast["index"], fast["held"]) == (2, 2), cons
    assert fast["missing"] == [f"{202:#018x}"] and fast["extra"] == [f"{203:#018x}"]
