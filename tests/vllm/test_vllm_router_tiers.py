"""What a KV-aware router sees of a real vLLM engine with the connector: the engine's own KV
events carry the connector's G2 and volume blocks (``take_events``, medium CPU / DISK), and
the advisor's indexer API, registered on that one stream as a Dynamo router's indexer
would be, answers ``POST /query`` with tiers ``g2`` / ``g3`` for a prompt vLLM's G1 no
longer holds; a G2 eviction leaves only the volume."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from vllm_cases import PAGE, PROMPTS, run_offloaded

from advisor import AdvisorService, AdvisorSettings
from api import serve_query
from kvbm_runtime.testing.vllm_engine import generate, llm_engine
from storage_backends.local_s3 import free_port
from tests.polling import wait_until

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(600)]

MODEL = "tiny-llama"
G2_BLOCKS = 20  # one prompt's 17 blocks fit, two do not: the third prompt evicts the first
FULL = (len(PROMPTS["a"]) // PAGE) * PAGE  # 544 tokens: the 17 full blocks of a prompt


@pytest.fixture(scope="module")
def engine(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """vLLM with the connector (G2 of 20 blocks, a POSIX volume from ``DYN_KVBM_DISK_CACHE_*``)
    publishing vLLM's KV events, and the advisor's API with the engine registered (``/register``)."""
    work = tmp_path_factory.mktemp("vllm-router-tiers")
    svc = AdvisorService(AdvisorSettings(journal_path=str(work / "journal.sqlite"), api_enabled=False))
    svc.start()
    handle = serve_query(svc.query(), "127.0.0.1", 0)
    vport, mport = free_port(count=2), free_port()  # vLLM replays on vport + 1
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(G2_BLOCKS),
        "DYN_KVBM_DISK_CACHE_GB": "0.05",
        "DYN_KVBM_DISK_CACHE_DIR": str(work / "disk"),
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_METRICS": "true",
        "DYN_KVBM_METRICS_PORT": str(mport),
    }
    try:
        with httpx.Client(base_url=handle.url, timeout=30.0) as http:
            r = http.post("/register", json={"instance_id": 0, "endpoint": f"tcp://127.0.0.1:{vport}",
                                             "replay_endpoint": f"tcp://127.0.0.1:{vport + 1}",
                                             "model_name": MODEL, "block_size": PAGE})
            assert r.status_code == 200, r.text
            with llm_engine(llama_dir, env=env, kv_events_endpoint=f"tcp://127.0.0.1:{vport}") as llm:
                yield {"llm": llm, "http": http, "metrics": f"http://127.0.0.1:{mport}/metrics"}
    finally:
        handle.stop()
        svc.stop()


def _tiers(engine: dict[str, Any], name: str) -> dict[str, int]:
    """The index's tiers of engine 0 for prompt ``name`` (tokens per tier), after one more
    engine step: the workers' last changes reach vLLM's stream with a step's output, so a
    4-token request (no full block: nothing of its own is stored) carries them."""
    generate(engine["llm"], [[1, 2, 3, 4]], 1)
    r = engine["http"].post("/query", json={"token_ids": PROMPTS[name], "model_name": MODEL})
    assert r.status_code == 200, r.text
    return r.json()["tiers"].get("0", {}).get("0", {})


def test_query_reports_g2_and_g3_after_g1_is_reset_and_a_g2_eviction(engine: dict[str, Any]) -> None:
    llm = engine["llm"]
    run_offloaded(llm, engine["metrics"], "a")  # a's blocks in G1, G2 and on the volume
    llm.reset_prefix_cache()  # vLLM's AllBlocksCleared: G1 is empty, the connector's copies stay
    want = {"g2": FULL, "g3": FULL}
    got = wait_until(lambda: (t := _tiers(engine, "a")) == want and t, what=f"tiers {want} for prompt a")
    assert "g1" not in got
    # c and d evict a from the 20-block G2 (BlockRemoved, medium CPU); the volume keeps it
    run_offloaded(llm, engine["metrics"], "c", "d")
    wait_until(lambda: _tiers(engine, "a") == {"g3": FULL}, what="prompt a on g3 alone")
    # d is everywhere: vLLM's G1 (its output's blocks too), G2 and the volume
    t = _tiers(engine, "d")
    assert t["g1"] >= FULL and t["g2"] == t["g3"] == FULL, t
