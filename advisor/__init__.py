"""The advisor: journal → PrefixIndex fold, tiering policies, planner and mover, query API.

Imports ``event_plane`` and ``storage_backends`` only (the REST API is loaded by name).
"""

from advisor.frequency import FrequencySettings, FrequencySketch, SsdAdmissionFilter
from advisor.index import BlockInfo, IndexCounters, PrefixIndex
from advisor.journal import BadPayloadError, JournalError, SqliteJournal
from advisor.mover import Mover
from advisor.plan import PlanItem, PlanKind, PlanResult, PlanStatus
from advisor.planner import Plan, Planner, TokenBucket
from advisor.policies import (
    CompactionSettings,
    DemotionSettings,
    PlannerSettings,
    PolicyInput,
    PolicySettings,
    PromotionSettings,
    VolumeUsage,
    plan_all,
    plan_compactions,
    plan_demotions,
    plan_promotions,
)
from advisor.prefix_policy import PrefixPolicySettings, PrefixValueCache, ReuseStats
from advisor.query import AdvisorQuery, LookupResult, VolumeView
from advisor.service import AdvisorError, AdvisorService, main
from advisor.settings import AdvisorSettings, SettingsError, VolumeSettings
from advisor.snapshot import (
    RedisSnapshotStore,
    Snapshot,
    SnapshotError,
    SqliteSnapshotStore,
    load_latest,
)

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
