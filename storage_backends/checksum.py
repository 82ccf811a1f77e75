"""Block bytes: XXH3-64 checksums (docs/design.md §6) and single-threaded byte copies.

Copies go through numpy (one ``memcpy`` on the calling thread) rather than
``Tensor.copy_``, whose intra-op thread pool costs milliseconds per small block when the
cores are busy.
"""

from __future__ import annotations

import ctypes
from collections.abc import Sequence

import numpy as np
import torch
import xxhash


def as_bytes(t: torch.Tensor) -> torch.Tensor:
    """Flat uint8 CPU view of a tensor's contiguous bytes (copies only if not contiguous).

    Raises:
        ValueError: for a tensor that is not on the CPU.
    """
    if t.device.type != "cpu":
        raise ValueError(f"storage blocks must be CPU tensors, got one on {t.device}")
    t = t.contiguous()
    if t.dtype == torch.uint8:
        return t.reshape(-1)
    return t.reshape(-1).view(torch.uint8)


def checksum(data: torch.Tensor) -> int:
    """XXH3-64 (seed 0) of ``data``'s bytes, as an unsigned 64-bit int."""
    return xxhash.xxh3_64_intdigest(memoryview(as_bytes(data).numpy()))


def checksum_np(data: np.ndarray) -> int:
    """XXH3-64 (seed 0) of a contiguous 1-D uint8 numpy array (no tensor overhead: the
    hot path of small blocks)."""
    return xxhash.xxh3_64_intdigest(data)


def clone(data: torch.Tensor) -> torch.Tensor:
    """A new uint8 CPU tensor with ``data``'s bytes (``data``: 1-D uint8 CPU)."""
    return torch.from_numpy(data.numpy().copy())


def pack(buf: torch.Tensor, offsets: Sequence[int], blocks: Sequence[torch.Tensor], size: int) -> None:
    """Copy 1-D uint8 ``blocks`` into ``buf`` at ``offsets`` and zero every gap up to ``size``."""
    dst = buf.numpy()
    pos = 0
    for off, b in zip(offsets, blocks):
        if off > pos:
            dst[pos:off] = 0
        n = b.numel()
        np.copyto(dst[off : off + n], b.numpy())
        pos = off + n
    if size > pos:
        dst[pos:size] = 0


_BYTE_ARRAYS: dict[int, type[ctypes.Array[ctypes.c_ubyte]]] = {}


def byte_array(nbytes: int) -> type[ctypes.Array[ctypes.c_ubyte]]:
    """The ctypes type ``c_ubyte * nbytes`` (cached): its ``from_address`` is
    :func:`memory_at` for one length, without the call."""
    t = _BYTE_ARRAYS.get(nbytes)
    if t is None:
        if len(_BYTE_ARRAYS) > 4096:
            _BYTE_ARRAYS.clear()
        t = _BYTE_ARRAYS[nbytes] = ctypes.c_ubyte * nbytes
    return t


def memory_at(address: int, nbytes: int) -> ctypes.Array[ctypes.c_ubyte]:
    """A buffer over ``nbytes`` of live memory at ``address`` (to hash it without building
    a tensor or array per block: ~0.3 us).  The caller keeps the memory alive."""
    return byte_array(nbytes).from_address(address)

