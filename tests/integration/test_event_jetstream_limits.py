"""A bounded JetStream stream on private nats-servers: default and configured limits
(publisher, subscriber, advisor), existing streams that differ, a full store reported at
once, and batches the stream deleted before a new consumer read them reported as gaps."""

from __future__ import annotations

import asyncio
import logging
import shutil
import subprocess
import time
from typing import Any

import nats
import pytest
from conftest import _wait_port, start_nats_server

from advisor import AdvisorSettings
from advisor.ingest.jslog import JetStreamLog
from advisor.embedded.service import AdvisorService
from event_plane import (
    JetStreamPublisher,
    JetStreamSubscriber,
    PublisherConfig,
    StreamLimits,
    StreamMismatchError,
    TransportError,
    make_publisher,
    store,
    subscribe,
)
from storage_backends.local_s3 import free_port

ONE = PublisherConfig(max_events=1)
STREAM = "KVADVISOR_EVENTS"


def ev(i: int) -> Any:
    return store(1000 + i, 1000, (999 + i) if i else None, 4096, "g2")




def hostport(url: str) -> str:
    return url.removeprefix("nats://")


def js_call(url: str, fn: Any) -> Any:
    """Run ``await fn(js)`` on a fresh nats-py connection to ``url``."""

    async def go() -> Any:
        nc = await nats.connect(url)
        try:
            return await fn(nc.jetstream())
        finally:
            await nc.close()

    return asyncio.run(go())


def stream_info(url: str) -> Any:
    return js_call(url, lambda js: js.stream_info(STREAM))


def limits_of(url: str) -> tuple[int, float, str]:
    cfg = stream_info(url).config
    return int(cfg.max_bytes), float(cfg.max_age or 0), getattr(cfg.discard, "value", cfg.discard)


def create_stream(url: str, max_bytes: int, discard: str) -> None:
    """Create the stream with plain nats-py (as an operator would), ahead of any publisher."""
    from nats.js import api

    cfg = api.StreamConfig(name=STREAM, subjects=["kvadvisor.events.>"], max_bytes=max_bytes,
                           discard=api.DiscardPolicy(discard), duplicate_window=120.0)
    js_call(url, lambda js: js.add_stream(cfg))


def publish_each(pub: Any, idx: range) -> None:
    """Publish one event per batch and flush each."""
    for i in idx:
        pub.publish([ev(i)])
        pub.flush()


@pytest.fixture
def no_give_up(monkeypatch: pytest.MonkeyPatch) -> None:
    """Publishers retry a failed publish for an hour instead of 30 s: a refusal that is
    retried (not reported at once) then holds its flush until pytest's timeout fails the
    test, whatever the machine's load."""
    from event_plane.nats_transport import JetStreamPublisher

    monkeypatch.setattr(JetStreamPublisher, "retry_for_s", 3600.0)


