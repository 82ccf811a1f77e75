"""ZMQ replay and ingest against a hostile peer, on real sockets: replay requests that are
never read, limits per client, and forged sources whose gaps nobody answers."""

from __future__ import annotations

import json
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import zmq

from event_plane import zmq_transport
from event_plane import EventBatch, PublisherConfig, ZmqPublisher, ZmqSubscriber, encode_batch, store
from event_plane.frames import END_SEQ, seq_to_bytes
from storage_backends.local_s3 import free_port
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
N_BATCHES = 1000
PAD = 8000  # bytes of metadata per batch: the replay buffer holds about 8 MB

# A publisher in its own process (so that its RSS is its own): N_BATCHES batches of ~8 KB,
# then one command per stdin line: "stats" prints its replay counters, "publish" one batch.
PUBLISHER = textwrap.dedent(
    """
    import json, sys
    from event_plane import PublisherConfig, ZmqPublisher, store

    def ev(i):
        return store(1000 + i, 1000, (999 + i) if i else None, 65536, "g1", {"pad": "x" * %d})

    pub = ZmqPublisher("w0", sys.argv[1], sys.argv[2], config=PublisherConfig(max_events=1, replay_buffer=%d))
    for i in range(%d):
        pub.publish([ev(i)])
    print("READY", flush=True)
    for line in sys.stdin:
        cmd = line.strip()
        if cmd == "stats":
            stats = getattr(pub, "replay_stats", dict)()
            print(json.dumps({**stats, "requests": pub.replay_requests}), flush=True)
        elif cmd == "publish":
            pub.publish([ev(%d)])
            print("OK", flush=True)
        else:
            break
    pub.close()
    """
) % (PAD, N_BATCHES, N_BATCHES, N_BATCHES)


def rss_bytes(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise AssertionError("no VmRSS")


def ask(proc: subprocess.Popen[str], cmd: str) -> str:
    assert proc.stdin is not None and proc.stdout is not None
    proc.stdin.write(cmd + "\n")
    proc.stdin.flush()
    return proc.stdout.readline().strip()


def test_replay_requests_never_read_keep_the_publisher_bounded_and_an_honest_joiner_recovers() -> None:
    """50 replay requests of the whole ~8 MB buffer from clients that never read: unbounded,
    ZMQ would queue 50 copies (~400 MB). The publisher's RSS grows by less than 64 MB, the
    refused requests are counted, and a subscriber joining afterwards still gets every
    buffered batch."""
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, pub_ep, rep_ep], cwd=ROOT, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    ctx = zmq.Context.instance()
    hostile = []
    try:
        assert proc.stdout is not None and proc.stdout.readline().strip() == "READY"
        before = rss_bytes(proc.pid)
        for _ in range(5):
            dealer = ctx.socket(zmq.DEALER)
            dealer.setsockopt(zmq.LINGER, 0)
            dealer.setsockopt(zmq.RCVHWM, 1)  # takes one message off the wire, then reads nothing more
            dealer.connect(rep_ep)
            hostile.append(dealer)
            for _ in range(10):
                dealer.send_multipart([b"", seq_to_bytes(0)])
        deadline = time.monotonic() + 20
        while json.loads(ask(proc, "stats"))["requests"] < 50 and time.monotonic() < deadline:
            time.sleep(0.1)
        time.sleep(1.5)  # what the publisher will queue, it has queued by now
        grown = rss_bytes(proc.pid) - before
        stats = json.loads(ask(proc, "stats"))
        assert stats["requests"] == 50
        assert grown < 64 << 20, f"publisher RSS grew by {grown >> 20} MB; replay stats {stats}"
        refused = sum(v for k, v in stats.items() if k.startswith("refused_"))
        assert refused >= 40, stats  # each client gets one answer (two with its burst), the rest are refused

        time.sleep(1.0)  # the request rate limits refill
        sub = ZmqSubscriber([(pub_ep, rep_ep)], catch_up_timeout_s=2.0)
        sub.start()
        try:
            time.sleep(0.3)  # ZMQ slow joiner (what it misses, the catch-up replays)
            assert ask(proc, "publish") == "OK"
            got = sub.get_many(N_BATCHES + 1, 30)
            assert [b.seq for b in got] == list(range(N_BATCHES + 1)), sub.stats()
            st = sub.stats()
            assert (st.unrecovered, st.resyncs) == (0, 0)
        finally:
            sub.close()
    finally:
        for dealer in hostile:
            dealer.close(linger=0)
        if proc.stdin is not None:
            proc.stdin.close()
        proc.wait(timeout=10)


