"""The event fast path (pools' ``publish_encoded`` parts mixed with ``publish``) on real
transports: what ZMQ replays and what NATS carries are the bytes sent live, byte for byte,
with the seqs and message ids the batches had before the fast path."""

from __future__ import annotations

import asyncio
import secrets
import threading
import time

import nats
import pytest
import torch
import zmq

from event_plane import KVEvent, PublisherConfig, ZmqPublisher, decode_batch, encode_batch, make_publisher
from event_plane.frames import END_SEQ, seq_from_bytes, seq_to_bytes
from event_plane.nats_transport import MSG_ID_HEADER, subject_for
from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig
from kvbm_runtime.layout import FullyContiguous
from storage_backends.local_s3 import free_port
from tests.polling import wait_until

CFG = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)


def _traffic(pub: object) -> None:
    """Pool batch calls (encoded parts, evictions included) interleaved with plain
    ``publish`` calls on the same publisher."""
    pool = BlockPool("g2", FullyContiguous(CFG, 6), pub)  # type: ignore[arg-type]
    for c in range(5):
        hs = [(c + 1) * 2**60 + i * 2**31 + 7 for i in range(4)]
        metas = [BlockMeta(h, hs[i - 1] if i else None, hs[0], 0) for i, h in enumerate(hs)]
        pool.release_blocks(pool.register_blocks(pool.allocate_complete(metas)))
        pub.publish([KVEvent(1, 10**6 + c, 10**6 + c, None, 64, "g9")])  # type: ignore[attr-defined]


def test_zmq_replay_returns_the_bytes_sent_live() -> None:
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqPublisher("w-fast", pub_ep, rep_ep, config=PublisherConfig(max_events=3, max_delay_s=60.0))
    ctx = zmq.Context.instance()
    sub = ctx.socket(zmq.SUB)
    sub.setsockopt(zmq.SUBSCRIBE, b"")
    sub.connect(pub_ep)
    dealer = ctx.socket(zmq.DEALER)
    dealer.connect(rep_ep)
    try:
        time.sleep(0.3)  # SUB join
        _traffic(pub)
        pub.flush()
        live: list[tuple[int, bytes]] = []
        while sub.poll(500):
            topic, seq, payload = sub.recv_multipart()
            live.append((seq_from_bytes(seq), payload))
        assert live and [s for s, _ in live] == list(range(len(live)))
        for _, payload in live:
            assert encode_batch(decode_batch(payload)) == payload
            assert 1 <= len(decode_batch(payload).events) <= 3
        dealer.send_multipart([b"", seq_to_bytes(0)])
        replayed: list[tuple[int, bytes]] = []
        while True:
            assert dealer.poll(3000), "replay answer timed out"
            frames = dealer.recv_multipart()
            assert frames[0] == b""
            _, topic, seq, payload = frames
            if seq == END_SEQ:
                break
            replayed.append((seq_from_bytes(seq), payload))
        assert replayed == live  # same seqs, same bytes
    finally:
        sub.close(linger=0)
        dealer.close(linger=0)
        pub.close()


@pytest.mark.parametrize("scheme", ["nats", "jetstream"])
def test_nats_messages_carry_the_live_bytes_and_the_batch_msg_ids(nats_url: str, scheme: str) -> None:
    ns = "t" + secrets.token_hex(4)
    url = nats_url.replace("nats://", f"{scheme}://") + f"?namespace={ns}"
    if scheme == "jetstream":
        # a JetStream publisher calls no JetStream API by default: the stream must exist.
        # It does on a server an earlier test (or run) left it on, not on a fresh one, where
        # every publish went unacknowledged until ``retry_for_s`` ran out
        url += "&manage_stream=1"
    got: list[tuple[str, bytes]] = []

    async def collect(ready: asyncio.Event, done: asyncio.Event) -> None:
        nc = await nats.connect(nats_url)
        sub = await nc.subscribe(subject_for(ns, "w-fast"))
        await nc.flush()  # the server has the subscription before the publisher starts
        ready.set()
        try:
            while not done.is_set():
                try:
                    msg = await sub.next_msg(timeout=0.5)
                except nats.errors.TimeoutError:
                    continue
                got.append((msg.headers[MSG_ID_HEADER], msg.data))
        finally:
            await nc.close()

    loop = asyncio.new_event_loop()
    ready, done = asyncio.Event(), asyncio.Event()
    th = threading.Thread(target=loop.run_until_complete, args=(collect(ready, done),), daemon=True)
    th.start()
    wait_until(ready.is_set, what="the subscriber ready")
    pub = make_publisher(url, "w-fast", config=PublisherConfig(max_events=3, max_delay_s=60.0))
    try:
        assert pub._payload_only  # the fast path, no EventBatch
        _traffic(pub)
        pub.flush()
        n_batches = pub.next_seq
        wait_until(lambda: len(got) >= n_batches, what=f"{n_batches} batches received")
    finally:
        pub.close()
        loop.call_soon_threadsafe(done.set)
        th.join(5)
    assert len(got) == n_batches > 5
    key = pub._msg_id_key  # the publisher's secret: no other peer can send its next ids first
    assert len(key) == 16 and int(key, 16) >= 0
    for seq, (msg_id, data) in enumerate(got):
        assert msg_id == f"{ns}.w-fast:{pub.epoch}:{seq}:{key}"
        batch = decode_batch(data)
        assert batch.seq == seq and batch.source == "w-fast" and batch.epoch == pub.epoch
        assert encode_batch(batch) == data