def start_small_store_server(tmp_path: Any, max_file_store: int) -> tuple[subprocess.Popen[bytes], str]:
    """A private nats-server whose JetStream file storage holds ``max_file_store`` bytes."""
    port = free_port()
    conf = tmp_path / "small.conf"
    conf.write_text(f'jetstream {{ store_dir: "{tmp_path / "small-js"}", max_file_store: {max_file_store}, '
                    f'max_memory_store: {max_file_store} }}\n')
    exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
    proc = subprocess.Popen([exe, "-a", "127.0.0.1", "-p", str(port), "-c", str(conf)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    _wait_port(port, proc, "nats-server")
    return proc, f"nats://127.0.0.1:{port}"


# ---------------------------------------------------------------------- 1. limits
def test_a_subscriber_that_starts_first_creates_the_stream_with_the_default_limits(js_url: str) -> None:
    sub = JetStreamSubscriber(js_url, "first", durable="early")
    sub.start()
    sub.close()
    assert limits_of(js_url) == (1 << 30, 24 * 3600.0, "old")


def test_url_limits_are_applied_by_whoever_creates_the_stream(tmp_path) -> None:  # type: ignore[no-untyped-def]
    for who in ("publisher", "subscriber"):
        proc, url, _ = start_nats_server(store_dir=str(tmp_path / who))
        try:
            target = f"jetstream://{hostport(url)}?namespace=lim&max_bytes=65536&max_age=90&discard=new"
            if who == "publisher":
                make_publisher(target + "&manage_stream=1", "w0").close()
            else:
                sub = subscribe(target + "&durable=d")
                sub.start()
                sub.close()
            assert limits_of(url) == (65536, 90.0, "new"), who
        finally:
            proc.terminate()
            proc.wait(timeout=10)


def test_unlimited_stream_by_url(js_url: str) -> None:
    make_publisher(f"jetstream://{hostport(js_url)}?max_bytes=unlimited&max_age=unlimited&manage_stream=1", "w0").close()
    assert limits_of(js_url) == (-1, 0.0, "old")


# ---------------------------------------------------------------------- 2. existing streams
def test_an_existing_stream_that_differs_is_named_field_by_field_or_refused(js_url: str, caplog) -> None:  # type: ignore[no-untyped-def]
    host = hostport(js_url)
    sub = subscribe(f"jetstream://{host}?namespace=mm&durable=d&max_bytes=8192&discard=new")
    sub.start()  # creates the stream: 8 KiB, 24 h, discard new
    sub.close()
    caplog.set_level(logging.WARNING, logger="event_plane.nats_transport")
    pub = make_publisher(f"jetstream://{host}?namespace=mm&max_age=60&manage_stream=1", "w0", config=ONE)
    try:
        texts = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
        assert len(texts) == 1, texts
        assert "JetStream publisher w0" in texts[0]
        assert "max_bytes: stream has 8192, configured 1073741824" in texts[0]
        assert "max_age: stream has 86400.0, configured 60.0" in texts[0]
        assert "discard: stream has new, configured old" in texts[0]
        assert "subjects" not in texts[0] and "duplicate_window" not in texts[0]
        publish_each(pub, range(2))  # it works with the stream as it is
        assert pub.stats().dropped == 0
    finally:
        pub.close()
    assert limits_of(js_url) == (8192, 86400.0, "new")  # nothing was changed

    caplog.clear()
    same = make_publisher(f"jetstream://{host}?namespace=mm&max_bytes=8192&discard=new&strict_stream=1&manage_stream=1",
                          "w1")
    same.close()  # the same configuration: no warning, strict or not
    assert not [r for r in caplog.records if r.levelno >= logging.WARNING]

    with pytest.raises(StreamMismatchError, match="max_bytes: stream has 8192, configured 4096"):
        make_publisher(f"jetstream://{host}?namespace=mm&max_bytes=4096&discard=new&strict_stream=1&manage_stream=1",
                       "w2")
    strict_sub = subscribe(f"jetstream://{host}?namespace=mm&durable=s&strict_stream=1")
    with pytest.raises(StreamMismatchError, match="discard: stream has new, configured old"):
        strict_sub.start()
    with pytest.raises(StreamMismatchError, match="max_bytes"):
        JetStreamLog(js_url, "mm", stream=StreamLimits(strict=True)).start()
    # what was accepted before stays: the two batches are in the stream
    assert stream_info(js_url).state.messages == 2


def test_a_stream_larger_than_the_servers_storage_is_a_clear_error(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc, url = start_small_store_server(tmp_path, 256 * 1024)
    try:
        with pytest.raises(TransportError, match=r"refused to create stream KVADVISOR_EVENTS \(max_bytes=1073741824"):
            JetStreamPublisher("w0", url, "big", manage_stream=True)
        make_publisher(f"jetstream://{hostport(url)}?namespace=big&max_bytes=65536&manage_stream=1", "w0").close()  # fits
        assert limits_of(url)[0] == 65536
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---------------------------------------------------------------------- 3. a full store
def test_a_full_stream_with_discard_new_is_reported_at_once(js_url: str, caplog, no_give_up) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.DEBUG, logger="event_plane.nats_transport")
    create_stream(js_url, 4096, "new")
    pub = make_publisher(f"jetstream://{hostport(js_url)}?namespace=full", "w0",
                         config=ONE, epoch=3)
    try:
        publish_each(pub, range(60))  # each flush returns, refused or not: not retried (was: 30 s each)
        st = pub.stats()
        stored = stream_info(js_url).state.messages
        assert 0 < stored < 60 and st.refused == 60 - stored  # the stream took what fitted
        assert st.dropped == st.refused  # one event per batch, counted as dropped
        errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
        assert len(errors) == 1 and "stream KVADVISOR_EVENTS is full" in errors[0]
        assert f"w0:3:{stored}" in errors[0] and "maximum bytes exceeded" in errors[0]

        js_call(js_url, lambda js: js.purge_stream(STREAM))  # room again: the next batch goes in
        publish_each(pub, range(60, 61))
        assert pub.stats().refused == st.refused and stream_info(js_url).state.messages == 1
        assert any("accepts batches again after" in r.getMessage() for r in caplog.records)
    finally:
        pub.close()


def test_exhausted_server_storage_is_reported_at_once(tmp_path, caplog, no_give_up) -> None:  # type: ignore[no-untyped-def]
    caplog.set_level(logging.ERROR, logger="event_plane.nats_transport")
    proc, url = start_small_store_server(tmp_path, 64 * 1024)
    try:
        create_stream(url, -1, "old")  # unlimited: the server's storage is what fills up
        pub = make_publisher(f"jetstream://{hostport(url)}?namespace=disk", "w0",
                             config=PublisherConfig(max_events=128))
        try:
            for i in range(60):  # ~140 KB in all
                pub.publish([ev(i * 128 + k) for k in range(128)])  # one ~2.3 KB batch
                pub.flush()  # a refusal retried would hold this flush (fixture no_give_up)
            st = pub.stats()
            assert st.refused > 0 and st.dropped == 128 * st.refused
            assert stream_info(url).state.messages == 60 - st.refused
            errors = [r.getMessage() for r in caplog.records if r.levelno == logging.ERROR]
            assert len(errors) == 1 and "is full" in errors[0] and "insufficient resources" in errors[0]
        finally:
            pub.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)


# ---------------------------------------------------------------------- 4. deleted before read
def ring(url: str, ns: str, n: int, epoch: int, source: str = "w0") -> int:
    """Publish ``n`` one-event batches into a 4 KiB discard-old stream (created first if
    missing); returns the stream's first sequence."""
    try:
        stream_info(url)
    except Exception:  # noqa: BLE001 - not there yet
        create_stream(url, 4096, "old")
    pub = make_publisher(f"jetstream://{hostport(url)}?namespace={ns}", source, config=ONE, epoch=epoch)
    try:
        publish_each(pub, range(n))
        assert pub.stats().dropped == 0  # discard old never refuses
    finally:
        pub.close()
    return int(stream_info(url).state.first_seq)


def test_a_new_durable_reports_what_the_stream_deleted_as_a_gap(js_url: str) -> None:
    ring(js_url, "ring", 60, epoch=11)
    first = ring(js_url, "ring", 3, epoch=12, source="w1")  # a source whose seq 0 is still there
    assert 2 < first < 61  # stream seqs 1..first-1 (w0's batch seqs 0..first-2) are gone, w1's kept
    lost = first - 1
    gaps: list[tuple] = []
    resyncs: list[str] = []
    sub = subscribe(f"jetstream://{hostport(js_url)}?namespace=ring&durable=late",
                    on_gap=lambda *g: gaps.append(g), on_resync=resyncs.append)
    sub.start()
    try:
        got = sub.get_many(100, 3.0)
        w0 = [b.seq for b in got if b.source == "w0"]
        k = w0[0]
        assert k == lost and w0 == list(range(k, 60))  # stream seq s holds w0's batch s-1
        assert [b.seq for b in got if b.source == "w1"] == [0, 1, 2]  # no gap: all kept
        assert gaps == [("w0", 11, 0, k - 1)]
        st = sub.stats()
        assert (st.gaps, st.unrecovered, st.resyncs) == (1, k, 1)
        assert resyncs == ["w0"] and sub.resync_needed == frozenset({"w0"})
        assert st.discarded == first - 1
    finally:
        sub.close()


def test_start_positions_below_the_first_kept_sequence_are_gaps_and_above_it_are_not(js_url: str) -> None:
    first = ring(js_url, "pos", 60, epoch=21)
    cases = [
        (("seq", 2), first - 2, 1),  # asked from seq 2: seqs 2..first-1 were deleted
        (("seq", first), 0, 0),  # exactly the first kept: nothing lost
        (("time", "2020-01-01T00:00:00+00:00"), first - 1, 1),  # before the oldest kept
        ("new", 0, 0),
    ]
    for i, (deliver, discarded, gaps) in enumerate(cases):
        sub = JetStreamSubscriber(js_url, "pos", durable=f"d{i}", deliver=deliver)
        sub.start()
        try:
            want = [] if deliver == "new" else list(range(first - 1, 60))
            # those (however long a loaded machine takes), then nothing more within 1.5 s
            got = sub.get_many(len(want), 30.0) + sub.get_many(100, 1.5)
            assert [b.seq for b in got] == want, deliver
            st = sub.stats()
            assert (st.gaps, st.unrecovered) == (gaps, first - 1 if gaps else 0), deliver
            assert st.discarded == discarded, deliver
        finally:
            sub.close()
    # a start time inside the kept messages: nothing before it was wanted
    since = js_call(js_url, lambda js: js.get_msg(STREAM, first + 5)).time.isoformat()
    sub = JetStreamSubscriber(js_url, "pos", durable="late-time", deliver=("time", since))
    sub.start()
    try:
        want = list(range(first + 4, 60))
        assert [b.seq for b in sub.get_many(len(want), 30.0) + sub.get_many(100, 1.5)] == want
        assert (sub.stats().gaps, sub.stats().discarded) == (0, 0)
    finally:
        sub.close()


def test_a_resumed_durable_reports_what_was_deleted_while_it_was_away(js_url: str) -> None:
    host = hostport(js_url)
    create_stream(js_url, 4096, "old")
    pub = make_publisher(f"jetstream://{host}?namespace=away", "w0", config=ONE, epoch=31)
    try:
        publish_each(pub, range(3))
        sub = subscribe(f"jetstream://{host}?namespace=away&durable=r")
        sub.start()
        assert [b.seq for b in sub.get_many(3, 3.0)] == [0, 1, 2]
        sub.close()
        assert sub.stats().gaps == 0
        publish_each(pub, range(3, 63))  # the stream deletes seqs 4.. that the durable did not read
    finally:
        pub.close()
    first = int(stream_info(js_url).state.first_seq)
    assert first > 4
    sub = subscribe(f"jetstream://{host}?namespace=away&durable=r")
    sub.start()
    try:
        got = sub.get_many(100, 3.0)
        assert [b.seq for b in got] == list(range(first - 1, 63))
        st = sub.stats()
        assert st.gaps == 1 and sub.resync_needed == frozenset({"w0"})
        assert st.discarded == first - 4
    finally:
        sub.close()


# ---------------------------------------------------------------------- the advisor
def advisor_log_settings(tmp_path: Any, url: str, **kw: Any) -> AdvisorSettings:
    return AdvisorSettings(log="jetstream", jetstream_url=url, jetstream_namespace="adv", snapshot_store="none",
                           api_enabled=False, get_timeout_s=0.05, journal_path=str(tmp_path / "unused.sqlite"), **kw)


def test_advisor_settings_set_the_stream_limits_wherever_the_advisor_meets_the_stream(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc, url, _ = start_nats_server(store_dir=str(tmp_path / "js"))
    try:
        svc = AdvisorService(advisor_log_settings(tmp_path, url, jetstream_max_bytes=4096, jetstream_max_age_s=600.0))
        svc.start()  # the advisor starts first: its log creates the stream
        svc.stop()
        assert limits_of(url) == (4096, 600.0, "old")
        strict = AdvisorService(advisor_log_settings(tmp_path, url, jetstream_strict_stream=True))
        with pytest.raises(StreamMismatchError, match="max_bytes: stream has 4096, configured 1073741824"):
            strict.start()
        strict.stop()
        # subscribe_urls / publish_url get the settings too (the URL's own parameters win)
        sub_settings = AdvisorSettings(subscribe_urls=[f"jetstream://{hostport(url)}?namespace=adv&durable=a"],
                                       jetstream_max_bytes=4096, jetstream_max_age_s=600.0,
                                       jetstream_strict_stream=True, api_enabled=False,
                                       journal_path=str(tmp_path / "j.sqlite"), snapshot_store="none")
        ok = AdvisorService(sub_settings)
        ok.start()  # same limits: accepted under strict
        ok.stop()
        bad = AdvisorService(sub_settings.model_copy(update={"jetstream_max_age_s": 60.0}))
        with pytest.raises(StreamMismatchError, match="max_age: stream has 600.0, configured 60.0"):
            bad.start()
        bad.stop()
        pub_settings = sub_settings.model_copy(update={
            "subscribe_urls": [], "publish_url": f"jetstream://{hostport(url)}?namespace=adv&max_age=60"})
        bad = AdvisorService(pub_settings)
        with pytest.raises(StreamMismatchError, match="max_age: stream has 600.0, configured 60.0"):
            bad.start()
        bad.stop()
        assert limits_of(url) == (4096, 600.0, "old")
    finally:
        proc.terminate()
        proc.wait(timeout=10)


def test_the_advisor_log_reports_entries_the_stream_deleted(tmp_path) -> None:  # type: ignore[no-untyped-def]
    proc, url, _ = start_nats_server(store_dir=str(tmp_path / "js"))
    settings = advisor_log_settings(tmp_path, url)
    try:
        ring(url, "adv", 5, epoch=40)  # nothing deleted yet
        svc = AdvisorService(settings)
        svc.start()
        try:
            assert svc.position == 5 and svc.counters["log_discarded"] == 0
        finally:
            svc.stop()
        first = ring(url, "adv", 60, epoch=41)
        fresh = AdvisorService(settings)
        fresh.start()  # reads from sequence 1: 1..first-1 are gone
        try:
            assert fresh.counters["log_discarded"] == first - 1 > 0
            assert fresh.position == 65
        finally:
            fresh.stop()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
