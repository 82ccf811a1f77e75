"""Adapter URLs fill ``block_size`` in bytes from the model geometry: ``model=`` (a Hugging
Face model directory's ``config.json``), ``kv_dtype=``, or ``num_layers`` / ``num_kv_heads`` /
``head_size`` given directly; ``bytes_per_token`` wins; bad values are EventURLErrors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from event_plane import EventType, EventURLError, subscribe
from event_plane.adapters.emit import peer_batch
from event_plane.adapters.geometry import kv_bytes_per_token, model_geometry
from event_plane.adapters.urls import PEER_PARAMS
from event_plane.errors import ConfigError
from event_plane.urls import _ALLOWED

# Fields as in meta-llama/Llama-3.1-8B-Instruct's config.json (no head_dim: 4096 // 32 = 128)
LLAMA_8B = {
    "architectures": ["LlamaForCausalLM"],
    "hidden_size": 4096,
    "num_attention_heads": 32,
    "num_hidden_layers": 32,
    "num_key_value_heads": 8,
    "torch_dtype": "bfloat16",
    "vocab_size": 128256,
}
LLAMA_8B_BPT = 2 * 32 * 8 * 128 * 2  # 131,072


def model_dir(tmp_path: Path, name: str, cfg: object) -> Path:
    d = tmp_path / name
    d.mkdir()
    (d / "config.json").write_text(json.dumps(cfg))
    return d


def bpt(url: str) -> int:
    sub = subscribe(url)
    return sub.converter.config.bytes_per_token  # type: ignore[attr-defined,no-any-return]


def test_kv_bytes_per_token_formula_and_dtypes() -> None:
    assert kv_bytes_per_token(32, 8, 128, "bfloat16") == LLAMA_8B_BPT
    assert kv_bytes_per_token(32, 8, 128, "torch.float16") == LLAMA_8B_BPT
    assert kv_bytes_per_token(32, 8, 128, "float32") == 2 * LLAMA_8B_BPT
    assert kv_bytes_per_token(32, 8, 128, "fp8") == kv_bytes_per_token(32, 8, 128, "FP8_E4M3") == LLAMA_8B_BPT // 2
    with pytest.raises(ConfigError, match="unknown KV dtype 'int3'"):
        kv_bytes_per_token(32, 8, 128, "int3")
    for bad in (0, -1, True, 1.5):
        with pytest.raises(ConfigError, match="num_kv_heads must be an int > 0"):
            kv_bytes_per_token(32, bad, 128, "fp8")  # type: ignore[arg-type]


def test_model_config_defaults_and_nesting(tmp_path: Path) -> None:
    g = model_geometry(model_dir(tmp_path, "llama", LLAMA_8B))
    assert (g.num_layers, g.num_kv_heads, g.head_size, g.dtype, g.bytes_per_token) == (32, 8, 128, "bfloat16", LLAMA_8B_BPT)
    # no num_key_value_heads: one KV head per attention head; head_dim given; "dtype" (newer transformers)
    mha = {"num_hidden_layers": 4, "num_attention_heads": 6, "hidden_size": 60, "head_dim": 16, "dtype": "float32"}
    g = model_geometry(model_dir(tmp_path, "mha", mha))
    assert (g.num_kv_heads, g.head_size, g.bytes_per_token) == (6, 16, 2 * 4 * 6 * 16 * 4)
    # no dtype at all: float16; multimodal models nest the text model in text_config
    nested = {"architectures": ["X"], "text_config": {"num_hidden_layers": 2, "num_attention_heads": 4, "hidden_size": 32}}
    g = model_geometry(model_dir(tmp_path, "vl", nested))
    assert (g.num_layers, g.num_kv_heads, g.head_size, g.dtype) == (2, 4, 8, "float16")


def test_urls_fill_block_size_from_the_model(tmp_path: Path) -> None:
    d = model_dir(tmp_path, "llama", LLAMA_8B)
    base = "vllm+zmq://127.0.0.1:5557?"
    assert bpt(f"{base}source=s") == 0  # nothing given: unknown
    assert bpt(f"{base}model={d}") == LLAMA_8B_BPT
    assert bpt(f"{base}model={d}&kv_dtype=fp8") == LLAMA_8B_BPT // 2
    assert bpt(f"{base}model={d}&kv_dtype=auto") == LLAMA_8B_BPT
    assert bpt(f"{base}model={d}&kv_dtype=float32&num_layers=16") == LLAMA_8B_BPT  # 2x dtype, half the layers
    assert bpt(f"sglang+zmq://127.0.0.1:6000?model={d}") == LLAMA_8B_BPT
    # the geometry directly
    assert bpt(f"{base}num_layers=32&num_kv_heads=8&head_size=128&kv_dtype=bfloat16") == LLAMA_8B_BPT
    # an explicit bytes_per_token wins
    assert bpt(f"{base}model={d}&kv_dtype=fp8&bytes_per_token=7") == 7
    # and the converted Store carries tokens x bytes per token
    sub = subscribe(f"{base}model={d}&kv_dtype=fp8")
    batch = sub.converter.convert(0, peer_batch([["BlockStored", [1], None, [], 16, None, "GPU"]]))  # type: ignore[attr-defined]
    assert batch.events[0].type == EventType.STORE and batch.events[0].block_size == 16 * LLAMA_8B_BPT // 2


def test_bad_geometry_parameters_are_url_errors(tmp_path: Path) -> None:
    d = model_dir(tmp_path, "llama", LLAMA_8B)
    base = "vllm+zmq://127.0.0.1:5557?"
    cases = {
        f"model={tmp_path / 'absent'}": "cannot read the model config",
        f"model={model_dir(tmp_path, 'list', [1, 2])}": "is not a JSON object",
        f"model={model_dir(tmp_path, 'nolayers', {'num_attention_heads': 8, 'hidden_size': 64})}": "num_hidden_layers must be an int > 0",
        f"model={model_dir(tmp_path, 'strheads', {**LLAMA_8B, 'num_key_value_heads': '8'})}": "num_key_value_heads must be an int > 0",
        f"model={model_dir(tmp_path, 'mla', {**LLAMA_8B, 'kv_lora_rank': 512})}": "MLA model",
        f"model={model_dir(tmp_path, 'dt', {**LLAMA_8B, 'torch_dtype': 'float7'})}": "unknown KV dtype 'float7'",
        "model=": "model must name a local model directory",
        f"model={d}&kv_dtype=int4": "unknown KV dtype 'int4'",
        f"model={d}&num_layers=x": "num_layers must be an int > 0",
        f"model={d}&head_size=0": "head_size must be an int > 0",
        "num_layers=32&num_kv_heads=8&kv_dtype=fp8": "missing: head_size",
        "num_layers=32&num_kv_heads=8&head_size=128": "missing: kv_dtype",
        "kv_dtype=auto": "missing: num_layers, num_kv_heads, head_size, kv_dtype",
        # bytes_per_token wins but the others are still checked
        f"bytes_per_token=7&model={tmp_path / 'absent'}": "cannot read the model config",
    }
    for query, message in cases.items():
        with pytest.raises(EventURLError, match=message):
            subscribe(base + query)


def test_peer_params_match_the_url_parser() -> None:
    assert _ALLOWED["vllm+zmq"] == _ALLOWED["sglang+zmq"] == set(PEER_PARAMS)
    assert {"model", "kv_dtype", "num_layers", "num_kv_heads", "head_size"} <= PEER_PARAMS
