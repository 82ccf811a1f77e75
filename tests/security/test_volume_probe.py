"""Registering an S3 volume whose endpoint is silent (a loopback listener that accepts TCP
and never answers) holds up nothing else, over a real uvicorn server: the endpoint is
probed with short timeouts outside the round lock, so an operator action that takes that
lock answers while the registration waits; the registration then fails with a clear 504
``volume_unreachable`` and adds no volume."""

from __future__ import annotations

import socket
import threading
from pathlib import Path
from typing import Any

import httpx
from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import wait_for

from advisor.settings import AdvisorSettings
from storage_backends.local_s3 import free_port


def silent_listener() -> tuple[socket.socket, list[socket.socket], threading.Event]:
    """A loopback TCP listener that accepts connections and never sends a byte."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(16)
    srv.settimeout(0.2)
    conns: list[socket.socket] = []
    stop = threading.Event()

    def accept() -> None:
        while not stop.is_set():
            try:
                conns.append(srv.accept()[0])
            except TimeoutError:
                continue
            except OSError:
                return

    threading.Thread(target=accept, daemon=True).start()
    return srv, conns, stop


def test_a_silent_s3_endpoint_holds_up_no_other_request(tmp_path: Path, advisor: Any) -> None:  # noqa: F811
    srv, conns, stop = silent_listener()
    api_port = free_port()
    svc = advisor(AdvisorSettings(
        journal_path=str(tmp_path / "journal.sqlite"), catalog_path=str(tmp_path / "catalog.sqlite"),
        volumes=[{"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 1 << 26,
                  "root": str(tmp_path / "fast"), "segment_bytes": 1 << 20}],
        fast_volume="fast", policy_interval_s=0, snapshot_store="none", volume_roots=[str(tmp_path)],
        api_enabled=True, api_port=api_port,
        volume_probe_timeout_s=10.0,  # a wide window for the concurrent requests below
    ))
    base = f"http://127.0.0.1:{api_port}"
    answer: list[httpx.Response] = []
    body = {"volume": {"id": "silent", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30,
                       "endpoint": f"http://127.0.0.1:{srv.getsockname()[1]}", "bucket": "kv-silent",
                       "access_key": "ak", "secret_key": "sk"}, "role": "none"}
    reg = threading.Thread(target=lambda: answer.append(httpx.post(f"{base}/v1/volumes", json=body, timeout=300)),
                           daemon=True)
    try:
        reg.start()
        wait_for(lambda: bool(conns), timeout=60, what="the probe's connection to the silent endpoint")
        # an operator action that takes the round lock, and health, answer meanwhile
        gone = httpx.delete(f"{base}/v1/volumes/nope", timeout=300)
        health = httpx.get(f"{base}/healthz", timeout=300)
        assert reg.is_alive() and not answer, "the other requests waited for the registration"
        assert (gone.status_code, gone.json()["error"]) == (409, "volume_refused")
        assert health.status_code == 200
        reg.join(timeout=300)
        assert answer and answer[0].status_code == 504, answer and answer[0].text
        assert answer[0].json()["error"] == "volume_unreachable"
        assert "no answer within 10 s" in answer[0].json()["detail"]
        assert "silent" not in {v.id for v in svc.settings.volumes}
    finally:
        stop.set()
        srv.close()
        for c in conns:
            c.close()
