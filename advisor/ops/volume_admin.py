"""Operator actions: register a volume with a running advisor, or unregister one
(docs/operations.md, "Operator actions").

Registering opens the volume in the advisor's storage agent (the catalog records its spec)
and adds it to the advisor's volumes, as a slow volume or with no role; unregistering
refuses while the catalog still places blocks there (drain it first, :mod:`advisor.ops.drain`)
and refuses the fast and archive volumes (their roles are fixed by the configuration).
Both run between policy rounds. The change is kept in the advisor's run state (the journal
file, :mod:`advisor.embedded.run_state`) and survives a restart; a volume registered at run time that
later appears in the configuration is the configuration's from then on.  A secret given
inline (``secret_key``) is stored too, so the journal file is made owner-only (0600) then.
Workers open volumes from their own configuration.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Literal

if TYPE_CHECKING:
    from advisor.ops.operated import OperatedAdvisor
    from advisor.settings import VolumeSettings

logger = logging.getLogger(__name__)

Role = Literal["slow", "none"]


class VolumeAdminError(RuntimeError):
    """The volume cannot be registered or unregistered (the message says why)."""


class VolumeUnreachableError(VolumeAdminError):
    """The volume's endpoint did not answer the probe in time (the message says which)."""


def register_volume(service: OperatedAdvisor, volume: VolumeSettings, role: Role = "none",
                    probe_timeout_s: float = 3.0) -> None:
    """Open ``volume`` in the advisor's storage agent and add it to its volumes.

    An S3 volume's endpoint is probed first (:func:`storage_backends.s3_volume.probe_s3`,
    ``probe_timeout_s`` to connect and as much to read), outside the round lock: a silent
    endpoint costs the caller that long, once, and holds up no policy round or operator
    action meanwhile.

    Raises:
        VolumeUnreachableError: the S3 endpoint did not answer the probe.
        VolumeAdminError: no storage attached, the id is taken, or the storage layer refused
            the descriptor (bad root, unreachable endpoint...: its message is kept).
    """
    from storage_backends.types import S3EndpointUnreachableError, StorageError

    agent = service.agent
    if agent is None:
        raise VolumeAdminError("this advisor has no storage attached")
    s = service.settings
    if any(v.id == volume.id for v in s.volumes):
        raise VolumeAdminError(f"volume {volume.id!r} is already registered")
    if volume.kind == "s3":
        from storage_backends.s3_volume import probe_s3

        try:
            probe_s3(volume.to_descriptor(), probe_timeout_s)
        except S3EndpointUnreachableError as exc:
            raise VolumeUnreachableError(f"cannot open volume {volume.id!r}: {exc}") from None
        except (StorageError, ValueError, OSError) as exc:
            raise VolumeAdminError(f"cannot open volume {volume.id!r}: {type(exc).__name__}: {exc}") from None
    with service.round_lock:
        if any(v.id == volume.id for v in s.volumes):
            raise VolumeAdminError(f"volume {volume.id!r} is already registered")
        try:
            agent.register_volume(volume.to_descriptor())
        except (StorageError, ValueError, OSError) as exc:
            raise VolumeAdminError(f"cannot open volume {volume.id!r}: {type(exc).__name__}: {exc}") from None
        s.volumes.append(volume)
        if role == "slow":
            s.slow_volumes.append(volume.id)
        service.runtime_volumes[volume.id] = (volume, role)
        service.save_admin_state()
    logger.warning("advisor: registered volume %s (%s, role %s)", volume.id, volume.kind, role)


def unregister_volume(service: OperatedAdvisor, volume_id: str) -> None:
    """Close an empty volume and remove it from the advisor's volumes.

    Raises:
        VolumeAdminError: no storage, unknown volume, the fast or archive volume, or blocks
            still placed there (drain first).
    """
    agent = service.agent
    if agent is None:
        raise VolumeAdminError("this advisor has no storage attached")
    s = service.settings
    with service.round_lock:
        if not any(v.id == volume_id for v in s.volumes):
            raise VolumeAdminError(f"unknown volume {volume_id!r}")
        if volume_id in (s.fast_volume, s.archive_volume):
            raise VolumeAdminError(f"volume {volume_id!r} is the fast or archive volume: change the configuration")
        left = sum(1 for _ in agent.catalog.iter_volume(volume_id))
        if left:
            raise VolumeAdminError(f"volume {volume_id!r} still holds {left} blocks: drain it first")
        agent.unregister_volume(volume_id)
        s.volumes[:] = [v for v in s.volumes if v.id != volume_id]
        s.slow_volumes[:] = [v for v in s.slow_volumes if v != volume_id]
        service.runtime_volumes.pop(volume_id, None)
        service.draining.discard(volume_id)
        service.save_admin_state()
    logger.warning("advisor: unregistered volume %s", volume_id)
