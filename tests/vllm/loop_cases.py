"""Shared pieces of the whole-loop tests (two real vLLM engines, the advisor, shared
volumes): the deployment's storage declaration, written once and read by the advisor and by
both engines' connectors (``storage_config``), and the checks of each phase."""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import boto3
from vllm_cases import PAGE, PROMPTS

from kvbm_runtime.hashing import ModelFingerprint
from storage_backends import BlockKey, PlacementCatalog
from storage_backends.local_s3 import LocalS3

FULL_BLOCKS = len(PROMPTS["a"]) // PAGE  # 17 full blocks of the 552-token prompt


def engine_namespace(llama_dir: Path) -> str:
    """The storage key namespace the connector logs at start for the test model (fp32 KV,
    block size 32): what the advisor is pointed at."""
    return ModelFingerprint(str(llama_dir), "float32", "FullyContiguous", PAGE).namespace()


def volumes(work: Path, s3: LocalS3, bucket: str) -> list[dict[str, Any]]:
    """A POSIX ``fast`` volume and an S3 ``archive`` volume (moto on loopback); the S3
    secret sits in a mode-0600 file, never in a config vLLM would log."""
    boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                 aws_secret_access_key=s3.secret_key, region_name="us-east-1").create_bucket(Bucket=bucket)
    key = work / "s3.secret"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(s3.secret_key + "\n")
    return [
        {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 64 << 20,
         "root": str(work / "volumes" / "fast"), "segment_bytes": 1 << 20},
        {"id": "archive", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30, "endpoint": s3.endpoint,
         "bucket": bucket, "prefix": "kv", "access_key": s3.access_key, "secret_key_file": str(key)},
    ]


def write_private_json(path: Path, data: dict[str, Any]) -> Path:
    """Write ``data`` as JSON, mode 0600."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(data, f, indent=2)
    return path


def connector_env(metrics_port: int) -> dict[str, str]:
    """Every saved block goes to the landing volume on its first save (filter off), and the
    worker serves its Prometheus metrics."""
    return {
        "DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER": "true",
        "DYN_KVBM_METRICS": "true",
        "DYN_KVBM_METRICS_PORT": str(metrics_port),
    }


def wait_for(cond: Callable[[], Any], what: str, timeout: float = 60.0) -> Any:
    """Poll ``cond`` until it is true (generous deadline: a loaded CI machine)."""
    deadline = time.monotonic() + timeout
    while True:
        got = cond()
        if got:
            return got
        if time.monotonic() > deadline:
            raise AssertionError(f"not reached within {timeout} s: {what}")
        time.sleep(0.1)


def where(catalog: PlacementCatalog, namespace: str, hashes: list[int]) -> list[str | None]:
    """The volume of each block in the shared catalog (``None``: not stored)."""
    return [None if p is None else p.volume_id for p in catalog.get_many([BlockKey(namespace, h) for h in hashes])]


def prompt_hashes(catalog: PlacementCatalog, namespace: str, volume: str) -> list[int]:
    """Sequence hashes of the blocks of ``namespace`` the catalog places on ``volume``."""
    return sorted(p.key.sequence_hash for p in catalog.iter_volume(volume) if p.key.namespace == namespace)
