"""NATS transports on a real server: core subjects + headers, JetStream durability."""

from __future__ import annotations

import asyncio
import secrets
from collections.abc import Iterator

import nats
import pytest
from conftest import start_nats_server

from event_plane import (
    ConfigError,
    EventBatch,
    JetStreamPublisher,
    JetStreamSubscriber,
    NatsPublisher,
    NatsSubscriber,
    PublisherConfig,
    TransportError,
    encode_batch,
    make_publisher,
    store,
    subscribe,
)
from storage_backends.local_s3 import free_port
from tests.polling import wait_until


def evs(n: int, start: int = 1) -> list:
    return [store(start + i, start, (start + i - 1) if i else None, 4096, "g2") for i in range(n)]


def namespace() -> str:
    return "t" + secrets.token_hex(4)


class RawTap:
    """A plain nats-py subscriber on its own loop thread, recording subject/header/payload."""

    def __init__(self, url: str, subject: str) -> None:
        self.msgs: list[tuple[str, dict[str, str], bytes]] = []
        self.loop = asyncio.new_event_loop()
        import threading

        self.thread = threading.Thread(target=self.loop.run_forever, daemon=True)
        self.thread.start()
        self.nc = self._run(nats.connect(url))
        self._run(self._sub(subject))

    def _run(self, coro):  # type: ignore[no-untyped-def]
        return asyncio.run_coroutine_threadsafe(coro, self.loop).result(10)

    async def _sub(self, subject: str) -> None:
        async def cb(msg) -> None:  # type: ignore[no-untyped-def]
            self.msgs.append((msg.subject, dict(msg.headers or {}), msg.data))

        await self.nc.subscribe(subject, cb=cb)
        await self.nc.flush()

    def publish(self, subject: str, data: bytes) -> None:
        async def go() -> None:
            await self.nc.publish(subject, data)
            await self.nc.flush()

        self._run(go())

    def close(self) -> None:
        self._run(self.nc.close())
        self.loop.call_soon_threadsafe(self.loop.stop)
        self.thread.join()


def test_core_pub_sub_exact_order_and_msg_id_header(nats_url: str) -> None:
    ns = namespace()
    tap = RawTap(nats_url, f"kvadvisor.events.{ns}.>")
    sub = subscribe(f"{nats_url}?namespace={ns}")
    sub.start()
    pub = make_publisher(f"{nats_url}?namespace={ns}", "w0", config=PublisherConfig(max_events=3), epoch=77)
    try:
        assert isinstance(pub, NatsPublisher)
        events = evs(10)
        pub.publish(events)
        pub.close()
        got = sub.get_many(4, 5.0)
        assert [b.seq for b in got] == [0, 1, 2, 3]
        assert [e for b in got for e in b.events] == events
        assert [len(b.events) for b in got] == [3, 3, 3, 1]
        for _ in range(100):
            if len(tap.msgs) == 4:
                break
            asyncio.run(asyncio.sleep(0.02))
        assert [m[0] for m in tap.msgs] == [f"kvadvisor.events.{ns}.w0"] * 4
        # <namespace>.<source>:<epoch>:<seq>:<the publisher's secret key>, one key for all
        ids = [m[1]["Nats-Msg-Id"] for m in tap.msgs]
        assert [i.rsplit(":", 1)[0] for i in ids] == [f"{ns}.w0:77:{s}" for s in range(4)]
        assert len({i.rsplit(":", 1)[1] for i in ids}) == 1 and len(ids[0].rsplit(":", 1)[1]) == 16
        assert [m[2] for m in tap.msgs] == [encode_batch(b) for b in got]
        assert pub.stats().payload_bytes == sum(len(m[2]) for m in tap.msgs)
    finally:
        pub.close()
        sub.close()
        tap.close()


def test_core_gap_and_garbage_are_counted(nats_url: str) -> None:
    ns = namespace()
    gaps: list[tuple] = []
    sub = NatsSubscriber(nats_url, ns, on_gap=lambda *g: gaps.append(g))
    sub.start()
    tap = RawTap(nats_url, "unused.subject")
    try:
        subject = f"kvadvisor.events.{ns}.ext"
        b0 = EventBatch(1, "ext", 5, 0, 0, evs(1))
        b3 = EventBatch(1, "ext", 5, 3, 0, evs(1, 10))
        tap.publish(subject, encode_batch(b0))
        tap.publish(subject, b"\xc1not msgpack")
        tap.publish(subject, encode_batch(b3))
        tap.publish(subject, encode_batch(b0))  # duplicate
        got = sub.get_many(2, 5.0)
        assert got == [b0, b3]
        assert sub.get(0.2) is None
        st = sub.stats()
        assert (st.decode_errors, st.gaps, st.unrecovered, st.duplicates) == (1, 1, 2, 1)
        assert gaps == [("ext", 5, 1, 2)]
    finally:
        sub.close()
        tap.close()


