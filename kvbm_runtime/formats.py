"""Operational KV formats of a page and the universal format blocks are stored in.

A page holds ``page_size`` tokens × ``num_heads`` heads × ``head_dim`` values of one layer
and one of K / V.  Attention kernels want one of two element orders:

* ``NHD`` — ``[page_size][num_heads][head_dim]`` (tokens outermost; vLLM's flash-attention
  layout, and the runtime's own block views ``[..., page_size, inner_dim]``);
* ``HND`` — ``[num_heads][page_size][head_dim]`` (heads outermost; FlashInfer / TRT-LLM).

The **universal** format of a block — what goes to G3/G4 and over the wire — is
``[num_layers][outer_dim][page_size][num_heads · head_dim]``: layer-major, K before V,
pages in ``NHD`` order.  It does not depend on the layout (``FullyContiguous`` /
``LayerSeparated``) or the engine's operational format, so a block written by an ``HND``
engine can be onboarded by an ``NHD`` one after :func:`from_universal`.

All functions take and return typed block tensors of shape
``[num_layers, outer_dim, page_size, inner_dim]`` (the runtime's block-view shape); for
``HND`` the memory of each ``[page_size, inner_dim]`` page is read as
``[num_heads, page_size, head_dim]``.
"""

from __future__ import annotations

import enum

import torch

from .errors import LayoutConfigError


class KvFormat(str, enum.Enum):
    """Element order of a page (see module doc)."""

    NHD = "NHD"
    HND = "HND"


def _split(block: torch.Tensor, num_heads: int) -> tuple[int, int, int, int, int]:
    if block.dim() != 4:
        raise LayoutConfigError(f"block must be [num_layers, outer_dim, page_size, inner_dim], got {tuple(block.shape)}")
    layers, outer, page, inner = (int(x) for x in block.shape)
    if num_heads <= 0 or inner % num_heads:
        raise LayoutConfigError(f"inner_dim {inner} is not divisible into {num_heads} heads")
    return layers, outer, page, num_heads, inner // num_heads


def to_universal(block: torch.Tensor, fmt: KvFormat, num_heads: int) -> torch.Tensor:
    """Block in operational format ``fmt`` → a new contiguous block in universal format.

    Raises:
        LayoutConfigError: not a 4-D block, or ``inner_dim`` not divisible by ``num_heads``.
    """
    layers, outer, page, heads, hd = _split(block, num_heads)
    if KvFormat(fmt) is KvFormat.NHD:
        return block.contiguous().clone() if block.is_contiguous() else block.contiguous()
    hnd = block.contiguous().view(layers, outer, heads, page, hd)
    return hnd.transpose(2, 3).contiguous().view(layers, outer, page, heads * hd)


def from_universal(block: torch.Tensor, fmt: KvFormat, num_heads: int) -> torch.Tensor:
    """Universal-format block → a new contiguous block in operational format ``fmt``.

    Raises:
        LayoutConfigError: as :func:`to_universal`.
    """
    layers, outer, page, heads, hd = _split(block, num_heads)
    if KvFormat(fmt) is KvFormat.NHD:
        return block.contiguous().clone() if block.is_contiguous() else block.contiguous()
    nhd = block.contiguous().view(layers, outer, page, heads, hd)
    return nhd.transpose(2, 3).contiguous().view(layers, outer, page, heads * hd)


def convert(block: torch.Tensor, src: KvFormat, dst: KvFormat, num_heads: int) -> torch.Tensor:
    """Block in format ``src`` → a new contiguous block in format ``dst`` (through the
    universal format)."""
    return from_universal(to_universal(block, src, num_heads), dst, num_heads)
