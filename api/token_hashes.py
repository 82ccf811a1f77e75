"""Block hashes of token ids as Dynamo's KV indexer computes them (docs/operations.md, "Indexer API").

* local (tokens) hash of a full block = XXH3-64, seed :data:`DYNAMO_SEED` (1337), over the
  block's token ids as 4-byte little-endian unsigned ints; with a LoRA adapter, the UTF-8
  bytes of ``lora_name`` are appended to every block's bytes (our rule: Dynamo's LoRA
  salting is not part of the indexer API contract);
* sequence (chain) hash of block 0 = its local hash; of block i = XXH3-64, seed 1337, over
  ``seq[i-1]`` then ``local[i]``, each 8 bytes little-endian.

Only full blocks are hashed; a partial tail is ignored. The local hashes are what a router
sends to ``POST /query_by_hash``; the chain hashes key the worker index
(:mod:`api.worker_index`), so two blocks with the same tokens at different prefixes differ.
The rule is the one ``kvbm_runtime.hashing`` uses for our own sequence hashes, with the
fixed seed 1337 in place of our salted one (docs/design.md §4).
"""

from __future__ import annotations

import struct
from collections.abc import Sequence

import numpy as np
import xxhash

from kvbm_runtime.hashing import TokenIdError, token_array

DYNAMO_SEED = 1337
"""XXH3 seed of Dynamo's block hashes."""

_PAIR = struct.Struct("<QQ")

__all__ = ["DYNAMO_SEED", "TokenIdError", "chain_hashes", "local_block_hashes"]


def local_block_hashes(token_ids: Sequence[int] | np.ndarray, block_size: int, lora_name: str | None = None) -> list[int]:
    """Local (tokens) hashes of every full block of ``token_ids``.

    Args:
        token_ids: 1-D ints in ``[0, 2**32)``.
        block_size: tokens per block (> 0).
        lora_name: LoRA adapter name, or ``None`` for the base model.

    Returns:
        ``len(token_ids) // block_size`` u64 values, in block order.

    Raises:
        ValueError: ``block_size`` not positive.
        TokenIdError: the token ids are not 1-D ints in range (floats and bools refused).
    """
    if block_size <= 0:
        raise ValueError("block_size must be positive")
    raw = token_array(token_ids).astype("<u4", copy=False).tobytes()
    suffix = lora_name.encode("utf-8") if lora_name else b""
    step = 4 * block_size
    digest = xxhash.xxh3_64_intdigest
    if suffix:
        return [digest(raw[i : i + step] + suffix, DYNAMO_SEED) for i in range(0, len(raw) - step + 1, step)]
    return [digest(raw[i : i + step], DYNAMO_SEED) for i in range(0, len(raw) - step + 1, step)]


def chain_hash(parent: int | None, local: int) -> int:
    """Sequence hash of a block from its parent's sequence hash (``None`` for block 0) and its local hash."""
    if parent is None:
        return local
    return xxhash.xxh3_64_intdigest(_PAIR.pack(parent, local), DYNAMO_SEED)


def chain_hashes(local_hashes: Sequence[int], parent: int | None = None) -> list[int]:
    """Sequence hashes of consecutive blocks given their local hashes (u64 each).

    Args:
        local_hashes: local hashes, first block first.
        parent: sequence hash of the block before the first one, ``None`` at a prefix start.

    Raises:
        struct.error: a value outside the u64 range.
    """
    out: list[int] = []
    pack, digest = _PAIR.pack, xxhash.xxh3_64_intdigest
    for local in local_hashes:
        parent = local if parent is None else digest(pack(parent, local), DYNAMO_SEED)
        out.append(parent)
    return out
