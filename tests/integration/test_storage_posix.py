"""StorageAgent on POSIX volumes: real NIXL POSIX transfers on real files under tmp_path."""

from __future__ import annotations

import errno
import os
import time
from pathlib import Path

import pytest
import torch

from storage_backends import (
    BlockKey,
    BlockNotFoundError,
    ChecksumMismatchError,
    InvalidRequestError,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    StorageError,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeFullError,
    VolumeKind,
)

NS = "0123456789abcdef"


def block(h: int, nbytes: int, dtype: torch.dtype = torch.uint8) -> torch.Tensor:
    """Deterministic block content for sequence hash ``h`` (``nbytes`` bytes)."""
    g = torch.Generator().manual_seed(h % (1 << 62))
    raw = torch.randint(0, 256, (nbytes,), dtype=torch.uint8, generator=g)
    return raw.view(dtype) if dtype != torch.uint8 else raw


def posix(vid: str, root: Path, capacity: int = 1 << 30, media: MediaClass = MediaClass.NVME, **kw: object) -> VolumeDescriptor:
    return VolumeDescriptor(vid, VolumeKind.POSIX, media, capacity, root=str(root), **kw)  # type: ignore[arg-type]


@pytest.fixture
def agent(tmp_path: Path) -> StorageAgent:
    cat = SqliteCatalog(tmp_path / "catalog.sqlite")
    a = StorageAgent(cat, name=f"test-posix-{tmp_path.name}")
    a.register_volume(posix("fast", tmp_path / "fast"))
    yield a
    a.close()
    cat.close()


def test_round_trip_many_blocks_of_several_sizes_and_dtypes(agent: StorageAgent) -> None:
    sizes = [1, 100, 4096, 65536, 1000, 262144]
    items = []
    for i in range(60):
        n = sizes[i % len(sizes)]
        dtype = [torch.uint8, torch.float16, torch.bfloat16][i % 3] if n % 2 == 0 else torch.uint8
        items.append((BlockKey(NS, 1000 + i), block(1000 + i, n, dtype)))
    ps = agent.put(items, "fast")
    assert len({p.segment_id for p in ps}) == 1  # one segment, one transfer
    assert [p.key for p in ps] == [k for k, _ in items]
    assert [p.length for p in ps] == [t.numel() * t.element_size() for _, t in items]
    # packed back to back in input order
    assert [p.offset for p in ps] == [sum(x.length for x in ps[:i]) for i in range(len(ps))]
    got = agent.get([k for k, _ in reversed(items)])
    for g, (_, t) in zip(got, reversed(items)):
        assert g.dtype == torch.uint8 and torch.equal(g, t.contiguous().view(-1).view(torch.uint8))
    # into caller-provided tensors of the original dtype
    outs = [torch.empty_like(t) for _, t in items]
    res = agent.get([k for k, _ in items], out=outs)
    assert all(r is o for r, o in zip(res, outs))
    assert all(torch.equal(o.view(torch.uint8), t.view(torch.uint8)) for o, (_, t) in zip(outs, items))
    st = {s.volume_id: s for s in agent.stats()}["fast"]
    total = sum(p.length for p in ps)
    assert (st.blocks, st.live_bytes, st.used_bytes, st.dead_bytes, st.segments) == (60, total, total, 0, 1)
    assert st.writes == 60 and st.reads == 120


def test_put_splits_batches_into_segments_of_segment_bytes(tmp_path: Path) -> None:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="split") as a:
        a.register_volume(posix("v", tmp_path / "v", segment_bytes=10_000))
        ps = a.put([(BlockKey(NS, i), block(i, 4000)) for i in range(5)], "v")
        assert [p.segment_id for p in ps] == [ps[0].segment_id] * 2 + [ps[2].segment_id] * 2 + [ps[4].segment_id]
        assert len(a.segments("v")) == 3
    cat.close()


def test_put_skips_keys_already_stored(agent: StorageAgent) -> None:
    k1, k2 = BlockKey(NS, 1), BlockKey(NS, 2)
    (p1,) = agent.put([(k1, block(1, 500))], "fast")
    seg_files = sorted(os.listdir(agent._vol("fast").dir))  # type: ignore[attr-defined]
    # the same key again (even with other bytes) is not rewritten; duplicates in a batch stored once
    again = agent.put([(k1, block(99, 500)), (k2, block(2, 300)), (k2, block(2, 300))], "fast")
    assert again[0] == p1 and again[1] == again[2] and again[1].segment_id != p1.segment_id
    assert agent.counters.dedup_skipped == 1
    assert torch.equal(agent.get([k1])[0], block(1, 500))
    # everything already stored: no new segment at all
    agent.put([(k1, block(1, 500)), (k2, block(2, 300))], "fast")
    assert len(os.listdir(agent._vol("fast").dir)) == len(seg_files) + 1  # type: ignore[attr-defined]


