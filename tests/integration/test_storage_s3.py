"""StorageAgent on S3 volumes: NIXL OBJ against a real HTTP S3 endpoint (moto_server)."""

from __future__ import annotations

import itertools
import time
from pathlib import Path

import boto3
import pytest
import torch

from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    ChecksumMismatchError,
    LocalS3,
    MediaClass,
    SegmentMissingError,
    SegmentTruncatedError,
    SqliteCatalog,
    StorageAgent,
    VersionConflictError,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeKind,
)
from storage_backends.keys import MAX_OBJECT_KEY_BYTES

NS = "fedcba9876543210"
_bucket_ids = itertools.count()


def block(h: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h % (1 << 62))
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def s3vol(s3: LocalS3, vid: str = "cold", bucket: str | None = None, prefix: str = "kv", **kw: object) -> VolumeDescriptor:
    return VolumeDescriptor(
        vid, VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=s3.endpoint,
        bucket=bucket or f"kvadvisor-test-{next(_bucket_ids)}", prefix=prefix,
        **{"access_key": s3.access_key, "secret_key": s3.secret_key, **kw},  # type: ignore[arg-type]
    )


def s3client(s3: LocalS3):  # type: ignore[no-untyped-def]
    return boto3.client("s3", endpoint_url=s3.endpoint, aws_access_key_id=s3.access_key,
                        aws_secret_access_key=s3.secret_key, region_name="us-east-1")


def objects(s3: LocalS3, bucket: str) -> list[str]:
    """The bucket's segment objects (the volume's owner marker aside)."""
    return sorted(o["Key"] for o in s3client(s3).list_objects_v2(Bucket=bucket).get("Contents", [])
                  if not o["Key"].endswith("/owner"))


@pytest.fixture
def agent(tmp_path: Path, local_s3: LocalS3) -> StorageAgent:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"test-s3-{tmp_path.name}")
    a.register_volume(VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 1 << 30, root=str(tmp_path / "fast")))
    a.register_volume(s3vol(local_s3))
    yield a
    a.close()
    cat.close()


def test_round_trip_many_blocks_through_s3(agent: StorageAgent, local_s3: LocalS3) -> None:
    sizes = [1, 513, 4096, 65536, 200_000]
    items = [(BlockKey(NS, i), block(i, sizes[i % len(sizes)])) for i in range(40)]
    ps = agent.put(items, "cold")
    bucket = agent.volume("cold").bucket
    assert bucket is not None
    assert objects(local_s3, bucket) == [f"kv/cold/{agent.catalog.catalog_id()}/seg-{ps[0].segment_id:012d}"]  # one object, bucket created
    wanted = [k for k, _ in items][::-3]
    got = agent.get(wanted)
    assert all(torch.equal(g, block(k.sequence_hash, sizes[k.sequence_hash % len(sizes)])) for g, k in zip(got, wanted))
    st = {s.volume_id: s for s in agent.stats()}["cold"]
    assert (st.blocks, st.segments, st.live_bytes) == (40, 1, sum(p.length for p in ps))
    assert agent.delete([k for k, _ in items]) == 40
    assert objects(local_s3, bucket) == []


def test_move_between_posix_and_s3(agent: StorageAgent, local_s3: LocalS3) -> None:
    keys = [BlockKey(NS, 100 + i) for i in range(6)]
    ps = agent.put([(k, block(k.sequence_hash, 10_000)) for k in keys], "fast")
    # demote two blocks to S3
    new = [agent.copy(p, "cold") for p in ps[:2]]
    assert all(n.volume_id == "cold" and n.version == 0 for n in new)
    assert agent.locate(keys[:2]) == ps[:2]  # not committed yet
    committed = [agent.commit_move(p, n) for p, n in zip(ps[:2], new)]
    assert [c.version for c in committed] == [1, 1] and agent.locate(keys[:2]) == committed
    seg = agent.segments("fast")[0]
    assert (seg.live_blocks, seg.dead_bytes) == (4, 20_000)  # old space is dead
    for k, g in zip(keys, agent.get(keys)):
        assert torch.equal(g, block(k.sequence_hash, 10_000))
    # promote one back: S3 -> posix, the S3 object holding only moved-away blocks disappears
    back = agent.commit_move(committed[0], agent.copy(committed[0], "fast"))
    assert back.version == 2 and back.volume_id == "fast"
    assert torch.equal(agent.get([keys[0]])[0], block(keys[0].sequence_hash, 10_000))
    bucket = agent.volume("cold").bucket
    assert bucket is not None
    assert len(objects(local_s3, bucket)) == 1  # one S3 segment still holds keys[1]
    agent.commit_move(committed[1], agent.copy(committed[1], "fast"))
    assert objects(local_s3, bucket) == [] and agent.segments("cold") == []


