"""Dead sources: a source silent for ``source_ttl_s`` has its ``g1``/``g2`` blocks dropped.

A worker that stopped (or lost its network) leaves its private tiers in the index forever:
nothing else ever removes them.  The advisor therefore expires a source from which it has
received no batch for ``source_ttl_s`` seconds (its own monotonic clock, see :func:`due`)
while the index still places blocks in its ``<source>/g1`` or ``<source>/g2``.

Deterministic replay: the expiry is not a side effect on the index but a batch, journaled
like any other before it is applied.  It carries the source's name and current epoch, two
Cleared events (``g1``, ``g2``: ``docs/events.md`` §2.3), a sequence number from a reserved
range (:data:`EXPIRY_SEQ_BASE` + the source's batch count, above any real publisher's
counter, so it never takes the place of a real batch in the journal), and the source's own
last ``ts_ns`` (so its last-seen time stays the time it was last heard from).  A replay of
the journal, or a fresh fold of it, applies the same batch at the same place and gives the
same index.  The source's blocks on shared volumes stay (a Cleared of a private tier
touches nothing else).  A source that comes back with the same epoch goes on as before (its
next batches fold normally); one that restarted has a new epoch anyway.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from advisor.index.reference import PRIVATE_TIERS
from event_plane.schema import WIRE_VERSION, EventBatch, cleared

EXPIRY_SEQ_BASE = 1 << 63
"""Sequence numbers of expiry batches start here (a publisher counts from 0, one per batch)."""


@dataclass(frozen=True)
class SourceSeen:
    """What expiry reads of a source (``advisor.index.prefix_index.SourceState``)."""

    epoch: int
    batches: int
    last_ts_ns: int


def private_blocks(index: Any, source: str) -> int:
    """Blocks ``index`` (a :class:`~advisor.index.prefix_index.PrefixIndex`) places in ``source``'s private tiers."""
    return int(sum(index.count_at(f"{source}/{t}") for t in sorted(PRIVATE_TIERS)))


def due(holding: Iterable[str], heard: Mapping[str, float], now: float, ttl_s: float, default: float,
        exclude: Iterable[str] = ()) -> list[str]:
    """Sources silent for more than ``ttl_s`` seconds that still hold private blocks.

    Silence is measured on the advisor's monotonic clock from the last batch it received
    from the source (``heard``), or from ``default`` (the advisor's start) for a source not
    heard from since: the publishers' clocks (``ts_ns``) may be skewed or, in tests,
    synthetic, so they only serve to show the last-seen time.

    Args:
        holding: the sources that still have ``g1``/``g2`` blocks in the index.
        heard: per source, monotonic seconds of the last batch received.
        now: monotonic seconds now.
        ttl_s: the time to live (``0`` means never: returns ``[]``).
        default: monotonic seconds used for a source missing from ``heard``.
        exclude: sources never expired (the advisor's own).

    Returns:
        The names, sorted.
    """
    if ttl_s <= 0:
        return []
    skip = set(exclude)
    return sorted(n for n in set(holding) if n not in skip and now - heard.get(n, default) > ttl_s)


def expiry_batch(source: str, seen: SourceSeen) -> EventBatch:
    """The batch that drops ``source``'s ``g1`` and ``g2`` (module docstring)."""
    events = [cleared(t) for t in sorted(PRIVATE_TIERS)]
    return EventBatch(WIRE_VERSION, source, seen.epoch, EXPIRY_SEQ_BASE + seen.batches, seen.last_ts_ns, events)


def is_expiry(batch: EventBatch) -> bool:
    """Whether ``batch`` is an expiry batch (by its reserved sequence number)."""
    return batch.seq >= EXPIRY_SEQ_BASE


__all__ = ["EXPIRY_SEQ_BASE", "SourceSeen", "due", "expiry_batch", "is_expiry", "private_blocks"]
