"""The prefix index: the event log folded into blocks, locations and hits; its core, reference and snapshots.

Modules: ``prefix_index`` (:class:`PrefixIndex`), ``_core`` (its compiled core,
``_core.pyx``), ``reference`` (the pure-Python fold it is checked against), ``frequency``
(the hit sketch), ``snapshot`` (index snapshots in SQLite or Redis).
"""

from advisor.index.prefix_index import (
    HITS_KEY,
    MOVE_KEY,
    PLACEMENT_KEYS,
    PRIVATE_TIERS,
    STATE_VERSION,
    U64_MAX,
    BlockInfo,
    IndexCounters,
    IndexStateError,
    PrefixIndex,
    SourceState,
    is_valid_location,
)
from advisor.index.frequency import FrequencySettings, FrequencySketch, SsdAdmissionFilter
from advisor.index.snapshot import (
    RedisSnapshotStore,
    Snapshot,
    SnapshotError,
    SqliteSnapshotStore,
    load_latest,
)

__all__ = [
    "BlockInfo",
    "FrequencySettings",
    "FrequencySketch",
    "HITS_KEY",
    "IndexCounters",
    "IndexStateError",
    "is_valid_location",
    "load_latest",
    "MOVE_KEY",
    "PLACEMENT_KEYS",
    "PrefixIndex",
    "PRIVATE_TIERS",
    "RedisSnapshotStore",
    "Snapshot",
    "SnapshotError",
    "SourceState",
    "SqliteSnapshotStore",
    "SsdAdmissionFilter",
    "STATE_VERSION",
    "U64_MAX",
]