def read_answer(dealer: zmq.Socket, timeout_ms: int = 3000) -> list[bytes]:
    """Seq frames of one replay answer, up to and including the end marker."""
    seqs = []
    while True:
        assert dealer.poll(timeout_ms), f"answer cut after {len(seqs)} messages"
        frames = dealer.recv_multipart()
        seqs.append(frames[2])
        if frames[2] == END_SEQ:
            return seqs


def replay_client(ctx: zmq.Context, rep_ep: str, dealers: list[zmq.Socket], rcvhwm: int = 1000) -> zmq.Socket:
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.setsockopt(zmq.RCVHWM, rcvhwm)
    d.connect(rep_ep)
    dealers.append(d)
    return d


def test_replay_byte_cap_and_request_rates_are_enforced_and_counted() -> None:
    """The byte cap cuts an answer (end marker after the batches that fit); past the per-client
    and total request rates a request gets the end marker only; each case is counted."""
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    cfg = PublisherConfig(max_events=1, replay_max_bytes=3000, replay_peer_rate=0.01, replay_total_rate=1.0)
    pub = ZmqPublisher("w0", pub_ep, rep_ep, config=cfg)
    ctx = zmq.Context.instance()
    dealers: list[zmq.Socket] = []
    try:
        for i in range(10):
            pub.publish([store(1000 + i, 1000, (999 + i) if i else None, 65536, "g1", {"pad": "x" * 900})])
        a = replay_client(ctx, rep_ep, dealers)
        asked = time.monotonic()  # read before a's request: the total rate's token is taken no earlier
        a.send_multipart([b"", seq_to_bytes(0)])
        seqs = read_answer(a)
        assert 1 < len(seqs) - 1 < 10  # cut: ~1 KB batches, 3000 bytes
        assert seqs[:-1] == [seq_to_bytes(s) for s in range(len(seqs) - 1)]
        assert pub.replay_stats()["truncated"] == 1
        a.send_multipart([b"", seq_to_bytes(9)])
        assert read_answer(a) == [END_SEQ]  # past a's rate (one request per 100 s)
        b = replay_client(ctx, rep_ep, dealers)
        b.send_multipart([b"", seq_to_bytes(9)])
        got_b = read_answer(b)
        answered = time.monotonic()  # read after b's answer: b's request was judged no later
        # past the total rate (1/s), though b never asked before: refused within a second of
        # a's request.  A loaded machine may get to b's request later than that, when the
        # token is back and b is served: then only the second must have passed (a late b
        # makes this weaker, never false)
        assert got_b in ([END_SEQ], [seq_to_bytes(9), END_SEQ]), got_b
        b_served = got_b != [END_SEQ]
        if b_served:
            assert answered - asked >= 1.0, f"b served {answered - asked:.3f} s after a's request"
        time.sleep(1.1)  # time passes: the total rate refills (after a's request, or b's)
        c = replay_client(ctx, rep_ep, dealers)
        c.send_multipart([b"", seq_to_bytes(9)])
        assert read_answer(c) == [seq_to_bytes(9), END_SEQ]  # the total rate refilled
        st = pub.replay_stats()
        assert (st["requests"], st["served"], st["truncated"], st["refused_peer_rate"], st["refused_total_rate"]) == (
            4, 1 + b_served, 1, 1, 1 - b_served), st
        assert set(st) == {"requests", "served", "malformed", "refused_busy", "refused_peer_rate",
                           "refused_total_rate", "refused_active", "refused_peer_active", "preempted", "truncated",
                           "stalled", "unreachable", "recycles"}
    finally:
        for d in dealers:
            d.close(linger=0)
        pub.close()


def tcp_peers_of(endpoint: str) -> list[str]:
    """Established TCP connections whose local side is ``endpoint``'s port (Linux /proc)."""
    port = int(endpoint.rsplit(":", 1)[1])
    peers = []
    for line in Path("/proc/net/tcp").read_text().splitlines()[1:]:
        fields = line.split()
        if int(fields[1].split(":")[1], 16) == port and fields[3] == "01":  # 01: ESTABLISHED
            peers.append(fields[2])
    return peers


