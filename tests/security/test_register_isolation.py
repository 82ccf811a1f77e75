"""``POST /register`` cannot take ingest down or make the server connect where the operator
never allowed, over real ZMQ and a real uvicorn server:

* 1,030 registrations to a dead loopback port: at most the registry's budget is taken (429
  beyond), in the registry's own ZMQ context, and the advisor keeps indexing a real
  publisher's batches, with ``/healthz`` 200;
* endpoints outside the allowed networks, unspecified or multicast addresses and host names
  are refused (403) without a connection or a name lookup;
* a subscriber whose receive loop fails (out of file descriptors) makes ``/healthz`` 503,
  retries, and ingests again once descriptors are free.
"""

from __future__ import annotations

import os
import resource
import socket
from pathlib import Path
from typing import Any

import httpx
from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import BS, RawPub, settings, wait_for

from event_plane.schema import WIRE_VERSION, EventBatch, store
from storage_backends.local_s3 import free_port

MODEL = "m"


def body(inst: int, endpoint: str) -> dict[str, Any]:
    return {"instance_id": inst, "endpoint": endpoint, "model_name": MODEL, "block_size": 32}


def indexed(pub: RawPub, svc: Any, seq: int) -> None:
    """A batch of the well-behaved publisher is indexed (polled, generous deadline)."""
    h = 1_000 + seq
    pub.send(EventBatch(WIRE_VERSION, "probe", 1, 10_000 + seq, 1, [store(h, h, None, BS, "g1")]))
    wait_for(lambda: svc.index.holds(h, "probe/g1"), what=f"well-behaved batch {seq} indexed")


def api_settings(tmp_path: Path, pub: RawPub, replay: bool = False) -> Any:
    """Settings of an advisor with its API; ``replay``: the subscription names a replay
    endpoint (nobody answers there), so the quiet line's probe opens a socket each second."""
    url = f"{pub.url}?replay={free_port()}" if replay else pub.url
    return settings(tmp_path, [url], api_enabled=True, api_port=free_port())


def test_a_registration_flood_cannot_take_ingest(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(api_settings(tmp_path, pub))
        pub.join(svc)
        dead = f"tcp://127.0.0.1:{free_port()}"
        codes: dict[int, int] = {}
        with httpx.Client(base_url=svc.api_url, timeout=30) as c:
            for inst in range(1030):
                code = c.post("/register", json=body(inst, dead)).status_code
                codes[code] = codes.get(code, 0) + 1
            budget = 256  # the default max_registrations (fewer with a low file-descriptor limit)
            assert codes.get(200, 0) <= budget and codes.get(429, 0) >= 1030 - budget, codes
            indexed(pub, svc, 0)
            assert c.get("/healthz").status_code == 200
            assert c.post("/unregister", json={"instance_id": 0, "model_name": MODEL}).status_code == 200
            indexed(pub, svc, 1)
    finally:
        pub.close()


def test_only_allowed_endpoints_are_connected(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    try:
        svc = advisor(api_settings(tmp_path, pub))
        port = free_port()
        with httpx.Client(base_url=svc.api_url, timeout=30) as c:
            for inst, ep in enumerate([f"tcp://0.0.0.0:{port}", f"tcp://10.1.2.3:{port}", f"tcp://224.0.0.1:{port}",
                                       f"tcp://localhost:{port}", f"tcp://[::]:{port}", f"tcp://*:{port}",
                                       f"tcp://no-such-host.invalid:{port}"]):
                r = c.post("/register", json=body(inst, ep))
                assert r.status_code == 403 and r.json()["error"] == "endpoint_not_allowed", (ep, r.text)
            r = c.post("/register", json={**body(50, f"tcp://127.0.0.1:{port}"),
                                          "replay_endpoint": f"tcp://192.168.0.1:{port}"})
            assert r.status_code == 403, r.text
            assert c.post("/register", json=body(51, f"tcp://127.0.0.1:{port}")).status_code == 200
            assert c.post("/register", json=body(52, f"tcp://[::1]:{port}")).status_code == 200
    finally:
        pub.close()


def test_a_failing_receive_loop_fails_health_and_recovers(tmp_path: Path, advisor: Any) -> None:
    pub = RawPub()
    held: list[int] = []
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    try:
        svc = advisor(api_settings(tmp_path, pub, replay=True))
        pub.join(svc)
        with httpx.Client(base_url=svc.api_url, timeout=30) as c:
            assert c.get("/healthz").status_code == 200
            # take every free descriptor: the subscriber's next socket (the quiet line's
            # probe of the replay endpoint) cannot be made
            resource.setrlimit(resource.RLIMIT_NOFILE, (min(soft, 4096), hard))
            try:
                while True:
                    held.append(os.open("/dev/null", os.O_RDONLY))
            except OSError:
                pass
            wait_for(lambda: svc.query().health()["status"] == "unhealthy", what="health reports the failing loop")
            for fd in held[:64]:
                os.close(fd)
            del held[:64]
            wait_for(lambda: svc.query().health()["status"] == "ok", what="health ok again")
            for fd in held:
                os.close(fd)
            held.clear()
            indexed(pub, svc, 2)
            assert c.get("/healthz").status_code == 200
    finally:
        for fd in held:
            os.close(fd)
        resource.setrlimit(resource.RLIMIT_NOFILE, (soft, hard))
        pub.close()
