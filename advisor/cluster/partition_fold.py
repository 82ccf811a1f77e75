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
"""

from __future__ import annotations

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.source_expiry import EXPIRY_SEQ_BASE
from event_plane.codec import BatchHead, decode_head

__all__ = ["PartitionFold"]


class PartitionFold:
    """Applies log entries to ``index``, each batch once (module docstring).

    Args:
        index: the index to fold into (fresh, or loaded from a snapshot).

    Attributes:
        duplicates: batches skipped as already applied.
    """

    def __init__(self, index: PrefixIndex) -> None:
        self.index = index
        self.duplicates = 0
        # (source, epoch) -> last applied seq; a snapshot knows each source's current epoch
        self._last: dict[tuple[str, int], int] = {
            (name, st.epoch): st.last_seq for name, st in index.sources().items() if st.last_seq < EXPIRY_SEQ_BASE
        }

    def apply(self, payload: bytes, head: BatchHead | None = None) -> bool:
        """Apply one entry unless it repeats a batch already applied; returns whether it was
        applied.  ``head``: the entry's envelope when the caller decoded it already.

        Raises:
            what ``PrefixIndex.apply_payload`` raises for an undecodable payload.
        """
        if head is None:
            head = decode_head(payload)
        if head is not None and head.seq < EXPIRY_SEQ_BASE:
            key = (head.source, head.epoch)
            prev = self._last.get(key)
            if prev is not None and head.seq <= prev:
                self.duplicates += 1
                return False
            self.index.apply_payload(payload)
            self._last[key] = head.seq
            return True
        self.index.apply_payload(payload)
        return True
