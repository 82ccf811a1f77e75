"""The engine demo's KV-aware router (Dynamo's rule: overlap weighed against load, blocks on
a shared volume held by every engine) against the advisor's real indexer API: two
vLLM-format ZMQ publishers, a uvicorn server, POST /register and POST /query."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import httpx
import pytest

from advisor import AdvisorService, AdvisorSettings
from api import serve_query
from event_plane.adapters import PeerEmitter
from kvadvisor.engine_demo.router import KvRouter, RoundRobinRouter
from storage_backends.local_s3 import free_port
from tests.polling import wait_until

BS = 32
MODEL = "tiny-llama"
PROMPT = list(range(1, 1 + 8 * BS))  # 8 full blocks


@pytest.fixture
def api(tmp_path) -> Iterator[str]:  # noqa: ANN001
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False))
    svc.start()
    handle = serve_query(svc.query(), "127.0.0.1", 0)
    try:
        yield handle.url
    finally:
        handle.stop()
        svc.stop()


def test_kv_router_sends_to_the_overlap_unless_its_load_outweighs_it(api: str) -> None:
    emitters = []
    with httpx.Client(base_url=api, timeout=10.0) as c:
        for i in range(2):
            pub, rep = f"tcp://127.0.0.1:{free_port()}", f"tcp://127.0.0.1:{free_port()}"
            emitters.append(PeerEmitter(pub, rep, flavor="vllm", form="map"))
            r = c.post("/register", json={"instance_id": i, "endpoint": pub, "replay_endpoint": rep,
                                          "model_name": MODEL, "block_size": BS})
            assert r.status_code == 200, r.text
        # engine 1 holds the first 6 blocks of the prompt in G1
        em = emitters[1]
        em.send([em.stored([11, 12, 13, 14, 15, 16], None, block_size=BS, token_ids=PROMPT[: 6 * BS], medium="GPU")])
        deadline = time.monotonic() + 20
        while c.post("/query", json={"token_ids": PROMPT, "model_name": MODEL}).json()["scores"] != {"1": {"0": 6 * BS}}:
            assert time.monotonic() < deadline, "the index never saw engine 1's blocks"
            time.sleep(0.05)

    async def go() -> None:
        async with httpx.AsyncClient(base_url=api, timeout=10.0) as http:
            router = KvRouter(http, MODEL, [0, 1], BS)
            first = await router.choose(PROMPT)
            assert first.engine == 1 and first.overlap_tokens == (0, 6 * BS)
            assert first.prefill_blocks == 2 and router.queued_prefill == [0, 2]
            # engine 1 now has 2 prefill blocks queued and 8 decode blocks: (2 + 2) + (8 + 8) = 20
            # against (0 + 8) + (0 + 8) = 16 on engine 0
            second = await router.choose(PROMPT)
            assert second.engine == 0
            router.first_token(first)
            assert router.queued_prefill == [8, 0]
            router.finished(first, PROMPT)
            router.finished(second, PROMPT)
            assert router.decode_blocks == [0, 0] and router.queued_prefill == [0, 0] and router.in_flight == [0, 0]
            # a heavy overlap weight follows the overlap whatever the load
            heavy = KvRouter(http, MODEL, [0, 1], BS, overlap_weight=10.0)  # 10 x (2 + 2) + 16 < 10 x 8 + 8
            assert [(await heavy.choose(PROMPT)).engine for _ in range(2)] == [1, 1]
            stats = router.stats
            assert stats.per_engine == {1: 1, 0: 1} and stats.with_overlap == 2 and stats.to_best_overlap == 1
            # a model nobody registered: no overlap anywhere, the query's 404 is not an error
            other = KvRouter(http, "other-model", [0, 1], BS)
            assert (await other.choose(PROMPT)).overlap_tokens == (0, 0) and other.stats.query_errors == 0
            rr = RoundRobinRouter(2)
            assert [(await rr.choose(PROMPT)).engine for _ in range(4)] == [0, 1, 0, 1]
            assert [c.engine for c in await rr.choose_many([PROMPT] * 3)] == [0, 1, 0]
            # a burst is routed as one: its queries run together, then each request is
            # picked in order and sees the load of those before it (the same choices as one
            # by one above: the overlap, then the idle engine)
            burst = KvRouter(http, MODEL, [0, 1], BS)
            both = await burst.choose_many([PROMPT, PROMPT])
            assert [c.engine for c in both] == [1, 0] and [c.prefill_blocks for c in both] == [2, 8]
            assert burst.in_flight == [1, 1] and burst.stats.with_overlap == 2
            assert await burst.choose_many([]) == []

    async def shared() -> None:
        async with httpx.AsyncClient(base_url=api, timeout=10.0) as http:
            router = KvRouter(http, MODEL, [0, 1], BS)
            # engine 0's connector put the whole prompt on a shared volume (medium DISK, tier
            # g3): engine 1 loads it from there too, past the 6 blocks its G1 holds
            assert await router.overlaps(PROMPT) == ([8 * BS, 8 * BS], 8 * BS)
            c = await router.choose(PROMPT)
            assert c.prefill_blocks == 0 and router.stats.with_shared_overlap == 1

    try:
        asyncio.run(go())
        em = emitters[0]
        em.send([em.stored([21, 22, 23, 24, 25, 26, 27, 28], None, block_size=BS, token_ids=PROMPT, medium="DISK")])
        with httpx.Client(base_url=api, timeout=10.0) as c:
            wait_until(lambda: c.post("/query", json={"token_ids": PROMPT, "model_name": MODEL}).json()["tiers"].get("0")
                       == {"0": {"g3": 8 * BS}}, what="the index places engine 0's blocks on g3")
        asyncio.run(shared())
    finally:
        for em in emitters:
            em.close()
