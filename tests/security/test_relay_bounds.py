"""``kvadvisor events relay`` is bounded, over real ZMQ and a real NATS: a stream naming 600
sources opens at most ``--max-sources`` publishers (each one a NATS connection and a
thread), the rest are skipped and counted; a batch whose source cannot be a subject token is
skipped alone and the relay goes on."""

from __future__ import annotations

import asyncio
import json
import threading
import time
import uuid
from typing import Any

import nats
from security_helpers import BS, RawPub
from typer.testing import CliRunner

from event_plane.codec import decode_batch
from event_plane.schema import WIRE_VERSION, EventBatch, store
from kvadvisor.cli import app


def test_relay_caps_its_sources_and_skips_a_bad_name(nats_url: str) -> None:
    ns = "r" + uuid.uuid4().hex[:8]
    pub = RawPub()
    got: list[Any] = []
    out: list[Any] = []
    seen: set[str] = set()
    stop = threading.Event()

    async def watch() -> None:
        nc = await nats.connect(nats_url)
        await nc.subscribe(f"kvadvisor.events.{ns}.>", cb=_seen)
        while not stop.is_set():
            await asyncio.sleep(0.05)
        await nc.close()

    async def _seen(m: Any) -> None:
        seen.add(decode_batch(m.data).source)

    watcher = threading.Thread(target=lambda: asyncio.run(watch()), daemon=True)
    watcher.start()
    relay = threading.Thread(target=lambda: out.append(CliRunner().invoke(
        app, ["events", "relay", pub.url, f"{nats_url}?namespace={ns}", "--duration", "10", "--max-sources", "50"])),
        daemon=True)
    relay.start()
    try:
        seq = 0
        deadline = time.monotonic() + 15
        while "first" not in seen:  # the relay's SUB joins late: probe until a batch comes through
            assert time.monotonic() < deadline, "the relay never relayed a batch"
            pub.send(EventBatch(WIRE_VERSION, "first", 1, seq, 1, [store(1, 1, None, BS, "g1")]))
            seq += 1
            time.sleep(0.2)
        pub.send(EventBatch(WIRE_VERSION, "bad.name", 1, 0, 1, [store(2, 2, None, BS, "g1")]))
        for s in range(600):
            pub.send(EventBatch(WIRE_VERSION, f"s{s}", 1, 0, 1, [store(10 + s, 10 + s, None, BS, "g1")]))
        pub.send(EventBatch(WIRE_VERSION, "first", 1, seq, 1, [store(3, 3, None, BS, "g1")]))
        relay.join(timeout=60)
        assert out, "the relay did not end"
        res = out[0]
        assert res.exit_code == 0, res.output
        report = json.loads(res.stdout.strip().splitlines()[-1])
        assert report["sources"] == 50
        assert report["refused_sources"] == 600 - 49
        assert report["bad_sources"] == 1
        assert "s0" in seen and "s100" not in seen and "bad.name" not in seen
    finally:
        stop.set()
        pub.close()
