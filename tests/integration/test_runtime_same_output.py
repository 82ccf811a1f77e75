"""Runtime acceptance: onboarded KV gives the same model output as recomputed KV.

A tiny transformer (random weights, float32) writes the K/V of every block it computes
into the runtime's G1 block views and attends over K/V read back from those views.  For
prompts sharing a 3-block prefix, logits (tail positions and 3 greedy generation steps)
computed with KV onboarded from G2, from a G3 volume (real StorageAgent + NIXL POSIX on
tmp_path) and from another worker's G2 through NIXL UCX equal the logits computed from
scratch within 1e-5.
"""

from __future__ import annotations

import os
import random
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from event_plane import NullPublisher  # noqa: E402
from kvbm_runtime import BlockManager, RuntimeConfig, ServeResult  # noqa: E402
from kvbm_runtime.remote import BlockExport, RemoteExporter, RemoteReader  # noqa: E402
from kvbm_runtime.testing import TinyConfig, TinyTransformer, paged_kv_fill  # noqa: E402
from storage_backends import StorageAgent  # noqa: E402
from conftest import posix_agent  # noqa: E402

TOL = 1e-5
MODEL = TinyConfig(vocab=61, num_layers=2, num_heads=4, head_dim=8, page_size=4)
STEPS = 3


def runtime_config(**kw: object) -> RuntimeConfig:
    base: dict[str, object] = {
        "model_name": "it/tiny-transformer",
        "num_layers": MODEL.num_layers,
        "outer_dim": 2,
        "page_size": MODEL.page_size,
        "inner_dim": MODEL.d_model,
        "kv_dtype": "float32",
        "g1_blocks": 16,
        "g2_blocks": 32,
        "disk_offload_filter": False,
    }
    base.update(kw)
    return RuntimeConfig(**base)  # type: ignore[arg-type]


@pytest.fixture(scope="module")
def model() -> TinyTransformer:
    return TinyTransformer(MODEL, seed=1234)


@pytest.fixture(scope="module")
def prompts() -> dict[str, list[int]]:
    rng = random.Random(7)
    base = [rng.randrange(MODEL.vocab) for _ in range(12)]  # 3 shared blocks
    return {
        "p1": base + [rng.randrange(MODEL.vocab) for _ in range(7)],  # 4 blocks + 3 tail
        "p2": base + [rng.randrange(MODEL.vocab) for _ in range(10)],  # 5 blocks + 2 tail
        "p3": base + [rng.randrange(MODEL.vocab) for _ in range(6)],  # 4 blocks + 2 tail
    }


@pytest.fixture()
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    ag = posix_agent(tmp_path, "same-output", "nvme0")
    yield ag
    ag.close()


def worker(name: str, store: StorageAgent | None = None) -> BlockManager:
    return BlockManager(runtime_config(), NullPublisher(name), store, "nvme0" if store is not None else None)


def run(mgr: BlockManager, model: TinyTransformer, tokens: list[int]) -> tuple[ServeResult, torch.Tensor, list[int], torch.Tensor]:
    """Serve ``tokens`` (model computes the missing blocks into G1), then take logits of the
    tail positions and of STEPS greedy steps with attention over the G1 blocks."""
    hashes = mgr.sequence_hashes(tokens)
    result = mgr.serve(tokens, paged_kv_fill(model, tokens, hashes, mgr.g1.get))
    handles = mgr.g1.match_blocks(hashes)
    assert len(handles) == len(hashes)
    try:
        blocks = [h.view() for h in handles]
        tail = model.forward_paged(tokens, len(blocks) * MODEL.page_size, blocks)
        generated, gen_logits = model.generate_paged(tokens, blocks, STEPS)
    finally:
        for h in handles:
            h.release()
    return result, tail, generated, gen_logits


def assert_same_as_scratch(model: TinyTransformer, tokens: list[int], tail: torch.Tensor, generated: list[int], gen_logits: torch.Tensor) -> None:
    n_full = len(tokens) // MODEL.page_size
    ref_tail = model.forward_full(tokens)[n_full * MODEL.page_size :]
    ref_generated, ref_gen_logits = model.generate_full(tokens, STEPS)
    assert tail.shape == ref_tail.shape and tail.dtype == torch.float32
    assert (tail - ref_tail).abs().max().item() <= TOL
    assert generated == ref_generated
    assert (gen_logits - ref_gen_logits).abs().max().item() <= TOL


def test_logits_equal_with_kv_from_g2_g3_and_a_remote_g2(
    model: TinyTransformer, prompts: dict[str, list[int]], agent: StorageAgent
) -> None:
    p1, p2, p3 = prompts["p1"], prompts["p2"], prompts["p3"]
    a = worker("prefill-a", agent)

    # from scratch inside the runtime: every block computed by the model into G1
    r, tail, gen, gl = run(a, model, p1)
    assert (r.computed, r.hits, r.stored_g3) == (4, 0, 4)
    assert_same_as_scratch(model, p1, tail, gen, gl)

    # KV onboarded from G2: G1 emptied, the shared 3-block prefix comes back from G2
    assert a.g1.evict() == 4 and a.resident("g1") == set()
    r, tail, gen, gl = run(a, model, p2)
    assert (r.hits_g1, r.hits_g2, r.hits_g3, r.computed) == (0, 3, 0, 2)
    assert_same_as_scratch(model, p2, tail, gen, gl)

    # KV onboarded from the G3 volume by a fresh worker sharing the storage agent
    b = worker("decode-b", agent)
    r, tail, gen, gl = run(b, model, p3)
    assert (r.hits_g1, r.hits_g2, r.hits_g3, r.computed, r.errors) == (0, 0, 3, 1, [])
    assert_same_as_scratch(model, p3, tail, gen, gl)

    # KV read from another worker's G2 through NIXL (UCX), then served from G1
    c = worker("decode-c")
    exporter = RemoteExporter(a.g2, "prefill-a-g2")
    reader = RemoteReader(c.g1, "decode-c-g1")
    try:
        hashes = c.sequence_hashes(p1)
        export = BlockExport.from_bytes(exporter.export(hashes).to_bytes())  # as sent over a wire
        assert [blk.sequence_hash for blk in export.blocks] == hashes and exporter.leases() == 1
        handles = reader.onboard(export)
        assert [h.sequence_hash for h in handles] == hashes
        assert reader.bytes_read == 4 * c.block_bytes
        for h in handles:
            h.release()
        assert exporter.release(export.lease) == 4
        r, tail, gen, gl = run(c, model, p1)
        assert (r.hits_g1, r.computed) == (4, 0)
        assert_same_as_scratch(model, p1, tail, gen, gl)
    finally:
        reader.close()
        exporter.close()
    for m in (a, b, c):
        m.close()


def test_the_comparison_detects_wrong_kv(model: TinyTransformer, prompts: dict[str, list[int]]) -> None:
    """Control: a single perturbed block in G1 moves the logits well past the tolerance."""
    mgr = worker("control")
    p1 = prompts["p1"]
    hashes = mgr.sequence_hashes(p1)
    mgr.serve(p1, paged_kv_fill(model, p1, hashes, mgr.g1.get))
    handle = mgr.g1.get(hashes[1])
    assert handle is not None
    handle.view()[0, 0, 2].add_(0.5)  # layer 0, K, token 2 of block 1
    handle.release()
    _, tail, _, _ = run(mgr, model, p1)
    ref = model.forward_full(p1)[16:]
    assert (tail - ref).abs().max().item() > 1e-3
    mgr.close()
