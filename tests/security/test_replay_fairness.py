"""Fair replay slots, over real ZMQ: peers that open replays and never read, a new
connection every 10 ms, each held 0.6 s, from two addresses (127.0.0.2 and .3: ZMQ binds the source address), cannot stop
a well-behaved subscriber from replaying a publisher's whole buffer. Each peer address holds
at most ``replay_peer_active`` answers; one whose answer it stopped reading is *not
reading* for a while and no longer gets the slots kept for peers that read, nor the request
rate they share."""

from __future__ import annotations

import threading
import time

import zmq

from event_plane import PublisherConfig, ZmqPublisher, ZmqSubscriber, store
from event_plane.frames import seq_to_bytes
from storage_backends.local_s3 import free_port

N = 1001
PAD = 16_000  # bytes of metadata per batch: a whole answer (~16 MB) outgrows ZMQ's and the kernel's buffers


def hostile(rep_port: int, source: str, stop: threading.Event) -> None:
    """DEALERs from ``source`` that ask for everything and never read, a new one (a new
    identity, a new request) every 10 ms, each closed after 0.6 s."""
    ctx = zmq.Context.instance()
    live: list[tuple[float, zmq.Socket]] = []
    try:
        while not stop.is_set():
            now = time.monotonic()
            while live and now - live[0][0] >= 0.6:
                live.pop(0)[1].close(linger=0)
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.setsockopt(zmq.RCVHWM, 1)
            d.connect(f"tcp://{source}:0;127.0.0.1:{rep_port}")
            d.send_multipart([b"", seq_to_bytes(0)])
            live.append((now, d))
            stop.wait(0.01)
    finally:
        for _, d in live:
            d.close(linger=0)


def test_peers_that_never_read_cannot_stop_a_reading_peer_s_replay() -> None:
    pub_port, rep_port = free_port(), free_port()
    pub_ep, rep_ep = f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}"
    pub = ZmqPublisher("w0", pub_ep, rep_ep, config=PublisherConfig(max_events=1, replay_buffer=2 * N))
    stop = threading.Event()
    threads = [threading.Thread(target=hostile, args=(rep_port, src, stop), daemon=True)
               for src in ("127.0.0.2", "127.0.0.3")]
    sub = None
    try:
        for i in range(N):
            pub.publish([store(1000 + i, 1000, (999 + i) if i else None, 65536, "g1", {"pad": "x" * PAD})])
        for t in threads:
            t.start()
        deadline = time.monotonic() + 30
        while pub.replay_stats()["requests"] < 300 and time.monotonic() < deadline:
            time.sleep(0.05)  # the hostile peers hold what they can
        sub = ZmqSubscriber([(pub_ep, rep_ep)])
        sub.start()  # its catch-up asks for the whole buffer
        time.sleep(0.2)  # (the SUB's subscription reaches the PUB: a batch sent before is not seen live)
        # a live batch: a subscriber whose catch-up was refused sees the gap 0..N-1 and asks
        # once more; refused again, those are lost (unrecovered), and no probe asks later
        pub.publish([store(1000 + N, 1000, 999 + N, 65536, "g1")])
        got = sub.get_many(N + 1, 90)
        st = pub.replay_stats()
        assert [b.seq for b in got] == list(range(N + 1)), (len(got), st, sub.stats())
        assert sub.stats().unrecovered == 0
        # the limits did the work: hostile requests refused (per address, for not reading,
        # by the request rates) or their answers preempted for the reading peer; which one
        # acts first depends on the machine's load (on a loaded one the rates act first)
        fair = ("refused_peer_active", "refused_active", "refused_peer_rate", "refused_total_rate", "preempted")
        assert sum(st[k] for k in fair) > 0, st
        assert st["served"] < st["requests"], st
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=10)
        if sub is not None:
            sub.close()
        pub.close()
