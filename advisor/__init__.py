"""The advisor: the KV event log folded into a prefix index, tiering policies, moves, the
embedded service and the scaled cluster, in rooms (docs/design.md, "The rooms of the advisor").

Rooms, lowest first (each imports only rooms below it): ``index``; ``ingest`` and ``policy``;
``moves``; ``settings`` (a module); ``ops``; ``embedded`` and ``cluster``.  This face
re-exports what a user imports most (``advisor.PrefixIndex``, ``advisor.AdvisorService``...);
``python -m advisor`` runs the embedded service, ``python -m advisor.cluster`` one cluster
advisor.  The package imports ``event_plane`` and ``storage_backends`` only.

The face is lazy (PEP 562 ``__getattr__``): ``import advisor.index`` loads the index room
alone, not the embedded service with it; a name of the face loads its room on first use.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from event_plane.lazy_face import lazy_getattr

if TYPE_CHECKING:
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

_FACE: dict[str, str] = {
    "AdvisorError": "advisor.embedded",
    "AdvisorService": "advisor.embedded",
    "main": "advisor.embedded",
    "BlockInfo": "advisor.index",
    "FrequencySettings": "advisor.index",
    "FrequencySketch": "advisor.index",
    "IndexCounters": "advisor.index",
    "PrefixIndex": "advisor.index",
    "RedisSnapshotStore": "advisor.index",
    "Snapshot": "advisor.index",
    "SnapshotError": "advisor.index",
    "SqliteSnapshotStore": "advisor.index",
    "SsdAdmissionFilter": "advisor.index",
    "load_latest": "advisor.index",
    "BadPayloadError": "advisor.ingest",
    "JournalError": "advisor.ingest",
    "SqliteJournal": "advisor.ingest",
    "Mover": "advisor.moves",
    "Plan": "advisor.moves",
    "Planner": "advisor.moves",
    "TokenBucket": "advisor.moves",
    "AdvisorQuery": "advisor.ops",
    "LookupResult": "advisor.ops",
    "VolumeView": "advisor.ops",
    "CompactionSettings": "advisor.policy",
    "DemotionSettings": "advisor.policy",
    "PlanItem": "advisor.policy",
    "PlanKind": "advisor.policy",
    "PlannerSettings": "advisor.policy",
    "PlanResult": "advisor.policy",
    "PlanStatus": "advisor.policy",
    "PolicyInput": "advisor.policy",
    "PolicySettings": "advisor.policy",
    "PrefixPolicySettings": "advisor.policy",
    "PrefixValueCache": "advisor.policy",
    "PromotionSettings": "advisor.policy",
    "ReuseStats": "advisor.policy",
    "VolumeUsage": "advisor.policy",
    "plan_all": "advisor.policy",
    "plan_compactions": "advisor.policy",
    "plan_demotions": "advisor.policy",
    "plan_promotions": "advisor.policy",
    "AdvisorSettings": "advisor.settings",
    "SettingsError": "advisor.settings",
    "VolumeSettings": "advisor.settings",
}
"""Each name of the face and the room that defines it."""


__getattr__ = lazy_getattr(__name__, _FACE)


def __dir__() -> list[str]:
    """The module's names and every name of the face."""
    return sorted(set(globals()) | set(_FACE))


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
