"""Advisor service over real transports: ZMQ and NATS ingest, journal restart, own process."""

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

from advisor import AdvisorService, AdvisorSettings
from event_plane import PublisherConfig, make_publisher
from event_plane.schema import remove, store
from storage_backends.local_s3 import free_port
from tests.polling import wait_until as wait_for

BS = 4096
REPO = Path(__file__).resolve().parents[2]


def chain(hashes: list[int], loc: str) -> list:
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


@pytest.mark.parametrize("snapshot_store", ["none", "sqlite"])
def test_zmq_ingest_then_restart_from_journal_rebuilds_the_same_index(tmp_path, snapshot_store) -> None:  # noqa: ANN001
    port, replay = free_port(), free_port()
    url = f"zmq://127.0.0.1:{port}?replay={replay}"
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[url], api_enabled=False,
                               get_timeout_s=0.05, snapshot_store=snapshot_store)
    pub = make_publisher(url, "w0", config=PublisherConfig(max_events=4, max_delay_s=0.05))
    svc = AdvisorService(settings)
    svc.start()
    try:
        # batches sent before the subscriber joined are recovered by replay (slow joiner)
        pub.publish(chain([1, 2, 3, 4, 5, 6], "g1"))
        pub.publish(chain([1, 2, 3], "g2"))
        pub.publish([remove(6, 1, 5, BS, "g1"), remove(42, 42, None, BS, "g1")])
        pub.flush()
        wait_for(lambda: svc.query().stats()["events_applied"] == 11)
        q = svc.query()
        assert q.lookup([1, 2, 3, 4, 5, 6]).per_location == {"w0/g1": 5, "w0/g2": 3}
        st = q.stats()
        assert st["sources"]["w0"]["last_seq"] == pub.next_seq - 1
        assert st["index_counters"]["unknown_removes"] == 1
        live = svc.index.dump()
        position = svc.position
    finally:
        svc.stop()
        pub.close()
    again = AdvisorService(settings.model_copy(update={"subscribe_urls": []}))
    again.start()
    try:
        if snapshot_store == "none":  # the whole journal is folded again
            assert again.counters["replayed_batches"] == position
        else:  # the snapshot taken on the clean stop covers the whole journal
            assert again.counters["snapshot_loaded_position"] == position
            assert again.counters["replayed_batches"] == 0
        assert again.index.dump() == live
    finally:
        again.stop()


def test_nats_ingest_and_own_moves_are_not_applied_twice(tmp_path, nats_url: str) -> None:  # noqa: ANN001
    ns = f"adv{os.getpid()}{time.monotonic_ns() % 100000}"
    url = f"{nats_url}?namespace={ns}"
    # the advisor publishes on the same subjects it subscribes to: its own batches come
    # back through NATS and are refused (its source name is reserved; journaled already)
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[url], publish_url=url,
                               api_enabled=False, get_timeout_s=0.05)
    svc = AdvisorService(settings)
    svc.start()
    pub = make_publisher(url, "w7", config=PublisherConfig(max_delay_s=0.05))
    try:
        pub.publish(chain([10, 11, 12], "slow"))
        pub.flush()
        wait_for(lambda: svc.query().stats()["events_applied"] == 3)
        svc.publisher.publish([store(10, 10, None, BS, "fast", {"moved_from": "slow"})])
        svc.publisher.flush()
        wait_for(lambda: svc.counters["reserved_source_refused"] == 1)
        assert svc.counters["duplicate_batches"] == 0
        assert svc.index.lookup([10, 11, 12]) == {"slow": 3, "fast": 1}
        assert svc.counters["ingested_batches"] == 2
        assert svc.index.block(10).hits == 0
    finally:
        pub.close()
        svc.stop()


