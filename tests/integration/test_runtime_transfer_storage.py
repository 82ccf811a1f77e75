"""Transfer manager with a real NIXL storage agent (POSIX volume on tmp_path): the disk
admission filter through ``serve``, G3 → G1 through the host bounce buffer, step-gated
storage offloads."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from event_plane import KVEvent, NullPublisher
from kvbm_runtime import BlockManager, BlockMeta, RuntimeConfig, fill_synthetic_kv, synthetic_block_bytes
from kvbm_runtime.transfer import StepEvent, StorageOffloadItem, TransferPath
from storage_backends import StorageAgent
from conftest import posix_agent

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")


class Capture:
    def __init__(self, source: str) -> None:
        self.batches: list[list[KVEvent]] = []
        self.publisher = NullPublisher(source, on_flush=lambda b, _p: self.batches.append(list(b.events)))

    def stores(self, loc: str) -> list[int]:
        self.publisher.flush()
        return [e.sequence_hash for b in self.batches for e in b if e.type.name == "STORE" and e.storage_location == loc]


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    ag = posix_agent(tmp_path, "transfer-it", "fast")
    yield ag
    ag.close()


def config(**kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model_name": "it/transfer",
        "num_layers": 2,
        "outer_dim": 2,
        "page_size": 4,
        "inner_dim": 16,
        "g1_blocks": 8,
        "g2_blocks": 16,
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


def expected(mgr: BlockManager, h: int) -> torch.Tensor:
    return synthetic_block_bytes(h, mgr.layout_config.block_shape, mgr.layout_config.dtype)


def test_filter_on_by_default_writes_blocks_on_their_second_use(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    for name in ("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "KVADVISOR_RUNTIME_DISK_OFFLOAD_FILTER", "KVADVISOR_RUNTIME_DISABLE_DISK_OFFLOAD_FILTER"):
        monkeypatch.delenv(name, raising=False)
    cap = Capture("filtered")
    mgr = BlockManager(config(), cap.publisher, agent, "fast")
    assert mgr.config.offload_filter_enabled and mgr.disk_filter is not None
    tokens = list(range(1, 13))  # 3 blocks
    r1 = mgr.serve(tokens, fill_synthetic_kv)
    assert r1.stored_g3 == 0 and cap.stores("fast") == [] and cap.stores("g2") == r1.sequence_hashes
    assert agent.exists([mgr.block_key(h) for h in r1.sequence_hashes]) == [False] * 3
    # second use of the first two blocks (plus one new block, offered once)
    r2 = mgr.serve(tokens[:8] + [90, 91, 92, 93], fill_synthetic_kv)
    assert r2.hits_g1 == 2 and r2.stored_g3 == 2
    assert cap.stores("fast") == r1.sequence_hashes[:2]
    assert r2.offloaded_bytes == (1 + 2) * mgr.block_bytes  # 1 new G2 block + 2 G3 writes
    for h in r1.sequence_hashes[:2]:
        assert torch.equal(agent.get([mgr.block_key(h)])[0], expected(mgr, h))
    mgr.close()


def test_filter_disabled_by_kvbm_env_name(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    cfg = config()
    assert cfg.disk_offload_filter and not cfg.offload_filter_enabled
    mgr = BlockManager(cfg, Capture("unfiltered").publisher, agent, "fast")
    assert mgr.disk_filter is None
    assert mgr.serve(list(range(1, 13)), fill_synthetic_kv).stored_g3 == 3
    mgr.close()


def test_g3_to_g1_goes_through_the_bounce_buffer_for_layer_separated_g1(agent: StorageAgent) -> None:
    """A LayerSeparated G1 block is not one contiguous host region: no direct read path."""
    kw = {"layout": "LayerSeparated", "disk_offload_filter": False, "bounce_blocks": 2}
    writer = BlockManager(config(**kw), Capture("w").publisher, agent, "fast")
    tokens = list(range(100, 120))  # 5 blocks: 3 bounce-buffer rounds of 2
    hs = writer.serve(tokens, fill_synthetic_kv).sequence_hashes
    reader = BlockManager(config(**kw), Capture("r").publisher, agent, "fast")
    r = reader.serve(tokens, fill_synthetic_kv)
    assert (r.hits_g3, r.computed, r.errors) == (5, 0, [])
    assert reader.transfers.bounce_buffer().shape == (2, reader.block_bytes)
    for h in hs:
        assert torch.equal(reader.read_block("g1", h), expected(reader, h))
    assert reader.metrics.sample("kvbm_onboard_blocks_d2d") == 5
    writer.close()
    reader.close()


def test_storage_offload_waits_for_step_and_skips_blocks_evicted_meanwhile(agent: StorageAgent) -> None:
    cap = Capture("gated")
    mgr = BlockManager(config(disk_offload_filter=False), cap.publisher, agent, "fast")
    # three blocks registered in G1 only (as a forward pass would leave them)
    hs = mgr.sequence_hashes(list(range(200, 212)))
    g1 = mgr.g1
    metas: list[BlockMeta] = []
    handles = []
    for i, h in enumerate(hs):
        mb = g1.allocate(1)[0]
        fill_synthetic_kv(h, mb.view())
        meta = BlockMeta(h, hs[i - 1] if i else None, hs[0], mgr.salt)
        metas.append(meta)
        handles.append(g1.register(mb.init_from(meta)))
    step = StepEvent()
    items = [StorageOffloadItem(m, mgr.block_key(m.sequence_hash), (h.weak(),)) for m, h in zip(metas, handles)]
    fut = mgr.transfers.offload_to_storage(items, step)
    assert mgr.transfers.pending(TransferPath.G2_TO_G3) == 1
    handles[2].release()
    assert g1.evict() == 1  # block 2 evicted before the step ends
    step.done()
    res = fut.result(timeout=10)
    assert (res.written, res.skipped, res.from_device, res.error) == (2, 1, 2, None)
    assert [p is not None for p in res.placements] == [True, True, False]
    assert cap.stores("fast") == hs[:2]
    assert agent.exists([mgr.block_key(h) for h in hs]) == [True, True, False]
    assert mgr.metrics.sample("kvbm_offload_blocks_d2d") == 2
    for h in handles[:2]:
        h.release()
    mgr.close()


def test_events_off_storage_offloads_count_their_stores_and_build_none(agent: StorageAgent, monkeypatch: pytest.MonkeyPatch) -> None:
    """``null://`` (a NullPublisher without on_flush) is events off for the transfer manager
    too: its Store(volume) events are counted in the publisher's stats, never built or sent."""
    monkeypatch.setenv("DYN_KVBM_DISABLE_DISK_OFFLOAD_FILTER", "true")
    # events on: the volume's three Stores are published
    cap = Capture("events-on")
    mgr_on = BlockManager(config(model_name="it/transfer-on"), cap.publisher, agent, "fast")
    r_on = mgr_on.serve(list(range(1, 13)), fill_synthetic_kv)
    assert cap.stores("fast") == r_on.sequence_hashes
    mgr_on.close()
    # events off: the same serve builds no event at all
    pub = NullPublisher("events-off")
    assert pub.wants_events is False
    built: list[object] = []
    monkeypatch.setattr("kvbm_runtime.transfer.KVEvent", lambda *a: built.append(a))  # any build is seen
    mgr = BlockManager(config(), pub, agent, "fast")
    r = mgr.serve(list(range(1, 13)), fill_synthetic_kv)  # 3 blocks: G1, G2 and G3 Stores
    assert r.stored_g3 == 3 and built == []
    assert agent.exists([mgr.block_key(h) for h in r.sequence_hashes]) == [True] * 3
    pub.flush()
    st = pub.stats()
    assert st.batches == 0 and st.events >= 3 * 3  # Stores on g1, g2 and the volume (+ any Removes)
    mgr.close()
