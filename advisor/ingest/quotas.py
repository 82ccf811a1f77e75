"""Admission of event batches into the advisor: quotas and publisher-reported hits.

Every batch from a subscribed stream passes :meth:`QuotaGuard.admit` before it is journaled
(``AdvisorService.ingest``), so the journal holds only what was admitted, as admitted:
a replay after a restart folds exactly what the live advisor folded, and what was refused
stays refused (it never entered the log).  The advisor's own batches (its moves) are not
checked.

What goes over a limit is refused *alone* and counted under a reason from the fixed
:class:`QuotaReason` enum (the Prometheus label set is bounded: never a source or a
location name):

* whole batch (batch-level reasons): more than ``max_batch_events`` events
  (``batch_events``); a source not yet known to the index while ``max_sources`` sources
  are (``sources``; known sources go on); ``extra_metadata`` of all events together above
  ``max_batch_metadata_bytes`` (``batch_metadata_bytes``); more events than the source's
  token bucket holds (``rate``: ``source_rate`` events/s refilled, ``source_burst``
  events at most);
* one event (event-level reasons; the rest of its batch is admitted): ``extra_metadata``
  above ``max_event_metadata_bytes`` (``metadata_bytes``); a Store at a volume name the
  index does not hold yet while ``max_locations`` volume names are held (``locations``;
  ``g1``/``g2`` are per source and bounded by ``max_sources``); a Store at the source's
  ``g1``/``g2`` while the source holds ``max_source_blocks`` blocks there
  (``source_blocks``); a Store while the index holds ``max_blocks`` blocks (``blocks``).
  Both count every admitted Store as a new block (a re-Store of a held block is counted
  too: the check reads no block), so they never let the state past the limit.

State quotas beside the rate: ``max_source_blocks`` bounds what one worker's ``g1``/``g2``
hold (a worker with 1 TiB of host memory and local disk at 2 MiB blocks holds 2^19 blocks;
the default 2^20 is twice that), ``max_blocks`` everything indexed (volumes included:
their blocks are shared by the sources that store them), ``max_bindings`` the source →
origin bindings (:mod:`event_plane.origins`; a batch whose source is not bound yet is
refused whole, reason ``bindings``, when that many are held; no binding is made for a
batch refused for any reason). Retired epochs are bounded where they are kept
(:data:`event_plane.ordering.MAX_RETIRED_EPOCHS` per source); the epochs forgotten are
counted here (``retired_epochs_forgotten``). Every batch costs at least one rate token,
an empty one too (a new epoch per empty batch is otherwise free).

Publisher-reported hits (``extra_metadata["hits"]``, ``docs/events.md`` §2.1): only sources
listed in ``reported_hits_sources`` may report hits, at most ``reported_hits_cap`` per
event; the key is removed from other sources' events (counted in ``hits_untrusted``) and
lowered to the cap for listed ones (the hits above the cap are counted in ``hits_capped``).
A re-Store or an onboarding still counts as an access whoever publishes it: reported hits
only ever add to what the index sees itself.

Sizes are those of the MessagePack encoding of ``extra_metadata`` (what the wire carries).
The rate limit uses the advisor's monotonic clock: it is decided live only (a refused batch
is not journaled), so the replay needs no clock.  With ``log=jetstream`` the stream is the
log: every entry is checked as it is folded (``AdvisorService._apply_logged``), with every
quota but the rate limit, which only reads the batch, the index and the limits, so a fold
from a snapshot decides the same again (with the same limits).
"""

from __future__ import annotations

import enum
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter
from typing import Any, Protocol

import msgspec

from advisor.index.reference import HITS_KEY, PRIVATE_TIERS, U64_MAX, is_valid_location
from event_plane.schema import EventBatch, EventType, KVEvent

logger = logging.getLogger(__name__)

_encoder = msgspec.msgpack.Encoder()
_metadata_of = attrgetter("extra_metadata")
_location_of = attrgetter("storage_location")