def test_exists_locate_delete_and_empty_segment_removal(agent: StorageAgent) -> None:
    keys = [BlockKey(NS, i) for i in range(4)]
    ps = agent.put([(k, block(k.sequence_hash, 1024)) for k in keys], "fast")
    path = agent._vol("fast").path(ps[0].segment_id)  # type: ignore[attr-defined]
    assert path.exists()
    other = BlockKey("another-model", 0)  # same hash, other fingerprint namespace: another block
    assert agent.exists(keys + [other]) == [True] * 4 + [False]
    assert agent.locate([keys[2], other]) == [ps[2], None]
    with pytest.raises(BlockNotFoundError):
        agent.get([keys[0], other])
    assert agent.delete([keys[0], keys[2], BlockKey(NS, 77)]) == 2
    seg = agent.segments("fast")[0]
    assert (seg.live_blocks, seg.live_bytes, seg.dead_bytes) == (2, 2048, 2048)
    assert [torch.equal(g, block(k.sequence_hash, 1024)) for g, k in zip(agent.get([keys[1], keys[3]]), [keys[1], keys[3]])] == [True, True]
    assert agent.delete([keys[1], keys[3]]) == 2
    assert agent.segments("fast") == [] and not path.exists()
    assert agent.exists(keys) == [False] * 4


def test_corrupted_byte_is_detected_and_quarantined(agent: StorageAgent) -> None:
    keys = [BlockKey(NS, i) for i in range(4)]
    ps = agent.put([(k, block(i, 4096)) for i, k in enumerate(keys)], "fast")
    path = agent._vol("fast").path(ps[1].segment_id)  # type: ignore[attr-defined]
    with open(path, "r+b") as f:  # one flipped bit in block 1 and in block 3
        for p in (ps[1], ps[3]):
            f.seek(p.offset + 1234)
            b = f.read(1)
            f.seek(p.offset + 1234)
            f.write(bytes([b[0] ^ 0x01]))
    agent.close()  # drop cached fds/registrations; a fresh agent reads from disk
    fresh = StorageAgent(agent.catalog, name="fresh-reader")
    fresh.register_volume(agent.volume("fast"))
    try:
        # read straight into the caller's tensors: the mismatch raises (the contract: only a
        # normal return vouches for the bytes in ``out``)
        outs = [torch.full((4096,), 7, dtype=torch.uint8) for _ in range(2)]
        with pytest.raises(ChecksumMismatchError, match="1 block.*quarantined"):
            fresh.get([keys[0], keys[1]], out=outs)
        # and into a new buffer
        with pytest.raises(ChecksumMismatchError, match="quarantined"):
            fresh.get([keys[3]])
        for k in (keys[1], keys[3]):
            with pytest.raises(BlockNotFoundError):
                fresh.get([k])
        good = fresh.get([keys[0], keys[2]])
        assert torch.equal(good[0], block(0, 4096)) and torch.equal(good[1], block(2, 4096))
        assert fresh.counters.quarantined == 2 and fresh.counters.checksum_mismatches == 2
    finally:
        fresh.close()


def test_capacity_is_enforced_and_nothing_recorded(tmp_path: Path) -> None:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="cap") as a:
        a.register_volume(posix("small", tmp_path / "s", capacity=10_000))
        a.put([(BlockKey(NS, 1), block(1, 6000))], "small")
        with pytest.raises(VolumeFullError, match="capacity"):
            a.put([(BlockKey(NS, 2), block(2, 3000)), (BlockKey(NS, 3), block(3, 3000))], "small")
        assert a.exists([BlockKey(NS, 2), BlockKey(NS, 3)]) == [False, False]
        assert len(a.segments("small")) == 1 and len(os.listdir(a._vol("small").dir)) == 1  # type: ignore[attr-defined]
        a.put([(BlockKey(NS, 2), block(2, 4000))], "small")  # exactly full
    cat.close()


