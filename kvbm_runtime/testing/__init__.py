"""Test helpers that need no GPU: a tiny transformer whose attention reads and writes its
KV through the runtime's G1 block views."""

from .tiny_model import TinyConfig, TinyTransformer, paged_kv_fill

__all__ = ["TinyConfig", "TinyTransformer", "paged_kv_fill"]
