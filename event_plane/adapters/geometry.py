"""KV-cache bytes per token of a model, so an adapter can give ``block_size`` in bytes.

vLLM and SGLang publish a block's size in tokens; KVEvent v1 carries bytes. For a model with
standard multi-head / grouped-query attention, every token stores one key and one value
vector per layer and KV head::

    bytes_per_token = 2 (K and V) × num_layers × num_kv_heads × head_size × itemsize(kv_dtype)

The geometry comes either from the model's Hugging Face ``config.json`` (:func:`model_geometry`)
or from explicit values; the dtype is the KV-cache dtype (vLLM's ``--kv-cache-dtype``;
``auto`` = the model's dtype). Used by the ``model=`` / ``num_layers=`` / ``num_kv_heads=`` /
``head_size=`` / ``kv_dtype=`` parameters of ``vllm+zmq://`` and ``sglang+zmq://`` URLs
(``docs/events.md`` §5.6).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path

from event_plane.errors import ConfigError

KV_DTYPE_BYTES: Mapping[str, int] = {
    "float16": 2,
    "half": 2,
    "fp16": 2,
    "bfloat16": 2,
    "bf16": 2,
    "float32": 4,
    "float": 4,
    "fp32": 4,
    "fp8": 1,
    "fp8_e4m3": 1,
    "fp8_e5m2": 1,
    "fp8_inc": 1,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "int8": 1,
    "uint8": 1,
}
"""Bytes per element of the KV-cache dtypes accepted (lower-case; vLLM's ``--kv-cache-dtype``
names and ``config.json``'s ``torch_dtype`` names; a ``torch.`` prefix is ignored)."""


@dataclass(frozen=True)
class KVGeometry:
    """Per-token KV geometry of a model.

    Attributes:
        num_layers: attention layers (``num_hidden_layers``).
        num_kv_heads: key/value heads per layer (``num_key_value_heads``).
        head_size: elements per head (``head_dim``).
        dtype: element dtype name (a key of :data:`KV_DTYPE_BYTES`).
    """

    num_layers: int
    num_kv_heads: int
    head_size: int
    dtype: str

    @property
    def bytes_per_token(self) -> int:
        """See :func:`kv_bytes_per_token`."""
        return kv_bytes_per_token(self.num_layers, self.num_kv_heads, self.head_size, self.dtype)


def dtype_bytes(name: str) -> int:
    """Bytes per element of KV dtype ``name`` (case-insensitive, ``torch.`` prefix ignored).

    Raises:
        ConfigError: an unknown dtype, naming the accepted ones (``auto`` is resolved by
            the caller, never here).
    """
    key = name.strip().lower().removeprefix("torch.") if isinstance(name, str) else ""
    if key not in KV_DTYPE_BYTES:
        raise ConfigError(f"unknown KV dtype {name!r}; use one of {', '.join(sorted(KV_DTYPE_BYTES))}")
    return KV_DTYPE_BYTES[key]


def kv_bytes_per_token(num_layers: int, num_kv_heads: int, head_size: int, kv_dtype: str) -> int:
    """KV-cache bytes one token takes: ``2 × num_layers × num_kv_heads × head_size ×
    itemsize(kv_dtype)`` (K and V of every layer and KV head).

    Example: Llama-3.1-8B (32 layers, 8 KV heads, head size 128, bfloat16) → 131,072 bytes.

    Raises:
        ConfigError: a count that is not an int > 0, or an unknown dtype.
    """
    for name, value in (("num_layers", num_layers), ("num_kv_heads", num_kv_heads), ("head_size", head_size)):
        if type(value) is not int or value <= 0:  # noqa: E721 - bool is not a count
            raise ConfigError(f"{name} must be an int > 0, got {value!r}")
    return 2 * num_layers * num_kv_heads * head_size * dtype_bytes(kv_dtype)


def model_geometry(model_dir: str | Path) -> KVGeometry:
    """Read the KV geometry of a Hugging Face model from ``<model_dir>/config.json``.

    Fields (of the file, or of its ``text_config`` when the top level has no
    ``num_hidden_layers``, as multimodal models nest it): ``num_hidden_layers``;
    ``num_key_value_heads`` (default ``num_attention_heads``); ``head_dim`` (default
    ``hidden_size // num_attention_heads``); ``torch_dtype`` or ``dtype`` (default
    ``float16``).

    Raises:
        ConfigError: no readable ``config.json`` / not a JSON object, a missing or non-int
            field, an unknown dtype, or an MLA model (``kv_lora_rank``: its cache is not
            K and V per head; give ``bytes_per_token`` instead).
    """
    path = Path(model_dir).expanduser() / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise ConfigError(f"cannot read the model config {path}: {exc}") from exc
    if not isinstance(cfg, dict):
        raise ConfigError(f"model config {path} is not a JSON object")
    if "num_hidden_layers" not in cfg and isinstance(cfg.get("text_config"), dict):
        cfg = {**cfg, **cfg["text_config"]}
    if "kv_lora_rank" in cfg:
        raise ConfigError(f"model config {path} is an MLA model (kv_lora_rank): give bytes_per_token explicitly")

    def count(name: str) -> int:
        value = cfg.get(name)
        if type(value) is not int or value <= 0:  # noqa: E721
            raise ConfigError(f"model config {path}: {name} must be an int > 0, got {value!r}")
        return value

    layers = count("num_hidden_layers")
    kv_heads = count("num_key_value_heads") if "num_key_value_heads" in cfg else count("num_attention_heads")
    if cfg.get("head_dim") is not None:
        head_dim = count("head_dim")
    else:
        head_dim = count("hidden_size") // count("num_attention_heads")
    dtype = cfg.get("torch_dtype") or cfg.get("dtype") or "float16"
    if not isinstance(dtype, str):
        raise ConfigError(f"model config {path}: torch_dtype must be a str, got {dtype!r}")
    dtype_bytes(dtype)
    return KVGeometry(layers, kv_heads, head_dim, dtype.lower().removeprefix("torch."))