class QuotaReason(str, enum.Enum):
    """Why a batch or an event was refused (the ``reason`` label of the quota metrics)."""

    SOURCES = "sources"
    RATE = "rate"
    BATCH_EVENTS = "batch_events"
    BATCH_METADATA_BYTES = "batch_metadata_bytes"
    METADATA_BYTES = "metadata_bytes"
    LOCATIONS = "locations"
    BINDINGS = "bindings"
    SOURCE_BLOCKS = "source_blocks"
    BLOCKS = "blocks"


BATCH_REASONS = (QuotaReason.SOURCES, QuotaReason.RATE, QuotaReason.BATCH_EVENTS, QuotaReason.BATCH_METADATA_BYTES,
                 QuotaReason.BINDINGS)
"""Reasons that refuse a whole batch."""

EVENT_REASONS = (QuotaReason.METADATA_BYTES, QuotaReason.LOCATIONS, QuotaReason.SOURCE_BLOCKS, QuotaReason.BLOCKS)
"""Reasons that refuse one event (its batch goes on)."""


@dataclass(frozen=True)
class QuotaLimits:
    """The limits (see the module docstring; ``AdvisorSettings.quota_limits()`` builds them).

    Attributes:
        max_sources: distinct sources the index may know (a new one beyond is refused).
        max_locations: distinct volume names (non ``g1``/``g2`` ``storage_location``).
        max_batch_events: events per batch.
        max_event_metadata_bytes: encoded ``extra_metadata`` bytes per event.
        max_batch_metadata_bytes: encoded ``extra_metadata`` bytes per batch (all events).
        source_rate: events per second refilled into each source's token bucket.
        source_burst: events a source's bucket holds (its size; a full bucket at start).
        reported_hits_cap: reported hits one Store may add (``0``: none).
        reported_hits_sources: sources whose reported hits count; others' are removed.
        max_source_blocks: blocks one source may hold in its ``g1``/``g2``.
        max_blocks: blocks the index may hold (every location).
        max_bindings: source → origin bindings (a source not yet bound beyond is refused).
    """

    max_sources: int = 10_000
    max_locations: int = 256
    max_batch_events: int = 65_536
    max_event_metadata_bytes: int = 4096
    max_batch_metadata_bytes: int = 1 << 20
    source_rate: float = 200_000.0
    source_burst: int = 1 << 20
    reported_hits_cap: int = 8
    reported_hits_sources: frozenset[str] = frozenset()
    max_source_blocks: int = 1 << 20
    max_blocks: int = 1 << 24
    max_bindings: int = 20_000


@dataclass
class TokenBucket:
    """Token bucket of one source: ``rate`` tokens/s up to ``burst`` (the classic
    algorithm: tokens = min(burst, tokens + rate × elapsed); a take of ``n`` succeeds when
    ``n`` tokens are there and removes them)."""

    rate: float
    burst: float
    tokens: float
    last: float

    def take(self, n: int, now: float) -> bool:
        """Refill to ``now`` (seconds, monotonic), then take ``n`` tokens if there are."""
        if now > self.last:
            self.tokens = min(self.burst, self.tokens + (now - self.last) * self.rate)
            self.last = now
        if n <= self.tokens:
            self.tokens -= n
            return True
        return False


@dataclass
class QuotaCounters:
    """What :class:`QuotaGuard` refused and rewrote (cumulative).

    Attributes:
        refused_batches: per reason, batches refused whole.
        refused_events: per reason, events refused (a refused batch counts all its events).
        hits_capped: reported hits removed by ``reported_hits_cap`` (sum of the excess).
        hits_untrusted: events whose reported hits were removed (source not listed).
        epochs_forgotten: retired epochs forgotten beyond the per-source bound (a new
            epoch of a source that already keeps the most).
    """

    refused_batches: dict[QuotaReason, int] = field(default_factory=lambda: dict.fromkeys(QuotaReason, 0))
    refused_events: dict[QuotaReason, int] = field(default_factory=lambda: dict.fromkeys(QuotaReason, 0))
    hits_capped: int = 0
    hits_untrusted: int = 0
    epochs_forgotten: int = 0


