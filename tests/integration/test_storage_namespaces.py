"""A model fingerprint namespaces every block: the same sequence hash written under two
fingerprints stays two blocks, on a posix volume (NIXL POSIX) and an S3 volume (NIXL OBJ),
with the SQLite and the Redis catalog."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from kvbm_runtime.hashing import ModelFingerprint
from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    LocalS3,
    MediaClass,
    PlacementCatalog,
    RedisCatalog,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
)

FP_A = ModelFingerprint(name="org/model", dtype="float16", layout="FullyContiguous", block_size=16, revision="r1")
# differs only in the revision: must still be another namespace
FP_B = ModelFingerprint(name="org/model", dtype="float16", layout="FullyContiguous", block_size=16, revision="r2")


def block(seed: int, n: int = 8192) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


@pytest.fixture(params=["posix-sqlite", "s3-sqlite", "posix-redis"])
def setup(request: pytest.FixtureRequest, tmp_path: Path) -> Iterator[tuple[StorageAgent, str]]:
    kind, catalog = request.param.split("-")
    cat: PlacementCatalog
    if catalog == "redis":
        cat = RedisCatalog(request.getfixturevalue("redis_url"), prefix=f"kvadvisor-test:{uuid.uuid4().hex}")
    else:
        cat = SqliteCatalog(tmp_path / "c.sqlite")
    agent = StorageAgent(cat, name=f"ns-{request.param}-{tmp_path.name}")
    if kind == "posix":
        agent.register_volume(VolumeDescriptor("v", VolumeKind.POSIX, MediaClass.NVME, 1 << 30, root=str(tmp_path / "v")))
    else:
        s3: LocalS3 = request.getfixturevalue("local_s3")
        agent.register_volume(VolumeDescriptor(
            "v", VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=s3.endpoint,
            bucket=f"kvadvisor-ns-{uuid.uuid4().hex[:12]}", access_key=s3.access_key, secret_key=s3.secret_key))
    yield agent, kind
    agent.close()
    if isinstance(cat, RedisCatalog):
        cat.destroy()
    cat.close()


def test_same_sequence_hash_under_two_fingerprints_stays_two_blocks(setup: tuple[StorageAgent, str]) -> None:
    agent, _ = setup
    ns_a, ns_b = FP_A.namespace(), FP_B.namespace()
    assert ns_a != ns_b
    h = (1 << 64) - 3  # one sequence hash, both models
    ka, kb = BlockKey(ns_a, h), BlockKey(ns_b, h)
    (pa,) = agent.put([(ka, block(1))], "v")
    assert agent.exists([ka, kb]) == [True, False]  # b is not served a's block
    with pytest.raises(BlockNotFoundError):
        agent.get([kb])
    (pb,) = agent.put([(kb, block(2))], "v")  # not deduplicated against a's block
    assert pb.segment_id != pa.segment_id and agent.counters.dedup_skipped == 0
    got_b, got_a = agent.get([kb, ka])
    assert torch.equal(got_a, block(1)) and torch.equal(got_b, block(2))
    assert agent.delete([ka]) == 1
    assert agent.exists([ka, kb]) == [False, True]
    assert torch.equal(agent.get([kb])[0], block(2))
