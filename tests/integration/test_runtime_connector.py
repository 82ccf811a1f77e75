"""Connector API end to end with the tiny transformer as the engine: the engine owns its KV
cache and block ids; a prefix hit is matched, loaded from G2 (and from a G3 volume by a
second worker) into the engine's blocks, and the logits equal those computed from scratch.
Saves run behind the step and the engine frees blocks after ``get_finished``."""

from __future__ import annotations

import os
import random
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from event_plane import KVEvent, NullPublisher  # noqa: E402
from kvbm_runtime import BlockManager, RuntimeConfig  # noqa: E402
from kvbm_runtime.connector import (  # noqa: E402
    ConnectorError,
    ConnectorRequest,
    KvbmConnector,
    ScheduledRequest,
    SchedulerOutput,
)
from kvbm_runtime.testing import TinyConfig, TinyTransformer  # noqa: E402
from storage_backends import StorageAgent  # noqa: E402
from conftest import posix_agent  # noqa: E402

MODEL = TinyConfig(vocab=61, num_layers=2, num_heads=4, head_dim=8, page_size=4)
PAGE = MODEL.page_size
ENGINE_BLOCKS = 24


class Capture:
    def __init__(self, source: str) -> None:
        self.batches: list[list[KVEvent]] = []
        self.publisher = NullPublisher(source, on_flush=lambda b, _p: self.batches.append(list(b.events)))

    def stores(self, loc: str) -> list[int]:
        self.publisher.flush()
        return [e.sequence_hash for b in self.batches for e in b if e.type.name == "STORE" and e.storage_location == loc]


