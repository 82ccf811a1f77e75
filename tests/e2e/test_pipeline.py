"""End to end: a real trace through real workers, ZMQ, NATS, NIXL, S3, the advisor and its API.

Replays 500 Mooncake requests through two workers — one publishing over ZMQ, one over the
NATS server — into an advisor running in its own process, with two POSIX volumes and an S3
volume on a real HTTP endpoint.  Then checks, while everything is still up:

(a) the advisor's index equals, location by location, what the runtimes and the storage
    agent hold;
(b) every block read back (NIXL) from its final volume has the bytes the runtime wrote;
(c) at least one promotion, one demotion to S3 and one compaction happened, and the
    workers reused blocks from every tier G1..G4;
(d) the dashboard, loaded in headless chromium after the replay, shows the hit rate of every
    tier (filled by the demo's router lookups) and the occupancy /v1/stats gives, and
    `kvadvisor status` prints the report's lookup figures (screenshot kept in
    runs/test-artifacts/).
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from kvadvisor.demo import FAST, S3, SLOW, AdvisorClient, DemoReport, run_demo
from kvbm_runtime import synthetic_block_bytes
from kvadvisor.settings import DemoSettings

from browser import chromium_cmd, parse_dom, run_browsers  # tests/browser.py

pytestmark = pytest.mark.e2e


@pytest.fixture(scope="module")
def replay(tmp_path_factory: pytest.TempPathFactory, nats_url: str, local_s3: Any) -> dict[str, Any]:
    s = DemoSettings(
        requests=500,
        workers=2,
        transport="mixed",
        nats_url=nats_url,
        nats_namespace=f"e2e{uuid.uuid4().hex[:8]}",
        s3_endpoint=local_s3.endpoint,
        s3_bucket="kvadvisor-e2e",
        s3_access_key=local_s3.access_key,
        s3_secret_key=local_s3.secret_key,
        workdir=tmp_path_factory.mktemp("demo"),
        # tier sizes left to the demo (kvadvisor.demo.size_tiers): slow is half the slice's
        # blocks, so it passes its 80 % watermark part-way and its cold blocks go down to S3
        policy_every=25,
        inner_dim=2,
    )
    seen: dict[str, Any] = {}
    tmp = tmp_path_factory.mktemp("browser")

    def inspect(report: DemoReport, client: AdvisorClient, managers: list, agent: Any) -> None:
        # the operator's page right after the replay (the demo asked POST /v1/lookup before
        # each request, as a router does): the dashboard in headless chromium (DOM dump +
        # screenshot), then /v1/stats; first, so the 1-minute window still holds the replay.
        # The lookups are prefetch hints too: let their promotions land before the page and the stats
        base = client.base_url
        deadline = time.monotonic() + 120
        while client.stats()["prefetch"].get("pending", 0) and time.monotonic() < deadline:
            time.sleep(0.1)
        shot = tmp / "dashboard.png"
        dump, _ = run_browsers([
            chromium_cmd(tmp, "dom", "--dump-dom", f"{base}/dashboard"),
            chromium_cmd(tmp, "shot", f"--screenshot={shot}", "--window-size=1280,2200", f"{base}/dashboard"),
        ])
        seen["dom"] = parse_dom(dump.stdout)
        seen["stats"] = client.stats()
        seen["shot"] = shot
        # what `kvadvisor status` prints while the demo runs
        from typer.testing import CliRunner

        from kvadvisor.cli import app

        seen["status"] = CliRunner().invoke(app, ["status", "--url", base], terminal_width=200)
        # (a) location by location, independently of the demo's own verification
        per_loc: dict[str, tuple[set[int], set[int]]] = {}
        for mgr in managers:
            for tier in ("g1", "g2"):
                per_loc[f"{mgr.publisher.source}/{tier}"] = (client.blocks_at(f"{mgr.publisher.source}/{tier}"), mgr.resident(tier))
        for vol in (FAST, SLOW, S3):
            held = {p.key.sequence_hash for p in agent.catalog.iter_volume(vol)}
            per_loc[vol] = (client.blocks_at(vol), held)
        seen["locations"] = per_loc
        # (b) read every block back from where the catalog says it lives
        shape = (s.num_layers, s.outer_dim, s.page_size, s.inner_dim)
        bad: list[int] = []
        n = 0
        for vol in (FAST, SLOW, S3):
            placements = list(agent.catalog.iter_volume(vol))
            for i in range(0, len(placements), 128):
                chunk = placements[i : i + 128]
                for p, data in zip(chunk, agent.get([p.key for p in chunk])):
                    n += 1
                    want = synthetic_block_bytes(p.key.sequence_hash, shape, torch.float16)
                    if not torch.equal(data.reshape(-1), want):
                        bad.append(p.key.sequence_hash)
        seen["read_back"] = (n, bad)

    report = run_demo(s, inspect=inspect)
    seen["report"] = report
    return seen


def test_index_equals_held_blocks_location_by_location(replay: dict[str, Any]) -> None:
    locs = replay["locations"]
    assert set(locs) >= {"worker-0/g1", "worker-1/g1", "worker-0/g2", "worker-1/g2", FAST, SLOW, S3}
    for loc, (index, held) in locs.items():
        assert index == held, f"{loc}: index-only {sorted(index - held)[:5]}, held-only {sorted(held - index)[:5]}"
    # something real was held everywhere that matters
    assert all(locs[f"worker-{i}/g1"][1] for i in (0, 1))
    assert locs[SLOW][1] and locs[S3][1]


def test_every_stored_block_reads_back_with_the_bytes_written(replay: dict[str, Any]) -> None:
    n, bad = replay["read_back"]
    assert n == sum(len(replay["locations"][v][1]) for v in (FAST, SLOW, S3))
    assert n > 1000
    assert bad == []


def test_promotion_demotion_to_s3_compaction_and_hits_on_every_tier(replay: dict[str, Any]) -> None:
    r: DemoReport = replay["report"]
    assert r.promotions >= 1
    assert r.moves_by_route.get(f"demote {SLOW}->{S3}", 0) >= 1, r.moves_by_route
    assert r.demotions == sum(n for k, n in r.moves_by_route.items() if k.startswith("demote "))
    assert r.compactions >= 1
    assert r.bytes_moved > 0
    assert all(r.hits[t] > 0 for t in ("g1", "g2", "g3", "g4")), r.hits
    assert r.failed_moves == {"promote": 0, "demote": 0, "compact": 0}


def test_the_router_lookups_fill_the_hit_rates_and_status_shows_the_reports_figures(replay: dict[str, Any]) -> None:
    r: DemoReport = replay["report"]
    total = replay["stats"]["hit_rates"]["lookup"]["total"]
    assert r.lookups == total  # the report's figures are the API's
    assert total["lookups"] == r.requests  # one lookup before each request
    assert set(total["tiers"]) == {"G1", "G2", "G3", "G4"}
    assert all(v["hit_rate"] > 0 and v["blocks"] > 0 and v["tokens"] > 0 for v in total["tiers"].values())
    # a lookup counts each leading block for the one tier the best-placed worker reads it from
    assert sum(v["blocks"] for v in total["tiers"].values()) <= r.blocks
    status = replay["status"]
    assert status.exit_code == 0, status.output
    rows = [" ".join(line.replace("│", " ").split()) for line in status.output.splitlines()]
    for tier, v in total["tiers"].items():
        want = f"lookup total {total['lookups']:,} {tier} {100 * v['hit_rate']:.1f} % {v['blocks']:,} {v['tokens']:,}"
        assert want in rows, (want, status.output)


def test_both_transports_and_the_wire_budget(replay: dict[str, Any]) -> None:
    r: DemoReport = replay["report"]
    sources = replay["stats"]["sources"]
    assert {"worker-0", "worker-1"} <= set(sources)  # one over ZMQ, one over NATS
    assert r.requests == 500
    assert r.hits["g1"] + r.hits["g2"] + r.hits["g3"] + r.hits["g4"] > 0
    assert 0 < r.event_bytes_per_event <= 100


def test_event_streams_are_listed_in_worker_order_then_the_advisor(replay: dict[str, Any]) -> None:
    urls = replay["report"].event_urls
    # mixed transport: worker-0 publishes over ZMQ, worker-1 over NATS; the advisor over ZMQ
    assert len(urls) == 3
    assert urls[0].startswith("zmq://") and urls[1].startswith("nats://") and urls[2].startswith("zmq://")


def test_dashboard_after_the_replay_shows_the_stats(replay: dict[str, Any]) -> None:
    dom, stats = replay["dom"], replay["stats"]
    assert dom.by_id["status"].attrs.get("data-state") == "ok", dom.by_id["status"].text

    def latest(chart: str) -> dict[str, float]:
        return {k: float(v["value"].attrs["data-value"]) for k, v in dom.table(f"chart-{chart}-latest").items()}

    # the demo's lookups, one per request, fill the hit rate of every tier (last minute)
    hit = latest("hit")
    assert set(hit) == {"G1", "G2", "G3", "G4"} == set(stats["hit_rates"]["lookup"]["1m"]["tiers"]), hit
    assert all(0 < v <= 1 for v in hit.values()), hit
    assert latest("occupancy") == {k: float(v) for k, v in stats["blocks_per_location"].items()}
    moves = latest("moves")
    assert moves["promotions"] == stats["promotions"] >= 1 and moves["demotions"] == stats["demotions"]
    shot = replay["shot"]
    assert shot.stat().st_size > 10_000
    artifacts = Path(__file__).resolve().parents[2] / "runs" / "test-artifacts"
    artifacts.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(shot, artifacts / "dashboard-after-demo.png")
