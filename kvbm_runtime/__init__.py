"""KV block manager runtime: block lifecycle, sequence hashing, per-tier pools, layouts
and formats, a transfer manager (offload G1 → G2 → G3, onboarding), remote blocks over
NIXL, an engine connector with vLLM's call points, parallel modes (docs/design.md §4–§5).

Imports ``event_plane`` (events) and ``storage_backends`` (block keys, storage agent
contract) only.
"""

from kvbm_runtime.block import BlockMeta, BlockState, ImmutableBlock, MutableBlock, PinnedBlocks, WeakBlock
from kvbm_runtime.config import RuntimeConfig
from kvbm_runtime.connector import (
    ConnectorError,
    ConnectorRequest,
    KvbmConnector,
    KvConnectorMetadata,
    ScheduledRequest,
    SchedulerOutput,
)
from kvbm_runtime.errors import (
    BlockMetaError,
    BlockStateError,
    CapacityConfigError,
    ConsumedHandleError,
    KvbmError,
    LayoutConfigError,
    PoolExhaustedError,
    StorageTierError,
)
from kvbm_runtime.formats import KvFormat, convert, from_universal, to_universal
from kvbm_runtime.hashing import ModelFingerprint, TokenIdError, chain_hash, local_hash, salt_hash, sequence_hashes
from kvbm_runtime.layout import (
    BlockLayout,
    ExternalLayout,
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
from kvbm_runtime.parallel import ParallelMode, ReplicatedLoader, TensorParallelWorker, head_shard, init_group, shard_config
from kvbm_runtime.pool import BlockPool, PoolStats
from kvbm_runtime.remote import BlockExport, ExportedLayout, RemoteBlockError, RemoteExporter, RemoteReader
from kvbm_runtime.synthetic import fill_synthetic_kv, synthetic_block_bytes, synthetic_kv
from kvbm_runtime.transfer import DiskOffloadFilter, StepEvent, TransferClosedError, TransferManager, TransferPath

__all__ = [
    "BlockExport",
    "BlockLayout",
    "BlockManager",
    "BlockMeta",
    "BlockMetaError",
    "BlockPool",
    "BlockState",
    "BlockStateError",
    "CapacityConfigError",
    "ConnectorError",
    "ConnectorRequest",
    "ConsumedHandleError",
    "DiskOffloadFilter",
    "ExportedLayout",
    "ExternalLayout",
    "FullyContiguous",
    "ImmutableBlock",
    "KvConnectorMetadata",
    "KvFormat",
    "KvbmConnector",
    "KvbmError",
    "LayerSeparated",
    "LayoutConfig",
    "LayoutConfigError",
    "LayoutDescriptor",
    "MemoryKind",
    "ModelFingerprint",
    "TokenIdError",
    "MutableBlock",
    "ParallelMode",
    "PoolExhaustedError",
    "PoolStats",
    "RemoteBlockError",
    "RemoteExporter",
    "RemoteReader",
    "ReplicatedLoader",
    "RuntimeConfig",
    "RuntimeMetrics",
    "ScheduledRequest",
    "SchedulerOutput",
    "ServeError",
    "ServeResult",
    "StepEvent",
    "StorageTierError",
    "TensorParallelWorker",
    "TransferClosedError",
    "TransferManager",
    "TransferPath",
    "PinnedBlocks",
    "WeakBlock",
    "align_up",
    "chain_hash",
    "convert",
    "copy_blocks",
    "fill_synthetic_kv",
    "from_universal",
    "head_shard",
    "init_group",
    "local_hash",
    "make_layout",
    "salt_hash",
    "sequence_hashes",
    "shard_config",
    "synthetic_block_bytes",
    "synthetic_kv",
    "to_universal",
]
