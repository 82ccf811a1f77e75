"""Which blocks should move where: tiering policies, prefix value, plan items, eviction kernels.

Modules: ``policies`` (promotion, demotion, compaction), ``prefix_policy`` (reuse
statistics per prefix), ``plan`` (what a policy asks for and what came of it), ``eviction/``
(numba kernels of LRU, ARC, S3-FIFO, SIEVE, LFU-DA, Belady and the default policy).
"""

from advisor.policy.plan import PlanItem, PlanKind, PlanResult, PlanStatus
from advisor.policy.policies import (
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
from advisor.policy.prefix_policy import PrefixPolicySettings, PrefixValueCache, ReuseStats

__all__ = [
    "CompactionSettings",
    "DemotionSettings",
    "plan_all",
    "plan_compactions",
    "plan_demotions",
    "plan_promotions",
    "PlanItem",
    "PlanKind",
    "PlannerSettings",
    "PlanResult",
    "PlanStatus",
    "PolicyInput",
    "PolicySettings",
    "PrefixPolicySettings",
    "PrefixValueCache",
    "PromotionSettings",
    "ReuseStats",
    "VolumeUsage",
]
