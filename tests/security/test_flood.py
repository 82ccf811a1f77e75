"""Acceptance flood, over real ZMQ and a real uvicorn server: registrations, epochs, source
names and one 64 MB message, each in turn, while a well-behaved publisher keeps sending.
After each flood the advisor indexes the well-behaved publisher's next batch within
:data:`INGEST_DEADLINE_S` (polled), and the process's peak RSS grows by less than
:data:`RSS_BOUND` (docs/security.md, "Flood bounds").

The floods are scaled down (:data:`SCALE` of the full 2,000 registrations, 200,000 epochs,
50,000 source names) to keep the suite short: what each bounds is a quota (registrations:
the registry's budget; epochs: 8 retired per source; source names: ``quota_max_sources``,
lowered here in proportion), so the state held is the same at full scale.
"""

from __future__ import annotations

import re
import time
from pathlib import Path
from typing import Any

import httpx
from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import BS, RawPub, settings, wait_for

from event_plane import PublisherConfig, make_publisher
from event_plane.frames import seq_to_bytes
from event_plane.ordering import MAX_RETIRED_EPOCHS
from event_plane.schema import WIRE_VERSION, EventBatch, store
from storage_backends.local_s3 import free_port

SCALE = 0.1
INGEST_DEADLINE_S = 1.0
RSS_BOUND = 160 << 20
"""Peak RSS growth allowed over the whole flood (the 64 MB message alone is not read)."""


def peak_rss() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def test_flood_in_turn_keeps_a_well_behaved_publisher_indexed(tmp_path: Path, advisor: Any) -> None:
    bad = RawPub()
    good_url = f"zmq://127.0.0.1:{free_port()}?replay={free_port()}"
    sources = int(50_000 * SCALE)
    svc = advisor(settings(tmp_path, [bad.url, good_url], api_enabled=True, api_port=free_port(),
                           quota_max_sources=sources // 5))
    good = make_publisher(good_url, "good", config=PublisherConfig(max_events=1, max_delay_s=0.01), epoch=1)
    h = [1 << 40]

    def good_batch_indexed(phase: str) -> None:
        h[0] += 1
        good.publish([store(h[0], h[0], None, BS, "g1")])
        wait_for(lambda: svc.index.holds(h[0], "good/g1"), timeout=INGEST_DEADLINE_S,
                 what=f"the well-behaved batch after the {phase} flood")

    try:
        bad.join(svc)
        wait_for(lambda: (good.publish([store(1, 1, None, BS, "g1")]) or svc.index.holds(1, "good/g1")),
                 timeout=30, what="the well-behaved publisher joined")
        with open("/proc/self/clear_refs", "w") as fh:
            fh.write("5")
        base = peak_rss()
        with httpx.Client(base_url=svc.api_url, timeout=30) as c:
            dead = f"tcp://127.0.0.1:{free_port()}"
            codes = [c.post("/register", json={"instance_id": k, "endpoint": dead, "model_name": "m",
                                               "block_size": 32}).status_code for k in range(int(2000 * SCALE))]
            assert set(codes) <= {200, 429}
        good_batch_indexed("registration")

        for e in range(int(200_000 * SCALE)):
            bad.send(EventBatch(WIRE_VERSION, "churn", 1_000_000 + e, 0, 1, []))
        wait_for(lambda: "churn" in svc.index.sources() and svc.index.sources()["churn"].epoch
                 == 1_000_000 + int(200_000 * SCALE) - 1, timeout=60, what="the epoch flood ingested")
        good_batch_indexed("epoch")
        assert len(svc.index.sources()["churn"].retired_epochs) == MAX_RETIRED_EPOCHS

        for s in range(sources):
            bad.send(EventBatch(WIRE_VERSION, f"name-{s}", 1, 0, 1, [store(10 + s, 10 + s, None, BS, "g1")]))
        wait_for(lambda: svc.counters["quota_refused_batches_sources"] >= sources - svc.settings.quota_max_sources,
                 timeout=60, what="the source-name flood refused")
        good_batch_indexed("source-name")
        assert len(svc.origins.bindings()) <= svc.settings.quota_max_sources

        bad.sock.send_multipart([b"", seq_to_bytes(0), bytes(64 << 20)], copy=False)
        time.sleep(0.5)  # the message is on its way (or dropped) when the good batch is sent
        good_batch_indexed("64 MB message")
        growth = peak_rss() - base
        print(f"flood: peak RSS grew by {growth >> 20} MiB (bound {RSS_BOUND >> 20} MiB)")
        assert growth < RSS_BOUND, f"peak RSS grew by {growth >> 20} MiB"
    finally:
        good.close()
        bad.close()
