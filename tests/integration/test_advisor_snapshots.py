"""Advisor start-up from a snapshot + log tail: SQLite journal (embedded) and JetStream (scaled)."""

from __future__ import annotations

import os
import time

import redis

from advisor import AdvisorService, AdvisorSettings
from advisor.index.prefix_index import PrefixIndex
from advisor.index.snapshot import SqliteSnapshotStore
from event_plane import PublisherConfig, make_publisher
from event_plane.schema import EventBatch, cleared, remove, store
from tests.conftest import start_nats_server
from tests.polling import wait_until as wait_for

BS = 4096


def chain(hashes: list[int], loc: str) -> list:
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


def batches(n: int, source: str = "w0", epoch: int = 5, start: int = 0) -> list[EventBatch]:
    """Chains at two tiers, removes, a Cleared every 7th batch; deterministic."""
    out = []
    for i in range(start, start + n):
        base = 1000 * (i % 9) + 1
        evs = chain([base, base + 1, base + 2], "g1") + chain([base, base + 1], "fast")
        if i % 3 == 2:
            evs.append(remove(base + 2, base, base + 1, BS, "g1"))
        if i % 7 == 6:
            evs.append(cleared("g2"))
        out.append(EventBatch(1, source, epoch, i, 10_000 + i, evs))
    return out


def test_periodic_snapshots_and_restart_replays_only_the_tail(tmp_path) -> None:  # noqa: ANN001
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False, snapshot_every_batches=4,
                               snapshot_every_s=0, snapshot_on_stop=False, snapshot_keep=3)
    log = batches(10)
    svc = AdvisorService(settings)
    svc.start()
    try:
        for b in log:
            assert svc.ingest(b)
        assert svc.counters["snapshots_taken"] == 2 and svc.counters["snapshot_position"] == 8
        live = svc.index.dump()
    finally:
        svc.stop()  # no snapshot on stop: positions 9 and 10 are the tail
    snaps = SqliteSnapshotStore(settings.snapshot_file)
    assert snaps.positions() == [4, 8]
    snaps.close()
    again = AdvisorService(settings)
    again.start()
    try:
        assert again.counters["snapshot_loaded_position"] == 8
        assert again.counters["replayed_batches"] == 2
        assert again.position == 10
        assert again.index.dump() == live
        # a fresh fold of the whole journal agrees
        fresh = PrefixIndex()
        assert again.journal is not None
        for _, b in again.journal.read():
            fresh.apply_batch(b)
        assert fresh.dump() == live
    finally:
        again.stop()


def test_snapshot_ahead_of_the_journal_is_ignored(tmp_path) -> None:  # noqa: ANN001
    """A journal replaced by an older copy: a snapshot covering positions it lacks is not used."""
    s1 = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False, snapshot_every_s=0)
    svc = AdvisorService(s1)
    svc.start()
    for b in batches(6):
        svc.ingest(b)
    svc.stop()  # snapshot at 6
    os.remove(tmp_path / "j.sqlite")
    for suffix in ("-wal", "-shm"):
        if (tmp_path / f"j.sqlite{suffix}").exists():
            os.remove(tmp_path / f"j.sqlite{suffix}")
    svc = AdvisorService(s1)
    svc.start()
    try:
        assert svc.counters["snapshot_loaded_position"] == 0
        assert len(svc.index) == 0 and svc.position == 0
        for b in batches(2):
            svc.ingest(b)
        expect = PrefixIndex()
        for b in batches(2):
            expect.apply_batch(b)
        assert svc.index.dump() == expect.dump()
    finally:
        svc.stop()


def test_jetstream_log_with_redis_snapshots_resumes_from_the_stream_position(tmp_path, redis_url: str) -> None:  # noqa: ANN001
    proc, nats, _store = start_nats_server(store_dir=str(tmp_path / "js"))
    prefix = f"kvadvisor-test:{os.getpid()}:{time.monotonic_ns()}"
    ns = "snap"
    host = nats.removeprefix("nats://")
    pub = make_publisher(f"jetstream://{host}?namespace={ns}", "w0", epoch=5,
                         config=PublisherConfig(max_events=8, max_delay_s=0.02), manage_stream=True)
    settings = AdvisorSettings(log="jetstream", jetstream_url=nats, jetstream_namespace=ns, snapshot_store="redis",
                               redis_url=redis_url, snapshot_key_prefix=prefix, snapshot_every_batches=5,
                               snapshot_every_s=0, snapshot_on_stop=False, api_enabled=False, get_timeout_s=0.05,
                               journal_path=str(tmp_path / "unused.sqlite"))
    r = redis.Redis.from_url(redis_url)
    try:
        svc = AdvisorService(settings)
        svc.start()
        try:
            for b in batches(12):
                pub.publish(b.events)
                pub.flush()
            wait_for(lambda: svc.position >= 12)
            assert svc.position == 12  # stream sequences 1..12, one per flushed batch
            assert svc.counters["snapshot_position"] == 10
            live = svc.index.dump()
        finally:
            svc.stop()
        assert svc.journal is None and not (tmp_path / "unused.sqlite").exists()  # the stream is the log
        for b in batches(5, start=12):  # more batches while the advisor is down
            pub.publish(b.events)
            pub.flush()
        again = AdvisorService(settings)
        again.start()
        try:
            assert again.counters["snapshot_loaded_position"] == 10
            assert again.counters["replayed_batches"] == 7  # stream sequences 11..17 only
            assert again.position == 17
            # a fresh advisor without snapshots folds the whole stream to the same index
            fresh = AdvisorService(settings.model_copy(update={"snapshot_store": "none"}))
            fresh.start()
            try:
                assert fresh.counters["replayed_batches"] == 17
                assert fresh.index.dump() == again.index.dump()
                assert fresh.index.dump() != live  # the 5 new batches changed it
            finally:
                fresh.stop()
        finally:
            again.stop()
    finally:
        pub.close()
        keys = list(r.scan_iter(f"{prefix}:*"))
        if keys:
            r.delete(*keys)
        r.close()
        proc.terminate()
        proc.wait(timeout=10)
