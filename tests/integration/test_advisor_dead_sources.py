"""Acceptance: a worker that stops has its g1/g2 blocks dropped after ``source_ttl_s``.

A worker process publishes over ZMQ: blocks in its g1 and g2 and blocks it wrote to the shared
``slow`` volume.  A second worker keeps publishing.  The first one exits; past the TTL, its g1/g2
blocks are gone from the index, from the REST API and from the dashboard (headless chromium),
its blocks on the shared volume stay, the other worker keeps its g1, and a restart of the advisor
on the same journal (replay) gives the same index.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import httpx

from advisor import AdvisorService, AdvisorSettings, VolumeSettings
from api import create_app, serve_in_thread
from api.dashboard import mount_dashboard
from event_plane import PublisherConfig, make_publisher
from event_plane.schema import store
from storage_backends.local_s3 import free_port
from tests.integration.test_api_dashboard import chromium_cmd, parse_dom, run_browsers, wait_for

TTL_S = 2.0
BS = 4096

WORKER = r'''
import sys, threading, time
from event_plane import PublisherConfig, make_publisher
from event_plane.schema import store
url = sys.argv[1]
pub = make_publisher(url, "w0", config=PublisherConfig(max_delay_s=0.05))
def chain(hs, loc):
    out, parent = [], None
    for h in hs:
        out.append(store(h, hs[0], parent, 4096, loc)); parent = h
    return out
# g1, g2 and the shared slow volume, then a heartbeat (its g1 again) every 0.3 s until told
# to stop (stdin closes): alive as long as it runs, however long the test takes to get there
pub.publish(chain([1, 2, 3], "g1") + chain([1, 2, 3, 4], "g2") + chain([1, 2, 3, 4, 5], "slow"))
pub.flush()
print("published", flush=True)
done = threading.Event()
def heartbeat():
    while not done.wait(0.3):
        pub.publish(chain([1, 2, 3], "g1")); pub.flush()
beat = threading.Thread(target=heartbeat)
beat.start()
sys.stdin.read()
done.set()
beat.join()
# the last batch: the monotonic clock (system-wide) and the wall clock before it went out
mono, wall = time.monotonic(), time.time()
pub.publish(chain([1, 2, 3], "g1")); pub.flush()
print(mono, wall, time.time(), flush=True)
pub.close()
'''


def _chain(hashes: list[int], loc: str) -> list:
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


def test_a_stopped_worker_loses_its_g1_g2_after_the_ttl_everywhere_and_keeps_its_volume_blocks(tmp_path: Path) -> None:
    p0, r0, p1, r1 = free_port(), free_port(), free_port(), free_port()
    url0, url1 = f"zmq://127.0.0.1:{p0}?replay={r0}", f"zmq://127.0.0.1:{p1}?replay={r1}"
    vols = [VolumeSettings(id="slow", kind="posix", media="hdd", capacity_bytes=1 << 20, root=str(tmp_path / "slow"))]
    conf = dict(journal_path=str(tmp_path / "j.sqlite"), catalog_path=str(tmp_path / "catalog.sqlite"),
                namespace="dead", volumes=vols, slow_volumes=["slow"], policy_interval_s=0, api_enabled=False,
                get_timeout_s=0.05, source_ttl_s=TTL_S, snapshot_store="none")
    worker = subprocess.Popen([sys.executable, "-c", WORKER, url0], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              cwd=str(Path(__file__).resolve().parents[2]))
    live = make_publisher(url1, "w1", config=PublisherConfig(max_delay_s=0.05))
    stop_beat = threading.Event()

    def heartbeat() -> None:  # w1 stays alive: a batch every 0.3 s
        while not stop_beat.wait(0.3):
            live.publish(_chain([100, 101], "g1"))
            live.flush()

    svc = AdvisorService(AdvisorSettings(**conf, subscribe_urls=[url0, url1]))
    server = None
    beat = threading.Thread(target=heartbeat, daemon=True)
    try:
        assert worker.stdout is not None and worker.stdout.readline().strip() == b"published"
        svc.start()
        beat.start()
        idx = svc.index
        # ZMQ slow joiner: the worker's first batch went out before the advisor connected; its
        # replay socket gives it back once the subscriber learns of it (the heartbeats carry
        # only g1), so wait for w0's g2, which only the replay brings
        wait_for(lambda: svc.index.count_at("w0/g2") == 4 and svc.index.count_at("w1/g1") == 2, timeout=30.0,
                 what=lambda: svc.query().stats()["blocks_per_location"])
        app = create_app(svc.query())
        mount_dashboard(app)
        server = serve_in_thread(app)
        base = server.url
        assert httpx.get(f"{base}/v1/locations/w0/g1/blocks").json()["count"] == 3

        worker.stdin.close()  # the worker stops
        sent_mono, sent_wall, flushed_wall = map(float, worker.stdout.readline().split())
        assert worker.wait(timeout=30) == 0
        # not before the TTL: the advisor heard the last batch no earlier than it went out, so
        # its blocks must be there until TTL after that; polled from the worker's exit on, the
        # first look that finds them gone is no earlier than that (a late look on a loaded
        # machine only makes this weaker, never false)
        gone_at: list[float] = []

        def expired() -> bool:
            if svc.index.count_at("w0/g1") + svc.index.count_at("w0/g2") == 0:
                gone_at.append(time.monotonic())  # read after the look: no earlier than the expiry
                return True
            return False

        wait_for(expired, timeout=TTL_S + 30.0)
        assert gone_at[0] >= sent_mono + TTL_S, (gone_at[0] - sent_mono, TTL_S)
        idx = svc.index
        # the index: w0's private tiers gone, its volume blocks and w1's g1 kept
        assert idx.blocks_at("w0/g1") == set() and idx.blocks_at("w0/g2") == set()
        assert idx.blocks_at("slow") == {1, 2, 3, 4, 5}
        assert idx.blocks_at("w1/g1") == {100, 101}
        assert svc.counters["sources_expired"] == 1
        # the API
        st = httpx.get(f"{base}/v1/stats").json()
        assert "w0/g1" not in st["blocks_per_location"] and "w0/g2" not in st["blocks_per_location"]
        assert st["blocks_per_location"]["slow"] == 5 and st["blocks_per_location"]["w1/g1"] == 2
        for loc in ("w0/g1", "w0/g2"):
            assert httpx.get(f"{base}/v1/locations/{loc}/blocks").json()["count"] == 0
        assert httpx.get(f"{base}/v1/locations/slow/blocks").json()["count"] == 5
        # the expiry is not a sign of life: last seen is the last batch's own timestamp
        assert sent_wall - 1e-3 <= st["sources"]["w0"]["last_seen_s"] <= flushed_wall + 1e-3, (st["sources"]["w0"], sent_wall)
        last_seen = st["sources"]["w0"]["last_seen"]
        assert last_seen.startswith(time.strftime("%Y-", time.gmtime()))
        # the dashboard
        (dump,) = run_browsers([chromium_cmd(tmp_path, "dom", "--dump-dom", f"{base}/dashboard")])
        dom = parse_dom(dump.stdout)
        assert dom.by_id["status"].attrs.get("data-state") == "ok", dom.by_id["status"].text
        locs = dom.table("locations-body")
        assert "w0/g1" not in locs and "w0/g2" not in locs
        assert locs["slow"]["blocks"].attrs["data-value"] == "5" and "w1/g1" in locs
        sources = dom.table("sources-body")
        assert sources["w0"]["last_seen"].attrs["title"] == last_seen
        assert sources["w0"]["last_seen"].text.strip().startswith(last_seen.replace("T", " ")[:19])
    finally:
        stop_beat.set()
        if beat.is_alive():
            beat.join(timeout=10)
        if server is not None:
            server.stop()
        if worker.poll() is None:
            worker.kill()
            worker.wait()
        live.close()
        svc.stop()
    # replay: a restart on the same journal gives the same index (the expiry was journaled)
    # (reconcile off: this worker only published its volume events, the catalog never held them).
    # The index is read once the service has stopped: w1's heartbeat publishes until then, and
    # a batch that lands after an earlier read is in the journal but not in that read
    dumped = svc.index.dump()
    again = AdvisorService(AdvisorSettings(**conf, reconcile_on_start=False))
    again.start()
    try:
        assert again.index.blocks_at("w0/g1") == set() and again.index.blocks_at("slow") == {1, 2, 3, 4, 5}
        assert again.index.dump() == dumped
    finally:
        again.stop()
