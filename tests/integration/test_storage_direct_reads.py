"""Reads that land straight in the destination: POSIX pieces, blocks larger than a piece
(streamed XXH3), caller buffers kept registered with NIXL (``DramRegions``), and large S3
blocks read with one ranged GET each.  Real NIXL POSIX on files under tmp_path, real
NIXL OBJ against moto_server."""

from __future__ import annotations

import itertools
from pathlib import Path

import boto3
import numpy as np
import pytest
import torch

from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    ChecksumMismatchError,
    LocalS3,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
)
from storage_backends import nixl_engine

NS = "direct-reads-0123"
_buckets = itertools.count()


def block(h: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x40]))


@pytest.fixture
def agent(tmp_path: Path) -> StorageAgent:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"direct-{tmp_path.name}")
    a.register_volume(VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 1 << 30, root=str(tmp_path / "fast")))
    yield a
    a.close()
    cat.close()


@pytest.mark.parametrize("aside", [False, True], ids=["verify-inline", "verify-aside"])
def test_blocks_larger_than_a_piece_are_hashed_in_chunks(agent: StorageAgent, aside: bool) -> None:
    """Also with the pieces hashed on the verifier thread while the next one is read
    (``verify_aside``): the streamed hashes of a block spread over pieces stay in order."""
    agent.verify_aside = aside
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    vol._nowait = False  # the NIXL-only path (O_DIRECT, or a kernel without RWF_NOWAIT)
    vol.read_piece_bytes = 64 << 10  # blocks of up to 5 pieces, and pieces of many small blocks
    sizes = [300_000, 1, 65_536, 65_537, 4096, 131_072, 7]
    items = [(BlockKey(NS, i), block(i, sizes[i % len(sizes)])) for i in range(21)]
    ps = agent.put(items, "fast")
    keys = [k for k, _ in items]
    order = keys[::-1]  # a request order unlike the file order
    got = agent.get(order)
    assert [g.numel() for g in got] == [sizes[k.sequence_hash % len(sizes)] for k in order]
    assert all(torch.equal(g, block(k.sequence_hash, g.numel())) for g, k in zip(got, order))
    outs = [torch.empty(p.length, dtype=torch.uint8) for p in ps]
    assert all(r is o for r, o in zip(agent.get(keys, out=outs), outs))
    assert all(torch.equal(o, t) for o, (_, t) in zip(outs, items))
    assert (agent.counters.verified_aside > 0) is aside
    # one bit flipped in the 4th 64 KiB chunk of block 7 (300 000 bytes): the streamed hash sees it
    flip(vol.path(ps[7].segment_id), ps[7].offset + 3 * 65_536 + 5)
    agent.close()
    fresh = StorageAgent(agent.catalog, name="direct-fresh")
    try:
        fresh.register_volume(agent.volume("fast"))
        fresh._vol("fast").read_piece_bytes = 64 << 10  # type: ignore[attr-defined]
        fresh.verify_aside = aside
        with pytest.raises(ChecksumMismatchError, match="1 block"):
            fresh.get(keys[5:10])
        with pytest.raises(BlockNotFoundError):
            fresh.get([keys[7]])
        rest = keys[:7] + keys[8:]
        assert all(torch.equal(g, t) for g, (_, t) in zip(fresh.get(rest), items[:7] + items[8:]))
        assert fresh.counters.quarantined == 1
    finally:
        fresh.close()


