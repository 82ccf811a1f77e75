"""The connector inside a real vLLM engine, onboarding from a G3 volume (G2 too small to
keep the prompt), and a load failure on G3 that vLLM recomputes."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from vllm_cases import PAGE, PROMPTS, run, run_offloaded, scrape

from kvbm_runtime.testing.vllm_engine import Completion, llm_engine, metric
from storage_backends.local_s3 import free_port

pytestmark = pytest.mark.vllm

G2_BLOCKS = 20  # one prompt's 17 blocks fit, two do not: the second evicts the first
FULL = (len(PROMPTS["a"]) // PAGE) * PAGE  # 544: every full block of a 552-token prompt


@pytest.fixture(scope="module")
def disk_engine(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """vLLM with the connector: G2 of 20 blocks and a G3 POSIX volume sized by
    ``DYN_KVBM_DISK_CACHE_GB`` in ``DYN_KVBM_DISK_CACHE_DIR``; filter off, metrics on."""
    disk = tmp_path_factory.mktemp("kvbm-disk")
    port = free_port()
    env = {
        "DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS": str(G2_BLOCKS),
        "DYN_KVBM_DISK_CACHE_GB": "0.05",
        "DYN_KVBM_DISK_CACHE_DIR": str(disk),
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_METRICS": "true",
        "DYN_KVBM_METRICS_PORT": str(port),
    }
    with llm_engine(llama_dir, env=env) as llm:
        yield {"llm": llm, "disk": disk, "metrics": f"http://127.0.0.1:{port}/metrics"}


def test_onboard_from_g3_when_g2_is_too_small(disk_engine: dict[str, Any], vllm_reference: dict[str, Completion]) -> None:
    llm, url = disk_engine["llm"], disk_engine["metrics"]
    run_offloaded(llm, url, "a", "c", "d")  # a on G3, then out of the 20-block G2
    llm.reset_prefix_cache()
    disk_reads = scrape(url, "kvbm_onboard_blocks_d2d")
    from_disk = metric(llm, "vllm:prompt_tokens_cached_by_source", source="disk")
    (again,) = run(llm, "a")
    assert again.num_cached_tokens >= 480
    assert again.num_cached_tokens == FULL
    # vLLM's own account of where the cached tokens came from (the connector's split)
    assert metric(llm, "vllm:prompt_tokens_cached_by_source", source="disk") - from_disk == FULL
    # the blocks came from the volume (G2 holds only c and d by now)
    assert scrape(url, "kvbm_onboard_blocks_d2d") - disk_reads >= 480 // PAGE
    assert again.token_ids == vllm_reference["a"].token_ids
    assert any(disk_engine["disk"].rglob("*")), "the G3 volume directory is empty"


def test_corrupt_g3_block_is_recomputed_and_counted(disk_engine: dict[str, Any], vllm_reference: dict[str, Completion]) -> None:
    llm, url, disk = disk_engine["llm"], disk_engine["metrics"], disk_engine["disk"]
    run_offloaded(llm, url, "e", "f", "g")
    # flip bytes in every segment file of the volume: each stored block fails its checksum
    segments = [p for p in disk.rglob("*") if p.is_file() and "catalog" not in p.name and p.stat().st_size > 4096]
    assert segments
    for seg in segments:
        with open(seg, "r+b") as f:
            data = bytearray(f.read())
            for i in range(0, len(data), 512):
                data[i] ^= 0xFF
            f.seek(0)
            f.write(data)
            f.flush()
    errors = scrape(url, "kvbm_onboard_errors")
    llm.reset_prefix_cache()
    (again,) = run(llm, "e")
    assert again.token_ids == vllm_reference["e"].token_ids  # recomputed, never wrong KV
    assert scrape(url, "kvbm_onboard_errors") > errors  # the failure is counted
    assert again.num_cached_tokens < FULL  # the failed blocks were not served from G3
