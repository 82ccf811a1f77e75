"""BlockManager without a storage tier: serve(), events, G2 onboarding, config, metrics
(cases C1, C10, C12)."""

from __future__ import annotations

import random

import numpy as np
import pytest
import torch

from event_plane import KVEvent, NullPublisher
from kvbm_runtime import (
    BlockManager,
    BlockMeta,
    CapacityConfigError,
    PoolExhaustedError,
    RuntimeConfig,
    StorageTierError,
    salt_hash,
    sequence_hashes,
)

PAGE = 4


class Capture:
    """A real NullPublisher whose flushed batches are collected in order."""

    def __init__(self) -> None:
        self.batches: list[list[KVEvent]] = []
        self.publisher = NullPublisher("unit-worker", on_flush=lambda batch, payload: self.batches.append(list(batch.events)))

    def raw(self) -> list[KVEvent]:
        self.publisher.flush()
        return [e for b in self.batches for e in b]

    def events(self) -> list[tuple[str, int, int | None, str]]:
        return [(e.type.name, e.sequence_hash, e.parent_hash, e.storage_location) for e in self.raw()]

    def clear(self) -> None:
        self.publisher.flush()
        self.batches.clear()


@pytest.fixture()
def cap() -> Capture:
    c = Capture()
    yield c
    c.publisher.close()


