"""Bounded decoding over real ZMQ: a message larger than any batch the quotas admit is
dropped by libzmq unread (``MAXMSGSIZE``), and a batch declaring more events than
``quota_max_batch_events`` is refused from its header, before one event object is built.
Either way the advisor's peak memory barely moves and a well-behaved batch sent after it
is indexed."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import BS, RawPub, settings, wait_for

from event_plane.codec import encode_batch_parts, encode_event, event_count
from event_plane.frames import seq_to_bytes
from event_plane.schema import WIRE_VERSION, EventBatch, store

MB = 1 << 20


def peak_rss_reset() -> None:
    """Reset this process's peak RSS (``VmHWM``; Linux ``clear_refs`` 5)."""
    with open("/proc/self/clear_refs", "w") as fh:
        fh.write("5")


def peak_rss() -> int:
    text = Path("/proc/self/status").read_text()
    return int(re.search(r"VmHWM:\s+(\d+) kB", text).group(1)) * 1024  # type: ignore[union-attr]


def well_behaved(pub: RawPub, svc: Any, seq: int, h: int) -> None:
    pub.send(EventBatch(WIRE_VERSION, "good", 1, seq, 1, [store(h, h, None, BS, "g1")]))
    wait_for(lambda: svc.index.holds(h, "good/g1"), what="the well-behaved batch indexed")


def test_a_batch_declaring_1_5m_events_is_refused_from_its_header(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(settings(tmp_path, [pub.url]))
        pub.join(svc)
        n = 1_500_000  # 18 MB: under the size limit (19.3 MB), 23 times the event quota
        ev = encode_event(store(7, 7, None, BS, "g1"))
        payload = encode_batch_parts("hog", 1, 0, 1, [ev * n], count=n)
        assert event_count(payload) == n and len(payload) < svc.settings.max_message_bytes()
        errors = svc.subscriber.stats().decode_errors
        peak_rss_reset()
        base = peak_rss()
        pub.sock.send_multipart([b"", seq_to_bytes(0), payload], copy=False)
        wait_for(lambda: svc.subscriber.stats().decode_errors > errors, what="the hog batch refused")
        assert peak_rss() - base < 100 * MB  # decoding it takes ~300 MB
        assert svc.counters["quota_refused_batches_batch_events"] == 0  # never decoded to reach the quota
        well_behaved(pub, svc, 0, 1)
    finally:
        pub.close()


def test_a_64mb_message_is_dropped_unread(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(settings(tmp_path, [pub.url]))
        assert svc.settings.max_message_bytes() < 20 * MB
        pub.join(svc)
        blob = bytes(64 * MB)
        peak_rss_reset()
        base = peak_rss()
        pub.sock.send_multipart([b"", seq_to_bytes(0), blob], copy=False)
        # the SUB reconnects after libzmq dropped the connection: later batches come again
        pub.join(svc, "good")
        assert peak_rss() - base < 40 * MB  # the message itself is 64 MB
        assert svc.counters["bad_batches"] == 0
    finally:
        pub.close()