def spawn_advisor(cfg: Path, tmp: Path) -> tuple[subprocess.Popen[str], Path]:
    """Start ``python -m advisor --config cfg``; stderr goes to a file (never a full pipe)."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "NIXL_LOG_LEVEL": "WARN"}
    err = tmp / "advisor.stderr"
    with err.open("w") as fh:
        proc = subprocess.Popen([sys.executable, "-m", "advisor", "--config", str(cfg)], cwd=REPO, env=env,
                                stdout=subprocess.PIPE, stderr=fh, text=True)
    return proc, err


def test_advisor_runs_as_its_own_process(tmp_path) -> None:  # noqa: ANN001
    port, replay, api_port = free_port(), free_port(), free_port()
    url = f"zmq://127.0.0.1:{port}?replay={replay}"
    cfg = tmp_path / "advisor.json"
    cfg.write_text(json.dumps({
        "journal_path": str(tmp_path / "j.sqlite"),
        "subscribe_urls": [url],
        "api_port": api_port,
        "get_timeout_s": 0.05,
    }))
    pub = make_publisher(url, "w0", config=PublisherConfig(max_delay_s=0.05))
    proc, err = spawn_advisor(cfg, tmp_path)
    try:
        line = proc.stdout.readline().strip()
        assert line == f"ADVISOR READY http://127.0.0.1:{api_port}", err.read_text()
        pub.publish(chain([7, 8, 9], "g1"))
        pub.flush()
        base = f"http://127.0.0.1:{api_port}"
        wait_for(lambda: httpx.get(base + "/v1/stats").json()["blocks"] == 3)
        body = httpx.post(base + "/v1/lookup", json={"sequence_hashes": [7, 8, 9]}).json()
        assert body["prefix_blocks"] == {"w0/g1": 3}
        # SIGUSR1: every thread's stack on stderr, and the advisor goes on serving
        proc.send_signal(signal.SIGUSR1)
        wait_for(lambda: "=== end of stacks" in err.read_text())
        dump = err.read_text()
        assert "kvevents-zmq-sub" in dump and "zmq_transport.py" in dump, dump[-3000:]  # the subscriber
        assert "MainThread" in dump and "run_forever" in dump, dump[-3000:]
        assert proc.poll() is None
        assert httpx.get(base + "/v1/stats").json()["blocks"] == 3
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close()


def test_bad_config_exits_with_a_clear_message(tmp_path) -> None:  # noqa: ANN001
    cfg = tmp_path / "bad.json"
    cfg.write_text(json.dumps({"fast_volume": "nvme0", "policy": {"demotion": {"low_watermark": 0.9}}}))
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    res = subprocess.run([sys.executable, "-m", "advisor", "--config", str(cfg)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "configuration error" in res.stderr
    assert "policy.demotion: Value error, demotion low_watermark (0.9) must be below high_watermark" in res.stderr
    cfg.write_text(json.dumps({"fast_volume": "nvme0"}))
    res = subprocess.run([sys.executable, "-m", "advisor", "--config", str(cfg)], cwd=REPO, env=env,
                         capture_output=True, text=True, timeout=60)
    assert res.returncode == 2
    assert "unknown volume ids ['nvme0']" in res.stderr


def test_advisor_process_promotes_in_the_background(tmp_path) -> None:  # noqa: ANN001
    import torch

    from storage_backends import BlockKey, SqliteCatalog, StorageAgent

    port, replay, api_port = free_port(), free_port(), free_port()
    url = f"zmq://127.0.0.1:{port}?replay={replay}"
    vols = [
        {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 1 << 24, "root": str(tmp_path / "fast")},
        {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 1 << 24, "root": str(tmp_path / "slow")},
    ]
    cfg = tmp_path / "advisor.json"
    cfg.write_text(json.dumps({
        "journal_path": str(tmp_path / "j.sqlite"), "catalog_path": str(tmp_path / "catalog.sqlite"),
        "namespace": "ns1", "volumes": vols, "fast_volume": "fast", "slow_volumes": ["slow"],
        "subscribe_urls": [url], "api_port": api_port, "policy_interval_s": 0.2, "get_timeout_s": 0.05,
    }))
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    worker = StorageAgent(cat, name="bg-worker")
    from advisor import VolumeSettings

    for v in vols:
        worker.register_volume(VolumeSettings(**v).to_descriptor())
    data = {h: torch.full((4096,), h, dtype=torch.uint8) for h in (1, 2)}
    worker.put([(BlockKey("ns1", h), t) for h, t in data.items()], "slow")
    pub = make_publisher(url, "w0", config=PublisherConfig(max_delay_s=0.05))
    proc, err = spawn_advisor(cfg, tmp_path)
    try:
        assert proc.stdout.readline().startswith("ADVISOR READY"), err.read_text()
        pub.publish([store(1, 1, None, 4096, "slow"), store(2, 1, 1, 4096, "slow")])
        pub.publish([store(1, 1, None, 4096, "g1"), store(2, 1, 1, 4096, "g1")])  # onboarded into g1: hit 1
        pub.flush()
        base = f"http://127.0.0.1:{api_port}"
        wait_for(lambda: httpx.get(base + "/v1/stats").json()["events_applied"] == 4)
        pub.publish([remove(1, 1, None, 4096, "g1"), remove(2, 1, 1, 4096, "g1")])
        pub.publish([store(1, 1, None, 4096, "g1"), store(2, 1, 1, 4096, "g1")])  # onboarded again: hit 2
        pub.flush()
        wait_for(lambda: httpx.get(base + "/v1/stats").json()["promotions"] == 2)
        assert [p.volume_id for p in worker.locate([BlockKey("ns1", 1), BlockKey("ns1", 2)])] == ["fast", "fast"]
        got = worker.get([BlockKey("ns1", 1), BlockKey("ns1", 2)])
        assert all(torch.equal(g, data[h]) for g, h in zip(got, (1, 2)))
        body = httpx.post(base + "/v1/lookup", json={"sequence_hashes": [1, 2]}).json()
        assert body["prefix_blocks"] == {"fast": 2, "w0/g1": 2}
        plans = httpx.get(base + "/v1/plans").json()
        assert plans["summary"] == {"promote_done": 2}
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0, err.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        pub.close()
        worker.close()
        cat.close()


def test_live_batch_with_too_deep_metadata_is_refused_counted_and_the_restart_replays_cleanly(tmp_path) -> None:  # noqa: ANN001
    """A hostile publisher on a real ZMQ socket sends metadata nested 980 levels deep (which
    msgspec decodes on a shallow stack) and 33 levels (one past the limit) between honest
    batches: both are refused at ingest and counted, the honest ones (one at exactly the
    limit) are journaled and applied, and a restart replays the journal to the same index."""
    import zmq

    from event_plane.codec import MAX_METADATA_DEPTH, encode_batch_parts, encode_event
    from event_plane.frames import seq_to_bytes

    def payload(seq: int, h: int, depth: int) -> bytes:
        ev = encode_event(store(h, h, None, BS, "g1"))[:-1] + b"\x81\xa1a" * depth + b"\x01"
        return encode_batch_parts("evil", 5, seq, 10 + seq, [ev])

    ctx = zmq.Context.instance()
    pub = ctx.socket(zmq.PUB)
    pub.setsockopt(zmq.LINGER, 0)
    port = pub.bind_to_random_port("tcp://127.0.0.1")
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[f"zmq://127.0.0.1:{port}"],
                               api_enabled=False, get_timeout_s=0.05, snapshot_store="none")
    svc = AdvisorService(settings)
    svc.start()
    try:
        time.sleep(0.3)  # ZMQ slow joiner
        for seq, (h, depth) in enumerate([(1, 1), (2, 980), (3, MAX_METADATA_DEPTH + 1), (4, MAX_METADATA_DEPTH)]):
            pub.send_multipart([b"", seq_to_bytes(seq), payload(seq, h, depth)])
        wait_for(lambda: svc.counters["ingested_batches"] == 2)
        wait_for(lambda: svc.subscriber_stats()["decode_errors"] == 2)
        assert svc.block_info(1) is not None and svc.block_info(4) is not None
        assert svc.block_info(2) is None and svc.block_info(3) is None
        assert len(svc.journal) == 2
        dump = svc.index.dump()
    finally:
        svc.stop()
        pub.close(linger=0)
    again = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[],
                                           api_enabled=False, snapshot_store="none"))
    try:
        again.start()
        assert again.index.dump() == dump
        assert (again.counters["replayed_batches"], again.counters["journal_skipped"]) == (2, 0)
    finally:
        again.stop()


def test_forged_batches_under_the_advisors_source_never_take_a_real_moves_place(tmp_path, nats_url: str) -> None:  # noqa: ANN001
    """A publisher pre-sending the advisor's own source name (same epoch, the next seqs)
    got the advisor's real move dropped as a duplicate; the name is reserved now."""
    ns = f"forge{os.getpid()}{time.monotonic_ns() % 100000}"
    url = f"{nats_url}?namespace={ns}"
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[url], publish_url="null://",
                               api_enabled=False, get_timeout_s=0.05)
    svc = AdvisorService(settings)
    svc.start()
    forger = make_publisher(url, settings.source, epoch=svc.publisher.epoch, config=PublisherConfig(max_delay_s=0.05))
    try:
        for h in range(5):  # seqs 1..5 of the advisor's own epoch, a block the advisor never moved
            forger.publish([store(900 + h, 900 + h, None, BS, "fast", {"hits": 10**6})])
            forger.flush()
        wait_for(lambda: svc.counters["reserved_source_refused"] == 5)
        svc.publisher.publish([store(10, 10, None, BS, "fast", {"moved_from": "slow"})])
        svc.publisher.flush()
        wait_for(lambda: svc.counters["ingested_batches"] == 1)
        assert svc.index.block(10) is not None and svc.index.lookup([10]) == {"fast": 1}
        assert all(svc.index.block(900 + h) is None for h in range(5))
        assert svc.counters["duplicate_batches"] == 0
    finally:
        forger.close()
        svc.stop()