def config(**kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model_name": "unit/model",
        "num_layers": 2,
        "outer_dim": 2,
        "page_size": PAGE,
        "inner_dim": 8,
        "g1_blocks": 8,
        "g2_blocks": 32,
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


def kv_for(sequence_hash: int, shape: tuple[int, ...]) -> torch.Tensor:
    """Deterministic KV of a block, derived from its sequence hash."""
    gen = torch.Generator().manual_seed(sequence_hash & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randn(shape, generator=gen).to(torch.float16)


def kv_fill(sequence_hash: int, view: torch.Tensor) -> None:
    view.copy_(kv_for(sequence_hash, tuple(view.shape)))


def expected_bytes(mgr: BlockManager, h: int) -> torch.Tensor:
    return kv_for(h, mgr.layout_config.block_shape).contiguous().view(torch.uint8).reshape(-1)


def stores(events: list[tuple[str, int, int | None, str]], loc: str) -> list[tuple[int, int | None]]:
    return [(h, p) for t, h, p, l in events if t == "STORE" and l == loc]


def chain_pairs(hashes: list[int]) -> list[tuple[int, int | None]]:
    return [(h, hashes[i - 1] if i else None) for i, h in enumerate(hashes)]


# ---------------------------------------------------------------- serve and events


@pytest.mark.parametrize("layout", ["FullyContiguous", "LayerSeparated"])
def test_first_serve_computes_registers_and_offloads_in_order(cap: Capture, layout: str) -> None:
    mgr = BlockManager(config(layout=layout), cap.publisher)
    tokens = np.arange(1, 19, dtype=np.int64)  # 18 tokens: 4 full blocks + 2-token tail
    filled: list[int] = []

    def fill(h: int, view: torch.Tensor) -> None:
        filled.append(h)
        kv_fill(h, view)

    r = mgr.serve(tokens, fill)
    hashes = sequence_hashes(tokens, PAGE, mgr.salt)
    assert r.num_blocks == 4 and r.sequence_hashes == hashes and filled == hashes
    assert (r.hits_g1, r.hits_g2, r.hits_g3, r.hits_g4, r.computed) == (0, 0, 0, 0, 4)
    assert r.onboarded_bytes == 0 and r.offloaded_bytes == 4 * mgr.block_bytes and r.errors == []
    evs = cap.raw()
    assert [(e.type.name, e.sequence_hash, e.parent_hash, e.storage_location) for e in evs] == [
        ("STORE", h, p, "g1") for h, p in chain_pairs(hashes)
    ] + [("STORE", h, p, "g2") for h, p in chain_pairs(hashes)]
    assert all(e.prefix_hash == hashes[0] and e.block_size == mgr.block_bytes for e in evs)
    assert mgr.resident("g1") == mgr.resident("g2") == set(hashes)
    for h in hashes:
        assert torch.equal(mgr.read_block("g1", h), expected_bytes(mgr, h))
        assert torch.equal(mgr.read_block("g2", h), expected_bytes(mgr, h))
    st = mgr.stats()["pools"]
    assert st["g1"]["active"] == 0 and st["g1"]["inactive"] == 4  # handles released


def test_shared_prefix_hits_g1_and_computes_only_the_rest(cap: Capture) -> None:
    mgr = BlockManager(config(), cap.publisher)
    mgr.serve(list(range(1, 13)), kv_fill)  # 3 blocks
    cap.clear()
    filled: list[int] = []
    r = mgr.serve(list(range(1, 9)) + [50, 51, 52, 53, 54, 55, 56, 57], lambda h, v: (filled.append(h), kv_fill(h, v)))
    hashes = r.sequence_hashes
    assert (r.hits_g1, r.computed) == (2, 2) and filled == hashes[2:]
    assert cap.events() == [
        ("STORE", hashes[2], hashes[1], "g1"),
        ("STORE", hashes[3], hashes[2], "g1"),
        ("STORE", hashes[2], hashes[1], "g2"),
        ("STORE", hashes[3], hashes[2], "g2"),
    ]


def test_g2_hits_are_onboarded_with_their_bytes(cap: Capture) -> None:
    mgr = BlockManager(config(g1_blocks=5, g2_blocks=16), cap.publisher)
    a = list(range(1, 17))  # 4 blocks
    b = list(range(100, 120))  # 5 other blocks: evicts all of A from G1
    ra = mgr.serve(a, kv_fill)
    mgr.serve(b, kv_fill)
    assert mgr.resident("g1") == set(sequence_hashes(b, PAGE, mgr.salt))
    cap.clear()
    calls: list[int] = []
    r = mgr.serve(a + [7, 7, 7, 7], lambda h, v: (calls.append(h), kv_fill(h, v)))
    ha = ra.sequence_hashes
    assert (r.hits_g1, r.hits_g2, r.computed) == (0, 4, 1) and calls == [r.sequence_hashes[4]]
    assert r.onboarded_bytes == 4 * mgr.block_bytes
    for h in r.sequence_hashes:
        assert torch.equal(mgr.read_block("g1", h), expected_bytes(mgr, h))
    ev = cap.events()
    # the 5 G1 allocations evict the 5 B blocks; onboarded Stores come first, in order
    assert [e for e in ev if e[0] == "REMOVE"] == [
        ("REMOVE", h, p, "g1") for h, p in chain_pairs(sequence_hashes(b, PAGE, mgr.salt))
    ]
    assert stores(ev, "g1") == chain_pairs(r.sequence_hashes)
    assert stores(ev, "g2") == [(r.sequence_hashes[4], ha[3])]
    m = mgr.metrics
    assert m.sample("kvbm_onboard_blocks_h2d") == 4
    assert m.sample("kvbm_matched_tokens") == 16
    assert m.sample("kvbm_offload_blocks_d2h") == 4 + 5 + 1
    # lookups beyond G1 so far: 4 (A) + 5 (B) + 5 (A') blocks, 4 of them host hits
    assert m.sample("kvbm_host_cache_hit_rate") == pytest.approx(4 / 14)
    assert m.sample("kvbm_disk_cache_hit_rate") == 0.0


def test_offload_parent_is_sequence_predecessor_not_last_written(cap: Capture) -> None:
    """C1: H0, H1, H3 already in G2; offloading H0..H5 names H2←H1, H4←H3, H5←H4."""
    mgr = BlockManager(config(), cap.publisher)
    tokens = list(range(1, 25))  # H0..H5
    hs = sequence_hashes(tokens, PAGE, mgr.salt)
    metas = [BlockMeta(h, hs[i - 1] if i else None, hs[0], mgr.salt) for i, h in enumerate(hs)]
    for i in (0, 1, 3):
        (mb,) = mgr.g2.allocate(1)
        kv_fill(hs[i], mb.view())
        mgr.g2.register(mb.init_from(metas[i])).release()
    cap.clear()
    r = mgr.serve(tokens, kv_fill)
    assert (r.hits_g2, r.computed) == (2, 4)  # H0, H1 onboarded; H2 missing stops the prefix
    ev = cap.events()
    assert stores(ev, "g1") == chain_pairs(hs)
    assert stores(ev, "g2") == [(hs[2], hs[1]), (hs[4], hs[3]), (hs[5], hs[4])]
    # a fresh index seeded with H0, H1, H3 and fed the events links all 6
    known = {hs[0], hs[1], hs[3]}
    for t, h, p, _ in ev:
        assert p is None or p in known
        known.add(h)
    assert known == set(hs)


def test_partial_tail_is_never_registered(cap: Capture) -> None:
    """C10: 10 tokens → 2 Stores per tier; 2 more tokens → one Store whose parent is block 2."""
    mgr = BlockManager(config(), cap.publisher)
    tokens = list(range(40, 50))
    r = mgr.serve(tokens, kv_fill)
    h = r.sequence_hashes
    assert r.num_blocks == 2
    assert stores(cap.events(), "g1") == [(h[0], None), (h[1], h[0])]
    cap.clear()
    r2 = mgr.serve(tokens + [50, 51], kv_fill)
    assert r2.sequence_hashes[:2] == h and r2.hits_g1 == 2 and r2.computed == 1
    assert stores(cap.events(), "g1") == [(r2.sequence_hashes[2], h[1])]
    cap.clear()
    assert mgr.serve([1, 2, 3], kv_fill).num_blocks == 0  # no full block: nothing at all
    assert cap.events() == []
    assert len(mgr.resident("g1")) == 3


def test_domain_separation_of_lora_and_cache_salt(cap: Capture) -> None:
    """C12: LoRA "COLLIDE" vs cache salt "COLLIDE" differ at all 4 positions; ("ab","c") vs ("a","bc")."""
    tokens = list(range(1, 17))
    lora = BlockManager(config(lora_name="COLLIDE"), cap.publisher).serve(tokens, kv_fill).sequence_hashes
    salt = BlockManager(config(cache_salt="COLLIDE"), cap.publisher).serve(tokens, kv_fill).sequence_hashes
    plain = BlockManager(config(), cap.publisher).serve(tokens, kv_fill).sequence_hashes
    assert len(lora) == len(salt) == 4
    assert all(a != b for a, b in zip(lora, salt, strict=True))
    assert all(a != b for a, b in zip(lora, plain, strict=True))
    ab_c = BlockManager(config(lora_name="ab", cache_salt="c"), cap.publisher)
    a_bc = BlockManager(config(lora_name="a", cache_salt="bc"), cap.publisher)
    assert ab_c.salt != a_bc.salt
    assert all(x != y for x, y in zip(ab_c.sequence_hashes(tokens), a_bc.sequence_hashes(tokens), strict=True))
    # another model never shares hashes either
    other = BlockManager(config(model_name="unit/model-2"), cap.publisher)
    assert other.salt != salt_hash(BlockManager(config(), cap.publisher).fingerprint)
    assert other.namespace != BlockManager(config(), cap.publisher).namespace


def test_every_published_parent_was_published_before(cap: Capture) -> None:
    """Random prefix-sharing requests with evictions at both tiers."""
    mgr = BlockManager(config(g1_blocks=6, g2_blocks=10), cap.publisher)
    rng = random.Random(7)
    roots = [[rng.randrange(1000) for _ in range(24)] for _ in range(4)]
    for _ in range(40):
        root = rng.choice(roots)
        n = rng.randrange(1, 25)
        tokens = root[:n] + [rng.randrange(1000) for _ in range(rng.randrange(0, 6))]
        mgr.serve(tokens, kv_fill)
    seen: set[int] = set()
    live: dict[str, set[int]] = {"g1": set(), "g2": set()}
    for e in cap.raw():
        if e.type.name == "STORE":
            assert e.parent_hash is None or e.parent_hash in seen
            assert e.sequence_hash not in live[e.storage_location]  # one Store per live copy
            seen.add(e.sequence_hash)
            live[e.storage_location].add(e.sequence_hash)
        else:
            live[e.storage_location].remove(e.sequence_hash)  # Remove only of a live block
    assert live["g1"] == mgr.resident("g1") and live["g2"] == mgr.resident("g2")


# ---------------------------------------------------------------- errors and config


def test_request_longer_than_g1_is_refused_without_side_effects(cap: Capture) -> None:
    mgr = BlockManager(config(g1_blocks=2, g2_blocks=4), cap.publisher)
    with pytest.raises(PoolExhaustedError, match="3 full blocks but G1 holds only 2"):
        mgr.serve(list(range(12)), kv_fill)
    with pytest.raises(ValueError, match="32-bit"):
        mgr.serve([-1, 2, 3, 4], kv_fill)
    assert cap.events() == [] and mgr.resident("g1") == set()


def test_capacity_shrinking_from_g1_to_g2_is_refused(cap: Capture) -> None:
    with pytest.raises(CapacityConfigError, match="G1 has 64 blocks but G2 only 32"):
        BlockManager(config(g1_blocks=64, g2_blocks=32), cap.publisher)
    with pytest.raises(CapacityConfigError, match="G2 has 32 blocks but G3 only 16"):
        BlockManager(config(g1_blocks=8, g2_blocks=32, g3_blocks=16), cap.publisher)
    with pytest.raises(StorageTierError):
        BlockManager(config(), cap.publisher, None, "fast")


def test_config_from_env_and_kvbm_names(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("KVADVISOR_RUNTIME_G1_BLOCKS", "16")
    monkeypatch.setenv("KVADVISOR_RUNTIME_PAGE_SIZE", "8")
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS", "48")
    monkeypatch.setenv("DYN_KVBM_DISK_CACHE_GB", "0.001")
    cfg = RuntimeConfig()
    assert (cfg.g1_blocks, cfg.page_size, cfg.g2_blocks) == (16, 8, 48)
    assert cfg.g3_blocks == 1_000_000 // cfg.layout_config().block_bytes
    monkeypatch.delenv("DYN_KVBM_CPU_CACHE_OVERRIDE_NUM_BLOCKS")
    monkeypatch.setenv("DYN_KVBM_CPU_CACHE_GB", "0.0001")
    assert RuntimeConfig().g2_blocks == 100_000 // cfg.layout_config().block_bytes
    monkeypatch.setenv("KVADVISOR_RUNTIME_KV_DTYPE", "float64x")
    with pytest.raises(ValueError, match="unsupported KV dtype"):
        RuntimeConfig()


def test_failing_kv_fill_returns_every_block_and_publishes_nothing(cap: Capture) -> None:
    mgr = BlockManager(config(g1_blocks=4, g2_blocks=8), cap.publisher)
    mgr.serve(list(range(1, 5)), kv_fill)  # one block, inactive in G1
    cap.clear()
    calls: list[int] = []

    def broken(h: int, view: torch.Tensor) -> None:
        calls.append(h)
        if len(calls) == 2:
            raise RuntimeError("model step failed")
        kv_fill(h, view)

    with pytest.raises(RuntimeError, match="model step failed"):
        mgr.serve(list(range(1, 17)), broken)  # block 0 hits G1, blocks 1..3 computed
    st = mgr.g1.stats()
    assert (st.active, st.reset, st.inactive) == (0, 3, 1)
    assert cap.events() == []  # nothing of the failed request was registered
    r = mgr.serve(list(range(1, 17)), kv_fill)
    assert (r.hits_g1, r.computed) == (1, 3)
