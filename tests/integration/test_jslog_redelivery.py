"""The advisor's JetStream log hands out each entry once, in stream order, even when the
server delivers an entry again because its acknowledgement was lost (real nats-server).

Without the guard the lost ack of a Store comes back after ``ack_wait``, behind the Remove
that followed it, and a fold brings the removed block back."""

from __future__ import annotations

import time
import uuid
from typing import Any

from advisor.index import PrefixIndex
from advisor.jslog import JetStreamLog
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
    with make_publisher(url, "w0", epoch=3) as pub:
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
        end = time.monotonic() + 4.0  # several ack_waits: the server redelivers the Store
        while time.monotonic() < end:
            item = log.get(timeout=0.2)
            if item is not None:
                got.append(item[0])
                idx.apply_payload(item[1])
    finally:
        log.close()
    assert got == seqs  # once each, in order
    assert idx.block(7) is None and idx.block(8) is not None  # the removed block stays removed
    assert log.lost and log.redelivered >= 1  # the server did deliver it again


def test_a_delivery_lost_in_transit_is_read_again_in_order(js_url: str, monkeypatch: Any) -> None:
    """A message the server sent but the reader never got (a fetch answer lost in a
    fail-over) is delivered again only after ack_wait, behind newer ones: the log notices
    the jump in delivery sequence and reads again from the first entry not handed out."""
    import advisor.jslog as jslog

    ns = "k" + uuid.uuid4().hex[:8]
    url = f"jetstream://{js_url.split('://')[1]}?namespace={ns}"
    with make_publisher(url, "w0", epoch=4) as pub:
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
            if int(msg.metadata.sequence.stream) == seqs[2] and not lost:
                lost.append(seqs[2])  # sent by the server, never seen here
                continue
            yield msg

    monkeypatch.setattr(jslog, "fetch_forever", loses_one)
    log = JetStreamLog(js_url, ns, ack_wait_s=1.0, batch_size=1)
    log.start()
    got: list[int] = []
    try:
        end = time.monotonic() + 4.0
        while time.monotonic() < end and len(got) < 6:
            item = log.get(timeout=0.2)
            if item is not None:
                got.append(item[0])
        time.sleep(1.5)  # past ack_wait: nothing more may come out
        while (item := log.get(timeout=0.2)) is not None:
            got.append(item[0])
    finally:
        log.close()
    assert lost == [seqs[2]]
    assert got == seqs  # none skipped, in order, once each
    assert log.resets >= 1
