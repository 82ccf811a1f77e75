"""Publisher-reported hits (``extra_metadata["hits"]``) are bounded and attributable: only
sources in ``reported_hits_sources`` may report them, at most ``reported_hits_cap`` per
Store; a forged ``{"hits": 10**6}`` no longer makes the promotion policy move a block."""

from __future__ import annotations

import time
from pathlib import Path

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.journal import SqliteJournal
from advisor.policy.policies import PolicyInput, plan_promotions
from advisor.embedded.service import AdvisorService
from advisor.settings import AdvisorSettings
from event_plane import PublisherConfig, make_publisher
from event_plane.schema import WIRE_VERSION, EventBatch, store
from storage_backends.local_s3 import free_port
from tests.polling import wait_until as wait_for

BS = 4096
FORGED = {"hits": 10**6, "tier": "nvme"}


def promoted(settings: AdvisorSettings, index: PrefixIndex) -> list[int]:
    """Blocks the promotion policy would move from ``slow`` to ``fast``."""
    inp = PolicyInput("fast", ["slow"], None)
    return [item.sequence_hash for item in plan_promotions(settings.policy.promotion, inp, index)]


def test_a_forged_hits_store_over_zmq_no_longer_makes_the_policy_promote(tmp_path: Path) -> None:
    port, replay = free_port(), free_port()
    url = f"zmq://127.0.0.1:{port}?replay={replay}"
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[url], api_enabled=False,
                               get_timeout_s=0.05, snapshot_store="none")
    forged = [store(77, 77, None, BS, "slow", FORGED), store(78, 78, None, BS, "slow")]
    # without the admission step the index takes the publisher at its word: the check can fail
    bare = PrefixIndex()
    bare.apply_batch(EventBatch(WIRE_VERSION, "forger", 1, 0, 1, forged))
    assert bare.block(77).hits == 10**6 and promoted(settings, bare) == [77]

    pub = make_publisher(url, "forger", config=PublisherConfig(max_delay_s=0.05))
    svc = AdvisorService(settings)
    svc.start()
    try:
        pub.publish(forged)
        pub.flush()
        wait_for(lambda: svc.counters["ingested_batches"] == 1)
        info = svc.index.block(77)
        assert info is not None and info.hits == 0 and "slow" in info.locations
        assert promoted(settings, svc.index) == []
        assert svc.counters["reported_hits_untrusted"] == 1
        assert svc.metrics.registry.get_sample_value("kvadvisor_reported_hits_untrusted_total") == 1
        # what was journaled is what was admitted: the hits key is gone, other keys stay
        journal = SqliteJournal(settings.journal_path)
        try:
            [(_, logged)] = list(journal.read())
        finally:
            journal.close()
        assert logged.events[0].extra_metadata == {"tier": "nvme"}
    finally:
        pub.close()
        svc.stop()
    again = AdvisorService(settings.model_copy(update={"subscribe_urls": []}))
    again.start()
    try:
        assert again.index.block(77).hits == 0 and promoted(settings, again.index) == []
    finally:
        again.stop()


def test_trusted_sources_report_at_most_the_cap_and_the_excess_is_counted(tmp_path: Path) -> None:
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[], api_enabled=False,
                               snapshot_store="none", reported_hits_sources=["cache-a"], reported_hits_cap=3)
    svc = AdvisorService(settings)
    svc.start()
    try:
        assert svc.ingest(EventBatch(WIRE_VERSION, "cache-a", 1, 0, 1, [
            store(1, 1, None, BS, "slow", {"hits": 10**6}),
            store(2, 2, None, BS, "slow", {"hits": 2}),
            store(3, 3, None, BS, "slow", {"hits": True}),  # not a count: left for the index to ignore
        ]))
        assert svc.ingest(EventBatch(WIRE_VERSION, "worker-9", 1, 0, 2, [store(4, 4, None, BS, "slow", {"hits": 5})]))
        assert [svc.index.block(h).hits for h in (1, 2, 3, 4)] == [3, 2, 0, 0]
        assert svc.counters["reported_hits_capped"] == 10**6 - 3
        assert svc.counters["reported_hits_untrusted"] == 1
        assert svc.metrics.registry.get_sample_value("kvadvisor_reported_hits_capped_total") == 10**6 - 3
        # a trusted source's capped report can still qualify a block (cap 3 >= min_hits 2)
        assert promoted(settings, svc.index) == [1, 2]
        dump = svc.index.dump()
    finally:
        svc.stop()
    again = AdvisorService(settings)
    again.start()
    try:
        assert again.index.dump() == dump  # the journal holds the capped values
    finally:
        again.stop()


