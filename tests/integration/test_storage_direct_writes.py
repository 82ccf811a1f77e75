"""Puts written straight from the caller's tensors (their storages registered once with
NIXL, one descriptor per run contiguous in memory, XXH3 from the block's own memory),
and the cases that must take the staging path instead.  Real NIXL POSIX on files under
tmp_path, real NIXL OBJ against moto_server."""

from __future__ import annotations

import itertools
import os
from pathlib import Path

import pytest
import torch

from storage_backends import (
    BlockKey,
    LocalS3,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    TransferError,
    VolumeDescriptor,
    VolumeKind,
)

NS = "direct-writes-0123"
_buckets = itertools.count()


def pool(seed: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


@pytest.fixture
def agent(tmp_path: Path) -> StorageAgent:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"dw-{tmp_path.name}")
    a.register_volume(VolumeDescriptor("fast", VolumeKind.POSIX, MediaClass.NVME, 1 << 30, root=str(tmp_path / "fast"),
                                       segment_bytes=2 << 20))
    yield a
    a.close()
    cat.close()


def _direct(agent: StorageAgent, vid: str) -> int:
    return agent._vol(vid).counters.extra.get("direct_writes", 0)  # type: ignore[attr-defined]


def test_pool_blocks_are_written_from_the_pool_registered_once(agent: StorageAgent) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    bb = 64 << 10
    g2 = pool(1, 40 * bb)  # a host pool: blocks are views of one storage
    # blocks 0-15 consecutive (one run), then 20, 18, 19 (out of order), as dtype float32
    ids = [*range(16), 20, 18, 19]
    items = [(BlockKey(NS, i), g2[i * bb:(i + 1) * bb].view(torch.float32)) for i in ids]
    ps = agent.put(items, "fast")
    assert _direct(agent, "fast") == 1 and len({p.segment_id for p in ps}) == 1
    # the segment file holds the blocks back to back, in item order
    raw = vol.path(ps[0].segment_id).read_bytes()
    assert raw == b"".join(g2[i * bb:(i + 1) * bb].numpy().tobytes() for i in ids)
    assert [p.offset for p in ps] == [k * bb for k in range(len(ids))]
    got = agent.get([k for k, _ in items])
    assert all(torch.equal(g, g2[i * bb:(i + 1) * bb]) for g, i in zip(got, ids))
    # later puts from the same pool register nothing new
    regs = vol.engine.dram.registrations
    agent.put([(BlockKey(NS, 100 + i), g2[i * bb:(i + 1) * bb]) for i in range(21, 40)], "fast")
    assert vol.engine.dram.registrations == regs and _direct(agent, "fast") == 2
    assert all(torch.equal(g, g2[i * bb:(i + 1) * bb])
               for g, i in zip(agent.get([BlockKey(NS, 100 + i) for i in range(21, 40)]), range(21, 40)))


def test_non_contiguous_and_overlapping_blocks_go_through_staging(agent: StorageAgent) -> None:
    m = pool(2, 64 * 1024).view(256, 256)
    strided = [(BlockKey(NS, 200 + i), m[:, i]) for i in range(4)]  # columns: not contiguous
    ps = agent.put(strided, "fast")
    assert _direct(agent, "fast") == 0
    assert all(torch.equal(g, m[:, i].contiguous()) for i, g in enumerate(agent.get([k for k, _ in strided])))
    assert len({p.segment_id for p in ps}) == 1
    flat = pool(3, 4096)
    overlapping = [(BlockKey(NS, 300), flat[0:3000]), (BlockKey(NS, 301), flat[1000:4096])]
    agent.put(overlapping, "fast")
    assert _direct(agent, "fast") == 0
    got = agent.get([k for k, _ in overlapping])
    assert torch.equal(got[0], flat[0:3000]) and torch.equal(got[1], flat[1000:4096])


def test_o_direct_puts_direct_only_when_aligned(tmp_path: Path) -> None:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="dw-odirect") as a:
        vol = a.register_volume(VolumeDescriptor("od", VolumeKind.POSIX, MediaClass.NVME, 1 << 30,
                                                 root=str(tmp_path / "od"), o_direct=True, alignment=4096))
        big = torch.empty(64 << 10, dtype=torch.uint8)
        pad = (-big.data_ptr()) % 4096
        g = big[pad:pad + 8 * 4096]
        g.copy_(pool(4, 8 * 4096))
        a.put([(BlockKey(NS, 400 + i), g[i * 4096:(i + 1) * 4096]) for i in range(4)], "od")
        assert _direct(a, "od") == 1
        # 5000-byte blocks: lengths not aligned -> staging (padded offsets), no fallback
        odd = pool(5, 3 * 5000)
        items = [(BlockKey(NS, 410 + i), odd[i * 5000:(i + 1) * 5000]) for i in range(3)]
        ps = a.put(items, "od")
        assert _direct(a, "od") == 1 and all(p.offset % 4096 == 0 for p in ps)
        keys = [BlockKey(NS, 400 + i) for i in range(4)] + [k for k, _ in items]
        want = [g[i * 4096:(i + 1) * 4096] for i in range(4)] + [t for _, t in items]
        assert all(torch.equal(x, y) for x, y in zip(a.get(keys), want))
        assert vol.counters.extra.get("o_direct_fallbacks", 0) == 0
    cat.close()


def test_failed_direct_write_registers_nothing_and_leaves_no_file(agent: StorageAgent) -> None:
    vol = agent._vol("fast")  # type: ignore[attr-defined]
    orig = vol._write

    def broken(fd, path, local, size, before_piece=None):  # noqa: ANN001, ANN202
        os.pwrite(fd, b"x" * (size // 2), 0)
        raise TransferError("injected: the NIXL WRITE failed half way")

    vol._write = broken
    g2 = pool(6, 8 * 4096)
    items = [(BlockKey(NS, 500 + i), g2[i * 4096:(i + 1) * 4096]) for i in range(8)]
    with pytest.raises(TransferError) as ei:
        agent.put(items, "fast")
    assert ei.value.stored == [] and agent.exists([k for k, _ in items]) == [False] * 8
    assert vol.list_segments() == [] and agent.segments("fast") == []
    vol._write = orig
    agent.put(items, "fast")
    assert _direct(agent, "fast") == 1
    assert all(torch.equal(g, t) for g, (_, t) in zip(agent.get([k for k, _ in items]), items))


def test_s3_segment_of_one_contiguous_run_is_one_direct_put(tmp_path: Path, local_s3: LocalS3) -> None:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="dw-s3") as a:
        a.register_volume(VolumeDescriptor(
            "obj", VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=local_s3.endpoint,
            bucket=f"dw-{next(_buckets)}", access_key=local_s3.access_key, secret_key=local_s3.secret_key,
            segment_bytes=256 << 10))
        g2 = pool(7, 1 << 20)
        run = [(BlockKey(NS, 600 + i), g2[i * (64 << 10):(i + 1) * (64 << 10)]) for i in range(8)]
        ps = a.put(run, "obj")  # 2 segments of 4 consecutive blocks: 2 direct PUTs
        assert _direct(a, "obj") == 2 and len({p.segment_id for p in ps}) == 2
        scattered = [(BlockKey(NS, 700 + i), g2[j * (64 << 10):(j + 1) * (64 << 10)]) for i, j in enumerate([9, 12, 10])]
        a.put(scattered, "obj")  # not one run: staged
        assert _direct(a, "obj") == 2
        got = a.get([k for k, _ in run + scattered])
        assert all(torch.equal(x, t) for x, (_, t) in zip(got, run + scattered))
    cat.close()