def test_batched_copy_with_a_conflict_keeps_the_other_copies(agent: StorageAgent, local_s3: LocalS3) -> None:
    keys = [BlockKey(NS, 200 + i) for i in range(3)]
    ps = agent.put([(k, block(k.sequence_hash, 3000)) for k in keys], "fast")
    news = agent.copy_many(ps, "cold")
    assert len({n.segment_id for n in news}) == 1
    agent.delete([keys[1]])  # concurrent delete of one block
    agent.commit_move(ps[0], news[0])
    with pytest.raises(VersionConflictError):
        agent.commit_move(ps[1], news[1])
    agent.commit_move(ps[2], news[2])
    seg = agent.segments("cold")[0]
    assert (seg.live_blocks, seg.dead_bytes, seg.sealed) == (2, 3000, True)
    got = agent.get([keys[0], keys[2]])
    assert torch.equal(got[0], block(keys[0].sequence_hash, 3000)) and torch.equal(got[1], block(keys[2].sequence_hash, 3000))


def test_conflicting_commit_deletes_the_new_object(agent: StorageAgent, local_s3: LocalS3) -> None:
    k = BlockKey(NS, 300)
    (p,) = agent.put([(k, block(300, 777))], "fast")
    new = agent.copy(p, "cold")
    bucket = agent.volume("cold").bucket
    assert bucket is not None and len(objects(local_s3, bucket)) == 1
    moved = agent.commit_move(p, agent.copy(p, "fast"))  # another mover wins first
    with pytest.raises(VersionConflictError):
        agent.commit_move(p, new)
    assert objects(local_s3, bucket) == [] and agent.locate([k]) == [moved]


def test_new_blocks_of_a_staged_get_are_views_of_one_buffer_and_out_gets_copies(agent: StorageAgent) -> None:
    """A get without ``out`` from S3 (blocks under 4 MiB: read through a buffer) hands
    out views of one new buffer per read (no copy out); each is exactly its block, and
    writing one never changes another.  With ``out`` the bytes are copied into the
    caller's tensors; both verify every block."""
    items = [(BlockKey(NS, 900 + i), block(900 + i, 64 << 10)) for i in range(48)]  # 3 MiB: split copy-out
    agent.put(items, "cold")
    keys = [k for k, _ in items]
    got = agent.get(keys)
    assert [torch.equal(g, t) for g, (_, t) in zip(got, items)] == [True] * 48
    assert len({g.untyped_storage().data_ptr() for g in got}) == 1  # one buffer
    assert all(g.numel() == 64 << 10 and g.is_contiguous() for g in got)
    got[3].fill_(7)  # a view: only its own bytes
    assert torch.equal(got[2], items[2][1]) and torch.equal(got[4], items[4][1])
    outs = [torch.zeros(64 << 10, dtype=torch.uint8) for _ in items]
    back = agent.get(keys, out=outs)
    assert all(b is o for b, o in zip(back, outs))
    assert [torch.equal(o, t) for o, (_, t) in zip(outs, items)] == [True] * 48


def test_new_blocks_of_a_sparse_read_are_copies_not_views_of_the_whole_span(agent: StorageAgent) -> None:
    """A get of every 60th block reads one span with the gaps between them (one ranged GET):
    views of it would keep ~60x their bytes alive, so such blocks are copied out."""
    items = [(BlockKey(NS, 1000 + i), block(1000 + i, 4096)) for i in range(600)]
    agent.put(items, "cold")
    some = items[::60]
    got = agent.get([k for k, _ in some])
    assert [torch.equal(g, t) for g, (_, t) in zip(got, some)] == [True] * 10
    assert all(g.untyped_storage().nbytes() == 4096 for g in got)  # their own memory only