class Engine:
    """A minimal engine: its own KV cache tensor, block allocator and one-step prefill."""

    def __init__(self, connector: KvbmConnector, model: TinyTransformer) -> None:
        self.model = model
        self.connector = connector
        self.kv = torch.zeros(MODEL.num_layers, ENGINE_BLOCKS, 2, PAGE, MODEL.d_model)
        self.names = [f"model.layers.{i}.self_attn" for i in range(MODEL.num_layers)]
        connector.register_kv_caches({n: self.kv[i] for i, n in enumerate(self.names)})
        self.free = list(range(ENGINE_BLOCKS))

    def prefill(self, req: ConnectorRequest) -> tuple[int, torch.Tensor, list[int]]:
        """Schedule and run one prefill step; returns (loaded tokens, logits of the
        computed positions, the request's block ids)."""
        c = self.connector
        tokens = req.prompt_token_ids
        loaded, load_async = c.get_num_new_matched_tokens(req, 0)
        assert load_async is False
        n_blocks = -(-len(tokens) // PAGE)
        ids, self.free = self.free[:n_blocks], self.free[n_blocks:]
        c.update_state_after_alloc(req, ids, loaded)
        meta = c.build_connector_meta(SchedulerOutput([ScheduledRequest(req, ids, loaded, len(tokens) - loaded)]))
        c.bind_connector_metadata(meta)
        c.start_load_kv(None)
        for name in self.names:
            c.wait_for_layer_load(name)
        start = loaded
        past = [self.kv[:, b] for b in ids[: start // PAGE]]
        full = len(tokens) // PAGE
        out = {j: self.kv[:, ids[j]] for j in range(start // PAGE, full)}
        logits = self.model.forward_paged(tokens, start, past, out)
        for i, name in enumerate(self.names):
            c.save_kv_layer(name, self.kv[i], None)
        c.wait_for_save()
        c.clear_connector_metadata()
        return loaded, logits, ids

    def finish(self, req: ConnectorRequest, ids: list[int]) -> None:
        delay, params = self.connector.request_finished(req, ids)
        if delay:
            deadline = time.monotonic() + 60  # bounds the wait only (a loaded machine is slow)
            finished: set[str] = set()
            pending = {req.request_id}
            while req.request_id not in finished:
                sending, recving = self.connector.get_finished(pending)
                pending = set()
                assert recving is None
                finished |= sending or set()
                assert time.monotonic() < deadline
                time.sleep(0.001)
        self.kv[:, ids] = 0.0  # the engine reuses the blocks: nothing stale may survive
        self.free.extend(ids)


def config(**kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model_name": "it/connector",
        "num_layers": MODEL.num_layers,
        "outer_dim": 2,
        "page_size": PAGE,
        "inner_dim": MODEL.d_model,
        "kv_dtype": "float32",
        "g1_blocks": 8,
        "g2_blocks": 32,
        "disk_offload_filter": False,
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    ag = posix_agent(tmp_path, "connector-it", "nvme0")
    yield ag
    ag.close()


def test_prefix_hit_is_matched_loaded_and_gives_the_same_logits(agent: StorageAgent) -> None:
    model = TinyTransformer(MODEL, seed=99)
    rng = random.Random(3)
    base = [rng.randrange(MODEL.vocab) for _ in range(12)]
    p1 = base + [rng.randrange(MODEL.vocab) for _ in range(6)]  # 4 full blocks + 2
    p2 = base + [rng.randrange(MODEL.vocab) for _ in range(9)]  # 5 full blocks + 1
    cap = Capture("connector-a")
    mgr = BlockManager(config(), cap.publisher, agent, "nvme0")
    conn = KvbmConnector(mgr)
    engine = Engine(conn, model)

    r1 = ConnectorRequest("r1", p1)
    loaded, logits, ids = engine.prefill(r1)
    assert loaded == 0
    assert (logits - model.forward_full(p1)).abs().max().item() <= 1e-5
    engine.finish(r1, ids)
    h1 = mgr.sequence_hashes(p1)
    assert cap.stores("g2") == h1  # the 4 full blocks were saved behind the step
    conn.worker.wait_for_storage(timeout=10)
    assert cap.stores("nvme0") == h1
    assert mgr.g1.resident() == set()  # G1 of the manager is not used: the engine owns G1

    # prefix hit: 3 shared blocks come back from G2 into fresh engine blocks
    r2 = ConnectorRequest("r2", p2)
    loaded, logits, ids = engine.prefill(r2)
    assert loaded == 3 * PAGE
    ref = model.forward_full(p2)[loaded:]
    assert (logits - ref).abs().max().item() <= 1e-5
    h2 = mgr.sequence_hashes(p2)
    for j in range(3):
        assert torch.equal(engine.kv[:, ids[j]], mgr.g2.layout.block_view(mgr.g2.get(h2[j]).block_id))
    assert mgr.metrics.sample("kvbm_matched_tokens") == 12 and mgr.metrics.sample("kvbm_onboard_blocks_h2d") == 3
    engine.finish(r2, ids)
    assert cap.stores("g2") == h1 + h2[3:5]  # the step completed blocks 3 and 4
    conn.worker.wait_for_storage(timeout=10)

    # a second worker (empty G2) sharing the volume: the same prefix comes from G3
    cap_b = Capture("connector-b")
    mgr_b = BlockManager(config(), cap_b.publisher, agent, "nvme0")
    conn_b = KvbmConnector(mgr_b)
    engine_b = Engine(conn_b, model)
    r3 = ConnectorRequest("r3", p2)
    loaded, logits, ids = engine_b.prefill(r3)
    assert loaded == 5 * PAGE  # all 5 full blocks are on the volume; the 1-token tail is computed
    assert (logits - model.forward_full(p2)[loaded:]).abs().max().item() <= 1e-5
    assert mgr_b.metrics.sample("kvbm_onboard_blocks_d2d") == loaded // PAGE
    engine_b.finish(r3, ids)
    for m, c in ((mgr, conn), (mgr_b, conn_b)):
        c.worker.wait_for_storage(timeout=10)
        c.close()
        m.close()


def test_whole_prompt_is_never_matched_and_bad_calls_raise() -> None:
    mgr = BlockManager(config(), NullPublisher("connector-c"))
    conn = KvbmConnector(mgr)
    model = TinyTransformer(MODEL, seed=5)
    engine = Engine(conn, model)
    p = list(range(1, 17))  # exactly 4 blocks
    r = ConnectorRequest("x", p)
    _, _, ids = engine.prefill(r)
    engine.finish(r, ids)
    # everything is in G2, but the engine must compute at least one token: 3 blocks
    assert conn.get_num_new_matched_tokens(ConnectorRequest("y", p), 0) == (12, False)
    # the engine's own prefix hit of 1 block: 2 more from the connector
    assert conn.get_num_new_matched_tokens(ConnectorRequest("z", p), 4) == (8, False)
    with pytest.raises(ConnectorError, match="multiple of 4"):
        conn.get_num_new_matched_tokens(ConnectorRequest("w", p), 3)
    with pytest.raises(ConnectorError, match="12 external tokens but 8 were matched"):
        conn.update_state_after_alloc(ConnectorRequest("z", p), [0, 1, 2, 3], 12)
    assert mgr.g2.stats().active == 3  # "y" still pins its 3 matched blocks
    conn.update_state_after_alloc(ConnectorRequest("y", p), [0, 1, 2, 3], 0)  # engine declined
    assert mgr.g2.stats().active == 0
    with pytest.raises(ConnectorError, match="unknown layer"):
        conn.wait_for_layer_load("model.layers.9.self_attn")
    conn.close()
    mgr.close()
