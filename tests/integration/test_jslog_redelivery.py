"""The advisor's JetStream log hands out each entry once, in stream order, even when the
server delivers an entry again because its acknowledgement was lost (real nats-server).

Without the guard the lost ack of a Store comes back after ``ack_wait``, behind the Remove
that followed it, and a fold brings the removed block back."""

from __future__ import annotations

import time
import uuid
from typing import Any

import pytest

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.jslog import JetStreamLog
from event_plane.codec import decode_batch
from event_plane.schema import remove, store
from event_plane.urls import make_publisher


class _LosesOneAck(JetStreamLog):
    """A log whose first acknowledgement of stream entry ``lose`` never reaches the server."""

    def __init__(self, *a: Any, lose: int, **kw: Any) -> None:
        super().__init__(*a, **kw)
        self.lose, self.lost = lose, False

    async def _ack(self, msg: Any) -> None:
        if int(msg.metadata.sequence.stream) == self.lose and not self.lost:
            self.lost = True
            return
        await super()._ack(msg)


def test_a_redelivered_entry_is_dropped_and_the_fold_stays_right(js_url: str) -> None:
    ns = "j" + uuid.uuid4().hex[:8]
    url = f"jetstream://{js_url.split('://')[1]}?namespace={ns}"
    with make_publisher(url, "w0", epoch=3, manage_stream=True) as pub:
        pub.publish([store(7, 7, None, 64, "g1")])
        pub.flush()
        pub.publish([remove(7, 7, None, 64, "g1")])
        pub.flush()
        pub.publish([store(8, 8, None, 64, "g1")])
        pub.flush()
    probe = JetStreamLog(js_url, ns)
    probe.start()
    try:
        first = [probe.get(timeout=10) for _ in range(3)]
    finally:
        probe.close()
    assert all(x is not None for x in first)
    seqs = [x[0] for x in first if x is not None]
    log = _LosesOneAck(js_url, ns, lose=seqs[0], ack_wait_s=1.0, durable=f"d-{ns}")
    log.start()
    idx = PrefixIndex()
    got: list[int] = []
    try:
        # until the server has delivered the Store again and the log dropped it (its ack_wait
        # is 1 s; a loaded machine may take longer than the 4 s this once waited), then one
        # more ack_wait in which nothing more may come out
        end, deadline = None, time.monotonic() + 60.0  # bounds a wait
        while time.monotonic() < (end or deadline):
            item = log.get(timeout=0.2)
            if item is not None:
                got.append(item[0])
                idx.apply_payload(item[1])
            if end is None and len(got) >= len(seqs) and log.redelivered >= 1:
                end = time.monotonic() + 1.0
    finally:
        log.close()
    assert got == seqs  # once each, in order
    assert idx.block(7) is None and idx.block(8) is not None  # the removed block stays removed
    assert log.lost and log.redelivered >= 1  # the server did deliver it again


@pytest.mark.parametrize("lost_at", [2, 0])
def test_a_delivery_lost_in_transit_is_read_again_in_order(js_url: str, monkeypatch: Any, lost_at: int) -> None:
    """A message the server sent but the reader never got (a fetch answer lost in a
    fail-over) is delivered again only after ack_wait, behind newer ones: the log notices
    the jump in delivery sequence and reads again from the first entry not handed out.

    ``lost_at = 0``: the first delivery of a consumer the log just made (at start, or again
    after a gap, in the middle of a fail-over).  The jump from nothing to delivery 2 is a
    gap like any other: without checking the first delivery, the log handed out the second
    entry, and the first came back only as a redelivery behind it and was dropped, so every
    fold of this reader missed it for good (a replica answering without a Store its log
    holds at a position it claims, seen in the scaled drill)."""
    import advisor.ingest.jslog as jslog

    ns = "k" + uuid.uuid4().hex[:8]
    url = f"jetstream://{js_url.split('://')[1]}?namespace={ns}"
    with make_publisher(url, "w0", epoch=4, manage_stream=True) as pub:
        for i in range(6):
            pub.publish([store(100 + i, 100 + i, None, 64, "g1")])
            pub.flush()
    probe = JetStreamLog(js_url, ns)
    probe.start()
    try:
        seqs = [x[0] for x in (probe.get(timeout=10) for _ in range(6)) if x is not None]
    finally:
        probe.close()
    assert len(seqs) == 6
    real = jslog.fetch_forever
    lost: list[int] = []

    async def loses_one(psub: Any, *a: Any, **kw: Any) -> Any:
        async for msg in real(psub, *a, **kw):
            if int(msg.metadata.sequence.stream) == seqs[lost_at] and not lost:
                lost.append(seqs[lost_at])  # sent by the server, never seen here
                continue
            yield msg

    monkeypatch.setattr(jslog, "fetch_forever", loses_one)
    log = JetStreamLog(js_url, ns, ack_wait_s=1.0, batch_size=1)
    log.start()
    got: list[int] = []
    try:
        end = time.monotonic() + 10.0
        while time.monotonic() < end and len(got) < 6:
            item = log.get(timeout=0.2)
            if item is not None:
                got.append(item[0])
        time.sleep(1.5)  # past ack_wait: nothing more may come out
        while (item := log.get(timeout=0.2)) is not None:
            got.append(item[0])
    finally:
        log.close()
    assert lost == [seqs[lost_at]]
    assert got == seqs  # none skipped, in order, once each
    assert log.resets >= 1


