"""A cluster client that gets a malformed answer on ``kvadvisor.query.*`` (whoever may answer
there sent bytes that are not an answer) reports the partition unavailable (the API's 503)
instead of failing with a KeyError or a decode error (the API's 500), over a real NATS."""

from __future__ import annotations

import asyncio
import threading
import uuid

import msgspec
import nats
import pytest

from advisor.cluster import ClusterClient, PartitionUnavailable, query_subject
from event_plane.partition import PartitionScheme

ANSWERS = [b"\xc1", msgspec.msgpack.encode([1, 2]), msgspec.msgpack.encode({"locations": 7, "position": 1}),
           msgspec.msgpack.encode({"position": "x", "locations": {}, "any": 0}), b"\x91" * 100_000 + b"\xc0"]


def test_malformed_query_answers_make_the_partition_unavailable(nats_url: str) -> None:
    ns = "q" + uuid.uuid4().hex[:8]
    answer = [ANSWERS[0]]
    ready, stop = threading.Event(), threading.Event()

    async def forger() -> None:
        nc = await nats.connect(nats_url)

        async def reply(msg: nats.aio.msg.Msg) -> None:
            await msg.respond(answer[0])

        await nc.subscribe(query_subject(ns, 0), cb=reply)
        await nc.flush()
        ready.set()
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await nc.close()

    t = threading.Thread(target=lambda: asyncio.run(forger()), daemon=True)
    t.start()
    assert ready.wait(15)
    client = ClusterClient(nats_url, PartitionScheme(partitions=1), ns, timeout_s=5.0)
    try:
        for a in ANSWERS:
            answer[0] = a
            with pytest.raises(PartitionUnavailable, match="malformed"):
                client.ask(0, [1, 2, 3])
            with pytest.raises(PartitionUnavailable, match="malformed"):
                client.lookup_full([1, 2, 3])
    finally:
        client.close()
        stop.set()
        t.join(timeout=10)