def test_bad_token_and_unreachable_server() -> None:
    with pytest.raises(ConfigError):
        NatsPublisher("has.dot", "nats://127.0.0.1:4222")
    with pytest.raises(ConfigError):
        NatsSubscriber("nats://127.0.0.1:4222", "bad ns")
    with pytest.raises(TransportError):
        NatsPublisher("w0", f"nats://127.0.0.1:{free_port()}", connect_timeout_s=0.5)


@pytest.fixture()
def private_nats(tmp_path) -> Iterator[tuple[str, int, str, dict]]:  # type: ignore[no-untyped-def]
    """A private JetStream server (own store dir) so durable state does not leak.

    Yields (url, port, store dir, {"proc": server process}); a test may restart the server.
    """
    port = free_port()
    proc, url, store_dir = start_nats_server(port, str(tmp_path / "js"))
    holder = {"proc": proc}
    try:
        yield url, port, store_dir, holder
    finally:
        holder["proc"].terminate()
        holder["proc"].wait(timeout=10)


def test_jetstream_late_subscriber_durable_resume_and_dedup(private_nats) -> None:  # type: ignore[no-untyped-def]
    url, _, _, _ = private_nats
    pub = JetStreamPublisher("w0", url, "ns1", epoch=9, config=PublisherConfig(max_events=3), manage_stream=True)
    try:
        pub.publish(evs(7))
        pub.flush()
        # late subscriber: the whole history comes from the stream
        sub = JetStreamSubscriber(url, "ns1", durable="vendor")
        sub.start()
        first = sub.get_many(3, 5.0)
        assert [b.seq for b in first] == [0, 1, 2]
        assert [e.sequence_hash for b in first for e in b.events] == list(range(1, 8))
        sub.close()

        pub.publish(evs(4, 100))  # seq 3 (3 events) and, on flush, seq 4 (1 event)
        pub.flush()
        # a re-sent batch (same Nats-Msg-Id) is dropped by the stream
        tap = RawTap(url, "unused.subject")
        try:
            dup = EventBatch(1, "w0", 9, 3, 0, evs(3, 100))

            async def resend() -> bool:
                ack = await tap.nc.jetstream().publish(
                    "kvadvisor.events.ns1.w0", encode_batch(dup), headers={"Nats-Msg-Id": f"ns1.w0:9:3:{pub._msg_id_key}"}
                )
                return bool(ack.duplicate)

            assert tap._run(resend()) is True
        finally:
            tap.close()

        sub = JetStreamSubscriber(url, "ns1", durable="vendor")
        sub.start()
        # the two (however long a loaded machine takes), then nothing more within 1.5 s
        rest = sub.get_many(2, 30.0) + sub.get_many(10, 1.5)
        assert [b.seq for b in rest] == [3, 4]  # resumes after the last ack, no doubles
        assert [e.sequence_hash for b in rest for e in b.events] == [100, 101, 102, 103]
        st = sub.stats()
        assert (st.gaps, st.duplicates, st.unrecovered) == (0, 0, 0)
        sub.close()
    finally:
        pub.close()


def test_a_durable_closed_then_resumed_gets_the_next_batch_first(private_nats) -> None:  # type: ignore[no-untyped-def]
    """A subscriber's last pull request outlives its close on the server until it expires
    (here: the server has not yet seen the connection go, through a proxy that keeps the
    upstream connection open, as a loaded server that has not processed the close yet).
    A batch published meanwhile must not go to that dead request: the durable's next run
    would get the later batches first and that one only after the ack wait (30 s).  Each pull
    request waits 5 s on the server, so the last one is still there when the next batch is
    published, whatever the machine's load (with the default 0.2 s it could expire while the
    close runs, and the test would pass without the unsubscribe it checks); one message per
    pull, so a pull returns with its first message instead of waiting to fill a batch."""
    from nats_proxy import NatsDeliveryDelayProxy

    url, port, _, _ = private_nats
    pub = JetStreamPublisher("w0", url, "nsr", epoch=4, config=PublisherConfig(max_events=1), manage_stream=True)
    try:
        with NatsDeliveryDelayProxy(port, 0.0) as proxy:
            for k in range(3):
                pub.publish(evs(1, 10 * k + 1))
                pub.flush()
                sub = JetStreamSubscriber(proxy.url, "nsr", durable="resumes", batch_size=1, pull_wait_s=5.0)
                sub.start()
                got = sub.get_many(1, 5.0)
                sub.close()
                assert [b.seq for b in got] == [k], f"run {k} got {[b.seq for b in got]}"
            pub.publish(evs(1, 100))
            pub.flush()
            sub = JetStreamSubscriber(url, "nsr", durable="resumes")
            sub.start()
            try:
                # at once, not after the 30 s ack wait: waited for up to 20 s (a loaded machine
                # may start the subscriber late), then nothing more within 1.5 s
                assert [b.seq for b in sub.get_many(1, 20.0) + sub.get_many(10, 1.5)] == [3]
            finally:
                sub.close()
    finally:
        pub.close()


