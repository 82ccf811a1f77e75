"""Fault cell: the NATS JetStream server killed (-9) mid-run and restarted on its store.
Every batch a worker published (before, during and after the outage) is journaled and
applied by the advisor exactly once; the index equals a fresh fold of the journal."""

from __future__ import annotations

import time
from pathlib import Path

from advisor import AdvisorService
from event_plane import PublisherConfig, make_publisher
from tests.conftest import start_nats_server
from tests.faults._invariants import index_equals_fold
from tests.faults._world import chain, settings
from storage_backends import free_port


def _wait(pred, timeout: float = 120.0) -> bool:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return True
        time.sleep(0.05)
    return pred()


def test_nats_killed_and_restarted_mid_run(tmp_path: Path) -> None:
    port = free_port()
    store = str(tmp_path / "js")
    proc, _, _ = start_nats_server(port, store)
    url = f"jetstream://127.0.0.1:{port}?namespace=faults"
    s = settings(tmp_path, subscribe_urls=[url], get_timeout_s=0.05)
    pub = make_publisher(url, "w0", config=PublisherConfig(max_events=1), reconnect_time_wait=0.1,
                         manage_stream=True)
    svc = AdvisorService(s)
    try:
        svc.start()
        for h in range(1, 11):
            pub.publish(chain([h], "g1"))
        pub.flush()
        assert _wait(lambda: len(svc.index.blocks_at("w0/g1")) == 10)
        proc.kill()  # -9
        proc.wait(timeout=10)
        for h in range(11, 21):  # while the server is down: the publisher retries
            pub.publish(chain([h], "g1"))
        proc, _, _ = start_nats_server(port, store)
        pub.flush()
        for h in range(21, 31):
            pub.publish(chain([h], "g1"))
        pub.flush()
        assert pub.stats().dropped == 0
        assert _wait(lambda: len(svc.index.blocks_at("w0/g1")) == 30), svc.index.stats()
        assert svc.journal is not None and len(svc.journal) == 30  # each batch journaled once
        index_equals_fold(svc)
        assert svc.query().health()["status"] == "ok"
    finally:
        svc.stop()
        pub.close()
        proc.kill()
        proc.wait(timeout=10)


def test_full_jetstream_store(tmp_path: Path) -> None:
    """A stream that is full (``discard=new``): the publisher is refused at once and counts
    it (the loss is reported with its reason); every batch the stream accepted is applied;
    once there is room, batches flow again without a restart."""
    import asyncio

    import nats
    from nats.js import api

    port = free_port()
    proc, nats_url, _ = start_nats_server(port, str(tmp_path / "js"))

    def js(fn):  # noqa: ANN001, ANN202
        async def go():  # noqa: ANN202
            nc = await nats.connect(nats_url)
            try:
                return await fn(nc.jetstream())
            finally:
                await nc.close()
        return asyncio.run(go())

    js(lambda j: j.add_stream(api.StreamConfig(name="KVADVISOR_EVENTS", subjects=["kvadvisor.events.>"],
                                               max_msgs=20, discard=api.DiscardPolicy("new"),
                                               duplicate_window=120.0)))
    url = f"jetstream://127.0.0.1:{port}?namespace=full"
    s = settings(tmp_path, subscribe_urls=[url], get_timeout_s=0.05)
    pub = make_publisher(url, "w0", config=PublisherConfig(max_events=1))
    svc = AdvisorService(s)
    try:
        svc.start()
        for h in range(1, 61):
            pub.publish(chain([h], "g1"))
            pub.flush()
        # full at 20 messages: a message limit is enforced exactly (nats-server 2.9 checks
        # max_bytes before counting a message's headers, so at a byte limit it may accept a
        # batch and then delete its oldest messages instead of refusing)
        info = js(lambda j: j.stream_info("KVADVISOR_EVENTS")).state
        stored = info.messages
        assert info.last_seq == stored == 20, info
        st = pub.stats()
        assert 0 < stored < 60, stored
        # every batch the stream did not accept is reported by the publisher, not silent
        assert st.refused > 0 and st.dropped == st.refused == 60 - stored, (stored, st)
        assert _wait(lambda: svc.position == stored), (svc.position, stored)
        assert len(svc.index.blocks_at("w0/g1")) == stored
        js(lambda j: j.purge_stream("KVADVISOR_EVENTS"))  # room again
        pub.publish(chain([1000], "g1"))
        pub.flush()
        assert _wait(lambda: 1000 in svc.index.blocks_at("w0/g1"))
        index_equals_fold(svc)
        assert svc.query().health()["status"] == "ok"
    finally:
        svc.stop()
        pub.close()
        proc.kill()
        proc.wait(timeout=10)
