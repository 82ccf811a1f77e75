"""The whole loop with real engines, embedded mode: two vLLM engines with the connector, a
live advisor, a POSIX volume ``fast`` and an S3 volume ``archive`` (moto on loopback), one
shared SQLite placement catalog.  The advisor's config file is the only place the volumes
and the catalog are declared: the engines read it too (``storage_config``).

In order: engine A offloads a prompt to ``fast``; the advisor demotes its blocks to S3;
engine B (which never saw the prompt) onboards them from S3 at its next run, with the
outputs of vLLM without a connector; the advisor promotes them back (B's onboarding made
them hot), and B's third run onboards them from ``fast``."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loop_cases import (
    FULL_BLOCKS, connector_env, engine_namespace, prompt_hashes, volumes, wait_for, where, write_private_json,
)
from vllm_cases import PAGE, run, run_offloaded

from advisor.ops.drain import drain_volume, undrain_volume
from advisor.embedded.service import AdvisorService
from advisor.settings import AdvisorSettings
from kvbm_runtime.testing.vllm_engine import Completion, llm_engine, metric
from storage_backends import SqliteCatalog
from storage_backends.local_s3 import LocalS3, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # two engine starts on a loaded machine


@pytest.fixture(scope="module")
def loop(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3) -> Iterator[dict[str, Any]]:
    """The advisor (from ``advisor.json``) and engines A and B (each with the connector on
    that same file; B's own KV events feed the advisor's hit counts)."""
    work = tmp_path_factory.mktemp("vllm-loop")
    ns = engine_namespace(llama_dir)
    kvbm_a, kvbm_b = (f"zmq://127.0.0.1:{free_port()}?replay={free_port()}" for _ in range(2))
    vb = free_port(count=2)  # vLLM replays on vb + 1
    vllm_b = f"vllm+zmq://127.0.0.1:{vb}?replay={vb + 1}&source=vllm-b&topic=kv&model={llama_dir}&media=GPU"
    config = write_private_json(work / "advisor.json", {
        "journal_path": str(work / "journal.sqlite"), "catalog_path": str(work / "catalog.sqlite"),
        "volume_roots": [str(work / "volumes")], "namespace": ns,
        "volumes": volumes(work, local_s3, "kvbm-loop"), "fast_volume": "fast", "archive_volume": "archive",
        "subscribe_urls": [kvbm_a, kvbm_b, vllm_b], "api_enabled": False, "get_timeout_s": 0.05,
        "policy_interval_s": 0, "policy": {"promotion": {"min_hits": 1}, "planner": {"min_move_interval_s": 0}},
    })
    svc = AdvisorService(AdvisorSettings.from_json_file(config))
    svc.start()
    pa, pb = free_port(), free_port()
    catalog = SqliteCatalog(work / "catalog.sqlite")
    try:
        with llm_engine(llama_dir, connector={"storage_config": str(config), "events_url": kvbm_a, "source": "kvbm-a",
                                              "g2_blocks": 20}, env=connector_env(pa)) as llm_a, \
             llm_engine(llama_dir, connector={"storage_config": str(config), "events_url": kvbm_b, "source": "kvbm-b",
                                              "g2_blocks": 20}, env=connector_env(pb),
                        kv_events_endpoint=f"tcp://127.0.0.1:{vb}") as llm_b:
            yield {"a": llm_a, "b": llm_b, "metrics_a": f"http://127.0.0.1:{pa}/metrics", "advisor": svc,
                   "catalog": catalog, "namespace": ns}
    finally:
        svc.stop()
        catalog.close()


def test_offload_demote_onboard_from_s3_promote_onboard_from_fast(
    loop: dict[str, Any], vllm_reference: dict[str, Completion],
) -> None:
    llm_a, llm_b, svc, catalog, ns = loop["a"], loop["b"], loop["advisor"], loop["catalog"], loop["namespace"]
    want = vllm_reference["a"].token_ids
    full = FULL_BLOCKS * PAGE

    # 1. engine A computes the prompt and offloads its blocks to the landing volume
    (first,) = run_offloaded(llm_a, loop["metrics_a"], "a")
    assert first.token_ids == want
    hashes = wait_for(lambda: (h := prompt_hashes(catalog, ns, "fast")) and len(h) == FULL_BLOCKS and h,
                      "the prompt's blocks on 'fast' in the shared catalog, under the logged namespace")
    wait_for(lambda: svc.index.blocks_at("fast") >= set(hashes), "the advisor's index places them on 'fast'")

    # 2. the advisor demotes them to S3; both engines forget their own prefix caches
    drained = drain_volume(svc, "fast", "archive")
    assert drained.counts.get("done") == FULL_BLOCKS, drained.counts
    assert where(catalog, ns, hashes) == ["archive"] * FULL_BLOCKS
    # a drain keeps 'fast' draining (no policy moves onto it) until the operator cancels it;
    # cancelled here, so the policy may promote onto it again in step 4
    assert undrain_volume(svc, "fast")
    llm_a.reset_prefix_cache()
    llm_b.reset_prefix_cache()

    # 3. engine B, which never saw the prompt, onboards it from S3 (vLLM's own counts)
    hits0 = metric(llm_b, "vllm:external_prefix_cache_hits")
    disk0 = metric(llm_b, "vllm:prompt_tokens_cached_by_source", source="disk")
    (second,) = run(llm_b, "a")
    loaded = metric(llm_b, "vllm:external_prefix_cache_hits") - hits0
    assert loaded >= 0.9 * full and second.num_cached_tokens >= 0.9 * full, (loaded, second.num_cached_tokens)
    assert metric(llm_b, "vllm:prompt_tokens_cached_by_source", source="disk") - disk0 == loaded
    assert second.token_ids == want
    assert where(catalog, ns, hashes) == ["archive"] * FULL_BLOCKS  # read where they were

    # 4. the onboarding made them hot (B's G1 stores): a policy round promotes them back
    wait_for(lambda: all((i := svc.index.block(h)) is not None and i.hits >= 1 for h in hashes),
             "B's onboarding counted as hits in the advisor's index")
    results = svc.run_policies_once()
    promoted = {r.item.sequence_hash for r in results if r.item.kind.value == "promote" and r.status.value == "done"}
    assert promoted >= set(hashes), [(r.item.kind.value, r.status.value) for r in results]
    assert where(catalog, ns, hashes) == ["fast"] * FULL_BLOCKS

    # 5. B's third run onboards them from 'fast'
    llm_b.reset_prefix_cache()
    hits1 = metric(llm_b, "vllm:external_prefix_cache_hits")
    (third,) = run(llm_b, "a")
    assert metric(llm_b, "vllm:external_prefix_cache_hits") - hits1 >= 0.9 * full
    assert third.num_cached_tokens >= 0.9 * full
    assert third.token_ids == want
