"""Test helper: fold a JetStream namespace's log into an index, as an advisor rebuilds one."""

from __future__ import annotations

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.jslog import JetStreamLog
from advisor.cluster.partition_fold import PartitionFold
from advisor.cluster.parts import is_mover_source
from advisor.ingest.quotas import QuotaLimits
from event_plane.config import StreamLimits


def read_log(url: str, namespace: str, *, start_seq: int = 1, replicas: int = 1) -> list[tuple[int, bytes]]:
    """Every entry ``(stream sequence, payload)`` of ``namespace`` from ``start_seq`` to what
    the stream holds now.

    Raises:
        AssertionError: the log ended before the messages pending at the start were read.
    """
    log = JetStreamLog(url, namespace, start_seq=start_seq, stream=StreamLimits(replicas=replicas))
    log.start()
    out: list[tuple[int, bytes]] = []
    try:
        for _ in range(log.pending_at_start):
            item = log.get(timeout=30)
            assert item is not None, f"{namespace}: the log ended early"
            out.append(item)
    finally:
        log.close()
    return out


def fold_log(url: str, namespace: str, *, start_seq: int = 1, replicas: int = 1,
             index: PrefixIndex | None = None, limits: QuotaLimits | None = None) -> PrefixIndex:
    """Apply every batch of ``namespace`` from stream sequence ``start_seq`` to what the
    stream holds now, onto ``index`` (a new one by default), each batch once
    (:class:`advisor.cluster.partition_fold.PartitionFold`), within the state quotas ``limits``
    when given (as a cluster advisor: ``ClusterSettings.quota_limits()``); returns the index.

    Raises:
        AssertionError: the log ended before the messages pending at the start were read.
    """
    idx = PrefixIndex() if index is None else index
    fold = PartitionFold(idx, limits, trusted=is_mover_source)  # as the advisors fold: each batch once
    for _seq, payload in read_log(url, namespace, start_seq=start_seq, replicas=replicas):
        fold.apply(payload)
    return idx