def test_descriptor_validation_errors(agent: StorageAgent, tmp_path: Path) -> None:
    bad = [
        (VolumeDescriptor("x", "tape", MediaClass.HDD, 100, root=str(tmp_path)), "unknown kind"),  # type: ignore[arg-type]
        (VolumeDescriptor("x", VolumeKind.POSIX, MediaClass.HDD, 100), "root"),
        (VolumeDescriptor("x", VolumeKind.S3, MediaClass.OBJECT, 100, bucket="b-1"), "endpoint"),
        (VolumeDescriptor("x", VolumeKind.S3, MediaClass.OBJECT, 100, endpoint="http://127.0.0.1:1"), "bucket"),
        (VolumeDescriptor("x", VolumeKind.S3, MediaClass.OBJECT, 100, endpoint="http://h:1", bucket="Bad_Bucket"), "bucket name"),
        (VolumeDescriptor("x", VolumeKind.S3, MediaClass.OBJECT, 100, endpoint="ftp://h", bucket="bkt"), "http"),
        (posix("x", tmp_path, capacity=0), "capacity"),
        (posix("x", tmp_path, capacity=-5), "capacity"),
        (posix("x", tmp_path, alignment=1000), "power of two"),
        (posix("", tmp_path), "non-empty"),
        (posix("x" * 200, tmp_path), "longer"),
        (VolumeDescriptor("x", VolumeKind.POSIX, "floppy", 100, root=str(tmp_path)), "media"),  # type: ignore[arg-type]
    ]
    for desc, msg in bad:
        with pytest.raises(VolumeConfigError, match=msg):
            agent.register_volume(desc)
    assert [v.id for v in agent.volumes()] == ["fast"]


def test_register_is_idempotent_and_conflicts_are_refused(agent: StorageAgent, tmp_path: Path) -> None:
    desc = agent.volume("fast")
    assert agent.register_volume(desc) is agent._vol("fast")  # type: ignore[attr-defined]
    with pytest.raises(VolumeConfigError, match="already registered"):
        agent.register_volume(posix("fast", tmp_path / "elsewhere"))
    # another process (another agent on the same catalog) with the same descriptor is fine ...
    other = StorageAgent(agent.catalog, name="other-proc")
    third = StorageAgent(agent.catalog, name="third-proc")
    try:
        assert other.register_volume(desc).desc == desc
        # ... but the same id for another place is refused, even from another agent
        with pytest.raises(VolumeConfigError, match="recorded in the catalog"):
            third.register_volume(posix("fast", tmp_path / "elsewhere"))
        assert third.volumes() == []
    finally:
        other.close()
        third.close()
    with pytest.raises(InvalidRequestError):
        agent.volume("nope")


def test_unregister_refuses_live_blocks_unless_drained(agent: StorageAgent) -> None:
    agent.put([(BlockKey(NS, 5), block(5, 100))], "fast")
    d = agent._vol("fast").dir  # type: ignore[attr-defined]
    with pytest.raises(StorageError, match="drain=True"):
        agent.unregister_volume("fast")
    assert agent.exists([BlockKey(NS, 5)]) == [True]
    agent.unregister_volume("fast", drain=True)
    assert agent.volumes() == [] and agent.exists([BlockKey(NS, 5)]) == [False]
    assert list(d.iterdir()) == []
    assert agent.catalog.volume_specs() == {}


def test_compaction_preserves_live_blocks_and_removes_the_old_segment(agent: StorageAgent) -> None:
    keys = [BlockKey(NS, i) for i in range(10)]
    ps = agent.put([(k, block(i, 3000 + i)) for i, k in enumerate(keys)], "fast")
    old_seg = ps[0].segment_id
    old_path = agent._vol("fast").path(old_seg)  # type: ignore[attr-defined]
    agent.delete(keys[::2])  # holes
    before = agent.segments("fast")[0]
    assert before.live_blocks == 5 and before.dead_bytes > 0
    moved = agent.compact("fast", old_seg)
    assert moved == 5
    assert not old_path.exists()
    segs = agent.segments("fast")
    assert len(segs) == 1 and segs[0].segment_id != old_seg
    assert segs[0].dead_bytes == 0 and segs[0].live_blocks == 5 and segs[0].sealed
    live = keys[1::2]
    locs = agent.locate(live)
    assert all(p is not None and p.segment_id == segs[0].segment_id and p.version == 1 for p in locs)
    assert [p.offset for p in locs if p] == sorted(p.offset for p in locs if p)  # order kept
    for k, g in zip(live, agent.get(live)):
        assert torch.equal(g, block(k.sequence_hash, 3000 + k.sequence_hash))
    assert agent.compact("fast", segs[0].segment_id) == 5  # a dense segment can be rewritten too