def test_corrupted_object_is_detected(agent: StorageAgent, local_s3: LocalS3) -> None:
    keys = [BlockKey(NS, 400 + i) for i in range(3)]
    ps = agent.put([(k, block(k.sequence_hash, 2048)) for k in keys], "cold")
    desc = agent.volume("cold")
    key = f"kv/cold/{agent.catalog.catalog_id()}/seg-{ps[0].segment_id:012d}"
    c = s3client(local_s3)
    body = bytearray(c.get_object(Bucket=desc.bucket, Key=key)["Body"].read())
    body[ps[2].offset + 5] ^= 0x80
    c.put_object(Bucket=desc.bucket, Key=key, Body=bytes(body))
    outs = [torch.zeros(2048, dtype=torch.uint8) for _ in keys]
    with pytest.raises(ChecksumMismatchError):
        agent.get(keys, out=outs)  # through the staging buffer and the copy out
    assert not outs[2].any()  # the bad copy never lands in the caller's tensor
    with pytest.raises(BlockNotFoundError):
        agent.get([keys[2]])
    assert torch.equal(agent.get([keys[0]])[0], block(keys[0].sequence_hash, 2048))
    keys2 = [BlockKey(NS, 410 + i) for i in range(3)]
    ps = agent.put([(k, block(k.sequence_hash, 2048)) for k in keys2], "cold")
    key = f"kv/cold/{agent.catalog.catalog_id()}/seg-{ps[0].segment_id:012d}"
    body = bytearray(c.get_object(Bucket=desc.bucket, Key=key)["Body"].read())
    body[ps[1].offset + 7] ^= 0x01
    c.put_object(Bucket=desc.bucket, Key=key, Body=bytes(body))
    with pytest.raises(ChecksumMismatchError):
        agent.get(keys2)  # new tensors: views of the read buffer, verified all the same
    assert agent.exists(keys2) == [True, False, True]


def test_same_hash_under_odd_model_names_stays_distinct(agent: StorageAgent, local_s3: LocalS3) -> None:
    """Case C13: odd model names / prefixes give distinct keys that round-trip the right bytes."""
    names = ["org/model_a", "org_model/a", "m-SEP-x", "m%2Fx", "m/x", "with space", "a+b", "a=b", "βeta", "n" * 900]
    items = [(BlockKey(n, 12345), block(i, 1000 + i)) for i, n in enumerate(names)]
    ps = agent.put(items, "cold")
    assert len({(p.key, p.offset) for p in ps}) == len(names)
    got = agent.get([BlockKey(n, 12345) for n in reversed(names)])
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, reversed(items)))
    # odd (single-token) volume ids and prefixes give valid, distinct, bounded object keys
    made = []
    for i, (vid, prefix) in enumerate([("org%2Fmodel_a", "org_model/a"), ("org_model%2Fa", "org/model_a"),
                                       ("βeta+=.", "p with space/%2F"), ("x" * 128, "y" * 600)]):
        agent.register_volume(s3vol(local_s3, vid=vid, prefix=prefix, bucket=f"kvadvisor-c13-{i}"))
        (p,) = agent.put([(BlockKey("c13", i), block(9000 + i, 4096))], vid)
        made.append((vid, f"kvadvisor-c13-{i}", p))
    keys = []
    for vid, bucket, p in made:
        (obj,) = objects(local_s3, bucket)
        assert len(obj.encode("utf-8")) <= MAX_OBJECT_KEY_BYTES
        keys.append(obj)
        assert torch.equal(agent.get([p.key])[0], block(9000 + int(p.key.sequence_hash), 4096))
    assert len(set(keys)) == len(keys)
    with pytest.raises(VolumeConfigError, match="prefix"):
        agent.register_volume(s3vol(local_s3, vid="long", prefix="z" * 900))