def test_replay_requests_refused_by_the_advisors_own_publisher_are_metrics(tmp_path) -> None:  # noqa: ANN001
    """The advisor's own ZMQ publisher counts the replay requests it refuses; the counters
    reach /metrics under a fixed set of kind labels, whatever the clients send."""
    import zmq
    from prometheus_client import generate_latest

    from event_plane.frames import END_SEQ, seq_to_bytes
    from event_plane.zmq_transport import REPLAY_COUNTERS

    port, replay = free_port(), free_port()
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False,
                                         publish_url=f"zmq://127.0.0.1:{port}?replay={replay}"))
    svc.start()
    dealer = zmq.Context.instance().socket(zmq.DEALER)
    dealer.setsockopt(zmq.LINGER, 0)
    dealer.connect(f"tcp://127.0.0.1:{replay}")
    try:
        for frames in ([b"", b"bad"], [b"", seq_to_bytes(0)], [b"", seq_to_bytes(0)], [b"", seq_to_bytes(0)]):
            dealer.send_multipart(frames)
            assert dealer.poll(3000)
            assert dealer.recv_multipart()[-2] == END_SEQ  # nothing buffered, or refused: the end marker
        text = generate_latest(svc.metrics.registry).decode()
        series = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("kvadvisor_publisher_replay_total{")}
        assert set(series) == set(REPLAY_COUNTERS)
        assert (series["requests"], series["malformed"], series["served"], series["refused_peer_rate"]) == (
            4.0, 1.0, 2.0, 1.0)
    finally:
        dealer.close(linger=0)
        svc.stop()
