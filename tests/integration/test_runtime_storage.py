"""BlockManager with a real NIXL storage agent: G3 (POSIX volume) and G4 (S3 volume on a
real HTTP endpoint) hits, write-through puts and their events, failed reads (cases C1, C17)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from event_plane import KVEvent, NullPublisher
from kvbm_runtime import BlockManager, RuntimeConfig, fill_synthetic_kv, synthetic_block_bytes
from storage_backends import StorageAgent
from storage_backends.local_s3 import LocalS3
from storage_backends.types import MediaClass, VolumeDescriptor, VolumeKind
from conftest import posix_agent

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

PAGE = 4


class Capture:
    """A real NullPublisher whose flushed batches are collected in order."""

    def __init__(self, source: str) -> None:
        self.batches: list[list[KVEvent]] = []
        self.publisher = NullPublisher(source, on_flush=lambda batch, payload: self.batches.append(list(batch.events)))

    def events(self) -> list[tuple[str, int, int | None, str]]:
        self.publisher.flush()
        return [(e.type.name, e.sequence_hash, e.parent_hash, e.storage_location) for b in self.batches for e in b]

    def clear(self) -> None:
        self.publisher.flush()
        self.batches.clear()


def config(**kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model_name": "it/model",
        "num_layers": 2,
        "outer_dim": 2,
        "page_size": PAGE,
        "inner_dim": 16,
        "g1_blocks": 8,
        "g2_blocks": 16,
        "disk_offload_filter": False,  # write-through to G3 on the first use
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    ag = posix_agent(tmp_path, "runtime-it", "fast")
    yield ag
    ag.close()


def manager(agent: StorageAgent, cap: Capture, volume: str = "fast", **kw: object) -> BlockManager:
    return BlockManager(config(**kw), cap.publisher, agent, volume)


def stores(events: list[tuple[str, int, int | None, str]], loc: str) -> list[tuple[int, int | None]]:
    return [(h, p) for t, h, p, l in events if t == "STORE" and l == loc]


def chain_pairs(hashes: list[int]) -> list[tuple[int, int | None]]:
    return [(h, hashes[i - 1] if i else None) for i, h in enumerate(hashes)]


def expected(mgr: BlockManager, h: int) -> torch.Tensor:
    return synthetic_block_bytes(h, mgr.layout_config.block_shape, mgr.layout_config.dtype)


def test_write_through_puts_once_and_a_new_worker_onboards_from_g3(agent: StorageAgent) -> None:
    cap_a, cap_b = Capture("worker-a"), Capture("worker-b")
    a = manager(agent, cap_a)
    tokens = list(range(1, 17))  # 4 blocks
    ra = a.serve(tokens, fill_synthetic_kv)
    hs = ra.sequence_hashes
    assert ra.stored_g3 == 4 and ra.offloaded_bytes == 8 * a.block_bytes
    ev = cap_a.events()
    assert [e[0] for e in ev] == ["STORE"] * 12
    assert stores(ev, "g1") == stores(ev, "g2") == stores(ev, "fast") == chain_pairs(hs)
    assert agent.exists([a.block_key(h) for h in hs]) == [True] * 4
    # serving again stores nothing new anywhere
    cap_a.clear()
    again = a.serve(tokens, fill_synthetic_kv)
    assert again.hits_g1 == 4 and again.stored_g3 == 0 and cap_a.events() == []

    # another worker (empty G1/G2) sharing the storage agent: 4 G3 hits, 1 computed
    b = manager(agent, cap_b)
    calls: list[int] = []
    rb = b.serve(tokens + [9, 9, 9, 9], lambda h, v: (calls.append(h), fill_synthetic_kv(h, v)))
    assert (rb.hits_g1, rb.hits_g2, rb.hits_g3, rb.hits_g4, rb.computed) == (0, 0, 4, 0, 1)
    assert calls == [rb.sequence_hashes[4]] and rb.errors == []
    assert rb.onboarded_bytes == 4 * b.block_bytes and rb.stored_g3 == 1
    for h in rb.sequence_hashes:
        assert torch.equal(b.read_block("g1", h), expected(b, h))
        assert torch.equal(b.read_block("g2", h), expected(b, h))
    ev = cap_b.events()
    assert stores(ev, "g1") == stores(ev, "g2") == chain_pairs(rb.sequence_hashes)
    assert stores(ev, "fast") == [(rb.sequence_hashes[4], hs[3])]
    m = b.metrics
    assert m.sample("kvbm_onboard_blocks_d2d") == 4 and m.sample("kvbm_onboard_blocks_h2d") == 0
    assert m.sample("kvbm_offload_blocks_h2d") == 1 and m.sample("kvbm_matched_tokens") == 16
    assert m.sample("kvbm_disk_cache_hit_rate") == pytest.approx(4 / 5)


def test_prefix_spans_g1_g2_g3_in_order(agent: StorageAgent) -> None:
    cap = Capture("worker-mix")
    mgr = manager(agent, cap, g1_blocks=8, g2_blocks=8)
    tokens = list(range(200, 216))  # a0..a3
    hs = mgr.serve(tokens, fill_synthetic_kv).sequence_hashes
    # leave a0 in G1, a0 + a1 in G2, everything in G3
    mgr.g1.evict()
    mgr.g2.match_blocks([hs[1]])[0].release()  # a1 used twice: survives the next eviction
    mgr.g2.match_blocks([hs[0]])[0].release()
    assert mgr.serve(tokens[:4], fill_synthetic_kv).hits_g2 == 1  # a0 back into G1
    assert mgr.g2.evict(2) == 2
    assert mgr.resident("g1") == {hs[0]} and mgr.resident("g2") == {hs[0], hs[1]}
    cap.clear()
    r = mgr.serve(tokens + [1, 2, 3, 4], fill_synthetic_kv)
    assert (r.hits_g1, r.hits_g2, r.hits_g3, r.hits_g4, r.computed) == (1, 1, 2, 0, 1)
    for h in r.sequence_hashes:
        assert torch.equal(mgr.read_block("g1", h), expected(mgr, h))
    ev = cap.events()
    assert stores(ev, "g1") == chain_pairs(r.sequence_hashes)[1:]
    assert stores(ev, "g2") == chain_pairs(r.sequence_hashes)[2:]
    assert stores(ev, "fast") == [(r.sequence_hashes[4], hs[3])]


def test_volume_stores_name_sequence_predecessor(agent: StorageAgent) -> None:
    """C1: H0, H1, H3 already on the volume; H2←H1, H4←H3, H5←H4 are the new Stores."""
    cap = Capture("worker-c1")
    mgr = manager(agent, cap)
    tokens = list(range(300, 324))
    hs = mgr.sequence_hashes(tokens)
    agent.put([(mgr.block_key(hs[i]), expected(mgr, hs[i])) for i in (0, 1, 3)], "fast")
    r = mgr.serve(tokens, fill_synthetic_kv)
    assert (r.hits_g3, r.computed, r.stored_g3) == (2, 4, 3)
    ev = cap.events()
    assert stores(ev, "fast") == [(hs[2], hs[1]), (hs[4], hs[3]), (hs[5], hs[4])]
    assert stores(ev, "g1") == stores(ev, "g2") == chain_pairs(hs)
    # an index seeded with H0, H1, H3 and fed these events links every block
    known = {hs[0], hs[1], hs[3]}
    for _, h, p, _ in ev:
        assert p is None or p in known
        known.add(h)
    assert known == set(hs)
    assert agent.exists([mgr.block_key(h) for h in hs]) == [True] * 6


def _segment_file(root: Path) -> Path:
    files = [p for p in root.rglob("*") if p.is_file() and p.stat().st_size > 0]
    assert len(files) == 1, files
    return files[0]


def test_failed_read_during_onboarding_stops_prefix_and_recomputes(agent: StorageAgent, tmp_path: Path) -> None:
    """C17: block 2 of 4 fails its checksum: blocks 0-1 load, 2-3 are recomputed, the error is recorded."""
    writer = manager(agent, Capture("writer"))
    tokens = list(range(400, 416))
    hs = writer.serve(tokens, fill_synthetic_kv).sequence_hashes
    (placement,) = agent.locate([writer.block_key(hs[2])])
    assert placement is not None and placement.volume_id == "fast"
    seg = _segment_file(tmp_path / "fast")
    with open(seg, "r+b") as f:  # flip one byte of block 2 on disk
        f.seek(placement.offset + 5)
        byte = f.read(1)
        f.seek(placement.offset + 5)
        f.write(bytes([byte[0] ^ 0xFF]))

    cap = Capture("reader")
    reader = manager(agent, cap)
    calls: list[int] = []
    r = reader.serve(tokens, lambda h, v: (calls.append(h), fill_synthetic_kv(h, v)))
    assert (r.hits_g3, r.computed) == (2, 2) and calls == hs[2:]
    assert [(e.position, e.sequence_hash, e.stage) for e in r.errors] == [(2, hs[2], "onboard")]
    assert "Checksum" in r.errors[0].error
    assert reader.metrics.sample("kvbm_onboard_errors") == 1
    for h in hs:  # nothing stale: every G1 block has the right bytes
        assert torch.equal(reader.read_block("g1", h), expected(reader, h))
    ev = cap.events()
    assert stores(ev, "g1") == stores(ev, "g2") == chain_pairs(hs)
    # the storage agent quarantined the bad copy, so the recomputed block 2 is put again
    assert stores(ev, "fast") == [(hs[2], hs[1])] and r.stored_g3 == 1
    assert torch.equal(agent.get([reader.block_key(hs[2])])[0], expected(reader, hs[2]))
    st = reader.stats()["pools"]["g1"]
    assert st["registered_hashes"] == 4 and st["reset"] == 8 - 4


def test_deleted_segment_during_onboarding_recomputes_everything(agent: StorageAgent, tmp_path: Path) -> None:
    writer = manager(agent, Capture("writer"))
    tokens = list(range(500, 512))
    hs = writer.serve(tokens, fill_synthetic_kv).sequence_hashes
    _segment_file(tmp_path / "fast").unlink()
    cap = Capture("reader")
    reader = manager(agent, cap)
    r = reader.serve(tokens, fill_synthetic_kv)
    assert (r.hits_g3, r.computed) == (0, 3)
    assert [(e.position, e.stage, e.error) for e in r.errors] == [(0, "onboard", "SegmentMissingError")]
    for h in hs:
        assert torch.equal(reader.read_block("g1", h), expected(reader, h))
    # the lost entries were quarantined, so the recomputed blocks are stored again and
    # published once each (the index holds what the volume holds)
    ev = cap.events()
    assert stores(ev, "fast") == chain_pairs(hs) and r.stored_g3 == 3
    assert agent.exists([reader.block_key(h) for h in hs]) == [True] * 3
    # every later worker onboards them from G3 instead of recomputing forever
    later = manager(agent, Capture("later"))
    r2 = later.serve(tokens, fill_synthetic_kv)
    assert (r2.hits_g3, r2.computed, r2.stored_g3, r2.errors) == (3, 0, 0, [])
    for h in hs:
        assert torch.equal(later.read_block("g1", h), expected(later, h))


def test_blocks_on_an_object_volume_count_as_g4_hits(agent: StorageAgent, local_s3: LocalS3, tmp_path: Path) -> None:
    import boto3

    bucket = f"kvadvisor-rt-{os.getpid()}-{tmp_path.name[-8:].lower().replace('_', '-')}"
    boto3.client(
        "s3",
        endpoint_url=local_s3.endpoint,
        aws_access_key_id=local_s3.access_key,
        aws_secret_access_key=local_s3.secret_key,
        region_name="us-east-1",
    ).create_bucket(Bucket=bucket)
    agent.register_volume(
        VolumeDescriptor(
            id="cold",
            kind=VolumeKind.S3,
            media=MediaClass.OBJECT,
            capacity_bytes=64 << 20,
            endpoint=local_s3.endpoint,
            bucket=bucket,
            prefix="rt",
            segment_bytes=1 << 20,
            access_key=local_s3.access_key,
            secret_key=local_s3.secret_key,
        )
    )
    cap_w = Capture("writer")
    writer = manager(agent, cap_w, volume="cold")
    tokens = list(range(600, 612))
    hs = writer.serve(tokens, fill_synthetic_kv).sequence_hashes
    assert stores(cap_w.events(), "cold") == chain_pairs(hs)
    reader = manager(agent, Capture("reader"))
    r = reader.serve(tokens, fill_synthetic_kv)
    assert (r.hits_g3, r.hits_g4, r.computed, r.stored_g3) == (0, 3, 0, 0)
    for h in hs:
        assert torch.equal(reader.read_block("g1", h), expected(reader, h))


def _removes(events: list[tuple[str, int, int | None, str]], loc: str) -> list[tuple[int, int | None]]:
    return [(h, p) for t, h, p, l in events if t == "REMOVE" and l == loc]


def test_a_failed_read_publishes_a_remove_for_every_copy_it_dropped(agent: StorageAgent, tmp_path: Path) -> None:
    """The catalog entries a failed onboarding read quarantines are announced (Remove at
    the volume, with the block's identity), before the recomputed blocks are stored again:
    an index fed by these events never keeps placing a block on a volume that lost it."""
    writer = manager(agent, Capture("writer"))
    tokens = list(range(600, 616))
    hs = writer.serve(tokens, fill_synthetic_kv).sequence_hashes
    placements = agent.locate([writer.block_key(h) for h in hs])
    seg = _segment_file(tmp_path / "fast")
    with open(seg, "r+b") as f:  # blocks 1 and 3 go bad: reading stops at 1, 3 is dropped too
        for p in (placements[1], placements[3]):
            assert p is not None
            f.seek(p.offset + 7)
            byte = f.read(1)
            f.seek(p.offset + 7)
            f.write(bytes([byte[0] ^ 0xFF]))
    cap = Capture("reader")
    reader = manager(agent, cap)
    r = reader.serve(tokens, fill_synthetic_kv)
    assert (r.hits_g3, r.computed) == (1, 3)
    ev = cap.events()
    dropped = [(hs[1], hs[0]), (hs[3], hs[2])]
    assert sorted(_removes(ev, "fast")) == sorted(dropped)
    # each Remove comes before the recomputed block's new Store at the volume
    order = [(t, h) for t, h, _, l in ev if l == "fast"]
    for h, _ in dropped:
        assert order.index(("REMOVE", h)) < order.index(("STORE", h))
    # the held ones are not announced gone
    assert not any(h in (hs[0], hs[2]) for h, _ in _removes(ev, "fast"))


def test_a_lost_segment_publishes_removes_for_all_its_blocks(agent: StorageAgent, tmp_path: Path) -> None:
    writer = manager(agent, Capture("writer"))
    tokens = list(range(700, 712))
    hs = writer.serve(tokens, fill_synthetic_kv).sequence_hashes
    _segment_file(tmp_path / "fast").unlink()
    cap = Capture("reader")
    manager(agent, cap).serve(tokens, fill_synthetic_kv)
    assert sorted(_removes(cap.events(), "fast")) == sorted(chain_pairs(hs))


def test_onboards_are_counted_per_volume_read_from_and_g2_residency_is_a_gauge(agent: StorageAgent, tmp_path: Path) -> None:
    import httpx
    from prometheus_client.parser import text_string_to_metric_families

    def parse_text(text: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
        return {(s.name, tuple(sorted(s.labels.items()))): s.value
                for fam in text_string_to_metric_families(text) for s in fam.samples}

    agent.register_volume(
        VolumeDescriptor("slow", VolumeKind.POSIX, MediaClass.HDD, 64 << 20, root=str(tmp_path / "slow"), segment_bytes=1 << 20)
    )
    t_fast, t_slow = list(range(1, 13)), list(range(101, 109))  # 3 and 2 blocks
    manager(agent, Capture("w-fast")).serve(t_fast, fill_synthetic_kv)
    manager(agent, Capture("w-slow"), volume="slow").serve(t_slow, fill_synthetic_kv)
    reader = manager(agent, Capture("reader"))
    assert reader.stats()["g2_resident_blocks"] == 0
    url = reader.metrics.serve_http(0)
    try:
        r1 = reader.serve(t_fast + [7], fill_synthetic_kv)
        r2 = reader.serve(t_slow + [7], fill_synthetic_kv)
        assert (r1.hits_g3, r1.computed, r2.hits_g3, r2.computed) == (3, 0, 2, 0)
        st = reader.stats()
        # each block counted at the volume it was read from
        assert st["onboarded_by_volume"] == {"fast": 3, "slow": 2}
        # onboarded blocks are offloaded to G2 behind the request: 5 resident
        assert st["g2_resident_blocks"] == 5 == st["pools"]["g2"]["registered_hashes"]
        page = parse_text(httpx.get(url, timeout=10).text)
    finally:
        reader.metrics.stop_http()
        reader.close()
    assert page[("kvbm_onboard_blocks_volume_total", (("volume", "fast"), ("worker", "reader")))] == 3
    assert page[("kvbm_onboard_blocks_volume_total", (("volume", "slow"), ("worker", "reader")))] == 2
    assert page[("kvbm_g2_resident_blocks", (("worker", "reader"),))] == 5
    assert page[("kvbm_onboard_storage_seconds_count", (("worker", "reader"),))] == 2