def test_out_views_of_one_pool_need_one_registration_and_are_merged(agent: StorageAgent) -> None:
    n, size = 32, 8192
    items = [(BlockKey(NS, 100 + i), block(100 + i, size)) for i in range(n)]
    agent.put(items, "fast")
    keys = [k for k, _ in items]
    pool = torch.zeros(n + 4, size // 2, dtype=torch.bfloat16)  # a host pool of KV slots
    eng = agent._vol("fast").engine  # type: ignore[attr-defined]
    before = eng.dram.registrations
    slots = [pool[i + 2] for i in range(n)]  # consecutive slots: one descriptor per piece
    agent.get(keys, out=slots)
    assert eng.dram.registrations == before + 1  # the pool's storage, once
    assert all(torch.equal(s.view(torch.uint8), t) for s, (_, t) in zip(slots, items))
    pool.zero_()
    shuffled = [pool[(7 * i) % (n + 4)] for i in range(n)]  # slots out of order
    agent.get(keys, out=shuffled)
    assert eng.dram.registrations == before + 1
    assert all(torch.equal(s.view(torch.uint8), t) for s, (_, t) in zip(shuffled, items))


def test_overlapping_caller_buffers_are_registered_as_their_union(agent: StorageAgent) -> None:
    items = [(BlockKey(NS, 200 + i), block(200 + i, 4096)) for i in range(3)]
    agent.put(items, "fast")
    keys = [k for k, _ in items]
    raw = bytearray(64 << 10)
    # three storages over one buffer: [0, 12k), [8k, 20k) overlaps it, [40k, 44k) apart
    a = torch.frombuffer(raw, dtype=torch.uint8, count=3 * 4096, offset=0)
    b = torch.frombuffer(raw, dtype=torch.uint8, count=3 * 4096, offset=8192)
    c = torch.frombuffer(raw, dtype=torch.uint8, count=4096, offset=40960)
    eng = agent._vol("fast").engine  # type: ignore[attr-defined]
    n0 = len(eng.dram)
    agent.get(keys, out=[a[0:4096], a[4096:8192], c])
    assert len(eng.dram) == n0 + 2
    agent.get(keys, out=[b[8192:12288], b[0:4096], c])  # b's storage overlaps a's: one union region
    assert len(eng.dram) == n0 + 2
    data = np.frombuffer(raw, dtype=np.uint8)
    assert bytes(data[8192 + 8192 : 8192 + 12288]) == bytes(items[0][1].numpy())
    assert bytes(data[8192 : 8192 + 4096]) == bytes(items[1][1].numpy())
    agent.get(keys, out=[a[0:4096], a[8192:12288], b[4096:8192]])  # both still covered: no new region
    assert len(eng.dram) == n0 + 2
    assert bytes(data[0:4096]) == bytes(items[0][1].numpy())
    assert bytes(data[8192:12288]) == bytes(items[1][1].numpy()) == bytes(data[12288 - 4096 : 12288])


def test_registration_cache_starts_over_when_full(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(nixl_engine, "_MAX_DRAM_REGIONS", 3)
    items = [(BlockKey(NS, 300 + i), block(300 + i, 1000)) for i in range(4)]
    agent.put(items, "fast")
    keys = [k for k, _ in items]
    eng = agent._vol("fast").engine  # type: ignore[attr-defined]
    for _ in range(3):  # 4 fresh tensors per call: more than the cache holds
        outs = [torch.empty(1000, dtype=torch.uint8) for _ in keys]
        agent.get(keys, out=outs)
        assert all(torch.equal(o, t) for o, (_, t) in zip(outs, items))
        assert len(eng.dram) <= 3 + len(keys)


# ---------------------------------------------------------------------------- S3
@pytest.fixture
def s3agent(tmp_path: Path, local_s3: LocalS3) -> StorageAgent:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"direct-s3-{tmp_path.name}")
    a.register_volume(VolumeDescriptor(
        "cold", VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=local_s3.endpoint,
        bucket=f"kvadvisor-direct-{next(_buckets)}", prefix="kv", segment_bytes=3 << 20,
        access_key=local_s3.access_key, secret_key=local_s3.secret_key))
    yield a
    a.close()
    cat.close()


def test_large_s3_blocks_are_read_straight_into_the_destination(s3agent: StorageAgent, local_s3: LocalS3) -> None:
    vol = s3agent._vol("cold")  # type: ignore[attr-defined]
    vol.direct_min_bytes = 1 << 20
    items = [(BlockKey(NS, 400 + i), block(400 + i, (1 << 20) + 4096 * i)) for i in range(5)]
    ps = s3agent.put(items, "cold")
    assert len({p.segment_id for p in ps}) == 3  # 3 MiB segments: blocks 0-1, 2-3, 4
    keys = [k for k, _ in items]
    gets = vol.counters.extra.get("ranged_gets", 0)
    got = s3agent.get(keys[::-1])
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, items[::-1]))
    assert vol.counters.extra["ranged_gets"] == gets + 5  # one ranged GET per block, in one transfer
    outs = [torch.empty(p.length, dtype=torch.uint8) for p in ps]
    s3agent.get(keys, out=outs)
    assert all(torch.equal(o, t) for o, (_, t) in zip(outs, items))
    # small blocks keep the coalesced staging path: one GET for the whole segment
    small = [(BlockKey(NS, 500 + i), block(500 + i, 5000)) for i in range(6)]
    s3agent.put(small, "cold")
    gets = vol.counters.extra["ranged_gets"]
    assert all(torch.equal(g, t) for g, (_, t) in zip(s3agent.get([k for k, _ in small]), small))
    assert vol.counters.extra["ranged_gets"] == gets + 1
    # a flipped byte of block 2, read straight into out: the get raises, the copy is quarantined
    c = boto3.client("s3", endpoint_url=local_s3.endpoint, aws_access_key_id=local_s3.access_key,
                     aws_secret_access_key=local_s3.secret_key, region_name="us-east-1")
    key = vol.key(ps[2].segment_id)
    body = bytearray(c.get_object(Bucket=vol.desc.bucket, Key=key)["Body"].read())
    body[ps[2].offset + 777] ^= 0x01
    c.put_object(Bucket=vol.desc.bucket, Key=key, Body=bytes(body))
    with pytest.raises(ChecksumMismatchError, match="quarantined"):
        s3agent.get(keys, out=outs)
    assert s3agent.exists(keys) == [True, True, False, True, True]
    assert s3agent.counters.quarantined == 1


