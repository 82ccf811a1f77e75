"""KV block manager runtime: block lifecycle, sequence hashing, per-tier pools, layouts,
write-through offload G1 → G2 → G3 and onboarding (DESIGN.md §4–§5).

Imports ``event_plane`` (events) and ``storage_backends`` (block keys, storage agent
contract) only.
"""

from kvbm_runtime.block import BlockMeta, BlockState, ImmutableBlock, MutableBlock, WeakBlock
from kvbm_runtime.config import RuntimeConfig
from kvbm_runtime.errors import (
    BlockStateError,
    CapacityConfigError,
    ConsumedHandleError,
    KvbmError,
    LayoutConfigError,
    PoolExhaustedError,
    StorageTierError,
)
from kvbm_runtime.hashing import ModelFingerprint, chain_hash, local_hash, salt_hash, sequence_hashes
from kvbm_runtime.layout import (
    BlockLayout,
    FullyContiguous,
    LayerSeparated,
    LayoutConfig,
    LayoutDescriptor,
    MemoryKind,
    align_up,
    copy_blocks,
    make_layout,
)
from kvbm_runtime.manager import BlockManager, ServeError, ServeResult
from kvbm_runtime.metrics import RuntimeMetrics
from kvbm_runtime.pool import BlockPool, PoolStats
from kvbm_runtime.synthetic import fill_synthetic_kv, synthetic_block_bytes, synthetic_kv

__all__ = [
    "BlockLayout",
    "BlockManager",
    "BlockMeta",
    "BlockPool",
    "BlockState",
    "BlockStateError",
    "CapacityConfigError",
    "ConsumedHandleError",
    "FullyContiguous",
    "ImmutableBlock",
    "KvbmError",
    "LayerSeparated",
    "LayoutConfig",
    "LayoutConfigError",
    "LayoutDescriptor",
    "MemoryKind",
    "ModelFingerprint",
    "MutableBlock",
    "PoolExhaustedError",
    "PoolStats",
    "RuntimeConfig",
    "RuntimeMetrics",
    "ServeError",
    "ServeResult",
    "StorageTierError",
    "WeakBlock",
    "align_up",
    "chain_hash",
    "copy_blocks",
    "fill_synthetic_kv",
    "local_hash",
    "make_layout",
    "salt_hash",
    "sequence_hashes",
    "synthetic_block_bytes",
    "synthetic_kv",
]
