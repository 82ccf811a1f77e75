"""What the REST API and an operator ask of a running advisor: queries, drain, invalidate, volumes.

They act on an :class:`OperatedAdvisor` (a Protocol the embedded service implements), so
this room sits below ``embedded``, which hands out its :class:`AdvisorQuery`.
"""

from advisor.ops.operated import OperatedAdvisor
from advisor.ops.query import AdvisorQuery, LookupResult, VolumeView
from advisor.ops.drain import DrainError, DrainResult, drain_volume, undrain_volume
from advisor.ops.invalidate import InvalidateError, InvalidateResult, invalidate_namespace
from advisor.ops.volume_admin import VolumeAdminError, register_volume, unregister_volume

__all__ = [
    "AdvisorQuery",
    "drain_volume",
    "undrain_volume",
    "DrainError",
    "DrainResult",
    "invalidate_namespace",
    "InvalidateError",
    "InvalidateResult",
    "LookupResult",
    "OperatedAdvisor",
    "register_volume",
    "unregister_volume",
    "VolumeAdminError",
    "VolumeView",
]
