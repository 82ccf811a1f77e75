"""State quotas over real ZMQ: what one peer can make the advisor hold is bounded, whatever
it sends within the rate quotas.

* origin bindings: none for a batch a quota refuses, at most ``quota_max_bindings``, and so
  at most that many persisted across a restart;
* retired epochs: a source opening a new epoch per (empty) batch keeps a handful, in the
  index and in the subscriber's ordering tracker; an empty batch costs a rate token;
* blocks: one source's ``g1``/``g2`` at most ``quota_max_source_blocks``, the index at most
  ``quota_max_blocks``; the Stores over are refused alone (the batch's other events go on).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import BS, RawPub, settings, wait_for

from advisor.origin_store import SqliteOriginStore
from event_plane.ordering import MAX_RETIRED_EPOCHS
from event_plane.schema import WIRE_VERSION, EventBatch, remove, store


def batch(source: str, seq: int, events: list[Any], epoch: int = 1) -> EventBatch:
    return EventBatch(WIRE_VERSION, source, epoch, seq, 1_000 + seq, events)


def stores(first: int, n: int, loc: str) -> list[Any]:
    return [store(h, h, None, BS, loc) for h in range(first, first + n)]


def settled(svc: Any, sent: int) -> bool:
    """Every batch sent was applied or refused whole by a quota."""
    c = svc.counters
    refused = sum(v for k, v in c.items() if k.startswith("quota_refused_batches_"))
    return c["ingested_batches"] + refused + c["duplicate_batches"] >= sent


def test_a_source_refused_by_a_quota_binds_nothing_and_bindings_are_capped(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(settings(tmp_path, [pub.url], quota_max_sources=20))
        pub.join(svc)
        sent = svc.counters["ingested_batches"]
        for s in range(300):
            pub.send(batch(f"squat-{s}", 0, stores(10_000 + s, 1, "g1")))
        wait_for(lambda: settled(svc, sent + 300), what="every squatting batch applied or refused")
        assert svc.counters["quota_refused_batches_sources"] == 300 - 19  # 20 sources: the probe + 19
        assert len(svc.origins.bindings()) == len(svc.index.sources()) == 20
        assert {s for s in svc.origins.bindings()} == set(svc.index.sources())
        svc.stop()
        persisted = SqliteOriginStore(svc.settings.origins_file)
        try:
            assert len(persisted.load()) == 20  # what survives a restart
        finally:
            persisted.close()
    finally:
        pub.close()


def test_bindings_have_their_own_quota(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(settings(tmp_path, [pub.url], quota_max_bindings=10))
        pub.join(svc)
        sent = svc.counters["ingested_batches"]
        for s in range(50):
            pub.send(batch(f"name-{s}", 0, stores(10_000 + s, 1, "g1")))
        wait_for(lambda: settled(svc, sent + 50), what="every batch applied or refused")
        assert svc.counters["quota_refused_batches_bindings"] == 41  # the probe + 9 bound
        assert svc.origins.count() == 10
        sample = svc.metrics.registry.get_sample_value("kvadvisor_quota_refused_batches_total",
                                                       {"reason": "bindings"})
        assert sample == 41
        # a bound source goes on
        pub.send(batch("name-0", 1, stores(20_000, 1, "g1")))
        wait_for(lambda: svc.index.holds(20_000, "name-0/g1"), what="a bound source's next batch")
    finally:
        pub.close()


def test_epoch_churn_keeps_a_handful_of_retired_epochs(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(settings(tmp_path, [pub.url]))
        pub.join(svc)
        sent = svc.counters["ingested_batches"]
        n = 3000
        for e in range(n):  # one empty batch per epoch: each retires the one before
            pub.send(batch("churn", 0, [], epoch=1_000_000 + e))
        wait_for(lambda: settled(svc, sent + n), what="every churn batch applied")
        assert len(svc.index.sources()["churn"].retired_epochs) == MAX_RETIRED_EPOCHS
        assert len(svc.subscriber._tracker._retired["churn"]) == MAX_RETIRED_EPOCHS
        assert svc.counters["retired_epochs_forgotten"] == n - 1 - MAX_RETIRED_EPOCHS
        # the newest retired epochs are still refused as superseded
        stale_before = svc.index.counters.stale_batches
        pub.send(batch("churn", 1, stores(5, 1, "g1"), epoch=1_000_000 + n - 2))
        pub.send(batch("churn", 1, stores(6, 1, "g1"), epoch=1_000_000 + n - 1))
        wait_for(lambda: svc.index.holds(6, "churn/g1"), what="the current epoch's next batch")
        assert not svc.index.holds(5, "churn/g1")
        assert svc.index.counters.stale_batches == stale_before  # dropped by the tracker already
    finally:
        pub.close()


def test_an_empty_batch_costs_a_rate_token(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(settings(tmp_path, [pub.url], quota_source_rate=1.0, quota_source_burst=50,
                               quota_max_batch_events=50))
        pub.join(svc, "probe")
        for seq in range(200):
            pub.send(batch("empty", seq, []))
        wait_for(lambda: settled(svc, 1 + 200), what="every empty batch applied or refused")
        assert svc.counters["quota_refused_batches_rate"] >= 200 - 50 - 10  # the burst, ~1/s refill
    finally:
        pub.close()


def test_blocks_per_source_and_in_total_are_bounded(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(settings(tmp_path, [pub.url], quota_max_source_blocks=1000, quota_max_blocks=3000))
        pub.join(svc)
        for seq in range(5):  # 2,500 g1 blocks offered; 1,000 kept
            pub.send(batch("w0", seq, stores(1 + 500 * seq, 500, "g1")))
        wait_for(lambda: svc.counters["quota_refused_events_source_blocks"] == 1500, what="w0 over its blocks")
        assert svc.index.count_at("w0/g1") == 1000
        # Removes still go on (a Store over is refused alone), and free room for later Stores
        pub.send(batch("w0", 5, [remove(h, h, None, BS, "g1") for h in range(1, 101)] + stores(5000, 1, "g1")))
        wait_for(lambda: svc.index.count_at("w0/g1") == 900, what="w0's Removes")
        assert svc.counters["quota_refused_events_source_blocks"] == 1501
        pub.send(batch("w0", 6, stores(6000, 150, "g1")))
        wait_for(lambda: svc.index.holds(6099, "w0/g1"), what="Stores within the freed room")
        assert svc.index.count_at("w0/g1") == 1000
        assert svc.counters["quota_refused_events_source_blocks"] == 1551
        # a new epoch starts w0's g1 empty: it may store again
        pub.send(batch("w0", 0, stores(7000, 10, "g1"), epoch=2))
        wait_for(lambda: svc.index.count_at("w0/g1") == 10, what="w0's new epoch")
        # volume blocks count in the total: the index stops at 3,000 blocks
        for seq in range(3):
            pub.send(batch("w1", seq, stores(100_000 + 1000 * seq, 1000, "vol-a")))
        wait_for(lambda: svc.counters["quota_refused_events_blocks"] > 0, what="the index's block quota")
        wait_for(lambda: len(svc.index) == 3000, what="the index full")
        sample = svc.metrics.registry.get_sample_value("kvadvisor_quota_refused_events_total", {"reason": "blocks"})
        assert sample == svc.counters["quota_refused_events_blocks"] > 0
    finally:
        pub.close()