def test_a_client_that_stops_reading_gets_one_answer_at_a_time_and_is_abandoned() -> None:
    """A ~32 MB answer to a client that does not read stalls once ZMQ's queue (the HWM) and
    the kernel's buffers are full; its second request meanwhile is dropped unanswered, and
    the answer is abandoned after ``replay_stall_s``. Another client is answered meanwhile.
    With ``replay_max_stalled=1`` the ROUTER is then rebound: the stalled connection is
    closed (what ZMQ queued for it freed) and new requests are answered again."""
    pub_ep, rep_ep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    pub = ZmqPublisher("w0", pub_ep, rep_ep,
                       config=PublisherConfig(max_events=1, replay_stall_s=3.0, replay_max_stalled=1))
    ctx = zmq.Context.instance()
    dealers: list[zmq.Socket] = []
    try:
        for i in range(4000):
            pub.publish([store(1000 + i, 1000, (999 + i) if i else None, 65536, "g1", {"pad": "x" * PAD})])
        b = replay_client(ctx, rep_ep, dealers, rcvhwm=1)
        # the second request right after the first, not 0.3 s later: the replay thread reads
        # every request waiting before it moves an answer on, and abandons one only after
        # replay_stall_s without progress, so the second finds the first's answer in progress
        # (after a sleep that a loaded machine drew out past replay_stall_s it came once the
        # answer was abandoned, and was not refused as busy)
        b.send_multipart([b"", seq_to_bytes(0)])
        b.send_multipart([b"", seq_to_bytes(0)])
        # (the other client must be answered before the stalled answer is abandoned and the
        # socket recycled: replay_stall_s = 3 s, so only a stall of that length here races it)
        other = replay_client(ctx, rep_ep, dealers)
        other.send_multipart([b"", seq_to_bytes(3999)])
        assert read_answer(other) == [seq_to_bytes(3999), END_SEQ]
        other.close(linger=0)  # (only the stalled client stays connected)
        wait_until(lambda: pub.replay_stats()["stalled"] > 0, what="a stalled replay client counted")
        st = pub.replay_stats()
        assert (st["refused_busy"], st["stalled"], st["served"]) == (1, 1, 1), st
        wait_until(lambda: pub.replay_stats()["recycles"] > 0, what="the replay socket recycled")
        assert pub.replay_stats()["recycles"] == 1
        # the stalled client's connection is closed; polled, since the other client's close
        # (linger 0) ends its connection only shortly after, and on a loaded machine the
        # recycle may come before that close (a look right after it saw the other's)
        wait_until(lambda: not tcp_peers_of(rep_ep), what="the stalled client's connection closed")
        late = replay_client(ctx, rep_ep, dealers)
        late.send_multipart([b"", seq_to_bytes(3999)])
        assert read_answer(late, 5000) == [seq_to_bytes(3999), END_SEQ]  # the rebound ROUTER answers
    finally:
        for d in dealers:
            d.close(linger=0)
        pub.close()


def forged(source: str, seq: int) -> list[bytes]:
    batch = EventBatch(1, source, 1, seq, 0, [store(7000 + seq, 7000, None, 65536, "g1")])
    return [b"", seq_to_bytes(seq), encode_batch(batch)]


def silent_publisher() -> tuple[zmq.Socket, zmq.Socket, str, str]:
    """A raw PUB and a ROUTER replay socket that reads requests and never answers them."""
    ctx = zmq.Context.instance()
    pub, router = ctx.socket(zmq.PUB), ctx.socket(zmq.ROUTER)
    for sock in (pub, router):
        sock.setsockopt(zmq.LINGER, 0)
    pub_port = pub.bind_to_random_port("tcp://127.0.0.1")
    rep_port = router.bind_to_random_port("tcp://127.0.0.1")
    return pub, router, f"tcp://127.0.0.1:{pub_port}", f"tcp://127.0.0.1:{rep_port}"


