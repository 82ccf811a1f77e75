"""The advisor: the KV event log folded into a prefix index, tiering policies, moves, the
embedded service and the scaled cluster, in rooms (docs/design.md, "The rooms of the advisor").

Rooms, lowest first (each imports only rooms below it): ``index``; ``ingest`` and ``policy``;
``moves``; ``settings`` (a module); ``ops``; ``embedded`` and ``cluster``.  This face
re-exports what a user imports most (``advisor.PrefixIndex``, ``advisor.AdvisorService``...);
``python -m advisor`` runs the embedded service, ``python -m advisor.cluster`` one cluster
advisor.  The package imports ``event_plane`` and ``storage_backends`` only.
"""

from advisor.embedded import AdvisorError, AdvisorService, main
from advisor.index import (
    BlockInfo,
    FrequencySettings,
    FrequencySketch,
    IndexCounters,
    PrefixIndex,
    RedisSnapshotStore,
    Snapshot,
    SnapshotError,
    SqliteSnapshotStore,
    SsdAdmissionFilter,
    load_latest,
)
from advisor.ingest import BadPayloadError, JournalError, SqliteJournal
from advisor.moves import Mover, Plan, Planner, TokenBucket
from advisor.ops import AdvisorQuery, LookupResult, VolumeView
from advisor.policy import (
    CompactionSettings,
    DemotionSettings,
    PlanItem,
    PlanKind,
    PlannerSettings,
    PlanResult,
    PlanStatus,
    PolicyInput,
    PolicySettings,
    PrefixPolicySettings,
    PrefixValueCache,
    PromotionSettings,
    ReuseStats,
    VolumeUsage,
    plan_all,
    plan_compactions,
    plan_demotions,
    plan_promotions,
)
from advisor.settings import AdvisorSettings, SettingsError, VolumeSettings

__all__ = [
    "RedisSnapshotStore",
    "Snapshot",
    "SnapshotError",
    "SqliteSnapshotStore",
    "TokenBucket",
    "load_latest",
    "SsdAdmissionFilter",
    "ReuseStats",
    "PrefixValueCache",
    "PrefixPolicySettings",
    "FrequencySketch",
    "FrequencySettings",
    "AdvisorError",
    "AdvisorQuery",
    "AdvisorService",
    "AdvisorSettings",
    "BadPayloadError",
    "BlockInfo",
    "CompactionSettings",
    "DemotionSettings",
    "IndexCounters",
    "JournalError",
    "LookupResult",
    "Mover",
    "Plan",
    "PlanItem",
    "PlanKind",
    "PlanResult",
    "PlanStatus",
    "Planner",
    "PlannerSettings",
    "PolicyInput",
    "PolicySettings",
    "PrefixIndex",
    "PromotionSettings",
    "SettingsError",
    "SqliteJournal",
    "VolumeSettings",
    "VolumeUsage",
    "VolumeView",
    "main",
    "plan_all",
    "plan_compactions",
    "plan_demotions",
    "plan_promotions",
]
