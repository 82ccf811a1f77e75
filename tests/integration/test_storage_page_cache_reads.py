"""Page-cache reads of POSIX volumes: what the OS holds in memory is copied with
``preadv2(RWF_NOWAIT)`` in groups hashed at once, the rest is read by NIXL POSIX.  Real
files under tmp_path (ext4 here), real NIXL; pages are evicted with POSIX_FADV_DONTNEED
(the segments are fsync-ed by ``put``, so their pages are clean and really go)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    ChecksumMismatchError,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    VolumeDescriptor,
    VolumeKind,
)
from storage_backends import posix_volume

NS = "page-cache-0123"
MiB = 1 << 20


def block(h: int, nbytes: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)


def evict(path: Path, offset: int = 0, length: int = 0) -> None:
    """Drop ``length`` bytes at ``offset`` of a (clean) file from the page cache (0: to the
    end).  The kernel drops only whole folios inside the range, and ext4 caches large
    writes in folios of up to 2 MiB: the tests evict 2 MiB-aligned windows."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class Reads:
    """Counts the NIXL reads of a volume (calls and bytes) while passing them through."""

    def __init__(self, vol: posix_volume.PosixVolume, monkeypatch: pytest.MonkeyPatch) -> None:
        self.calls = 0
        self.bytes = 0
        orig = vol.read_direct

        def counted(segments, offsets, lengths, addrs):  # type: ignore[no-untyped-def]
            self.calls += 1
            self.bytes += int(lengths.sum())
            return orig(segments, offsets, lengths, addrs)

        monkeypatch.setattr(vol, "read_direct", counted)


@pytest.fixture
def agent(tmp_path: Path) -> StorageAgent:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"pagecache-{tmp_path.name}")
    a.register_volume(VolumeDescriptor("v", VolumeKind.POSIX, MediaClass.NVME, 1 << 32, root=str(tmp_path / "v")))
    yield a
    a.close()
    cat.close()


def cached_bytes(vol: posix_volume.PosixVolume) -> int:
    return vol.counters.extra.get("bytes_read_cached", 0)


def test_a_hot_get_is_copied_from_the_page_cache_without_nixl(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, i), block(i, 64 << 10)) for i in range(48)]  # 3 MiB: three groups
    agent.put(items, "v")
    nixl = Reads(vol, monkeypatch)
    outs = [torch.empty(64 << 10, dtype=torch.uint8) for _ in items]
    got = agent.get([k for k, _ in items], out=outs)
    assert all(g is o for g, o in zip(got, outs))
    assert [torch.equal(o, t) for o, (_, t) in zip(outs, items)] == [True] * 48
    assert (nixl.calls, cached_bytes(vol)) == (0, 48 << 16)
    assert vol.counters.bytes_read == 48 << 16 and vol.counters.blocks_read == 48


def test_a_cold_get_goes_through_nixl(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, 100 + i), block(100 + i, 256 << 10)) for i in range(32)]  # 8 MiB
    ps = agent.put(items, "v")
    for seg in {p.segment_id for p in ps}:
        evict(vol.path(seg))
    nixl = Reads(vol, monkeypatch)
    got = agent.get([k for k, _ in items])
    assert [torch.equal(g, t) for g, (_, t) in zip(got, items)] == [True] * 32
    # the first piece at least missed the cache (readahead may bring later ones in)
    assert nixl.calls >= 1 and nixl.bytes >= 4 * MiB
    assert nixl.bytes + cached_bytes(vol) == 8 * MiB  # every byte read once, by one of the two


def test_a_partly_cached_segment_reads_each_part_its_way(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, 200 + i), block(200 + i, 64 << 10)) for i in range(160)]  # 10 MiB
    ps = agent.put(items, "v")
    assert len({p.segment_id for p in ps}) == 1
    assert ps[64].offset == 4 * MiB
    evict(vol.path(ps[64].segment_id), 4 * MiB, 2 * MiB)  # the pages of blocks 64..95 go
    nixl = Reads(vol, monkeypatch)
    got = agent.get([k for k, _ in items])
    assert [torch.equal(g, t) for g, (_, t) in zip(got, items)] == [True] * 160
    assert nixl.calls >= 1 and cached_bytes(vol) >= 64 << 16  # the blocks before the hole came from memory
    assert nixl.bytes + cached_bytes(vol) == 160 << 16
    assert agent.counters.read_retries == 0 and agent.counters.quarantined == 0