@dataclass(frozen=True)
class Admission:
    """Outcome of :meth:`QuotaGuard.admit`.

    Attributes:
        batch: the batch to journal and apply (``None``: refused whole).
        changed: ``batch`` is not the batch offered (events refused or ``hits`` rewritten),
            so its payload must be encoded again.
        reason: why the batch was refused whole (``None`` when admitted).
    """

    batch: EventBatch | None
    changed: bool = False
    reason: QuotaReason | None = None


class IndexView(Protocol):
    """What :class:`QuotaGuard` reads of the index (a :class:`advisor.index.prefix_index.PrefixIndex` or
    the reference): ``sources()``, ``has_location(name)``, ``volume_count()``,
    ``count_at(location)`` and ``len()`` (blocks indexed)."""

    def sources(self) -> dict[str, Any]: ...
    def has_location(self, location: str) -> bool: ...
    def volume_count(self) -> int: ...
    def count_at(self, location: str) -> int: ...
    def __len__(self) -> int: ...


def reported_hits(value: object) -> int:
    """The hits an ``extra_metadata["hits"]`` value reports, as the index reads it: an int
    (not a bool) above 0, saturated at 2**64 - 1; anything else reports none (0)."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value if value < U64_MAX else U64_MAX
    return 0


class QuotaGuard:
    """Decides what of a batch enters the advisor (rules: module docstring).

    Args:
        limits: the :class:`QuotaLimits`.
        clock: monotonic seconds (for the token buckets; tests pass their own).

    Not thread-safe: the advisor calls :meth:`admit` under its state lock, with the index
    it then applies the batch to.
    """

    def __init__(self, limits: QuotaLimits, clock: Callable[[], float] = time.monotonic) -> None:
        self.limits = limits
        self.clock = clock
        self.counters = QuotaCounters()
        self._buckets: dict[str, TokenBucket] = {}
        self._logged: dict[QuotaReason, int] = dict.fromkeys(QuotaReason, 0)
        self.changes = 0
        """Incremented whenever a counter changes (callers compare it to skip unchanged ones)."""

    @staticmethod
    def counter_names() -> list[str]:
        """The keys of :meth:`as_dict`, in order."""
        return list(_COUNTER_NAMES)

    # ------------------------------------------------------------------ admission
    def admit(self, batch: EventBatch, index: IndexView, *, rate: bool = True,
              bindings: int | None = None, hits: bool = True) -> Admission:
        """Check ``batch`` against the quotas and the state of ``index`` (before the batch
        is applied to it); ``rate=False`` skips the token bucket (a decision that must come
        out the same when a log is folded again reads only the batch, the index and the
        limits). ``bindings``: the number of source → origin bindings held when the
        batch's source is not bound yet (``None``: bound, or no binding at all).

        Returns:
            An :class:`Admission`: the batch refused whole (``batch=None``, counted under
            its reason), or the batch to journal, possibly without some of its events and
            with ``hits`` rewritten (``changed=True``).
        """
        lim = self.limits
        events = batch.events
        n = len(events)
        source = batch.source
        if n > lim.max_batch_events:
            return self._refuse(batch, QuotaReason.BATCH_EVENTS, f"{n} events > {lim.max_batch_events}")
        known = index.sources()
        state = known.get(source)
        if state is None and len(known) >= lim.max_sources:
            return self._refuse(batch, QuotaReason.SOURCES, f"{len(known)} sources known (max {lim.max_sources})")
        if bindings is not None and bindings >= lim.max_bindings:
            return self._refuse(batch, QuotaReason.BINDINGS, f"{bindings} origin bindings held (max {lim.max_bindings})")
        sizes: list[int] | None = None
        metas = list(map(_metadata_of, events))
        if metas.count(None) != n:
            sizes = [0 if m is None else len(_encoder.encode(m)) for m in metas]
            total = sum(sizes)
            if total > lim.max_batch_metadata_bytes:
                return self._refuse(batch, QuotaReason.BATCH_METADATA_BYTES,
                                    f"{total} metadata bytes > {lim.max_batch_metadata_bytes}")
        if rate:
            bucket = self._buckets.get(source)
            now = self.clock()
            if bucket is None:
                bucket = TokenBucket(lim.source_rate, float(lim.source_burst), float(lim.source_burst), now)
            self._buckets[source] = bucket
            if not bucket.take(max(n, 1), now):  # an empty batch costs a token too
                return self._refuse(batch, QuotaReason.RATE, f"{max(n, 1)} events > {bucket.tokens:.0f} tokens left")
        if (state is not None and batch.epoch != state.epoch and batch.epoch not in state.retired_epochs
                and len(state.retired_epochs) >= state.retired_epochs.cap):
            self.counters.epochs_forgotten += 1
            self.changes += 1
        budget = self._block_budget(batch, index, state is None)
        if budget is None and sizes is None and all(
            sl in PRIVATE_TIERS or index.has_location(sl) or not is_valid_location(sl)
            for sl in set(map(_location_of, events))
        ):
            return Admission(batch)  # the common case: no metadata, no new volume name, room for the blocks
        return self._admit_events(batch, index, sizes, budget, hits)

    def _block_budget(self, batch: EventBatch, index: IndexView, new_source: bool) -> tuple[int, int] | None:
        """``None`` when every Store of ``batch`` fits both block quotas, else the Stores
        still allowed ``(at the source's g1/g2, anywhere)``. A new epoch starts the source's
        ``g1``/``g2`` empty (the fold drops them)."""
        lim = self.limits
        events = batch.events
        total = len(index)
        held = 0
        if not new_source and batch.epoch == index.sources()[batch.source].epoch:
            held = index.count_at(f"{batch.source}/g1") + index.count_at(f"{batch.source}/g2")
        # the common case, without a look at the events: even if every one were a Store at
        # g1/g2, both quotas would hold
        n = len(events)
        if total + n <= lim.max_blocks and held + n <= lim.max_source_blocks:
            return None
        stores = private = 0
        for ev in events:
            if ev.type == EventType.STORE:
                stores += 1
                private += ev.storage_location in PRIVATE_TIERS
        if total + stores <= lim.max_blocks and held + private <= lim.max_source_blocks:
            return None
        return max(lim.max_source_blocks - held, 0), max(lim.max_blocks - total, 0)

    def _admit_events(self, batch: EventBatch, index: IndexView, sizes: list[int] | None,
                      budget: tuple[int, int] | None = None, hits: bool = True) -> Admission:
        lim = self.limits
        c = self.counters
        private_left, total_left = budget if budget is not None else (-1, -1)
        trusted = batch.source in lim.reported_hits_sources
        out: list[KVEvent] | None = None
        new_volumes: set[str] = set()
        volumes: int | None = None  # volume names the index holds (counted once, when needed)
        for k, ev in enumerate(batch.events):
            keep: KVEvent | None = ev
            if sizes is not None and sizes[k] > lim.max_event_metadata_bytes:
                keep = None
                self._count_event(QuotaReason.METADATA_BYTES, batch, f"{sizes[k]} metadata bytes")
            elif ev.type == EventType.STORE:
                sl = ev.storage_location
                if budget is not None and sl in PRIVATE_TIERS and private_left <= 0:
                    keep = None
                    self._count_event(QuotaReason.SOURCE_BLOCKS, batch, f"source holds its most blocks "
                                      f"(max {lim.max_source_blocks})")
                elif budget is not None and total_left <= 0:
                    keep = None
                    self._count_event(QuotaReason.BLOCKS, batch, f"index holds its most blocks (max {lim.max_blocks})")
                elif budget is not None:
                    total_left -= 1
                    private_left -= sl in PRIVATE_TIERS
                if keep is not None and (sl not in PRIVATE_TIERS and sl not in new_volumes and is_valid_location(sl)
                        and not index.has_location(sl)):
                    if volumes is None:
                        volumes = index.volume_count()
                    if volumes + len(new_volumes) >= lim.max_locations:
                        keep = None
                        self._count_event(QuotaReason.LOCATIONS, batch, f"new volume name (max {lim.max_locations})")
                    else:
                        new_volumes.add(sl)
                extra = ev.extra_metadata
                if hits and keep is not None and extra and HITS_KEY in extra:
                    reported = reported_hits(extra[HITS_KEY])
                    if reported and not trusted:
                        c.hits_untrusted += 1
                        self.changes += 1
                        keep = msgspec.structs.replace(ev, extra_metadata={k2: v for k2, v in extra.items()
                                                                           if k2 != HITS_KEY})
                    elif reported > lim.reported_hits_cap:
                        c.hits_capped += reported - lim.reported_hits_cap
                        self.changes += 1
                        keep = msgspec.structs.replace(ev, extra_metadata={**extra, HITS_KEY: lim.reported_hits_cap})
            if keep is not ev and out is None:
                out = list(batch.events[:k])
            if out is not None and keep is not None:
                out.append(keep)
        if out is None:
            return Admission(batch)
        return Admission(msgspec.structs.replace(batch, events=out), changed=True)

    # ------------------------------------------------------------------ counting
    def _refuse(self, batch: EventBatch, reason: QuotaReason, why: str) -> Admission:
        self.counters.refused_batches[reason] += 1
        self.counters.refused_events[reason] += len(batch.events)
        self._log(reason, batch, why)
        return Admission(None, reason=reason)

    def _count_event(self, reason: QuotaReason, batch: EventBatch, why: str) -> None:
        self.counters.refused_events[reason] += 1
        self._log(reason, batch, why)

    def _log(self, reason: QuotaReason, batch: EventBatch, why: str) -> None:
        """Warn for the 1st, 1,001st, 2,001st... refusal of each reason (a flood must not
        flood the log as well)."""
        self.changes += 1
        n = self._logged[reason]
        self._logged[reason] = n + 1
        if n % 1000 == 0:
            logger.warning("advisor: quota %s refused (batch %r:%s:%s): %s (refusal %d of this reason)",
                           reason.value, batch.source[:64], batch.epoch, batch.seq, why, n + 1)

    def as_dict(self) -> dict[str, int]:
        """Flat counters: ``quota_refused_batches_<reason>``, ``quota_refused_events_<reason>``,
        ``reported_hits_capped``, ``reported_hits_untrusted``."""
        c = self.counters
        out = {f"quota_refused_batches_{r.value}": n for r, n in c.refused_batches.items() if r in BATCH_REASONS}
        out.update({f"quota_refused_events_{r.value}": n for r, n in c.refused_events.items()})
        out["reported_hits_capped"] = c.hits_capped
        out["reported_hits_untrusted"] = c.hits_untrusted
        out["retired_epochs_forgotten"] = c.epochs_forgotten
        return out


_COUNTER_NAMES = tuple(
    [f"quota_refused_batches_{r.value}" for r in QuotaReason if r in BATCH_REASONS]
    + [f"quota_refused_events_{r.value}" for r in QuotaReason]
    + ["reported_hits_capped", "reported_hits_untrusted", "retired_epochs_forgotten"])


__all__ = [
    "Admission", "BATCH_REASONS", "EVENT_REASONS", "IndexView", "QuotaCounters", "QuotaGuard", "QuotaLimits", "QuotaReason",
    "TokenBucket", "reported_hits",
]
