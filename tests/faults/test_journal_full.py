"""Finding 1: a journal on a full filesystem. Every batch a worker sent over ZMQ is
journaled and applied once space is back (backpressure, not loss); meanwhile the failures
are counted and ``/healthz`` answers 503 with the reason, then 200 again."""

from __future__ import annotations

from pathlib import Path

import httpx

from advisor import AdvisorService, AdvisorSettings
from event_plane import PublisherConfig, make_publisher
from event_plane.schema import store
from storage_backends import free_port
from tests.faults._mounts import fill, small_tmpfs
from tests.faults._world import wait_until

BATCHES = 400



def test_full_journal_applies_backpressure_is_counted_and_unhealthy(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "jfs", "16m") as jfs:
        port, replay = free_port(), free_port()
        url = f"zmq://127.0.0.1:{port}?replay={replay}"
        settings = AdvisorSettings(journal_path=str(jfs / "journal.sqlite"), subscribe_urls=[url], api_port=0,
                                   get_timeout_s=0.05, snapshot_store="none")
        pub = make_publisher(url, "w0", config=PublisherConfig(max_events=1, max_delay_s=0.01))
        svc = AdvisorService(settings)
        svc.start()
        try:
            http = httpx.Client(base_url=svc.api_url, timeout=10.0)
            assert http.get("/healthz").status_code == 200
            pub.publish([store(1, 1, None, 4096, "g1")])
            pub.flush()
            wait_until(lambda: svc.position >= 1)
            filler = jfs / "filler"
            fill(filler)
            for h in range(2, BATCHES + 1):  # one batch per event, each with a 1 KiB metadata value
                pub.publish([store(h, 1, h - 1, 4096, "g1", {"pad": "x" * 1024})])
            pub.flush()
            wait_until(lambda: svc.counters["journal_failures"] > 0)
            r = http.get("/healthz")
            assert r.status_code == 503, r.text
            assert r.json()["status"] == "unhealthy" and "journal append failed" in r.json()["reason"]
            assert svc.counters["bad_batches"] == 0
            metrics = http.get("/metrics").text
            assert "kvadvisor_journal_failures_total" in metrics
            stuck = svc.position
            assert stuck < BATCHES
            filler.unlink()  # space is back: the same batches go through, in order
            wait_until(lambda: svc.position >= BATCHES)
            assert http.get("/healthz").status_code == 200
            assert svc.index.stats()["counters"]["events"] == BATCHES
            assert len(svc.index.blocks_at("w0/g1")) == BATCHES
            assert svc.journal is not None and len(svc.journal) == BATCHES
            http.close()
        finally:
            svc.stop()
            pub.close()
