"""Scheduler side of the connector when the engine runs it in its own process (vLLM).

The leader holds no KV memory.  It answers the engine's prefix queries from a
:class:`~kvbm_runtime.residency.ResidencyDirectory` that the workers keep current
(:meth:`KvbmLeader.apply_report`), plans loads into the engine's blocks, and lists each
step's saves (the blocks the step fills).  Its output, :class:`KvConnectorMetadata`, is
plain data the engine ships to the workers, which do the copies
(:class:`~kvbm_runtime.connector.KvbmConnectorWorker`).

Block identity is the engine's own: the caller passes each request's sequence hashes
(for vLLM, its block hashes reduced to u64 as its KV events carry them), so the Store /
Remove events of the workers name the same blocks as the engine's own KV events.

Call order per engine step (vLLM's names):

1. ``match(request, num_computed_tokens)`` for each waiting request — side-effect free
   apart from remembering the match; may be called again for the same request;
2. ``plan_load(request_id, block_ids, num_external_tokens)`` once the engine allocated
   blocks for the tokens it accepted;
3. ``build_meta(step)`` — the loads planned since the last call and the step's saves;
4. ``apply_report(report)`` with the workers' step output;
5. ``finished(request_id)`` when a request ends: ``True`` when saves of it may still
   read its blocks (the engine frees them once a worker lists it as finished sending).
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

from .connector import BlockTransfer, ConnectorError, KvConnectorMetadata, RequestTransfers
from .residency import HOST, STORAGE, ResidencyDirectory, ResidencyReport, Transition

logger = logging.getLogger(__name__)


def shared_lookup(
    catalog: PlacementCatalogView, namespaces: Sequence[str],
    observe: Callable[[Sequence[int], Sequence[str | None]], None] | None = None,
) -> Callable[[Sequence[int]], list[str | None]]:
    """A :class:`KvbmLeader` ``shared`` function over a placement catalog: per block, the
    volume holding it (rank 0's copy) when the catalog holds it under every one of
    ``namespaces`` (one per tensor-parallel rank), else ``None``.  A catalog that cannot
    be asked matches nothing (logged).

    Args:
        catalog: ``get_many(keys) -> [Placement | None]`` (a ``storage_backends``
            catalog; only read).
        namespaces: the storage key namespaces of the ranks.
        observe: called with ``(hashes, volumes)`` after each lookup the catalog answered
            (not after a failed one): what the catalog says now, e.g. for
            :meth:`kvbm_runtime.tier_events.TierEventLog.catalog`.
    """
    from storage_backends.types import BlockKey, StorageError

    spaces = list(namespaces)
    n = len(spaces)

    def held(hashes: Sequence[int]) -> list[str | None]:
        keys = [BlockKey(ns, h) for h in hashes for ns in spaces]
        try:
            found = catalog.get_many(keys)
        except StorageError as exc:  # the catalog is away: match nothing from it
            logger.warning("placement catalog lookup failed, no shared-volume match this time: %r", exc)
            return [None] * len(hashes)
        out = [found[i * n].volume_id if all(p is not None for p in found[i * n : (i + 1) * n]) else None
               for i in range(len(hashes))]
        if observe is not None:
            observe(hashes, out)
        return out

    return held


class PlacementCatalogView(Protocol):
    """What :func:`shared_lookup` reads of a placement catalog."""

    def get_many(self, keys: Sequence[Any]) -> list[Any]: ...


@dataclass(slots=True)
class StepRequest:
    """One request scheduled in an engine step.

    Attributes:
        request_id: engine request id.
        sequence_hashes: the request's full-block sequence hashes so far, in block order.
        block_ids: the engine's block ids of the request, in block order.
        num_computed_tokens: tokens whose KV is in the engine before the step.
        num_scheduled_tokens: tokens the step computes.
    """

    request_id: str
    sequence_hashes: Sequence[int]
    block_ids: Sequence[int]
    num_computed_tokens: int
    num_scheduled_tokens: int

    def saved_blocks(self, page_size: int) -> range:
        """The blocks the step completes, which :meth:`KvbmLeader.build_meta` lists for
        saving: ``[ceil(computed / page), (computed + scheduled) // page)``, bounded by the
        hashes known (loaded blocks and the engine's own prefix hits are not saved again)."""
        lo = -(-self.num_computed_tokens // page_size)
        hi = min((self.num_computed_tokens + self.num_scheduled_tokens) // page_size, len(self.sequence_hashes))
        return range(lo, max(lo, hi))


@dataclass(slots=True)
class _Match:
    hashes: list[int]
    first: int
    tiers: list[str]
    volumes: list[str | None]  # per matched block: the volume of a storage block, when known
    load_async: bool  # what match() told the engine: the planned load must be the same kind


@dataclass(slots=True)
class LeaderStats:
    """Counters of the leader (blocks unless stated).

    Attributes:
        lookups: ``match`` calls.
        matched_g2, matched_storage: blocks planned for loading, per source tier.
        saves: blocks listed for saving.
        reports: worker reports applied.
        load_failures: blocks whose load a worker reported as failed.
    """

    lookups: int = 0
    matched_g2: int = 0
    matched_storage: int = 0
    saves: int = 0
    reports: int = 0
    load_failures: int = 0


@dataclass(slots=True)
class _Pending:
    loads: list[RequestTransfers] = field(default_factory=list)


class KvbmLeader:
    """Scheduler-side connector over a residency directory (see module doc).

    Args:
        page_size: tokens per block (the engine's block size).
        salt: salt recorded in the transfers' block identities (informational; the
            engine's hashes already include its own salt).
        world_size: worker ranks that must all hold a block (tensor-parallel size).
        shared: ``shared(hashes)`` says per block which shared volume holds it now
            (a volume id, or ``None``; ``True`` / ``False`` are read as "held, volume
            unknown" / "not held"): the placement catalog the workers and the advisor
            share (blocks other engines stored, blocks the advisor moved).  It extends
            the match where the directory ends, and names the volume of the directory's
            own storage blocks.  ``None``: the directory alone.  Called outside the
            leader's lock.
        sync_volumes: volumes fast enough to load from within the step (local POSIX
            volumes: a read of a request's blocks takes milliseconds, less than one
            engine step).  A load whose storage blocks are all on these volumes is
            synchronous, like a G2 load: the request is computed in the step that loads
            it.  Any other storage block (object storage, or a volume not known) makes
            the load asynchronous: the engine runs other requests meanwhile, and the
            request waits for the step after the one that sees the load finished.
    """

    def __init__(
        self, page_size: int, salt: int = 0, world_size: int = 1,
        shared: Callable[[Sequence[int]], Sequence[str | bool | None]] | None = None,
        sync_volumes: Collection[str] = (),
    ) -> None:
        if page_size <= 0:
            raise ValueError(f"page_size must be > 0, got {page_size}")
        self.page = page_size
        self.salt = salt
        self.shared = shared
        self.sync_volumes = frozenset(sync_volumes)
        self.directory = ResidencyDirectory(world_size)
        self.stats = LeaderStats()
        self._matches: dict[str, _Match] = {}
        self._pending = _Pending()
        self._saving: set[str] = set()
        self._planned: dict[str, tuple[int, int]] = {}
        self._lock = threading.Lock()

    # ------------------------------------------------------------------ lookups
    def match(self, request_id: str, sequence_hashes: Sequence[int], num_tokens: int, num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens beyond ``num_computed_tokens`` that the workers can load.

        Args:
            request_id: engine request id.
            sequence_hashes: the prompt's full-block hashes, in block order.
            num_tokens: tokens of the request (the engine must compute at least one, so
                a prompt is never matched whole).
            num_computed_tokens: the engine's own prefix hit (a multiple of
                ``page_size``).

        The directory (what this engine's workers hold) answers first; past its end,
        ``shared`` (the placement catalog) extends the match with blocks on the shared
        volumes.

        Returns:
            ``(tokens, load_async)``: a multiple of ``page_size``; ``load_async`` is true
            when part of the match comes from a storage volume not in ``sync_volumes``
            (a slow tier: the engine schedules other requests while it loads), false for
            host-only matches, matches on ``sync_volumes`` (copied before the step's
            forward pass) and for no match.

        Raises:
            ConnectorError: ``num_computed_tokens`` negative or not block-aligned.
        """
        if num_computed_tokens < 0 or num_computed_tokens % self.page:
            raise ConnectorError(f"num_computed_tokens={num_computed_tokens} must be a non-negative multiple of {self.page}")
        first = num_computed_tokens // self.page
        last = min(len(sequence_hashes), max(0, num_tokens - 1) // self.page)
        hashes = list(sequence_hashes[:last])
        tiers = self.directory.match(hashes[first:]) if first < last else []
        volumes: list[str | None] = [None] * len(tiers)
        rest = hashes[first + len(tiers) :]
        if self.shared is not None:
            # one catalog query: where the directory's own storage blocks are now, and
            # how far the shared volumes extend the match
            own = [k for k, t in enumerate(tiers) if t == STORAGE]
            query = [hashes[first + k] for k in own] + rest
            where = list(self.shared(query)) if query else []
            for k, w in zip(own, where):
                volumes[k] = w if isinstance(w, str) else None
            for w in where[len(own) :]:
                if not w:
                    break
                tiers.append(STORAGE)
                volumes.append(w if isinstance(w, str) else None)
        load_async = self._is_async(tiers, volumes)
        with self._lock:
            self.stats.lookups += 1
            if tiers:
                self._matches[request_id] = _Match(hashes, first, tiers, volumes, load_async)
            else:
                self._matches.pop(request_id, None)
        return len(tiers) * self.page, load_async

    def _is_async(self, tiers: Sequence[str], volumes: Sequence[str | None]) -> bool:
        """Whether a load of these blocks is asynchronous (see ``sync_volumes``)."""
        return any(t == STORAGE and (v is None or v not in self.sync_volumes) for t, v in zip(tiers, volumes))

    def plan_load(self, request_id: str, block_ids: Sequence[int], num_external_tokens: int) -> None:
        """Plan the loads of the tokens the engine accepted into its ``block_ids``.

        Args:
            request_id: a request :meth:`match` matched.
            block_ids: the engine's block ids of the whole request, in block order.
            num_external_tokens: tokens to load (0: none; the match is dropped).

        Raises:
            ConnectorError: more tokens than matched, or too few block ids.
        """
        with self._lock:
            match = self._matches.pop(request_id, None)
        if num_external_tokens == 0 or match is None:
            return
        n, rest = divmod(num_external_tokens, self.page)
        if rest or n > len(match.tiers):
            raise ConnectorError(f"{num_external_tokens} external tokens but {len(match.tiers) * self.page} were matched")
        if len(block_ids) < match.first + n:
            raise ConnectorError(f"{len(block_ids)} engine blocks for {match.first + n} loaded blocks")
        hashes = match.hashes
        blocks = [
            BlockTransfer(h, hashes[i - 1] if i else None, hashes[0], self.salt, block_ids[i], match.tiers[i - match.first])
            for i, h in enumerate(hashes[match.first : match.first + n], start=match.first)
        ]
        # the engine waits for a finished_recving exactly when match() said asynchronous
        load_async = match.load_async
        from_host = sum(1 for b in blocks if b.tier == HOST)
        with self._lock:
            self._pending.loads.append(RequestTransfers(request_id, blocks, load_async))
            self._planned[request_id] = (from_host, n - from_host)
            self.stats.matched_g2 += from_host
            self.stats.matched_storage += n - from_host

    def planned_sources(self, request_id: str) -> tuple[int, int]:
        """``(blocks from G2, blocks from storage)`` of the request's last planned load
        (``(0, 0)`` when none); forgets it."""
        with self._lock:
            return self._planned.pop(request_id, (0, 0))

    # ------------------------------------------------------------------ steps
    def build_meta(self, step: Sequence[StepRequest]) -> KvConnectorMetadata:
        """The loads planned since the last call and the saves of the blocks ``step`` fills.

        A block is saved in the step that completes it (:meth:`StepRequest.saved_blocks`).

        Raises:
            ConnectorError: a request with fewer block ids than blocks to save.
        """
        with self._lock:
            pending, self._pending = self._pending, _Pending()
        meta = KvConnectorMetadata(loads=pending.loads)
        page = self.page
        for sr in step:
            saved = sr.saved_blocks(page)
            lo, hi = saved.start, saved.stop
            if hi <= lo:
                continue
            if len(sr.block_ids) < hi:
                raise ConnectorError(f"request {sr.request_id}: {len(sr.block_ids)} block ids for {hi} blocks")
            hashes = sr.sequence_hashes
            first = hashes[0]
            blocks = [
                BlockTransfer(hashes[i], hashes[i - 1] if i else None, first, self.salt, sr.block_ids[i], "g1")
                for i in range(lo, hi)
            ]
            meta.saves.append(RequestTransfers(sr.request_id, blocks))
            with self._lock:
                self._saving.add(sr.request_id)
                self.stats.saves += len(blocks)
        return meta

    def apply_report(self, report: ResidencyReport) -> list[Transition]:
        """Fold a worker step report (possibly merged over ranks) into the directory;
        returns the residency changes it made, in order
        (:meth:`~kvbm_runtime.residency.ResidencyDirectory.apply`).

        Raises:
            ValueError: a rank or tier the directory does not know.
        """
        changed = self.directory.apply(report)
        with self._lock:
            self.stats.reports += 1
            self.stats.load_failures += sum(r.load_failures for r in report.flatten())
        return changed

    def finished(self, request_id: str) -> bool:
        """The request ended; ``True`` when saves of it were listed (its blocks must stay
        until a worker reports it as finished sending)."""
        with self._lock:
            self._matches.pop(request_id, None)
            self._planned.pop(request_id, None)
            saving = request_id in self._saving
            self._saving.discard(request_id)
        return saving
