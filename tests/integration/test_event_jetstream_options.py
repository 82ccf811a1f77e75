"""JetStream options a vendor relies on: replay from a stream sequence or a time, stream
retention limits, and credentials passed through to nats-py — on private nats-servers."""

from __future__ import annotations

import asyncio
import datetime as dt
import shutil
import subprocess
import time

import nats
import pytest
from conftest import _wait_port

from event_plane import (
    JetStreamPublisher,
    JetStreamSubscriber,
    NatsSubscriber,
    PublisherConfig,
    TransportError,
    store,
)
from storage_backends.local_s3 import free_port

ONE = PublisherConfig(max_events=1)


def ev(i: int) -> object:
    return store(100 + i, 100, (99 + i) if i else None, 4096, "g2")




def _publish(pub: JetStreamPublisher, idx: range) -> None:
    for i in idx:
        pub.publish([ev(i)])
    pub.flush()


def test_replay_from_a_stream_sequence(js_url: str) -> None:
    pub = JetStreamPublisher("w0", js_url, "seqns", epoch=7, config=ONE, manage_stream=True)
    try:
        _publish(pub, range(5))  # stream seqs 1..5 hold batch seqs 0..4
        sub = JetStreamSubscriber(js_url, "seqns", durable="from-seq", deliver=("seq", 3))
        sub.start()
        try:
            got = sub.get_many(5, 3.0)
            assert [b.seq for b in got] == [2, 3, 4]
            assert [b.events[0].sequence_hash for b in got] == [102, 103, 104]
            assert sub.stats().gaps == 0  # a position chosen on purpose is not a gap
        finally:
            sub.close()
    finally:
        pub.close()


def test_replay_from_a_time(js_url: str) -> None:
    pub = JetStreamPublisher("w0", js_url, "timens", epoch=8, config=ONE, manage_stream=True)
    try:
        _publish(pub, range(3))
        time.sleep(0.3)
        since = dt.datetime.now(dt.timezone.utc).isoformat()
        time.sleep(0.3)
        _publish(pub, range(3, 5))
        sub = JetStreamSubscriber(js_url, "timens", durable="from-time", deliver=("time", since))
        sub.start()
        try:
            got = sub.get_many(5, 3.0)
            assert [b.seq for b in got] == [3, 4]
        finally:
            sub.close()
    finally:
        pub.close()


def test_stream_retention_limits_are_applied(js_url: str) -> None:
    pub = JetStreamPublisher("w0", js_url, "limns", stream_max_age_s=3600.0, stream_max_bytes=1 << 20,
                             manage_stream=True)
    pub.close()

    async def info() -> tuple[float, int]:
        nc = await nats.connect(js_url)
        try:
            si = await nc.jetstream().stream_info("KVADVISOR_EVENTS")
            return float(si.config.max_age), int(si.config.max_bytes)
        finally:
            await nc.close()

    max_age, max_bytes = asyncio.run(info())
    assert (max_age, max_bytes) == (3600.0, 1 << 20)


def test_token_credentials_are_passed_to_nats(tmp_path) -> None:  # type: ignore[no-untyped-def]
    port = free_port()
    exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
    proc = subprocess.Popen(
        [exe, "-a", "127.0.0.1", "-p", str(port), "-js", "-sd", str(tmp_path / "js"), "--auth", "s3cret-token"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        _wait_port(port, proc, "nats-server")
        url = f"nats://127.0.0.1:{port}"
        with pytest.raises(TransportError):
            JetStreamPublisher("w0", url, "authns", connect_timeout_s=1.0)
        with pytest.raises(TransportError):
            NatsSubscriber(url, "authns", connect_timeout_s=1.0, token="wrong").start()
        pub = JetStreamPublisher("w0", url, "authns", config=ONE, token="s3cret-token", manage_stream=True)
        try:
            _publish(pub, range(2))
            sub = JetStreamSubscriber(url, "authns", durable="auth", token="s3cret-token")
            sub.start()
            try:
                assert [b.seq for b in sub.get_many(2, 3.0)] == [0, 1]
            finally:
                sub.close()
        finally:
            pub.close()
    finally:
        proc.terminate()
        proc.wait(timeout=10)
