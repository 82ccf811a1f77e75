"""Admission quotas of the advisor (``advisor/ingest/quotas.py``): what goes over a limit is refused
alone and counted under a fixed ``reason`` label, the other sources and the rest of the
stream go on, and the decision is the same after a restart (only admitted batches are
journaled, so the replay folds what the live advisor folded)."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest
import zmq
from prometheus_client import generate_latest

from advisor.ingest.quotas import EVENT_REASONS, QuotaGuard, QuotaLimits, QuotaReason
from advisor.embedded.service import AdvisorService
from advisor.settings import AdvisorSettings
from event_plane.codec import encode_batch
from event_plane.frames import seq_to_bytes
from event_plane.schema import WIRE_VERSION, EventBatch, store
from storage_backends.environ import environment
from storage_backends.local_s3 import free_port
from tests.polling import wait_until as until

BS = 4096
REPO = Path(__file__).resolve().parents[2]


def batch(source: str, seq: int, events: list, epoch: int = 1) -> EventBatch:
    return EventBatch(WIRE_VERSION, source, epoch, seq, 1_000 + seq, events)


def g1(h: int, loc: str = "g1", extra: dict | None = None):  # noqa: ANN201
    return store(h, h, None, BS, loc, extra)


def service(tmp_path: Path, **quotas: object) -> AdvisorService:
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[], api_enabled=False,
                               snapshot_store="none", **quotas)
    svc = AdvisorService(settings)
    svc.start()
    return svc


def restarted(svc: AdvisorService) -> AdvisorService:
    """Stop ``svc`` and start a new service on the same settings (journal replay)."""
    svc.stop()
    again = AdvisorService(svc.settings)
    again.start()
    return again


def metric(svc: AdvisorService, name: str, reason: str | None = None) -> float:
    labels = {"reason": reason} if reason else {}
    got = svc.metrics.registry.get_sample_value(name, labels)
    return got or 0.0


def test_batch_over_max_batch_events_is_refused_alone_and_counted(tmp_path: Path) -> None:
    svc = service(tmp_path, quota_max_batch_events=4, quota_source_burst=100)
    try:
        assert svc.ingest(batch("w0", 0, [g1(1)]))
        assert not svc.ingest(batch("w0", 1, [g1(h) for h in range(10, 15)]))  # 5 events > 4
        assert svc.ingest(batch("w0", 2, [g1(2)]))  # the same source goes on
        assert svc.ingest(batch("w1", 0, [g1(3), g1(4), g1(5), g1(6)]))  # 4 = the limit
        assert svc.counters["quota_refused_batches_batch_events"] == 1
        assert svc.counters["quota_refused_events_batch_events"] == 5
        assert metric(svc, "kvadvisor_quota_refused_batches_total", "batch_events") == 1
        assert metric(svc, "kvadvisor_quota_refused_events_total", "batch_events") == 5
        assert all(svc.index.block(h) is None for h in range(10, 15))
        assert sorted(svc.index.hashes()) == [1, 2, 3, 4, 5, 6]
        dump = svc.index.dump()
        svc = restarted(svc)
        assert svc.index.dump() == dump and svc.counters["replayed_batches"] == 3
        assert not svc.ingest(batch("w0", 1, [g1(h) for h in range(10, 15)]))  # still refused
    finally:
        svc.stop()


def test_new_source_over_max_sources_is_refused_known_sources_continue(tmp_path: Path) -> None:
    svc = service(tmp_path, quota_max_sources=2)
    try:
        assert svc.ingest(batch("w0", 0, [g1(1)]))
        assert svc.ingest(batch("w1", 0, [g1(2)]))
        assert not svc.ingest(batch("w2", 0, [g1(3), g1(4)]))  # a third source
        assert svc.ingest(batch("w0", 1, [g1(5)]))  # known sources go on
        assert svc.ingest(batch("w1", 1, [g1(6)], epoch=2))  # a restart of a known source too
        assert svc.counters["quota_refused_batches_sources"] == 1
        assert svc.counters["quota_refused_events_sources"] == 2
        assert metric(svc, "kvadvisor_quota_refused_batches_total", "sources") == 1
        assert set(svc.index.sources()) == {"w0", "w1"}
        dump = svc.index.dump()
        svc = restarted(svc)
        assert svc.index.dump() == dump
        assert not svc.ingest(batch("w2", 0, [g1(3)]))  # refused after the restart as well
        assert svc.ingest(batch("w0", 2, [g1(7)]))
    finally:
        svc.stop()


def test_store_at_a_new_volume_over_max_locations_is_refused_alone(tmp_path: Path) -> None:
    svc = service(tmp_path, quota_max_locations=2)
    try:
        assert svc.ingest(batch("w0", 0, [g1(1, "vol-a"), g1(2, "vol-b"), g1(3, "vol-c"), g1(4, "g1"), g1(5, "vol-a")]))
        # vol-c is a third volume name: its Store alone is refused; g1 (private) and the
        # known volumes are not limited by it
        assert svc.index.block(3) is None
        assert {h: sorted(svc.index.block(h).locations) for h in (1, 2, 4, 5)} == {
            1: ["vol-a"], 2: ["vol-b"], 4: ["w0/g1"], 5: ["vol-a"]}
        assert svc.counters["quota_refused_events_locations"] == 1
        assert metric(svc, "kvadvisor_quota_refused_events_total", "locations") == 1
        assert svc.ingest(batch("w1", 0, [g1(6, "vol-c"), g1(7, "vol-b")]))  # other sources: same rule
        assert svc.index.block(6) is None and svc.index.block(7) is not None
        assert svc.counters["quota_refused_events_locations"] == 2
        dump = svc.index.dump()
        svc = restarted(svc)
        assert svc.index.dump() == dump
        assert svc.ingest(batch("w0", 1, [g1(8, "vol-c"), g1(9, "vol-a")]))
        assert svc.index.block(8) is None and svc.index.block(9) is not None  # still refused after restart
        assert svc.counters["quota_refused_events_locations"] == 3  # the counts survive the restart (run state)
    finally:
        svc.stop()


def test_metadata_over_the_event_limit_refuses_that_event_over_the_batch_limit_the_batch(tmp_path: Path) -> None:
    svc = service(tmp_path, quota_max_event_metadata_bytes=64, quota_max_batch_metadata_bytes=200)
    try:
        big = {"blob": "x" * 100}
        assert svc.ingest(batch("w0", 0, [g1(1, extra={"tier": "nvme"}), g1(2, extra=big), g1(3)]))
        assert svc.index.block(2) is None and svc.index.block(1) is not None and svc.index.block(3) is not None
        assert svc.counters["quota_refused_events_metadata_bytes"] == 1
        many = [g1(10 + i, extra={"blob": "y" * 50}) for i in range(5)]  # 5 x ~57 bytes > 200
        assert not svc.ingest(batch("w0", 1, many))
        assert all(svc.index.block(10 + i) is None for i in range(5))
        assert svc.counters["quota_refused_batches_batch_metadata_bytes"] == 1
        assert svc.ingest(batch("w1", 0, [g1(20, extra={"tier": "ssd"})]))
        dump = svc.index.dump()
        svc = restarted(svc)
        assert svc.index.dump() == dump
        assert svc.index.block(2) is None
    finally:
        svc.stop()


def test_per_source_rate_limit_refuses_the_batch_over_the_bucket_others_unaffected(tmp_path: Path) -> None:
    svc = service(tmp_path, quota_source_rate=80.0, quota_source_burst=10, quota_max_batch_events=10)
    now = [1024.0]
    svc.quotas.clock = lambda: now[0]
    try:
        assert svc.ingest(batch("w0", 0, [g1(h) for h in range(1, 11)]))  # the full bucket: 10 events
        assert not svc.ingest(batch("w0", 1, [g1(11)]))  # empty: refused
        assert svc.ingest(batch("w1", 0, [g1(h) for h in range(20, 30)]))  # another source: its own bucket
        now[0] += 0.0625  # 5 tokens refilled (80/s; exact binary fractions)
        assert not svc.ingest(batch("w0", 2, [g1(h) for h in range(30, 36)]))  # 6 > 5
        assert svc.ingest(batch("w0", 3, [g1(h) for h in range(40, 45)]))  # 5 = 5
        assert svc.counters["quota_refused_batches_rate"] == 2
        assert svc.counters["quota_refused_events_rate"] == 7
        assert metric(svc, "kvadvisor_quota_refused_batches_total", "rate") == 2
        assert svc.index.block(11) is None and svc.index.block(44) is not None
        dump = svc.index.dump()
        svc = restarted(svc)
        assert svc.index.dump() == dump  # refused batches were never journaled
    finally:
        svc.stop()


def test_the_advisors_own_batches_are_not_subject_to_quotas(tmp_path: Path) -> None:
    svc = service(tmp_path, quota_max_sources=1, quota_max_batch_events=2, quota_source_burst=2)
    try:
        assert svc.ingest(batch("w0", 0, [g1(1)]))
        own = batch(svc.settings.source, 0, [g1(h, "fast") for h in range(2, 6)])
        assert svc.ingest(own)  # a second source and 4 events: its moves are never refused
        assert svc.index.block(5) is not None
    finally:
        svc.stop()


def test_quota_metrics_have_a_fixed_label_set_whatever_the_names_offered(tmp_path: Path) -> None:
    svc = service(tmp_path, quota_max_sources=3, quota_max_locations=3)
    try:
        for s in range(50):
            svc.ingest(batch(f"forged-{s}", 0, [g1(1000 + i, f"loc-{s}-{i}") for i in range(4)]))
        text = generate_latest(svc.metrics.registry).decode()
        quota_lines = [ln for ln in text.splitlines() if ln.startswith("kvadvisor_quota_")]
        reasons = {ln.split('reason="')[1].split('"')[0] for ln in quota_lines if 'reason="' in ln}
        assert reasons == {r.value for r in QuotaReason}
        assert not any("forged" in ln or "loc-" in ln for ln in quota_lines)
        assert svc.counters["quota_refused_batches_sources"] == 47
        assert len(svc.index.sources()) == 3
        assert svc.index.volume_count() == 3
    finally:
        svc.stop()


def test_settings_refuse_a_bucket_smaller_than_a_batch() -> None:
    with pytest.raises(ValueError, match="quota_source_burst"):
        AdvisorSettings(quota_source_burst=10, quota_max_batch_events=11)
    env = {"KVADVISOR_ADVISOR_QUOTA_MAX_SOURCES": "7", "KVADVISOR_ADVISOR_REPORTED_HITS_SOURCES": '["cache-a"]'}
    with environment(env):
        lim = AdvisorSettings().quota_limits()
    assert lim.max_sources == 7 and lim.reported_hits_sources == frozenset({"cache-a"})
    assert QuotaLimits().max_sources == 10_000 and QuotaLimits().max_locations == 256


def test_guard_refusal_is_event_level_only_for_event_reasons() -> None:
    """The enum split the service and the metrics rely on."""
    assert set(EVENT_REASONS) == {QuotaReason.METADATA_BYTES, QuotaReason.LOCATIONS, QuotaReason.SOURCE_BLOCKS,
                                  QuotaReason.BLOCKS}
    assert "quota_refused_events_locations" in QuotaGuard.counter_names()
    assert "quota_refused_batches_locations" not in QuotaGuard.counter_names()


# ----------------------------------------------------------------------------- a flood over real ZMQ
FORGED_SOURCES = 20_000
FORGED_LOCATIONS = 1_000
W0_BLOCKS = 90_000


def scrape(base: str) -> dict[str, float]:
    """``/metrics`` as ``{'name{labels}': value}`` (comments dropped)."""
    out = {}
    for line in httpx.get(base + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            key, _, value = line.rpartition(" ")
            out[key] = float(value)
    return out


def spawn(cfg: Path, tmp: Path, name: str) -> tuple[subprocess.Popen[str], Path]:
    env = {**os.environ, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"}
    err = tmp / f"{name}.stderr"
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "advisor", "--config", str(cfg)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=fh, text=True)
    return proc, err


def test_20k_sources_and_1k_locations_over_zmq_stay_under_quota_across_a_restart(tmp_path: Path) -> None:
    """20,000 sources and 1,000 volume names offered over a real ZMQ PUB socket to the advisor
    process (default quotas: 10,000 sources, 256 volume names): the excess is refused and
    counted, known sources go on; at ~100k indexed blocks SIGTERM (a snapshot, then exit 0)
    and a restart bring back every indexed block, and after the restart a new source is
    still refused and a known one still admitted.  The stop and restart times are printed,
    not asserted (the stop's deadline is held by test_advisor_many_sources.py)."""
    port, api_port = free_port(), free_port()
    cfg = tmp_path / "advisor.json"
    cfg.write_text(json.dumps({
        "journal_path": str(tmp_path / "j.sqlite"), "subscribe_urls": [f"zmq://127.0.0.1:{port}"],
        "api_port": api_port, "get_timeout_s": 0.05, "snapshot_store": "sqlite",
        "snapshot_every_batches": 0, "snapshot_every_s": 0, "reconcile_on_start": False,
    }))
    base = f"http://127.0.0.1:{api_port}"
    ctx = zmq.Context()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.SNDHWM, 0)
    pub.setsockopt(zmq.LINGER, 0)
    pub.bind(f"tcp://127.0.0.1:{port}")

    def send(b: EventBatch) -> None:
        pub.send_multipart([b"", seq_to_bytes(b.seq), encode_batch(b)])

    def joined(tag: str, known: bool) -> int:
        """Send one-event batches until the (re)started advisor applies one (PUB drops what
        it sends before the subscription arrives); how many probe sources were sent."""
        n = 0
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            src = "forged-0" if known else f"probe-{tag}-{n}"
            send(batch(src, 0, [g1((1 << 50) + n, "g2")], epoch=(1000 + n) if known else 1))
            n += 1
            time.sleep(0.2)
            if scrape(base).get("kvadvisor_batches_applied_total", 0) >= 1:
                return n
        raise AssertionError("the advisor never received a probe")

    proc, err = spawn(cfg, tmp_path, "advisor1")
    try:
        assert proc.stdout.readline().startswith("ADVISOR READY"), err.read_text()
        probes = joined("a", known=False)
        sent = 0
        h = 1
        for seq in range(W0_BLOCKS // 1000):  # one worker's chains on a volume: 90,000 blocks
            send(batch("w0", seq, [store(h + i, h, h + i - 1 if i else None, BS, "fast") for i in range(1000)]))
            h += 1000
            sent += 1
        send(batch("locs", 0, [g1((1 << 45) + i, f"vol-{i:04d}") for i in range(FORGED_LOCATIONS)]))
        sent += 1
        for s in range(FORGED_SOURCES):
            send(batch(f"forged-{s}", 0, [g1((1 << 40) + s)]))
            sent += 1
        key_src = 'kvadvisor_quota_refused_batches_total{reason="sources"}'
        until(lambda: (lambda m: m["kvadvisor_batches_applied_total"] + m[key_src] >= probes + sent)(scrape(base)),
              240, "every batch applied or refused")
        m = scrape(base)
        known_before = 1 + probes + 1  # w0, the probes, locs
        admitted_forged = 10_000 - known_before
        assert m[key_src] == FORGED_SOURCES - admitted_forged
        assert m['kvadvisor_quota_refused_events_total{reason="locations"}'] == FORGED_LOCATIONS - 255  # "fast" + 255
        assert m["kvadvisor_batches_applied_total"] == probes + sent - m[key_src]
        blocks = m["kvadvisor_index_blocks_total"]
        assert blocks == probes + W0_BLOCKS + 255 + admitted_forged and blocks >= 99_000
        assert not any("forged-" in k or "vol-0" in k for k in m if k.startswith("kvadvisor_quota"))
        t = time.perf_counter()
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, err.read_text()
        stop_s = time.perf_counter() - t
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    # the stop's deadline (before `kvadvisor down`'s SIGKILL after 20 s) is held by
    # tests/integration/test_advisor_many_sources.py; here it is printed (7.4 s seen on a
    # loaded 2-core box, with the ZMQ subscriber and 100,000 blocks)

    t = time.perf_counter()
    proc, err = spawn(cfg, tmp_path, "advisor2")
    try:
        assert proc.stdout.readline().startswith("ADVISOR READY"), err.read_text()
        start_s = time.perf_counter() - t
        m = scrape(base)
        assert m["kvadvisor_index_blocks_total"] == blocks
        joined("b", known=True)  # a known source (a new epoch of it) is admitted
        send(batch("late-forged", 0, [g1(1 << 55)]))
        until(lambda: scrape(base).get(key_src, 0) == 1, 30, "the new source refused after the restart")
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close()
        ctx.term()
    # the restart's duration (a new process: imports, then the snapshot) is a speed, printed,
    # not asserted: no launcher holds it to a deadline (21 s seen on a loaded 2-core box)
    print(f"20,000 sources over ZMQ: stop {stop_s:.2f} s, restart to READY {start_s:.2f} s")


def test_empty_metadata_maps_count_towards_the_batch_metadata_limit(tmp_path: Path) -> None:
    """An empty ``extra_metadata`` map is 1 encoded byte: 10 of them pass a 10-byte batch
    limit, 11 do not (empty maps are not skipped as "no metadata")."""
    svc = service(tmp_path, quota_max_batch_metadata_bytes=10)
    try:
        assert svc.ingest(batch("w0", 0, [g1(h, extra={}) for h in range(1, 11)]))
        assert not svc.ingest(batch("w0", 1, [g1(h, extra={}) for h in range(20, 31)]))
        assert svc.counters["quota_refused_batches_batch_metadata_bytes"] == 1
    finally:
        svc.stop()
