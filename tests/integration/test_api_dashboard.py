"""Operator dashboard in a real headless browser (Debian's chromium) over a real advisor.

A real AdvisorService (ZMQ subscription, journal, posix volumes, storage catalog) ingests
event batches from a real ZMQ publisher and runs one policy round (two promotions);
uvicorn serves the API plus ``mount_dashboard``; chromium loads ``/dashboard``, runs its
JS (virtual time), and the DOM it dumps must show what the JSON API returns.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest
from fastapi import FastAPI

from advisor import AdvisorService, AdvisorSettings, VolumeSettings
from api import create_app, serve_in_thread
from api.dashboard import DashboardError, mount_dashboard
from event_plane import PublisherConfig, make_publisher
from event_plane.schema import remove, store
from storage_backends.local_s3 import free_port

from browser import chromium_cmd, parse_dom, run_browsers  # tests/browser.py

BS = 4096
NS = "dash"


# ---------------------------------------------------------------- advisor
def wait_for(pred, timeout: float = 10.0, what=lambda: "") -> None:  # noqa: ANN001
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if pred():
            return
        time.sleep(0.02)
    raise AssertionError(f"condition not reached in time {what()}")


def chain(hashes: list[int], loc: str) -> list:
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


@dataclass
class Running:
    url: str
    service: AdvisorService
    last_seq: int
    hashes: list[int]


@pytest.fixture
def advisor_with_dashboard(tmp_path: Path) -> Iterator[Running]:
    import torch

    from storage_backends import BlockKey, SqliteCatalog, StorageAgent

    port, replay = free_port(), free_port()
    url = f"zmq://127.0.0.1:{port}?replay={replay}"
    vols = [
        VolumeSettings(id="fast", kind="posix", media="nvme", capacity_bytes=64 << 10, segment_bytes=16 << 10,
                       root=str(tmp_path / "fast")),
        VolumeSettings(id="slow", kind="posix", media="hdd", capacity_bytes=32 << 10, segment_bytes=16 << 10,
                       root=str(tmp_path / "slow")),
    ]
    settings = AdvisorSettings(
        journal_path=str(tmp_path / "j.sqlite"), catalog_path=str(tmp_path / "catalog.sqlite"), namespace=NS,
        volumes=vols, fast_volume="fast", slow_volumes=["slow"], subscribe_urls=[url], policy_interval_s=0,
        api_enabled=False, get_timeout_s=0.05,
        # the page's lookups would be prefetch hints (advisor.moves.prefetch) that move blocks
        # while the page is read; this test checks the page against a world that holds still
        prefetch={"enabled": False},
    )
    # a worker wrote blocks 1..3 of one prefix to the slow volume
    hot = [0xF000_0000_0000_0001, 2, 3]  # first hash above 2**53: must survive JS as a string
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    worker = StorageAgent(cat, name="dash-worker")
    for v in vols:
        worker.register_volume(v.to_descriptor())
    worker.put([(BlockKey(NS, h), torch.full((BS,), i, dtype=torch.uint8)) for i, h in enumerate(hot)], "slow")
    svc = AdvisorService(settings)
    pub = make_publisher(url, "w0", config=PublisherConfig(max_delay_s=0.05))
    server = None
    svc.start()
    try:
        batches = [
            chain(hot, "slow"),
            chain(hot[:2], "g1"),  # onboarded into g1: hit 1
            [remove(hot[1], hot[0], hot[0], BS, "g1"), remove(hot[0], hot[0], None, BS, "g1")],
            chain(hot[:2], "g1"),  # onboarded again: hit 2 -> promotion candidates
            chain([20, 21, 22, 23], "g1") + chain([20, 21], "g2"),
        ]
        for i, events in enumerate(batches):  # one batch each: seqs 0..4
            if i == len(batches) - 1:
                # ZMQ slow joiner: batches sent before the SUB connected are lost until a later
                # one arrives and the gap is replayed; so the last one goes out only once the
                # subscriber has seen something (or after 3 s, by when it has joined)
                deadline = time.monotonic() + 3.0
                while svc.subscriber_stats().get("batches", 0) == 0 and time.monotonic() < deadline:
                    time.sleep(0.01)
            pub.publish(events)
            pub.flush()
        wait_for(lambda: svc.query().stats()["events_applied"] == 3 + 2 + 2 + 2 + 6,
                 what=lambda: {k: v for k, v in svc.query().stats().items() if k in ("sources", "subscriber", "ingest")})
        results = svc.run_policies_once()
        assert [(r.item.kind.value, r.status.value, r.item.sequence_hash) for r in results] == [
            ("promote", "done", hot[0]), ("promote", "done", hot[1])]
        app = create_app(svc.query())
        mount_dashboard(app)
        server = serve_in_thread(app)
        yield Running(server.url, svc, pub.next_seq - 1, hot)
    finally:
        if server is not None:
            server.stop()
        pub.close()
        svc.stop()
        worker.close()
        cat.close()


# ---------------------------------------------------------------- tests
def test_dashboard_renders_the_api_figures_in_chromium(advisor_with_dashboard: Running, tmp_path: Path) -> None:
    run = advisor_with_dashboard
    base = run.url
    page = httpx.get(base + "/dashboard")
    assert page.status_code == 200 and page.headers["content-type"].startswith("text/html")
    assert httpx.get(base + "/dashboard/static/dashboard.js").status_code == 200
    assert httpx.get(base + "/dashboard/static/nope.js").status_code == 404

    hot_hex = [f"0x{h:x}" for h in run.hashes]
    lookup_q = ",".join([*hot_hex, "99"])
    shot = tmp_path / "dash.png"
    dump, _ = run_browsers([
        chromium_cmd(tmp_path, "dom", "--dump-dom", f"{base}/dashboard?lookup={lookup_q}"),
        chromium_cmd(tmp_path, "shot", f"--screenshot={shot}", "--window-size=1280,1000",
                     f"{base}/dashboard?lookup={lookup_q}"),
    ])
    dom = parse_dom(dump.stdout)
    stats = httpx.get(base + "/v1/stats").json()
    volumes = httpx.get(base + "/v1/volumes").json()["volumes"]
    plans = httpx.get(base + "/v1/plans").json()

    # the JS ran and the API answered
    assert dom.by_id["status"].attrs.get("data-state") == "ok", dom.by_id["status"].text
    assert dom.by_id["status"].text.strip() == "live"
    assert dom.by_id["error-banner"].hidden

    # ingest figures
    # 15 events from w0 + the advisor's own 4 (store on fast, remove from slow, per promotion)
    assert dom.num("events-applied") == stats["events_applied"] == 19
    assert stats["sources"]["advisor"]["events"] == 4
    assert dom.num("batches-applied") == stats["batches_applied"]
    # gaps is 0, or 1 when the SUB joined late and the first batches were replayed
    assert dom.num("gaps") == stats["subscriber"]["gaps"] <= 1
    assert dom.num("unrecovered") == stats["subscriber"]["unrecovered"] == 0
    assert dom.num("decode-errors") == stats["subscriber"]["decode_errors"] == 0
    assert dom.num("blocks-total") == stats["blocks"]
    assert dom.num("journal-position") == stats["journal_position"]
    assert float(dom.by_id["events-per-s"].attrs["data-value"]) >= 0.0

    # per-source epoch / last seq
    sources = dom.table("sources-body")
    assert sorted(sources) == sorted(stats["sources"]) == ["advisor", "w0"]
    w0 = sources["w0"]
    assert int(w0["last_seq"].attrs["data-value"]) == stats["sources"]["w0"]["last_seq"] == run.last_seq
    assert w0["last_seq"].text == str(run.last_seq)
    assert run.last_seq == 4 and int(w0["batches"].attrs["data-value"]) == 5
    # epochs are random u64: exact (JSON parsed with BigInt) and shown as hex
    for name, src in stats["sources"].items():
        assert int(sources[name]["epoch"].attrs["data-value"]) == src["epoch"]
        assert sources[name]["epoch"].text == f"0x{src['epoch']:016x}"
    assert int(w0["events"].attrs["data-value"]) == stats["sources"]["w0"]["events"] == 15
    # last seen: the last batch's timestamp, shown relative to now
    assert int(w0["last_seen"].attrs["data-value"]) == stats["sources"]["w0"]["last_ts_ns"] > 0
    assert w0["last_seen"].text.endswith("ago")

    # blocks per location: the same figures as the API, biggest first
    locs = dom.table("locations-body")
    shown = {k: int(v["blocks"].attrs["data-value"]) for k, v in locs.items()}
    assert shown == stats["blocks_per_location"]
    assert shown == {"fast": 2, "slow": 1, "w0/g1": 6, "w0/g2": 2}
    assert [c.row for c in dom.cells if c.table == "locations-body" and c.attrs["data-field"] == "location"] == [
        "w0/g1", "fast", "w0/g2", "slow"]

    # volumes: capacity, used, live, dead bytes, segments
    vrows = dom.table("volumes-body")
    assert sorted(vrows) == ["fast", "slow"]
    for v in volumes:
        row = vrows[v["id"]]
        for f in ("capacity_bytes", "used_bytes", "live_bytes", "dead_bytes", "segments", "blocks"):
            assert row[f].attrs["data-value"] == str(v[f]), (v["id"], f)
        assert row["role"].text == v["role"]
        assert float(row["fill"].attrs["data-value"]) == pytest.approx(100 * v["used_bytes"] / v["capacity_bytes"], abs=0.01)
    assert vrows["fast"]["capacity_bytes"].text == "64.0 KiB" and vrows["fast"]["used_bytes"].text == "8.0 KiB"
    assert vrows["fast"]["fill"].attrs["data-value"] == "12.50"

    # moves and recent plans with their reasons, newest first
    assert dom.num("promotions") == stats["promotions"] == 2
    assert dom.num("demotions") == 0 and dom.num("compactions") == 0
    assert int(dom.by_id["bytes-moved"].attrs["data-value"]) == stats["bytes_moved"] == 2 * BS
    assert dom.by_id["bytes-moved"].text == "8.0 KiB"
    moves = dom.table("moves-body")
    assert sorted(moves) == ["compact", "demote", "promote"]
    assert {f: int(c.attrs["data-value"]) for f, c in moves["promote"].items() if f != "kind"} == {
        "done": 2, "skipped": 0, "failed": 0, "blocks": 2, "bytes": 2 * BS}
    prows = dom.table("plans-body")
    newest_first = plans["plans"][::-1]
    assert [prows[str(i)]["target"].text for i in range(len(newest_first))] == [
        p["sequence_hash_hex"] for p in newest_first] == [f"0x{run.hashes[1]:016x}", f"0x{run.hashes[0]:016x}"]
    for i, p in enumerate(newest_first):
        assert prows[str(i)]["reason"].text.startswith(p["reason"]) and "min_hits" in p["reason"]
        assert prows[str(i)]["status"].text == "done" and prows[str(i)]["route"].text == "slow → fast"

    # lookup box (?lookup= runs it on load): longest cached prefix per location
    expect = httpx.post(base + "/v1/lookup", json={"sequence_hashes": [*hot_hex, "99"]}).json()
    assert not dom.by_id["lookup-result"].hidden
    got = {k: int(v["prefix_blocks"].attrs["data-value"]) for k, v in dom.table("lookup-body").items()}
    assert got == expect["prefix_blocks"] == {"fast": 2, "w0/g1": 2}
    assert dom.num("lookup-requested") == 4 and dom.num("lookup-longest") == 2 and dom.num("lookup-any") == 3

    # screenshot: a real PNG of the rendered page
    data = shot.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 30_000
    width, height = int.from_bytes(data[16:20], "big"), int.from_bytes(data[20:24], "big")
    assert (width, height) == (1280, 1000)


def test_lookup_error_is_shown_in_the_page(advisor_with_dashboard: Running, tmp_path: Path) -> None:
    base = advisor_with_dashboard.url
    (dump,) = run_browsers([chromium_cmd(tmp_path, "bad", "--dump-dom", f"{base}/dashboard?lookup=1,nope")])
    dom = parse_dom(dump.stdout)
    assert dom.by_id["lookup-result"].hidden
    assert dom.by_id["lookup-error"].text == (
        "v1/lookup: invalid_request: sequence_hashes: Value error, sequence_hashes[1]: "
        "sequence hash 'nope' is neither decimal nor 0x-hex")
    assert dom.by_id["status"].attrs.get("data-state") == "ok"


def test_unreachable_api_shows_an_error_banner(tmp_path: Path) -> None:
    # the page served by an app without the /v1 routes: every poll fails with 404
    app = FastAPI()
    mount_dashboard(app)
    server = serve_in_thread(app)
    try:
        (dump,) = run_browsers([chromium_cmd(tmp_path, "down", "--dump-dom", f"{server.url}/dashboard")])
    finally:
        server.stop()
    dom = parse_dom(dump.stdout)
    assert dom.by_id["status"].attrs.get("data-state") == "error"
    assert dom.by_id["status"].text == "v1/stats: HTTP 404 Not Found"
    assert not dom.by_id["error-banner"].hidden
    assert "Cannot reach the advisor API" in dom.by_id["error-banner"].text
    assert dom.by_id["events-applied"].text == "—"  # nothing invented


def test_mounting_twice_is_a_no_op_and_a_taken_path_is_refused() -> None:
    app = FastAPI()
    mount_dashboard(app)
    paths = [getattr(r, "path", None) for r in app.routes]
    mount_dashboard(app)  # e.g. create_app already mounted it and a caller does too
    assert [getattr(r, "path", None) for r in app.routes] == paths
    assert paths.count("/dashboard") == 1 and paths.count("/dashboard/static") == 1
    other = FastAPI()

    @other.get("/dashboard")
    def mine() -> dict[str, str]:
        return {}

    with pytest.raises(DashboardError, match=r"app already serves \['/dashboard'\]"):
        mount_dashboard(other)


def test_history_charts_show_the_api_hit_rates_and_occupancy(advisor_with_dashboard: Running, tmp_path: Path) -> None:
    """The uPlot history charts (hit rate per tier, occupancy, events/s, moves) are drawn, and
    the values beside them are /v1/stats' after the replay and a few lookups; a screenshot is
    kept as a test artifact (runs/test-artifacts/dashboard-history.png)."""
    run = advisor_with_dashboard
    base = run.url
    assert httpx.get(base + "/dashboard/static/vendor/uPlot.iife.min.js").status_code == 200
    assert "MIT" in httpx.get(base + "/dashboard/static/vendor/uPlot.LICENSE").text
    hot = [f"0x{h:x}" for h in run.hashes]
    assert httpx.post(base + "/v1/lookup", json={"sequence_hashes": hot}).json()["longest"] >= 1
    httpx.post(base + "/v1/lookup", json={"sequence_hashes": [99]})  # a miss everywhere
    shot = tmp_path / "history.png"
    dump, _ = run_browsers([
        chromium_cmd(tmp_path, "hdom", "--dump-dom", f"{base}/dashboard"),
        chromium_cmd(tmp_path, "hshot", f"--screenshot={shot}", "--window-size=1280,2200", f"{base}/dashboard"),
    ])
    dom = parse_dom(dump.stdout)
    stats = httpx.get(base + "/v1/stats").json()
    assert dom.by_id["status"].attrs.get("data-state") == "ok", dom.by_id["status"].text

    # uPlot drew the four charts (one canvas each) from the vendored script
    assert dump.stdout.count('class="uplot') >= 4 and dump.stdout.count("<canvas") >= 4

    def latest(chart: str) -> dict[str, float]:
        return {k: float(v["value"].attrs["data-value"]) for k, v in dom.table(f"chart-{chart}-latest").items()}

    tiers = stats["hit_rates"]["lookup"]["1m"]["tiers"]
    assert tiers and latest("hit") == {t: v["hit_rate"] for t, v in tiers.items()}
    assert latest("hit")["G1"] == 0.5  # one of the two lookups found its first block in w0/g1
    assert latest("occupancy") == {k: float(v) for k, v in stats["blocks_per_location"].items()}
    assert latest("occupancy") == {"fast": 2.0, "slow": 1.0, "w0/g1": 6.0, "w0/g2": 2.0}
    assert latest("moves") == {"promotions": 2.0, "demotions": 0.0, "compactions": 0.0}
    assert set(latest("events")) == {"events/s"}
    shown = dom.table("chart-hit-latest")["G1"]["value"].text.strip()
    assert shown == "50.0 %"

    # the per-volume panel: the first volume's segments, as the API lists them
    segs = httpx.get(base + "/v1/volumes/fast/segments").json()
    rows = dom.table("segments-body")
    assert segs["count"] >= 1 and sorted(rows, key=int) == [str(g["segment_id"]) for g in segs["segments"]]
    for g in segs["segments"]:
        for f in ("size_bytes", "live_bytes", "dead_bytes", "live_blocks"):
            assert rows[str(g["segment_id"])][f].attrs["data-value"] == str(g[f]), f
    assert sum(g["live_blocks"] for g in segs["segments"]) == 2  # the two promoted blocks

    assert shot.stat().st_size > 10_000
    artifacts = Path(__file__).resolve().parents[2] / "runs" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, artifacts / "dashboard-history.png")
