"""Finding 3: two deployments (two catalogs) on one S3 bucket and prefix. The prefix is
claimed by the first catalog with a conditional PUT; the second is refused before it
writes anything, so the first one's blocks stay intact. Object keys carry the catalog id."""

from __future__ import annotations

import threading
import uuid
from pathlib import Path

import boto3
import pytest
import torch

from storage_backends import (
    BlockKey,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeKind,
)
from storage_backends.local_s3 import LocalS3

NS = "ns-faults-s3"


def _desc(s3: LocalS3, bucket: str) -> VolumeDescriptor:
    return VolumeDescriptor("s3", VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=s3.endpoint, bucket=bucket,
                            prefix="kv", segment_bytes=1 << 20, access_key=s3.access_key, secret_key=s3.secret_key)


def _block(h: int) -> torch.Tensor:
    return torch.full((16 << 10,), h % 251, dtype=torch.uint8)


def _keys(s3: LocalS3, bucket: str) -> list[str]:
    c = boto3.client("s3", endpoint_url=s3.endpoint, region_name="us-east-1", aws_access_key_id=s3.access_key,
                     aws_secret_access_key=s3.secret_key)
    return sorted(o["Key"] for o in c.list_objects_v2(Bucket=bucket).get("Contents", []))


def test_a_second_catalog_on_the_same_bucket_and_prefix_is_refused(tmp_path: Path, local_s3: LocalS3) -> None:
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    first = StorageAgent(SqliteCatalog(tmp_path / "one" / "catalog.sqlite"), "deployment-one")
    second = StorageAgent(SqliteCatalog(tmp_path / "two" / "catalog.sqlite"), "deployment-two")
    peer = StorageAgent(SqliteCatalog(tmp_path / "one" / "catalog.sqlite"), "deployment-one-worker")
    try:
        first.register_volume(_desc(local_s3, bucket))
        keys = [BlockKey(NS, h) for h in range(1, 9)]
        placed = first.put([(k, _block(k.sequence_hash)) for k in keys], "s3")
        cid = first.catalog.catalog_id()
        assert {f"kv/s3/{cid}/seg-{p.segment_id:012d}" for p in placed} <= set(_keys(local_s3, bucket))
        before = _keys(local_s3, bucket)
        with pytest.raises(VolumeConfigError, match=f"owned by catalog '{cid}'"):
            second.register_volume(_desc(local_s3, bucket))
        assert _keys(local_s3, bucket) == before  # the refused deployment wrote nothing
        peer.register_volume(_desc(local_s3, bucket))  # the same deployment's other process: accepted
        got = peer.get(keys)
        assert all(torch.equal(g, _block(k.sequence_hash)) for g, k in zip(got, keys))
    finally:
        for a in (first, second, peer):
            a.close()
            a.catalog.close()


def test_two_deployments_racing_for_a_prefix_one_wins(tmp_path: Path, local_s3: LocalS3) -> None:
    bucket = f"faults-{uuid.uuid4().hex[:12]}"
    agents = [StorageAgent(SqliteCatalog(tmp_path / f"d{i}" / "catalog.sqlite"), f"racer-{i}") for i in range(4)]
    outcome: list[str] = [""] * len(agents)
    go = threading.Barrier(len(agents))

    def claim(i: int) -> None:
        go.wait()
        try:
            agents[i].register_volume(_desc(local_s3, bucket))
            outcome[i] = "won"
        except VolumeConfigError as exc:
            outcome[i] = "refused" if "owned by catalog" in str(exc) else f"error: {exc}"

    threads = [threading.Thread(target=claim, args=(i,)) for i in range(len(agents))]
    try:
        for t in threads:
            t.start()
        for t in threads:
            t.join(timeout=120)
        assert sorted(outcome) == ["refused"] * 3 + ["won"], outcome
    finally:
        for a in agents:
            a.close()
            a.catalog.close()


def test_catalog_ids_are_stable_per_catalog_and_differ_between_catalogs(tmp_path: Path, redis_url: str) -> None:
    from storage_backends import RedisCatalog

    a1, a2 = SqliteCatalog(tmp_path / "a.sqlite"), SqliteCatalog(tmp_path / "a.sqlite")
    b = SqliteCatalog(tmp_path / "b.sqlite")
    prefix = f"faults-{uuid.uuid4().hex}"
    r1, r2, r3 = RedisCatalog(redis_url, prefix), RedisCatalog(redis_url, prefix), RedisCatalog(redis_url, prefix + "x")
    try:
        assert a1.catalog_id() == a2.catalog_id() == a1.catalog_id() != b.catalog_id()
        assert r1.catalog_id() == r2.catalog_id() != r3.catalog_id()
        assert len({a1.catalog_id(), b.catalog_id(), r1.catalog_id(), r3.catalog_id()}) == 4
    finally:
        for c in (a1, a2, b):
            c.close()
        for r in (r1, r2, r3):
            r.destroy()
            r.close()
