"""The FLOPs and KV bytes per token of a Llama shape (what bench/e2e_ttft.py prints to show
its random-weight model weighs a load against a recompute as a real model does)."""

from __future__ import annotations

import pytest

from kvbm_runtime.testing.llama_model import LlamaGeometry

LLAMA3_8B = LlamaGeometry(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336)


def test_llama3_8b_weights_match_its_published_size() -> None:
    # 8.03 B parameters, of which the input embedding (vocab x hidden) is not a matmul
    # (RMSNorm weights, 0.27 M, neither)
    published = 8.03e9
    assert LLAMA3_8B.matmul_params() == pytest.approx(published - 128256 * 4096, rel=0.01)
    # 128 KiB of bf16 KV per token: 2 x 32 layers x 8 heads x 128
    assert LLAMA3_8B.kv_bytes_per_token(2) == 128 << 10


def test_flops_per_token_adds_attention_over_the_context() -> None:
    g = LlamaGeometry(vocab=1024, hidden=1024, layers=4, heads=16, kv_heads=2, intermediate=4096)
    assert g.head_size == 64
    # per layer: Q, O 1024 x 1024; K, V 1024 x 128; MLP 3 x 1024 x 4096; LM head 1024 x 1024
    assert g.matmul_params() == 4 * (2 * 1024 * 1024 + 2 * 1024 * 128 + 3 * 1024 * 4096) + 1024 * 1024
    assert g.flops_per_token() == 2 * g.matmul_params()
    assert g.flops_per_token(100) - g.flops_per_token() == 4 * 4 * 16 * 64 * 100
    assert g.kv_bytes_per_token() == 2 * 4 * 2 * 64 * 4
