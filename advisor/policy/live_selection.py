"""Feeding the live expert selection from an index's event stream: the one code path of the
embedded advisor and of each scaled-mode partition that plans moves (docs/design.md §7).

Both fold event batches into a :class:`~advisor.index.prefix_index.PrefixIndex` and, right
after each batch, hand it to their :class:`~advisor.policy.eviction.experts.LiveSelector`
(:func:`observe`: the batch's Store runs become requests, their ancestors read from that
index; the advisors' own moves are not requests).  Before a policy round they ask for the
leader for the fast tier's capacity (:func:`leader_for`), outside the index lock (the
replay is O(window) per expert), and pass it to ``plan_all``.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from advisor.policy.eviction.experts import LiveSelector
from advisor.policy.policies import SelectorLiveSettings

__all__ = ["leader_for", "new_selector", "observe"]


class _BlockFacts(Protocol):
    parent: int | None


class _Index(Protocol):
    def block(self, sequence_hash: int) -> _BlockFacts | None: ...


def new_selector(settings: SelectorLiveSettings) -> LiveSelector:
    """A selector bounded by ``settings`` (sample rate, window quota in block references,
    references between two replays, finish hints kept)."""
    return LiveSelector(settings.sample_rate, settings.max_window_refs, settings.min_new_refs,
                        max_hints=settings.max_finish_hints, finish_sources=settings.finish_reason_sources)


def observe(selector: LiveSelector, index: _Index, batch: object,
            is_own_move: Callable[[str], bool] | None = None) -> int:
    """Hand one batch, just folded into ``index``, to ``selector``; returns the requests it
    held (:meth:`LiveSelector.observe_batch`).  The caller holds the index's lock.

    Args:
        batch: an :class:`event_plane.schema.EventBatch`.
        is_own_move: whether a batch source is an advisor's mover (its Stores are moves,
            not requests); ``None``: every source is a worker.
    """
    if is_own_move is not None and is_own_move(str(getattr(batch, "source", ""))):
        return 0

    def parent_of(h: int) -> int | None:
        info = index.block(h)
        return info.parent if info is not None else None
    return selector.observe_batch(batch, parent_of)


def leader_for(selector: LiveSelector, capacity_bytes: int) -> str:
    """The expert to follow for a fast tier of ``capacity_bytes``: the leader after replaying
    the window for ``capacity_bytes // block bytes`` blocks (the latest Stored block's size);
    the current leader when either is unknown (``<= 0``)."""
    block = selector.block_bytes
    if capacity_bytes <= 0 or block <= 0:
        return selector.leader
    return selector.refresh(max(1, capacity_bytes // block))