def test_forged_sources_waiting_for_replay_do_not_delay_another_source() -> None:
    """10 forged sources start at seq 3 and their replay is never answered. A legitimate
    source's batch sent after them on the same socket arrives first, while the forged
    recoveries wait (a blocking recovery per forged source used to hold it 2 s each, 20 s in
    all: the honest get's 10 s deadline would pass); the forged batches are delivered
    once their recoveries time out, their seqs 0..2 counted unrecovered."""
    pub, router, pub_ep, rep_ep = silent_publisher()
    sub = ZmqSubscriber([(pub_ep, rep_ep)], catch_up=False, idle_probe_s=0, replay_timeout_s=2.0)
    sub.start()
    try:
        time.sleep(0.3)
        for k in range(10):
            pub.send_multipart(forged(f"forged-{k}", 3))
        pub.send_multipart(forged("honest", 0))
        first = sub.get(timeout=10.0)
        assert first is not None and first.source == "honest", sub.stats()
        rest = sub.get_many(10, 6.0)
        assert sorted(b.source for b in rest) == sorted(f"forged-{k}" for k in range(10))
        st = sub.stats()
        assert (st.gaps, st.unrecovered, st.recoveries_refused) == (10, 30, 0)
    finally:
        sub.close()
        pub.close(linger=0)
        router.close(linger=0)


def test_sources_in_recovery_and_parked_batches_are_bounded_and_counted() -> None:
    """With max_recovering=4, 6 of 10 forged gaps are not fetched (counted, their batches
    delivered at once); with max_parked=2 a source in recovery holds 2 batches and drops the
    rest (counted). An honest source is never held, and an honest publisher on another
    endpoint still gets its gap recovered (the limit is per endpoint)."""
    pub, router, pub_ep, rep_ep = silent_publisher()
    other_ep, other_rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    other = ZmqPublisher("other", other_ep, other_rep, config=PublisherConfig(max_events=1))
    sub = ZmqSubscriber([(pub_ep, rep_ep), (other_ep, other_rep)], catch_up=False, idle_probe_s=0,
                        replay_timeout_s=5.0, max_recovering=4, max_parked=2)
    try:
        for i in range(3):
            other.publish([store(5000 + i, 5000, (4999 + i) if i else None, 65536, "g1")])  # nobody listens yet
        sub.start()
        time.sleep(0.3)
        for k in range(10):
            pub.send_multipart(forged(f"forged-{k}", 3))
        for seq in (4, 5, 6):
            pub.send_multipart(forged("forged-0", seq))
        pub.send_multipart(forged("honest", 0))
        time.sleep(0.05)
        other.publish([store(5003, 5000, 5002, 65536, "g1")])  # reveals the gap 0..2 of "other"
        # returns once the 11 are in, well before any forged recovery times out (5 s after it
        # began: wide enough that a loaded machine delivers the 11 first)
        got = sub.get_many(11, 4.0)
        assert sorted(b.source for b in got if b.source != "other") == sorted(
            ["honest"] + [f"forged-{k}" for k in range(4, 10)])
        assert [b.seq for b in got if b.source == "other"] == [0, 1, 2, 3]
        st = sub.stats()
        assert (st.recoveries_refused, st.parked_dropped, st.replayed) == (6, 2, 3)
        later = sub.get_many(10, 8.0)  # the forged recoveries time out; their parked batches come
        assert [b.seq for b in later if b.source == "forged-0"] == [3, 4]
        assert sorted(b.source for b in later if b.source != "forged-0") == [f"forged-{k}" for k in (1, 2, 3)]
    finally:
        sub.close()
        other.close()
        pub.close(linger=0)
        router.close(linger=0)


def test_source_names_remembered_per_endpoint_are_bounded(monkeypatch: pytest.MonkeyPatch) -> None:
    """One endpoint sending under ever new source names: the subscriber remembers at most
    MAX_PROBE_SOURCES of them for its idle probe, the most recently seen, and still delivers
    every batch."""
    monkeypatch.setattr(zmq_transport, "MAX_PROBE_SOURCES", 8)
    pub, router, pub_ep, rep_ep = silent_publisher()
    sub = ZmqSubscriber([(pub_ep, rep_ep)], catch_up=False, idle_probe_s=0)
    sub.start()
    try:
        time.sleep(0.3)  # time passes: the ZMQ slow joiner (a SUB misses what is sent before it joined)
        names = [f"s{k}" for k in range(40)] + ["s3"]  # s3 seen again last: kept as recent
        for name in names:
            pub.send_multipart(forged(name, 0))
        got = sub.get_many(len(names) - 1, 30.0)  # the repeat is a duplicate (same seq)
        assert [b.source for b in got] == names[:-1]
        kept = wait_until(lambda: (k := list(sub._sources_at[0])) and k[-1] == "s3" and k,
                          what="the repeated name seen last")
        assert kept == [f"s{k}" for k in range(33, 40)] + ["s3"], kept
    finally:
        sub.close()
        pub.close(linger=0)
        router.close(linger=0)