def test_a_cap_of_zero_ignores_every_report(tmp_path: Path) -> None:
    settings = AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[], api_enabled=False,
                               snapshot_store="none", reported_hits_sources=["cache-a"], reported_hits_cap=0)
    svc = AdvisorService(settings)
    svc.start()
    try:
        assert svc.ingest(EventBatch(WIRE_VERSION, "cache-a", 1, 0, 1, [store(1, 1, None, BS, "slow", {"hits": 9})]))
        assert svc.index.block(1).hits == 0 and svc.counters["reported_hits_capped"] == 9
    finally:
        svc.stop()


def test_scaled_mode_checks_stream_entries_as_it_folds_them_and_refolds_the_same(tmp_path: Path, js_url: str) -> None:
    """``log=jetstream``: the stream is the log, so each entry passes the quotas as it is
    folded (rate limit aside); forged hits are removed, a source over the quota is refused,
    and a fresh advisor folding the whole stream again decides the same."""
    host = js_url.removeprefix("nats://")
    ns = f"q{time.monotonic_ns() % 10**9}"
    settings = AdvisorSettings(log="jetstream", jetstream_url=js_url, jetstream_namespace=ns, snapshot_store="none",
                               api_enabled=False, get_timeout_s=0.05, journal_path=str(tmp_path / "unused.sqlite"),
                               quota_max_sources=2)
    pubs = [make_publisher(f"jetstream://{host}?namespace={ns}", name, config=PublisherConfig(max_delay_s=0.02))
            for name in ("forger", "w1", "w2")]
    svc = AdvisorService(settings)
    svc.start()
    try:
        pubs[0].publish([store(77, 77, None, BS, "slow", FORGED)])
        pubs[0].flush()
        pubs[1].publish([store(5, 5, None, BS, "g1")])
        pubs[1].flush()
        pubs[2].publish([store(6, 6, None, BS, "g1")])  # a third source: over the quota
        pubs[2].flush()
        wait_for(lambda: svc.position >= 3)
        assert svc.index.block(77).hits == 0 and svc.index.block(77).locations == frozenset({"slow"})
        assert svc.index.block(6) is None and set(svc.index.sources()) == {"forger", "w1"}
        assert svc.counters["reported_hits_untrusted"] == 1
        assert svc.counters["quota_refused_batches_sources"] == 1
        live = svc.index.dump()
    finally:
        for p in pubs:
            p.close()
        svc.stop()
    fresh = AdvisorService(settings)
    fresh.start()
    try:
        assert fresh.index.dump() == live
        assert fresh.counters["quota_refused_batches_sources"] == 1
    finally:
        fresh.stop()


def test_a_store_reporting_no_hits_does_not_let_the_next_ones_through() -> None:
    """Each Store's reported hits are checked on their own: a first Store reporting 0 hits
    once switched the check off for the rest of its batch (its value was kept in the flag
    that says whether to check), so a forged count after it went in untouched."""
    from advisor.ingest.quotas import QuotaGuard, QuotaLimits

    batch = EventBatch(WIRE_VERSION, "forger", 1, 0, 1, [store(1, 1, None, BS, "slow", {"hits": 0}),
                                                         store(2, 2, None, BS, "slow", {"extra": 1}),
                                                         store(3, 3, None, BS, "slow", FORGED)])
    got = QuotaGuard(QuotaLimits()).admit(batch, PrefixIndex())
    assert got.changed and got.batch is not None
    assert got.batch.events[2].extra_metadata == {"tier": "nvme"}  # untrusted: the hits key is gone
    trusted = QuotaGuard(QuotaLimits(reported_hits_sources=frozenset({"forger"}), reported_hits_cap=8))
    got = trusted.admit(batch, PrefixIndex())
    assert got.batch is not None and got.batch.events[2].extra_metadata == {"hits": 8, "tier": "nvme"}
    assert trusted.counters.hits_capped == 10**6 - 8
