"""What the queries and operator actions use of an advisor: the :class:`OperatedAdvisor`
protocol.

:class:`advisor.embedded.service.AdvisorService` implements it; :class:`~advisor.ops.query.AdvisorQuery`,
:func:`~advisor.ops.drain.drain_volume`, :func:`~advisor.ops.invalidate.invalidate_namespace` and
:mod:`advisor.ops.volume_admin` take it, so they need not import the service that hands them
out (``AdvisorService.query()``).
"""

from __future__ import annotations

import threading
from collections.abc import MutableSequence
from typing import TYPE_CHECKING, Any, Protocol

from advisor.index.prefix_index import PrefixIndex
from advisor.policy.plan import PlanResult

if TYPE_CHECKING:
    from advisor.moves.mover import Mover
    from advisor.settings import AdvisorSettings


class OperatedAdvisor(Protocol):
    """A running advisor as its queries and operator actions see it.

    Attributes:
        settings: its settings (volumes and their roles, namespaces).
        index: the prefix index; read it under ``lock``.
        lock: the state lock (index, counters, ``plans``, ``position``).
        round_lock: held for a whole policy round; operator actions take it so that no move
            is in flight meanwhile.
        agent: the ``storage_backends.StorageAgent``, ``None`` without storage.
        catalog: the agent's placement catalog (``storage_backends.SqliteCatalog``), ``None``
            without storage.
        mover: the mover, ``None`` without storage.
        publisher / subscriber: the event publisher and subscriber, or ``None``.
        metrics: the Prometheus figures (``advisor.embedded.metrics.AdvisorMetrics``: ``registry``,
            ``record_results``).
        plans: the most recent executed plan items, newest last.
        position: the journal position applied to the index.
        counters: ingest counters.
        rate: the arrival meter (``rate()``, ``busy_rate()``: events per second).
        started_at: ``time.monotonic()`` at start, ``None`` before.
        journal_error: why journal appends fail now, ``None`` while they succeed.
        draining: ids of the volumes a drain marked (no policy move goes onto them).
        runtime_volumes: volumes registered at run time, ``{id: (VolumeSettings, role)}``.
        namespace_counts: the catalog's placements per namespace and volume, as
            :meth:`managed_namespaces` last saw them.
        namespaces_left: namespaces the catalog holds blocks in that are not managed → blocks.
    """

    settings: AdvisorSettings
    index: PrefixIndex
    lock: threading.RLock
    agent: Any
    catalog: Any
    mover: Mover | None
    publisher: Any
    subscriber: Any
    metrics: Any
    plans: MutableSequence[PlanResult]
    position: int
    counters: dict[str, int]
    rate: Any
    started_at: float | None
    journal_error: str | None
    draining: set[str]
    runtime_volumes: dict[str, tuple[Any, str]]
    namespace_counts: dict[str, dict[str, int]]
    namespaces_left: dict[str, int]

    @property
    def round_lock(self) -> threading.Lock:
        """The lock a policy round holds."""

    def run_policies_once(self) -> list[PlanResult]:
        """Run one policy round now and return its results."""

    def mover_summary(self) -> dict[str, Any]:
        """Done / skipped / failed counts and bytes moved per plan kind."""

    def subscriber_stats(self) -> dict[str, int]:
        """The subscriber's counters (empty without one)."""

    def save_admin_state(self) -> None:
        """Store :attr:`runtime_volumes` and :attr:`draining` in the run state (kept across
        a restart)."""

    def managed_namespaces(self, max_age_s: float = 5.0) -> list[str]:
        """The key namespaces it manages now (configured, then followed from the catalog,
        under ``max_namespaces``); the catalog looked at again past ``max_age_s``."""

    def ingest_problem(self) -> str | None:
        """Why subscribed batches are not ingested now, ``None`` while they are."""
