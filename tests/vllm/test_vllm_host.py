"""The connector inside a real vLLM engine, onboarding from G2 (host memory), and vLLM's
own KV events meeting the connector's in a running advisor."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_cases import MAX_TOKENS, PAGE, PROMPTS, SHARED, run

from advisor.embedded.service import AdvisorService
from advisor.settings import AdvisorSettings
from kvbm_runtime.testing.vllm_engine import Completion, llm_engine, metric
from storage_backends.local_s3 import free_port

pytestmark = pytest.mark.vllm

VLLM_SOURCE = "vllm-w0"
KVBM_SOURCE = "kvbm-w0"


def _vllm_hashes(tokens: list[int], n_blocks: int) -> list[int]:
    """vLLM's block hashes (sha256, its default) of the first ``n_blocks`` blocks, as the
    u64 its KV events carry; computed here with vLLM's own hashing code."""
    from vllm.utils.hashing import get_hash_fn_by_name
    from vllm.v1.core import kv_cache_utils as kcu

    from event_plane.adapters.peer import hash_to_u64

    fn = get_hash_fn_by_name("sha256")
    kcu.init_none_hash(fn)
    out: list[int] = []
    parent = None
    for i in range(n_blocks):
        parent = kcu.hash_block_tokens(fn, parent, tokens[i * PAGE : (i + 1) * PAGE], None)
        out.append(hash_to_u64(parent))
    return out


@pytest.fixture(scope="module")
def stack(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """An advisor subscribed to vLLM's KV events (``vllm+zmq://``, GPU only: vLLM's stream
    carries the connector's G2 blocks too, which the advisor takes from the connector's own
    stream) and to the connector's (``zmq://``), and a vLLM engine with the connector (G2 of
    256 blocks)."""
    work = tmp_path_factory.mktemp("vllm-host")
    vport, kport = free_port(count=2), free_port()  # vLLM replays on vport + 1
    kvbm_url = f"zmq://127.0.0.1:{kport}?replay={free_port()}"
    vllm_url = f"vllm+zmq://127.0.0.1:{vport}?replay={vport + 1}&source={VLLM_SOURCE}&topic=kv&model={llama_dir}&media=GPU"
    settings = AdvisorSettings(
        journal_path=str(work / "journal.sqlite"), subscribe_urls=[vllm_url, kvbm_url], api_enabled=False,
        get_timeout_s=0.05,
    )
    svc = AdvisorService(settings)
    svc.start()
    metrics_port = free_port()
    try:
        with llm_engine(
            llama_dir,
            connector={"events_url": kvbm_url, "source": KVBM_SOURCE, "g2_blocks": 256},
            env={"DYN_KVBM_METRICS": "true", "DYN_KVBM_METRICS_PORT": str(metrics_port)},
            kv_events_endpoint=f"tcp://127.0.0.1:{vport}",
        ) as llm:
            yield {"llm": llm, "advisor": svc, "metrics": f"http://127.0.0.1:{metrics_port}/metrics"}
    finally:
        svc.stop()


def test_shared_prefix_then_reset_onboards_from_g2_with_identical_outputs(stack: dict[str, Any], vllm_reference: dict[str, Completion]) -> None:
    llm = stack["llm"]
    hits0 = metric(llm, "vllm:external_prefix_cache_hits")
    host0 = metric(llm, "vllm:prompt_tokens_cached_by_source", source="host")
    a1, b = run(llm, "a", "b")
    assert a1.num_cached_tokens == 0
    assert b.num_cached_tokens == SHARED  # vLLM's own G1 prefix cache
    llm.reset_prefix_cache()
    (a2,) = run(llm, "a")
    # everything but the tail: 17 full blocks of the 552-token prompt came from the connector
    assert a2.num_cached_tokens >= 480
    assert a2.num_cached_tokens == (len(PROMPTS["a"]) // PAGE) * PAGE
    assert metric(llm, "vllm:external_prefix_cache_hits") - hits0 == a2.num_cached_tokens
    assert metric(llm, "vllm:prompt_tokens_cached_by_source", source="host") - host0 == a2.num_cached_tokens
    assert [a1.token_ids, b.token_ids, a2.token_ids] == [vllm_reference["a"].token_ids, vllm_reference["b"].token_ids, vllm_reference["a"].token_ids]
    assert len(a2.token_ids) == MAX_TOKENS


def _wait(cond: Any, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if cond():
            return True
        time.sleep(0.1)
    return cond()


def test_advisor_index_shows_vllm_g1_and_connector_g2_for_the_same_blocks(stack: dict[str, Any]) -> None:
    llm, svc = stack["llm"], stack["advisor"]
    llm.reset_prefix_cache()
    run(llm, "c", "d")
    # vLLM's prefix cache now holds the full blocks whose KV it computed: prompt and
    # output tokens but the last one (552 + 8 - 1 = 559 tokens → 17 blocks per prompt)
    n = (len(PROMPTS["c"]) + MAX_TOKENS - 1) // PAGE
    expected = set(_vllm_hashes(PROMPTS["c"], n)) | set(_vllm_hashes(PROMPTS["d"], n))
    index = svc.index
    g1, g2 = f"{VLLM_SOURCE}/g1", f"{KVBM_SOURCE}/g2"
    assert _wait(lambda: index.blocks_at(g1) == expected), (len(index.blocks_at(g1)), len(expected))
    # the connector saved the same blocks to G2 under the same names
    assert _wait(lambda: expected <= index.blocks_at(g2))
    for h in expected:
        info = index.block(h)
        assert info is not None and {g1, g2} <= set(info.locations)
        assert f"{VLLM_SOURCE}/g2" not in info.locations  # once, from the connector's stream
        assert info.size == 32 * 1024  # bytes, from the model geometry (vllm+zmq ...&model=)
    # lineage: each block's parent is the previous block of its prompt
    chain = _vllm_hashes(PROMPTS["c"], n)
    assert [index.block(h).parent for h in chain[1:]] == chain[:-1]