def test_batches_not_handed_out_at_close_go_to_the_next_run_first(private_nats) -> None:  # type: ignore[no-untyped-def]
    """A subscriber whose queue is full holds one queued batch nobody read and a fetch of
    messages it could not queue, none acknowledged (a batch is acknowledged when ``get``
    hands it out).  Closing it hands them all back, so the durable's next run reads them at
    once and in order: nothing lost, nothing after the ack wait (30 s)."""
    url, _, _, _ = private_nats
    pub = JetStreamPublisher("w0", url, "nsq", epoch=5, config=PublisherConfig(max_events=1), manage_stream=True)
    try:
        for i in range(10):
            pub.publish(evs(1, 200 + i))
        pub.flush()
        first = JetStreamSubscriber(url, "nsq", durable="full", queue_capacity=2)
        first.start()

        async def unacked() -> int:
            nc = await nats.connect(url)
            try:
                return int((await nc.jetstream().consumer_info("KVADVISOR_EVENTS", "full")).num_ack_pending)
            finally:
                await nc.close()

        try:
            # the first batch fills its source's share of the queue; the other nine are
            # fetched while the pull loop waits for room: none is acknowledged yet
            wait_until(lambda: asyncio.run(unacked()) == 10, 20, "ten batches fetched and not acknowledged")
            assert [b.seq for b in first.get_many(1, 5.0)] == [0]  # handed out: acknowledged
            wait_until(lambda: asyncio.run(unacked()) == 9, 20, "the batch handed out acknowledged")
            wait_until(lambda: first._queue.qsize() == 1, 20, "the next batch queued")
        finally:
            first.close()  # the batch queued and never read goes back, with the eight fetched
        sub = JetStreamSubscriber(url, "nsq", durable="full")
        sub.start()
        try:
            assert [b.seq for b in sub.get_many(10, 3.0)] == list(range(1, 10))
            assert sub.stats().gaps == 0
        finally:
            sub.close()
    finally:
        pub.close()


def test_jetstream_server_restart_mid_stream_loses_and_doubles_nothing(private_nats) -> None:  # type: ignore[no-untyped-def]
    url, port, store_dir, holder = private_nats
    pub = JetStreamPublisher("w0", url, "ns2", config=PublisherConfig(max_events=2), reconnect_time_wait=0.1,
                             manage_stream=True)
    try:
        pub.publish(evs(6))
        pub.flush()
        holder["proc"].terminate()
        holder["proc"].wait(timeout=10)
        pub.publish(evs(4, 50))  # while the server is down: retried until it is back
        holder["proc"], _, _ = start_nats_server(port, store_dir)
        pub.flush()
        assert pub.stats().dropped == 0
        sub = JetStreamSubscriber(url, "ns2", durable="after-restart")
        sub.start()
        try:
            got = sub.get_many(10, 5.0)
            assert [b.seq for b in got] == [0, 1, 2, 3, 4]
            assert [e.sequence_hash for b in got for e in b.events] == [1, 2, 3, 4, 5, 6, 50, 51, 52, 53]
            assert sub.get(0.3) is None
        finally:
            sub.close()
    finally:
        pub.close()


def test_jetstream_publisher_killed_and_restarted_new_epoch(private_nats) -> None:  # type: ignore[no-untyped-def]
    url, _, _, _ = private_nats
    sub = JetStreamSubscriber(url, "ns3", durable="d")
    sub.start()
    try:
        old = JetStreamPublisher("w0", url, "ns3", epoch=1, config=PublisherConfig(max_delay_s=3600))
        old.publish(evs(2))
        old.flush()
        old.publish(evs(1, 40))  # pending, never flushed: the process "dies"
        old._io.stop()  # kill the connection without close(): no flush happens
        new = JetStreamPublisher("w0", url, "ns3", epoch=2)
        new.publish(evs(1, 70))
        new.close()
        got = sub.get_many(2, 5.0)
        assert [(b.epoch, b.seq) for b in got] == [(1, 0), (2, 0)]
        assert [e.sequence_hash for b in got for e in b.events] == [1, 2, 70]
        assert sub.stats().restarts == 1
    finally:
        sub.close()



def test_jetstream_block_overflow_loses_nothing_in_a_burst(private_nats) -> None:  # type: ignore[no-untyped-def]
    url, _, _, _ = private_nats
    cfg = PublisherConfig(max_events=1, queue_capacity=2, overflow="block")
    pub = JetStreamPublisher("w0", url, "ns4", config=cfg, manage_stream=True)
    try:
        pub.publish(evs(60))  # 60 one-event batches through a 2-event queue
        pub.flush()
        assert pub.stats().dropped == 0 and pub.stats().batches == 60
        sub = JetStreamSubscriber(url, "ns4", durable="burst")
        sub.start()
        try:
            got = sub.get_many(60, 5.0)
            assert [b.seq for b in got] == list(range(60))
            assert [b.events[0].sequence_hash for b in got] == list(range(1, 61))
        finally:
            sub.close()
    finally:
        pub.close()