def test_one_piece_spanning_many_segments(tmp_path: Path) -> None:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="direct-multi") as a:
        vol = a.register_volume(VolumeDescriptor("small", VolumeKind.POSIX, MediaClass.SSD, 1 << 30,
                                                 root=str(tmp_path / "s"), segment_bytes=10_000))
        items = [(BlockKey(NS, 600 + i), block(600 + i, 3000 + i)) for i in range(12)]
        ps = a.put(items, "small")
        assert len({p.segment_id for p in ps}) == 4
        order = [items[i] for i in (11, 0, 5, 6, 1, 10, 2, 9, 3, 8, 4, 7)]
        before = vol.counters.bytes_read
        got = a.get([k for k, _ in order])  # one batch, one piece, one transfer over 4 files
        assert all(torch.equal(g, t) for g, (_, t) in zip(got, order))
        assert vol.counters.bytes_read - before == sum(p.length for p in ps)
        assert vol.counters.blocks_read == 12
    cat.close()


def test_overlapping_destinations_fall_back_to_verify_then_copy(agent: StorageAgent) -> None:
    a_item, b_item = (BlockKey(NS, 700), block(700, 4096)), (BlockKey(NS, 701), block(701, 4096))
    agent.put([a_item, b_item], "fast")
    shared = torch.empty(4096, dtype=torch.uint8)
    # two different blocks into one tensor (a caller bug): read in place, the second would
    # overwrite the first before it is hashed; both must verify and nothing be quarantined
    res = agent.get([a_item[0], b_item[0]], out=[shared, shared])
    assert res[0] is shared and torch.equal(shared, b_item[1])
    assert agent.counters.quarantined == 0 and agent.exists([a_item[0], b_item[0]]) == [True, True]


def test_blocks_of_one_size_over_many_pieces_flag_exactly_the_bad_one(agent: StorageAgent) -> None:
    """The one-length fast path of the piece verifier (chunk k is block k): a corrupted
    block in the middle of a later piece is the one quarantined, every other one reads."""
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    vol.read_piece_bytes = 3 * 4096  # 3 blocks a piece: 7 pieces for 20 blocks
    keys = [BlockKey(NS, 500 + i) for i in range(20)]
    ps = agent.put([(k, block(500 + i, 4096)) for i, k in enumerate(keys)], "fast")
    assert len({p.segment_id for p in ps}) == 1
    outs = [torch.empty(4096, dtype=torch.uint8) for _ in keys]
    agent.get(keys, out=outs)
    assert all(torch.equal(o, block(500 + i, 4096)) for i, o in enumerate(outs))
    flip(vol.path(ps[13].segment_id), ps[13].offset + 17)
    vol.close()  # drop the cached fd: the next read opens the file again
    with pytest.raises(ChecksumMismatchError, match="1 block"):
        agent.get(keys, out=outs)
    assert agent.exists(keys) == [i != 13 for i in range(20)]
    rest = [k for i, k in enumerate(keys) if i != 13]
    got = agent.get(rest)
    assert all(torch.equal(g, block(500 + i, 4096)) for g, i in zip(got, [i for i in range(20) if i != 13]))
