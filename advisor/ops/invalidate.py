"""Operator action: invalidate a namespace (a model fingerprint's blocks) on every volume
(docs/operations.md, "Operator actions").

Every block of the namespace that the catalog places on a volume the advisor's storage
agent has registered is deleted (catalog entry, then its segment when no live block is left
in it), and a Remove is published through the advisor's own publisher for each deleted block
the index places on that volume, so workers and other advisors stop looking for it there.
It runs between policy rounds (the round lock), so no move of those blocks is in flight.
Blocks in workers' own G1/G2 are not touched: they belong to the workers.

A model deployed with tensor or pipeline parallelism stores each rank's blocks under its
own namespace, the model's plus a layout suffix (``<ns>/tp0of2``, ``<ns>/tp1of2``, ``<ns>/pp1of4``;
``kvbm_runtime.config.KvbmConfig.namespace_suffix``): invalidating the model's namespace
retires every such layout (:func:`in_namespace`).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from event_plane.schema import remove

if TYPE_CHECKING:
    from advisor.ops.operated import OperatedAdvisor

logger = logging.getLogger(__name__)

PUBLISH_CHUNK = 1024
"""Removes published per flush."""


class InvalidateError(RuntimeError):
    """The advisor has no storage attached (nothing to invalidate on)."""


@dataclass(frozen=True)
class InvalidateResult:
    """What an invalidation did.

    Attributes:
        namespace: the namespace invalidated.
        deleted: volume id → blocks deleted there (volumes with none are left out).
        removes_published: Remove events published.
    """

    namespace: str
    deleted: dict[str, int] = field(default_factory=dict)
    removes_published: int = 0


def in_namespace(key_namespace: str, namespace: str) -> bool:
    """Whether a key's namespace is ``namespace`` or one of its parallel layouts
    (``namespace + "/" + suffix``, e.g. ``<ns>/tp1of2``)."""
    return key_namespace == namespace or key_namespace.startswith(namespace + "/")


def invalidate_namespace(service: OperatedAdvisor, namespace: str) -> InvalidateResult:
    """Delete every block of ``namespace`` and of its parallel layouts (:func:`in_namespace`)
    on every volume and publish their Removes.

    Args:
        service: a started advisor with storage attached.
        namespace: key namespace, e.g. ``ModelFingerprint.namespace()`` (16 hex digits).

    Raises:
        InvalidateError: the advisor has no storage agent or publisher.
        storage_backends.StorageError: a catalog or volume failure (blocks deleted before it
            stay deleted; their Removes are published up to that volume).
    """
    agent, publisher = service.agent, service.publisher
    if agent is None or publisher is None:
        raise InvalidateError("this advisor has no storage attached: nothing to invalidate")
    deleted: dict[str, int] = {}
    published = 0
    with service.round_lock:  # between policy rounds: no move of these blocks in flight
        for desc in agent.volumes():
            keys = [p.key for p in agent.catalog.iter_volume(desc.id) if in_namespace(p.key.namespace, namespace)]
            if not keys:
                continue
            deleted[desc.id] = agent.delete(keys)
            events = []
            with service.lock:  # one Remove per block: the ranks of a layout share sequence hashes
                for h in sorted({k.sequence_hash for k in keys}):
                    info = service.index.block(h)
                    if info is not None and desc.id in info.locations:
                        events.append(remove(h, info.prefix_hash, info.parent, info.size, desc.id))
            for i in range(0, len(events), PUBLISH_CHUNK):
                publisher.publish(events[i : i + PUBLISH_CHUNK])
                publisher.flush()
            published += len(events)
    logger.warning("advisor: invalidated namespace %s: %s blocks deleted, %d Removes published",
                   namespace, deleted, published)
    return InvalidateResult(namespace, deleted, published)
