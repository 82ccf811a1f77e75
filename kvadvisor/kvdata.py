"""Deterministic KV contents for replays: what a model *would* have computed.

A simulated worker has no model, so it fills each new block with values derived from the
block's sequence hash alone.  Any reader can recompute the expected bytes of a block from
its hash and check what a tier returns, byte for byte.
"""

from __future__ import annotations

import numpy as np
import torch


def expected_block(sequence_hash: int, shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """The KV block for ``sequence_hash``: standard-normal values of ``shape`` in ``dtype`` (CPU)."""
    rng = np.random.default_rng(sequence_hash)
    n = int(np.prod(shape))
    vals = rng.standard_normal(n, dtype=np.float32)
    return torch.from_numpy(vals).reshape(shape).to(dtype)


def fill_block(sequence_hash: int, view: torch.Tensor) -> None:
    """Fill ``view`` (any shape, any device) with :func:`expected_block` data for its hash."""
    view.copy_(expected_block(sequence_hash, tuple(view.shape), view.dtype))
