"""The indexer routes' indexes hold a bounded number of blocks, over real ZMQ and a real
uvicorn server on loopback.

A registered worker's KV-event publisher (vLLM format) can send any number of
``BlockStored``; the blocks one worker holds in an index are at most
``KVADVISOR_API_MAX_WORKER_BLOCKS`` and all indexes together hold at most
``KVADVISOR_API_MAX_INDEXER_BLOCKS`` (a block on several media counts once per medium).
A Store over either is refused from that block on, and counted under a fixed reason in
``/v1/stats`` (``indexer``) and ``/metrics``. One flooding worker takes its own share, not
another worker's; ``/load`` (admin) is held to the same quotas. The ``(model, tenant)``
indexes themselves are at most ``KVADVISOR_API_MAX_INDEXES`` (429 ``too_many_indexes``).
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import settings, wait_for

from event_plane.adapters import PeerEmitter
from storage_backends.local_s3 import free_port

BS = 4
MODEL = "m"
PER_WORKER, TOTAL = 50, 80


@pytest.fixture
def api(tmp_path: Path, advisor: Any, monkeypatch: pytest.MonkeyPatch) -> Iterator[httpx.Client]:
    """The advisor's own API, its quotas from the environment (no token: loopback only)."""
    monkeypatch.setenv("KVADVISOR_API_MAX_WORKER_BLOCKS", str(PER_WORKER))
    monkeypatch.setenv("KVADVISOR_API_MAX_INDEXER_BLOCKS", str(TOTAL))
    monkeypatch.setenv("KVADVISOR_API_MAX_INDEXES", "2")
    svc = advisor(settings(tmp_path, [], api_enabled=True, api_port=free_port()))
    with httpx.Client(base_url=svc.api_url, timeout=10.0) as c:
        yield c


def emitter() -> tuple[PeerEmitter, str, str]:
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    return PeerEmitter(pub, rep, flavor="vllm", form="map"), pub, rep


def store_roots(em: PeerEmitter, first: int, n: int, per_message: int = 20) -> None:
    """``n`` one-block prefixes (hashes ``first``..), ``per_message`` Stores per message."""
    for k in range(first, first + n, per_message):
        em.send([em.stored([h], None, block_size=BS, token_ids=[h % 1000] * BS)
                 for h in range(k, min(k + per_message, first + n))])


def tree(c: httpx.Client, inst: int) -> int:
    r = c.post("/query_by_hash", json={"block_hashes": [1], "model_name": MODEL})
    return int(r.json()["tree_sizes"].get(str(inst), {}).get("0", 0)) if r.status_code == 200 else 0


def refused(c: httpx.Client) -> dict[str, int]:
    return c.get("/v1/stats").json().get("indexer", {}).get("refused_blocks", {})


def test_a_flooding_worker_is_held_to_its_share(api: httpx.Client) -> None:
    c = api
    ems = []
    try:
        for inst in (1, 2):
            em, pub, rep = emitter()
            ems.append(em)
            r = c.post("/register", json={"instance_id": inst, "endpoint": pub, "replay_endpoint": rep,
                                          "model_name": MODEL, "block_size": BS})
            assert r.status_code == 200, r.text
        time.sleep(0.3)  # time passes: the registrations' SUB sockets connect (a PUB drops what it sends before)
        store_roots(ems[0], 1_000, 200)
        wait_for(lambda: tree(c, 1) + refused(c).get("worker_blocks", 0) >= 200, what="the flood applied or refused")
        assert tree(c, 1) == PER_WORKER
        assert refused(c) == {"worker_blocks": 200 - PER_WORKER, "blocks": 0}
        # the other worker still gets its blocks
        store_roots(ems[1], 5_000, 20)
        wait_for(lambda: tree(c, 2) >= 20, what="the other worker's blocks indexed")
        assert tree(c, 2) == 20
        # the total: a /load of a third worker gets what is left of it
        dump = {"stored": {"parent_hash": None, "medium": "g1", "copies": 1,
                           "blocks": [{"block_hash": h, "tokens_hash": h, "sequence_hash": h} for h in range(9_000, 9_030)]}}
        r = c.post("/load", json={"block_size": BS, "dump": {f"{MODEL}:default": [
            {"instance_id": 3, "dp_rank": 0, "event": dump}]}})
        assert r.status_code == 200, r.text
        assert r.json()["blocks"] == TOTAL - PER_WORKER - 20
        assert tree(c, 3) == TOTAL - PER_WORKER - 20
        assert refused(c) == {"worker_blocks": 200 - PER_WORKER, "blocks": 30 - (TOTAL - PER_WORKER - 20)}
        metrics = c.get("/metrics").text
        assert f'kvadvisor_api_indexer_blocks_refused_total{{reason="worker_blocks"}} {200 - PER_WORKER}.0' in metrics
        # a worker that goes gives its blocks back
        assert c.post("/unregister", json={"instance_id": 1, "model_name": MODEL}).status_code == 200
        assert c.get("/v1/stats").json()["indexer"]["blocks"] == TOTAL - PER_WORKER
    finally:
        for em in ems:
            em.close()


def test_indexes_are_capped(api: httpx.Client) -> None:
    block = {"block_hash": 1, "tokens_hash": 1, "sequence_hash": 1}
    ev = {"instance_id": 1, "dp_rank": 0, "event": {"stored": {"parent_hash": None, "blocks": [block]}}}
    for k in range(2):
        assert api.post("/load", json={"block_size": BS, "dump": {f"m{k}:t": [ev]}}).status_code == 200
    r = api.post("/load", json={"block_size": BS, "dump": {"m2:t": [ev]}})
    assert r.status_code == 429 and r.json()["error"] == "too_many_indexes", r.text
    r = api.post("/register", json={"instance_id": 9, "endpoint": f"tcp://127.0.0.1:{free_port()}",
                                    "model_name": "m3", "block_size": BS})
    assert r.status_code == 429 and r.json()["error"] == "too_many_indexes", r.text
    assert api.get("/v1/stats").json()["indexer"]["indexes"] == 2
