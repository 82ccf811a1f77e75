"""Helpers of the security tests: event chains, polling, advisor settings, a private nats-server."""

from __future__ import annotations

import asyncio
import os
import shutil
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from advisor.embedded.service import AdvisorService
from advisor.settings import AdvisorSettings
from event_plane import store
from event_plane.nats_transport import connect_nats
from storage_backends.local_s3 import free_port
from tests.polling import wait_until as wait_for  # noqa: F401 - the security tests import it from here

BS = 4096


def chain(hashes: list[int], loc: str) -> list[Any]:
    """Store events of one prefix chain (first hash = prefix hash) at ``loc``."""
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


def as_advisor(cluster: Any, act: Any) -> Any:
    """``await act(nc)`` on a NATS connection as the advisor user of ``cluster`` (a
    :class:`kvadvisor.localcluster.NatsCluster`); its result."""

    async def run() -> Any:
        nc = await connect_nats(cluster.advisor_url, 5.0, {})
        try:
            return await act(nc)
        finally:
            await nc.close()

    return asyncio.run(run())


def per_location(svc: AdvisorService, hashes: list[int]) -> dict[str, int]:
    """How many of ``hashes`` (a chain) the advisor's index holds, per location."""
    return dict(svc.query().lookup(hashes).per_location)


def settings(tmp_path: Path, urls: list[str], **kw: Any) -> AdvisorSettings:
    """Advisor settings for an ingest-only advisor journaling under ``tmp_path``."""
    base: dict[str, Any] = {"journal_path": str(tmp_path / "journal.sqlite"), "subscribe_urls": urls,
                            "api_enabled": False, "snapshot_store": "none", "policy_interval_s": 0,
                            "get_timeout_s": 0.05}
    return AdvisorSettings(**{**base, **kw})


def nats_server(tmp_path: Path, body: str) -> Iterator[int]:
    """A private nats-server on a free loopback port with config ``body`` (written mode
    0600: it holds passwords); yields its port, stops it afterwards."""
    port = free_port()
    conf = tmp_path / "nats.conf"
    fd = os.open(conf, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as fh:
        fh.write(f"listen: 127.0.0.1:{port}\n" + body)
    exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
    proc = subprocess.Popen([exe, "-c", str(conf)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        deadline = time.monotonic() + 15.0
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"nats-server exited with code {proc.returncode}")
            try:
                socket.create_connection(("127.0.0.1", port), timeout=0.5).close()
                break
            except OSError:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"nats-server did not listen on {port}") from None
                time.sleep(0.05)
        yield port
    finally:
        proc.terminate()
        proc.wait(timeout=10)


class RawPub:
    """A bare ZMQ PUB socket on a free loopback port that sends hand-made batches (any
    source, epoch and seq: what a hostile publisher can do). ``url`` is the advisor's
    subscribe URL (no replay endpoint)."""

    def __init__(self) -> None:
        import zmq

        self.port = free_port()
        self.url = f"zmq://127.0.0.1:{self.port}"
        self._ctx = zmq.Context()
        self.sock = self._ctx.socket(zmq.PUB)
        self.sock.setsockopt(zmq.SNDHWM, 0)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.bind(f"tcp://127.0.0.1:{self.port}")
        self._probe_seq = 0

    def send(self, b: Any, payload: bytes | None = None) -> None:
        """Send batch ``b`` (or ``payload`` under ``b``'s seq frame)."""
        from event_plane.codec import encode_batch
        from event_plane.frames import seq_to_bytes

        self.sock.send_multipart([b"", seq_to_bytes(b.seq), encode_batch(b) if payload is None else payload])

    def join(self, svc: AdvisorService, source: str = "probe", timeout: float = 30.0) -> None:
        """Send empty batches of ``source`` until the advisor has indexed one (a PUB drops
        what it sends before the subscription arrives)."""
        from event_plane.schema import WIRE_VERSION, EventBatch

        deadline = time.monotonic() + timeout
        while source not in svc.index.sources():
            if time.monotonic() > deadline:
                raise AssertionError(f"the advisor never received {source}")
            self.send(EventBatch(WIRE_VERSION, source, 1, self._probe_seq, 1, []))
            self._probe_seq += 1
            time.sleep(0.1)

    def close(self) -> None:
        self.sock.close(linger=0)
        self._ctx.term()
