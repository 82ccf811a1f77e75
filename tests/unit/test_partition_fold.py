"""PartitionFold: a log holding a re-sent batch twice folds as if it held it once."""

from __future__ import annotations

from advisor.index.prefix_index import PrefixIndex
from advisor.cluster.partition_fold import PartitionFold
from advisor.index.snapshot import decode_index, encode_index
from advisor.ingest.source_expiry import SourceSeen, expiry_batch
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch, remove, store


def _b(source: str, epoch: int, seq: int, *events) -> bytes:  # noqa: ANN002
    return encode_batch(EventBatch(1, source, epoch, seq, 1_000 + seq, list(events)))


STORE = _b("w", 1, 0, store(7, 7, None, 64, "g1"))
REMOVE = _b("w", 1, 1, remove(7, 7, None, 64, "g1"))
LOG = [STORE, REMOVE, STORE, _b("w", 1, 2, store(8, 8, None, 64, "g1"))]  # the Store re-sent, stored late


def test_a_batch_stored_twice_is_applied_once() -> None:
    fold = PartitionFold(PrefixIndex())
    assert [fold.apply(p) for p in LOG] == [True, True, False, True]
    assert fold.duplicates == 1
    assert fold.index.block(7) is None and fold.index.block(8) is not None  # the removed block stays removed
    plain = PrefixIndex()
    for p in LOG:
        plain.apply_payload(p)
    assert plain.block(7) is not None  # what applying every entry does


def test_a_fold_resumed_from_a_snapshot_skips_the_same() -> None:
    first = PartitionFold(PrefixIndex())
    for p in LOG[:2]:
        first.apply(p)
    resumed = PartitionFold(decode_index(encode_index(first.index)))
    assert [resumed.apply(p) for p in LOG[2:]] == [False, True]
    assert resumed.index.block(7) is None


def test_other_epochs_sources_and_expiries_are_applied() -> None:
    fold = PartitionFold(PrefixIndex())
    assert fold.apply(_b("w", 1, 5, store(1, 1, None, 64, "g1")))
    assert fold.apply(_b("w", 2, 0, store(2, 2, None, 64, "g1")))  # a restart: seq starts again
    assert fold.apply(_b("v", 1, 0, store(3, 3, None, 64, "g1")))
    st = fold.index.sources()["v"]
    exp = encode_batch(expiry_batch("v", SourceSeen(st.epoch, st.batches, st.last_ts_ns)))
    assert fold.apply(exp) and fold.index.block(3) is None
    assert fold.apply(_b("v", 1, 1, store(3, 3, None, 64, "g1")))  # back with the same epoch: folds on
    assert fold.index.block(3) is not None and fold.duplicates == 0