def test_lost_object_is_quarantined_and_the_block_stored_again(agent: StorageAgent, local_s3: LocalS3) -> None:
    """An object deleted behind the catalog's back (NoSuchKey): the entries are quarantined,
    the other blocks of the same get are unaffected, and a new put lands."""
    keep = [(BlockKey(NS, 700 + i), block(700 + i, 3000)) for i in range(2)]
    gone = [(BlockKey(NS, 710 + i), block(710 + i, 3000)) for i in range(2)]
    agent.put(keep, "cold")
    ps = agent.put(gone, "cold")
    bucket = agent.volume("cold").bucket
    s3client(local_s3).delete_object(Bucket=bucket, Key=f"kv/cold/{agent.catalog.catalog_id()}/seg-{ps[0].segment_id:012d}")
    keys = [k for k, _ in keep + gone]
    with pytest.raises(SegmentMissingError, match="2 block"):
        agent.get(keys)
    assert agent.exists(keys) == [True, True, False, False]
    assert agent.counters.segments_missing == 2
    got = agent.get(keys[:2])
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, keep))
    (p,) = agent.put(gone[:1], "cold")
    assert p.segment_id != ps[0].segment_id and torch.equal(agent.get([gone[0][0]])[0], gone[0][1])


def test_truncated_object_quarantines_the_blocks_past_its_end(
    agent: StorageAgent, local_s3: LocalS3, tmp_path: Path,
) -> None:
    """An object overwritten with fewer bytes behind the catalog's back: the blocks past
    its new end are quarantined (SegmentTruncatedError), the block still inside reads.

    A ranged GET past an object's end answers the bytes there are (206), and NIXL OBJ does
    not report the short body: the bytes past it are whatever the buffer held, so the
    check that catches it is the checksum, and the segment's size then says why."""
    items = [(BlockKey(NS, 720 + i), block(720 + i, 3000)) for i in range(3)]
    ps = agent.put(items, "cold")
    assert len({p.segment_id for p in ps}) == 1
    bucket = agent.volume("cold").bucket
    key = f"kv/cold/{agent.catalog.catalog_id()}/seg-{ps[0].segment_id:012d}"
    c = s3client(local_s3)
    body = c.get_object(Bucket=bucket, Key=key)["Body"].read()
    c.put_object(Bucket=bucket, Key=key, Body=body[:3500])  # block 0 whole, 1 cut, 2 gone
    keys = [k for k, _ in items]
    # a reader in another process: its buffers never held these bytes
    with StorageAgent(agent.catalog, name=f"test-s3-reader-{tmp_path.name}") as reader:
        reader.register_volume(agent.volume("cold"))
        with pytest.raises(SegmentTruncatedError, match="2 block"):
            reader.get(keys)
        assert reader.counters.quarantined == 2 and reader.counters.checksum_mismatches == 0
    assert agent.exists(keys) == [True, False, False]
    assert [r for _, r in agent.catalog.quarantined()] == ["segment truncated on read"] * 2  # type: ignore[attr-defined]
    assert torch.equal(agent.get(keys[:1])[0], items[0][1])


def test_s3_descriptor_errors(agent: StorageAgent, local_s3: LocalS3) -> None:
    with pytest.raises(VolumeConfigError, match="both"):
        agent.register_volume(s3vol(local_s3, vid="half", access_key=None, secret_key="only-secret"))
    with pytest.raises(VolumeConfigError, match="unreachable|bucket"):
        d = s3vol(local_s3, vid="dead")
        agent.register_volume(VolumeDescriptor(
            d.id, d.kind, d.media, d.capacity_bytes, endpoint="http://127.0.0.1:9", bucket=d.bucket,
            access_key="a", secret_key="b",
        ))


def test_s3_throughput_100_blocks_of_64k(agent: StorageAgent, capsys: pytest.CaptureFixture[str]) -> None:
    items = [(BlockKey("tp", i), block(i, 64 << 10)) for i in range(100)]
    t0 = time.perf_counter()
    agent.put(items, "cold")
    t1 = time.perf_counter()
    got = agent.get([k for k, _ in items])
    t2 = time.perf_counter()
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, items))
    mb = 100 * 64 / 1024
    with capsys.disabled():
        print(f"\n[s3/moto] 100 x 64 KiB: put {mb / (t1 - t0):.0f} MB/s, get {mb / (t2 - t1):.0f} MB/s")