def test_commit_move_conflict_releases_the_new_copy(tmp_path: Path, agent: StorageAgent) -> None:
    agent.register_volume(posix("slow", tmp_path / "slow", media=MediaClass.HDD))
    k = BlockKey(NS, 42)
    (p,) = agent.put([(k, block(42, 5000))], "fast")
    new = agent.copy(p, "slow")
    assert new.volume_id == "slow" and new.version == p.version
    new_path = agent._vol("slow").path(new.segment_id)  # type: ignore[attr-defined]
    assert new_path.exists()
    agent.delete([k])  # a concurrent delete wins
    with pytest.raises(Exception) as ei:
        agent.commit_move(p, new)
    assert type(ei.value).__name__ == "VersionConflictError"
    assert not new_path.exists() and agent.segments("slow") == []


def test_o_direct_round_trip_and_misaligned_buffer_fallback(tmp_path: Path) -> None:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="odirect") as a:
        vol = a.register_volume(posix("od", tmp_path / "od", o_direct=True, alignment=4096))
        items = [(BlockKey(NS, i), block(i, 5000 + 7 * i)) for i in range(8)]
        ps = a.put(items, "od")
        assert all(p.offset % 4096 == 0 for p in ps)
        assert all(torch.equal(g, t) for g, (_, t) in zip(a.get([k for k, _ in items]), items))
        assert vol.counters.extra.get("o_direct_fallbacks", 0) == 0
        # C15: a buffer at an aligned address + 8 -> buffered fallback, bytes still right
        seg = cat.new_segment("od", 8192)
        with vol.engine.lock:
            buf = vol.engine.staging(8192 + 4096 + 8, 4096)[8 : 8 + 8192]
            buf.copy_(block(777, 8192))
            vol.write_segment(seg, buf, 8192)
            out = vol.engine.staging(8192, 4096)
            (view,) = vol.read(seg, [(0, 8192)], out)
            assert torch.equal(view, block(777, 8192))
        assert vol.counters.extra["o_direct_fallbacks"] == 1
    cat.close()


def test_fallocate_unsupported_falls_back_to_zero_fill(tmp_path: Path) -> None:
    def no_fallocate(fd: int, off: int, n: int) -> None:
        raise OSError(errno.EOPNOTSUPP, "fallocate not supported")

    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="nofalloc") as a:
        vol = a.register_volume(posix("z", tmp_path / "z", capacity=64 << 20, o_direct=True))
        vol.fallocate = no_fallocate  # type: ignore[attr-defined]
        big = block(5, (64 << 20) - 8192)
        ps = a.put([(BlockKey(NS, 5), big), (BlockKey(NS, 6), block(6, 100))], "z")
        assert vol.counters.extra["fallocate_fallbacks"] == 1
        assert ps[0].segment_id == ps[1].segment_id
        assert os.path.getsize(vol.path(ps[0].segment_id)) == a.segments("z")[0].size_bytes == (64 << 20) - 4096  # type: ignore[attr-defined]
        got = a.get([BlockKey(NS, 6), BlockKey(NS, 5)])
        assert torch.equal(got[0], block(6, 100)) and torch.equal(got[1], big)
    cat.close()


