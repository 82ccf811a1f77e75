"""The advisor as one process: the service with its journal fold, policy rounds, run state and metrics.

``python -m advisor --config FILE.json`` runs :func:`main`.
"""

from advisor.embedded.service import AdvisorError, AdvisorService, main
from advisor.embedded.metrics import AdvisorMetrics
from advisor.embedded.owner_lock import OwnedError, OwnerLock
from advisor.embedded.run_state import RunStateStore
from advisor.embedded.volume_backoff import FullVolumeBackoff

__all__ = [
    "AdvisorError",
    "AdvisorMetrics",
    "AdvisorService",
    "FullVolumeBackoff",
    "main",
    "OwnedError",
    "OwnerLock",
    "RunStateStore",
]
