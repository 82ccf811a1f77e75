"""Deterministic stand-in KV data for demos and tests (no model needed).

The KV of a block is a pure function of its sequence hash, so any copy of the block at
any tier can be checked byte for byte against :func:`synthetic_kv`.
"""

from __future__ import annotations

import torch


def synthetic_kv(sequence_hash: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """CPU tensor of ``shape`` / ``dtype`` with standard-normal values seeded by the hash."""
    gen = torch.Generator().manual_seed(sequence_hash & 0x7FFF_FFFF_FFFF_FFFF)
    return torch.randn(shape, generator=gen, dtype=torch.float32).to(dtype)


def fill_synthetic_kv(sequence_hash: int, view: torch.Tensor) -> None:
    """A ``kv_fill`` for :meth:`BlockManager.serve`: writes :func:`synthetic_kv` into ``view``."""
    view.copy_(synthetic_kv(sequence_hash, tuple(view.shape), view.dtype))


def synthetic_block_bytes(sequence_hash: int, shape: tuple[int, ...], dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """Universal-format bytes (CPU ``uint8``) of a block filled by :func:`fill_synthetic_kv`."""
    return synthetic_kv(sequence_hash, shape, dtype).contiguous().view(torch.uint8).reshape(-1)