def test_enospc_from_preallocation_records_nothing(tmp_path: Path) -> None:
    def full(fd: int, off: int, n: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    cat = SqliteCatalog(tmp_path / "c.sqlite")
    with StorageAgent(cat, name="enospc") as a:
        vol = a.register_volume(posix("f", tmp_path / "f"))
        vol.fallocate = full  # type: ignore[attr-defined]
        with pytest.raises(VolumeFullError, match="no space"):
            a.put([(BlockKey(NS, i), block(i, 256 << 10)) for i in range(4)], "f")
        assert a.exists([BlockKey(NS, i) for i in range(4)]) == [False] * 4
        assert a.segments("f") == [] and list(vol.dir.iterdir()) == []  # type: ignore[attr-defined]
    cat.close()


def test_bad_requests_are_refused(agent: StorageAgent) -> None:
    with pytest.raises(InvalidRequestError):
        agent.put([(BlockKey(NS, 1), torch.empty(0))], "fast")
    with pytest.raises(InvalidRequestError):
        agent.put([(BlockKey(NS, 1), block(1, 10))], "nowhere")
    with pytest.raises(InvalidRequestError):
        agent.put([(BlockKey(NS, -1), block(1, 10))], "fast")
    agent.put([(BlockKey(NS, 1), block(1, 10))], "fast")
    with pytest.raises(InvalidRequestError, match="bytes"):
        agent.get([BlockKey(NS, 1)], out=[torch.empty(11, dtype=torch.uint8)])
    assert agent.exists([BlockKey(NS, 1)]) == [True]
    # no keys: nothing to read (the cluster mover tests read back an empty volume)
    assert agent.get([]) == []
    assert agent.get([], out=[]) == []


def test_throughput_100_blocks_of_64k(agent: StorageAgent, capsys: pytest.CaptureFixture[str]) -> None:
    items = [(BlockKey("tp", i), block(i, 64 << 10)) for i in range(100)]
    t0 = time.perf_counter()
    agent.put(items, "fast")
    t1 = time.perf_counter()
    got = agent.get([k for k, _ in items])
    t2 = time.perf_counter()
    assert all(torch.equal(g, t) for g, (_, t) in zip(got, items))
    mb = 100 * 64 / 1024
    with capsys.disabled():
        print(f"\n[posix] 100 x 64 KiB: put {mb / (t1 - t0):.0f} MB/s, get {mb / (t2 - t1):.0f} MB/s")


def test_copy_from_a_stale_placement_reads_the_new_one_and_cannot_commit(agent: StorageAgent, tmp_path: Path) -> None:
    agent.register_volume(posix("slow", tmp_path / "slow", media=MediaClass.HDD))
    keys = [BlockKey(NS, i) for i in range(3)]
    ps = agent.put([(k, block(i, 2000)) for i, k in enumerate(keys)], "fast")
    agent.compact("fast", ps[0].segment_id)  # the old segment file is gone now
    assert not agent._vol("fast").path(ps[0].segment_id).exists()  # type: ignore[attr-defined]
    new = agent.copy(ps[1], "slow")  # read retried at the current placement
    assert agent.counters.read_retries == 1
    assert torch.equal(agent.get([keys[1]])[0], block(1, 2000))
    with pytest.raises(Exception) as ei:
        agent.commit_move(ps[1], new)
    assert type(ei.value).__name__ == "VersionConflictError"
    assert agent.segments("slow") == []


def test_prometheus_export(agent: StorageAgent) -> None:
    from prometheus_client import CollectorRegistry, generate_latest

    from storage_backends import register_storage_metrics

    agent.put([(BlockKey(NS, 1), block(1, 1000)), (BlockKey(NS, 2), block(2, 500))], "fast")
    agent.delete([BlockKey(NS, 2)])
    reg = CollectorRegistry()
    register_storage_metrics(agent, reg)
    text = generate_latest(reg).decode()
    assert 'kvadvisor_storage_live_bytes{volume="fast"} 1000.0' in text
    assert 'kvadvisor_storage_dead_bytes{volume="fast"} 500.0' in text
    assert 'kvadvisor_storage_blocks_written_total{volume="fast"} 2.0' in text


@pytest.mark.parametrize("refused_at", ["create", "read"])
def test_a_filesystem_that_refuses_o_direct_falls_back_to_buffered_reads_too(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, refused_at: str,
) -> None:
    """A filesystem that refuses O_DIRECT opens (EINVAL; ext4 here accepts them, so the
    refusal is injected at ``os.open``): a segment created without it used to be opened
    with O_DIRECT again for reading, and the EINVAL escaped ``get`` as a bare OSError.
    Now the volume goes buffered for good and says so once."""
    from storage_backends import posix_volume

    real_open = os.open

    def refusing_open(path, flags, *args):  # type: ignore[no-untyped-def]
        if flags & posix_volume._O_DIRECT:
            raise OSError(errno.EINVAL, "Invalid argument (O_DIRECT refused)", str(path))
        return real_open(path, flags, *args)

    with StorageAgent(SqliteCatalog(tmp_path / "c.sqlite"), name=f"odref-{refused_at}") as a:
        vol = a.register_volume(posix("od", tmp_path / "od", o_direct=True, alignment=4096))
        items = [(BlockKey("odref", i), torch.full((8192,), i, dtype=torch.uint8)) for i in range(4)]
        if refused_at == "create":
            monkeypatch.setattr(posix_volume.os, "open", refusing_open)
        a.put(items, "od")
        if refused_at == "read":
            vol.close()  # forget the open segment files: the next get opens them again
            monkeypatch.setattr(posix_volume.os, "open", refusing_open)
        got = a.get([k for k, _ in items])
        assert [torch.equal(g, t) for g, (_, t) in zip(got, items)] == [True] * 4
        assert vol._direct is False  # type: ignore[attr-defined]
        assert vol.counters.extra.get("o_direct_fallbacks") == 1
        a.put([(BlockKey("odref", 9), torch.ones(100, dtype=torch.uint8))], "od")  # buffered from now on
        assert torch.equal(a.get([BlockKey("odref", 9)])[0], torch.ones(100, dtype=torch.uint8))
