"""Folding a JetStream log into a prefix index once per batch (scaled mode, docs/scaling.md).

JetStream de-duplicates a re-sent batch by its ``Nats-Msg-Id`` (namespace, source, epoch,
seq), but only within its duplicate window and only for what the stream leader has
applied: a batch whose first send was still being replicated when the leader changed can be
stored twice.  A publisher sends one batch at a time per subject (each acknowledged before
the next), so within one source and epoch the sequence numbers of a log only grow; a batch
whose ``seq`` is not above the last one applied for its source and epoch is such a
duplicate.  Applied again it could replay an old Store after the Remove that followed it,
so :class:`PartitionFold` skips it.

The state is the last applied ``seq`` per source and epoch; a fold resumed from a snapshot
starts from the index's own (``SourceState``: each source's current epoch and last
``seq``, part of every snapshot), so it skips what a fold from the start skips (a
duplicate of a superseded epoch's batch, which only carries volume facts, may be applied
again after a snapshot).  Expiry batches (``advisor.ingest.source_expiry``,
sequence numbers from the reserved range) are applied as they come and do not move a
source's last sequence here.

State quotas (``limits``, docs/security.md "State quotas"): the stream holds whatever a
worker user may publish on its own subject, so the fold checks every batch of a source that
is not trusted (a cluster mover's, ``trusted``) with :class:`advisor.ingest.quotas.QuotaGuard`
before applying it: the number of sources, volume names, events and metadata bytes per
batch and per event, blocks per source's ``g1``/``g2`` and blocks in all.  Never the rate
limit and never the reported hits: each decision reads only the batch, the index and the
limits, so every replica of a partition, and every rebuild from its log (a new owner, a
restart from a snapshot), refuses exactly the same.  The limits apply per partition
replica (each partition's index on its own).  What is refused is counted (``quotas``).

``_last`` keeps, per source, only the epochs the index still knows for it (its current one
and its retired ones, at most :data:`event_plane.ordering.MAX_RETIRED_EPOCHS`); a source
opening a new epoch per batch cannot grow it.  A batch of an epoch forgotten there is
folded as the index folds it (a new epoch); a fold from the start forgets the same.
"""

from __future__ import annotations

from collections.abc import Callable

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.quotas import QuotaGuard, QuotaLimits
from advisor.ingest.source_expiry import EXPIRY_SEQ_BASE
from event_plane.codec import BatchHead, decode_batch, decode_head
from event_plane.ordering import MAX_RETIRED_EPOCHS
from event_plane.schema import EventBatch

__all__ = ["PartitionFold"]


class PartitionFold:
    """Applies log entries to ``index``, each batch once and within ``limits`` (module
    docstring).

    Args:
        index: the index to fold into (fresh, or loaded from a snapshot).
        limits: the state quotas (``None``: none, every batch applied as it is).
        trusted: sources whose batches skip the quotas (the cluster movers').

    Attributes:
        duplicates: batches skipped as already applied.
        quotas: the guard (its ``counters``/``as_dict()``: what was refused), or ``None``.
        admitted: the batch last applied as decoded here (``None`` when it was applied from
            its payload unread: no quotas, a trusted source, or a batch of the common shape
            that plainly fits the quotas, ``PrefixIndex.apply_payload_within``).
    """

    def __init__(self, index: PrefixIndex, limits: QuotaLimits | None = None,
                 trusted: Callable[[str], bool] | None = None) -> None:
        self.index = index
        self.duplicates = 0
        self.quotas = QuotaGuard(limits) if limits is not None else None
        # a batch of the common shape that plainly fits is checked and folded in one pass
        # over its bytes (PrefixIndex.apply_payload_within), with nothing decoded here
        self._plain = (() if limits is None else
                       (limits.max_batch_events, limits.max_sources, limits.max_blocks, limits.max_source_blocks))
        self._trusted = trusted
        self.admitted: EventBatch | None = None
        # source -> {epoch -> last applied seq}; a snapshot knows each source's current epoch
        self._last: dict[str, dict[int, int]] = {
            name: {st.epoch: st.last_seq} for name, st in index.sources().items() if st.last_seq < EXPIRY_SEQ_BASE
        }

    def quota_counters(self) -> dict[str, int]:
        """What the quotas refused and rewrote (``QuotaGuard.as_dict``); ``{}`` without quotas."""
        return self.quotas.as_dict() if self.quotas is not None else {}

    def tracked_epochs(self) -> int:
        """How many (source, epoch) sequence marks the fold keeps."""
        return sum(map(len, self._last.values()))

    def apply(self, payload: bytes, head: BatchHead | None = None) -> bool:
        """Apply one entry unless it repeats a batch already applied or the quotas refuse it
        whole; returns whether (some of) it was applied.  ``head``: the entry's envelope when
        the caller decoded it already.

        Raises:
            what ``PrefixIndex.apply_payload`` (or ``decode_batch``) raises for an
            undecodable payload.
        """
        self.admitted = None
        if head is None:
            head = decode_head(payload)
        key = None
        if head is not None and head.seq < EXPIRY_SEQ_BASE:
            key = (head.source, head.epoch)
            prev = self._last.get(head.source, {}).get(head.epoch)
            if prev is not None and head.seq <= prev:
                self.duplicates += 1
                return False
        guard = self.quotas
        if guard is None or (head is not None and self._trusted is not None and self._trusted(head.source)):
            self.index.apply_payload(payload)
        elif self.index.apply_payload_within(payload, *self._plain) < 0:  # not plainly within: the full check
            batch = decode_batch(payload)
            got = guard.admit(batch, self.index, rate=False, hits=False)
            if got.batch is None:
                return False
            if got.changed:
                self.index.apply_batch(got.batch)
            else:
                self.index.apply_payload(payload)  # as admitted: the index's own decoder is the faster
            self.admitted = got.batch
        if key is not None:
            self._mark(*key, head.seq)
        return True

    def _mark(self, source: str, epoch: int, seq: int) -> None:
        """Record ``seq`` as the last applied of ``source``'s ``epoch``, keeping only the
        epochs the index still knows for ``source`` (and only sources it knows)."""
        epochs = self._last.get(source)
        if epochs is None:
            epochs = self._last[source] = {}
            if len(self._last) > 2 * len(self.index.sources()) + 64:  # sources the index no longer knows
                known = self.index.sources()
                self._last = {k: v for k, v in self._last.items() if k in known}
                self._last[source] = epochs
        epochs[epoch] = seq
        if len(epochs) > MAX_RETIRED_EPOCHS + 1:
            st = self.index.sources().get(source)
            keep = {st.epoch, *st.retired_epochs} if st is not None else {epoch}
            for e in [e for e in epochs if e not in keep]:
                del epochs[e]