@pytest.mark.parametrize("size", [3 * MiB, 6 * MiB + 12_345], ids=["within-a-piece", "over-two-pieces"])
def test_blocks_larger_than_a_group_with_a_hole_keep_their_stream_in_order(
    agent: StorageAgent, monkeypatch: pytest.MonkeyPatch, size: int,
) -> None:
    """Blocks of several 1 MiB groups (and of two 4 MiB pieces): a miss in the middle of
    a chunk must not leave half a chunk in the block's streamed hash (a false mismatch
    would quarantine a good copy)."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, 300 + i), block(300 + i, size)) for i in range(3)]
    ps = agent.put(items, "v")
    assert len({p.segment_id for p in ps}) == 1 and ps[0].offset == 0
    # 2 MiB holes at 2, 8 and 12 MiB of the file: misses in the third 1 MiB group of a
    # chunk, after two groups of it were streamed (at 12 MiB, over two pieces: in the
    # second chunk of block 1, whose stream already holds the first chunk)
    for at in (2 * MiB, 8 * MiB, 12 * MiB):
        evict(vol.path(ps[0].segment_id), at, 2 * MiB)
    nixl = Reads(vol, monkeypatch)
    got = agent.get([k for k, _ in items])
    assert [torch.equal(g, t) for g, (_, t) in zip(got, items)] == [True] * 3
    assert nixl.calls >= 2 and cached_bytes(vol) > 0  # one NIXL read from each hole to the end of its piece
    # no false mismatch: none was read again alone (that re-read would hide it)
    assert agent.counters.read_retries == 0 and agent.counters.quarantined == 0
    assert agent.exists([k for k, _ in items]) == [True] * 3


def test_a_corrupt_byte_read_from_the_page_cache_is_caught_and_quarantined(agent: StorageAgent) -> None:
    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, 400 + i), block(400 + i, 64 << 10)) for i in range(8)]
    ps = agent.put(items, "v")
    with open(vol.path(ps[5].segment_id), "r+b") as f:  # through the page cache
        f.seek(ps[5].offset + 777)
        b = f.read(1)
        f.seek(ps[5].offset + 777)
        f.write(bytes([b[0] ^ 0x01]))
    with pytest.raises(ChecksumMismatchError, match="1 block"):
        agent.get([k for k, _ in items])
    assert cached_bytes(vol) > 0
    with pytest.raises(BlockNotFoundError):
        agent.get([items[5][0]])
    rest = items[:5] + items[6:]
    assert [torch.equal(g, t) for g, (_, t) in zip(agent.get([k for k, _ in rest]), rest)] == [True] * 7


def test_more_small_blocks_than_one_preadv_takes(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """2 048 blocks of 512 B fill one 1 MiB group: over the 1 024 buffers of one preadv."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, 1000 + i), block(1000 + i, 512)) for i in range(2500)]
    agent.put(items, "v")
    nixl = Reads(vol, monkeypatch)
    got = agent.get([k for k, _ in items])
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, items))
    assert (nixl.calls, cached_bytes(vol)) == (0, 2500 * 512)


def test_without_rwf_nowait_every_read_goes_through_nixl(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """A kernel or filesystem that refuses the flag (here: an unknown flag bit, EOPNOTSUPP
    from the real syscall) turns page-cache reads off for the volume; gets still work."""
    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, 500 + i), block(500 + i, 64 << 10)) for i in range(16)]
    agent.put(items, "v")
    monkeypatch.setattr(posix_volume, "_RWF_NOWAIT", 1 << 30)
    nixl = Reads(vol, monkeypatch)
    for _ in range(2):
        got = agent.get([k for k, _ in items])
        assert [torch.equal(g, t) for g, (_, t) in zip(got, items)] == [True] * 16
    assert cached_bytes(vol) == 0 and vol._nowait is False  # type: ignore[attr-defined]
    assert nixl.bytes == 2 * (16 << 16)


def test_o_direct_volumes_never_read_the_page_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    with StorageAgent(cat, name="pagecache-od") as a:
        vol = a.register_volume(VolumeDescriptor("od", VolumeKind.POSIX, MediaClass.NVME, 1 << 30,
                                                 root=str(tmp_path / "od"), o_direct=True, alignment=4096))
        items = [(BlockKey(NS, 600 + i), block(600 + i, 64 << 10)) for i in range(16)]
        a.put(items, "od")
        assert vol._direct  # type: ignore[attr-defined]  # ext4 takes O_DIRECT: no fallback
        outs = [torch.empty(64 << 10, dtype=torch.uint8) for _ in items]
        a.get([k for k, _ in items], out=outs)
        assert [torch.equal(o, t) for o, (_, t) in zip(outs, items)] == [True] * 16
        assert cached_bytes(vol) == 0 and vol.counters.bytes_read == 16 << 16  # type: ignore[attr-defined]
    cat.close()


def test_without_the_compiled_copy_loop_every_read_goes_through_nixl(
    agent: StorageAgent, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """When python-xxhash's XXH3 cannot be bound (``_readcore.available`` false: another
    build of the library), hot gets fall back to NIXL reads hashed in Python, same bytes."""
    from storage_backends import _readcore

    vol = agent._vol("v")  # type: ignore[attr-defined]
    items = [(BlockKey(NS, 700 + i), block(700 + i, 64 << 10)) for i in range(32)]
    agent.put(items, "v")
    monkeypatch.setattr(_readcore, "available", False)
    nixl = Reads(vol, monkeypatch)
    got = agent.get([k for k, _ in items])
    assert [torch.equal(g, t) for g, (_, t) in zip(got, items)] == [True] * 32
    assert (cached_bytes(vol), nixl.bytes) == (0, 32 << 16)