def test_a_lost_delivery_followed_by_a_redelivery_is_read_again_in_order(js_url: str, monkeypatch: Any) -> None:
    """A fail-over can lose an acknowledgement and a delivery together.  The next delivery
    is then the redelivery of the entry whose ack was lost (handed out already), and the
    deliveries after it follow on without a further jump in delivery sequence: the log must
    count the jump onto the redelivery as a loss too, or the lost entry is skipped (its own
    redelivery comes after ack_wait behind a newer entry, and is dropped as old)."""
    import advisor.ingest.jslog as jslog

    ns = "r" + uuid.uuid4().hex[:8]
    url = f"jetstream://{js_url.split('://')[1]}?namespace={ns}"

    def block_of(payload: bytes) -> int:
        return decode_batch(payload).events[0].sequence_hash

    real = jslog.fetch_forever
    dropped: list[int] = []

    async def loses_202(psub: Any, *a: Any, **kw: Any) -> Any:
        async for msg in real(psub, *a, **kw):
            if block_of(bytes(msg.data)) == 202 and not dropped:
                dropped.append(int(msg.metadata.sequence.stream))  # sent by the server, never seen here
                continue
            yield msg

    monkeypatch.setattr(jslog, "fetch_forever", loses_202)
    class LosesAckOf200(JetStreamLog):
        lost = False

        async def _ack(self, msg: Any) -> None:
            if block_of(bytes(msg.data)) == 200 and not self.lost:
                self.lost = True
                return
            await super()._ack(msg)

    ack_wait = 2.0
    got: list[int] = []
    with make_publisher(url, "w0", epoch=5, manage_stream=True) as pub:
        pub.publish([store(200, 200, None, 64, "g1")])
        pub.flush()
        pub.publish([store(201, 201, None, 64, "g1")])
        pub.flush()
        log = LosesAckOf200(js_url, ns, ack_wait_s=ack_wait, batch_size=1, durable=f"d-{ns}")
        log.start()
        try:
            def take(n: int, timeout_s: float) -> None:
                end = time.monotonic() + timeout_s
                while len(got) < n and time.monotonic() < end:
                    item = log.get(timeout=0.1)
                    if item is not None:
                        got.append(block_of(item[1]))

            take(2, 10)
            assert got == [200, 201]
            time.sleep(ack_wait * 0.4)  # block 202 is delivered well after 200, and lost on the way
            pub.publish([store(202, 202, None, 64, "g1")])
            pub.flush()
            end = time.monotonic() + ack_wait * 3
            while not dropped and time.monotonic() < end:
                time.sleep(0.01)
            assert dropped, "block 202 was never delivered"
            # block 200's entry comes back first (its ack_wait ends first): a jump onto a redelivery
            while log.redelivered == 0 and time.monotonic() < end:
                time.sleep(0.01)
            assert log.redelivered == 1, "block 200's entry was not delivered again"
            pub.publish([store(203, 203, None, 64, "g1")])  # delivered before 202's redelivery is due
            pub.flush()
            take(4, ack_wait * 2)
            time.sleep(ack_wait)  # past every ack_wait: nothing more may come out
            take(5, 0.5)
        finally:
            log.close()
    assert log.lost and log.redelivered >= 1
    assert got == [200, 201, 202, 203]  # none skipped, in order, once each
    assert log.resets >= 1

