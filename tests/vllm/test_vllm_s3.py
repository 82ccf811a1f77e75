"""The connector inside a real vLLM engine, offloading to and onboarding from an S3 volume
(G4) on a real HTTP S3 endpoint (moto) on loopback."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import Any

import boto3
import pytest
from vllm_cases import PAGE, PROMPTS, run, run_offloaded, scrape

from kvbm_runtime.testing.vllm_engine import Completion, llm_engine
from storage_backends.local_s3 import LocalS3, free_port

pytestmark = pytest.mark.vllm

FULL = (len(PROMPTS["a"]) // PAGE) * PAGE


@pytest.fixture(scope="module")
def s3_engine(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3) -> Iterator[dict[str, Any]]:
    """vLLM with the connector: G2 of 20 blocks, an S3 volume as the offload target
    (credentials from the environment, never from the extra config)."""
    work = tmp_path_factory.mktemp("kvbm-s3")
    port = free_port()
    volume = {
        "id": "archive", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30,
        "endpoint": local_s3.endpoint, "bucket": "kvbm-vllm", "prefix": f"t{port}",
    }
    boto3.client("s3", endpoint_url=local_s3.endpoint, aws_access_key_id=local_s3.access_key,
                 aws_secret_access_key=local_s3.secret_key, region_name="us-east-1").create_bucket(Bucket="kvbm-vllm")
    env = {
        "AWS_ACCESS_KEY_ID": local_s3.access_key,
        "AWS_SECRET_ACCESS_KEY": local_s3.secret_key,
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_METRICS": "true",
        "DYN_KVBM_METRICS_PORT": str(port),
    }
    connector = {"g2_blocks": 20, "volume": volume, "storage_catalog": str(work / "catalog.sqlite")}
    with llm_engine(llama_dir, connector=connector, env=env) as llm:
        yield {"llm": llm, "metrics": f"http://127.0.0.1:{port}/metrics", "s3": local_s3, "prefix": volume["prefix"]}


def test_onboard_from_g4_s3(s3_engine: dict[str, Any], vllm_reference: dict[str, Completion]) -> None:
    llm, url = s3_engine["llm"], s3_engine["metrics"]
    run_offloaded(llm, url, "a")
    s3 = s3_engine["s3"]
    objects = boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                           aws_secret_access_key=s3.secret_key, region_name="us-east-1").list_objects_v2(
        Bucket="kvbm-vllm", Prefix=s3_engine["prefix"])
    assert objects.get("KeyCount", 0) >= 1  # the blocks are in the bucket
    run_offloaded(llm, url, "c", "d")  # evict a's blocks from the 20-block G2
    llm.reset_prefix_cache()
    reads = scrape(url, "kvbm_onboard_blocks_d2d")
    (again,) = run(llm, "a")
    assert again.num_cached_tokens >= 480, {m: scrape(url, m) for m in ("kvbm_onboard_errors", "kvbm_onboard_blocks_d2d", "kvbm_offload_blocks_h2d")}
    assert scrape(url, "kvbm_onboard_blocks_d2d") - reads >= 480 // PAGE
    assert again.token_ids == vllm_reference["a"].token_ids
