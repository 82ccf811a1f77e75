"""Block identity: salted local hashes and positional sequence hashes (docs/design.md §4).

* local hash  = XXH3-64(token ids as 4-byte little-endian ints, seed = salt hash)
* sequence hash of block 0 = its local hash;
  of block i = XXH3-64(seq_hash[i-1].to_bytes(8, "little") + local[i].to_bytes(8, "little"))
* salt hash   = XXH3-64 of an injective, length-prefixed encoding of the model fingerprint
  (name, dtype, layout, block size in tokens), the LoRA name and the cache salt.

The same tokens at another position, under another model, LoRA or cache salt give another
sequence hash.  Only full blocks are hashed; a partial tail is never registered (case C10).
"""

from __future__ import annotations

import struct
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

import numpy as np
import xxhash

_U64 = struct.Struct("<Q")


@dataclass(frozen=True, slots=True)
class ModelFingerprint:
    """What makes KV data of one model incompatible with another's.

    Attributes:
        name: model name, e.g. ``"meta-llama/Llama-3.1-8B"``.
        dtype: KV dtype name, e.g. ``"float16"``.
        layout: layout name, e.g. ``"FullyContiguous"``.
        block_size: tokens per block.
        revision: model revision (commit or tag), ``""`` when unknown.
    """

    name: str
    dtype: str
    layout: str
    block_size: int
    revision: str = ""

    def encode(self) -> bytes:
        """Injective byte encoding (length-prefixed fields)."""
        return _encode_fields(
            ("fp", self.name, self.revision, self.dtype, self.layout, str(self.block_size))
        )

    def namespace(self) -> str:
        """Short stable id (16 hex digits) used to namespace storage keys."""
        return f"{xxhash.xxh3_64_intdigest(self.encode()):016x}"


def _encode_fields(fields: Iterable[str | None]) -> bytes:
    """Length-prefix every field; ``None`` and ``""`` encode differently."""
    out = bytearray()
    for f in fields:
        if f is None:
            out += b"\x00"
        else:
            raw = f.encode("utf-8")
            out += b"\x01" + len(raw).to_bytes(4, "little") + raw
    return bytes(out)


def salt_hash(fingerprint: ModelFingerprint, lora_name: str | None = None, cache_salt: str | None = None) -> int:
    """u64 seed for local hashes.

    ``lora="ab", salt="c"`` and ``lora="a", salt="bc"`` differ, and so do LoRA ``"X"``
    and cache salt ``"X"`` (case C12), because each field is tagged and length-prefixed.
    """
    body = fingerprint.encode() + _encode_fields(("lora", lora_name, "salt", cache_salt))
    return xxhash.xxh3_64_intdigest(body)


class TokenIdError(ValueError):
    """Token ids are not a 1-D sequence of integers in ``[0, 2**32)``."""


def token_array(tokens: Sequence[int] | np.ndarray) -> np.ndarray:
    """``tokens`` as a 1-D integer array, checked; floats, bools, strings are refused.

    Raises:
        TokenIdError: not 1-D, not integers (a float 1.9 must not alias token 1), or a
            token id outside ``[0, 2**32)``.
    """
    arr = np.asarray(tokens)
    if arr.ndim != 1:
        raise TokenIdError(f"token ids must be a 1-D sequence, got shape {arr.shape}")
    if arr.size == 0:
        return arr.astype(np.uint32)
    if arr.dtype == np.bool_ or not np.issubdtype(arr.dtype, np.integer):
        raise TokenIdError(f"token ids must be integers, got dtype {arr.dtype}")
    if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
        raise TokenIdError("token ids must fit in an unsigned 32-bit int")
    return arr


def local_hash(tokens: Sequence[int] | np.ndarray, seed: int) -> int:
    """XXH3-64 of ``tokens`` as 4-byte little-endian ints, seeded with ``seed`` (u64).

    Raises:
        TokenIdError: see :func:`token_array`.
    """
    arr = token_array(tokens)
    return xxhash.xxh3_64_intdigest(arr.astype("<u4", copy=False).tobytes(), seed)


def chain_hash(parent: int | None, local: int) -> int:
    """Sequence hash of a block given its parent's sequence hash and its local hash."""
    if parent is None:
        return local
    return xxhash.xxh3_64_intdigest(_U64.pack(parent) + _U64.pack(local))


def sequence_hashes(tokens: Sequence[int] | np.ndarray, block_size: int, seed: int) -> list[int]:
    """Sequence hashes of every *full* block of ``tokens`` (tail tokens are ignored).

    Returns:
        ``len(tokens) // block_size`` u64 hashes, in block order.

    Raises:
        ValueError: ``block_size`` not positive.
        TokenIdError: see :func:`token_array`.
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    arr = token_array(tokens).astype("<u4", copy=False)
    out: list[int] = []
    parent: int | None = None
    for i in range(len(arr) // block_size):
        local = xxhash.xxh3_64_intdigest(arr[i * block_size : (i + 1) * block_size].tobytes(), seed)
        parent = chain_hash(parent, local)
        out.append(parent)
    return out
