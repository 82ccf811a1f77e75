"""Dead sources: which sources expire, and the expiry batch's effect on the index."""

from __future__ import annotations

from advisor.index.prefix_index import PrefixIndex
from advisor.ingest.source_expiry import EXPIRY_SEQ_BASE, due, expiry_batch, is_expiry, private_blocks
from event_plane.codec import decode_batch, encode_batch
from event_plane.schema import EventBatch, store


def test_due_counts_silence_from_the_last_batch_or_the_start() -> None:
    heard = {"w0": 100.0, "w1": 190.0}
    assert due(["w0", "w1", "w2", "advisor"], heard, 200.0, 50.0, default=160.0, exclude=["advisor"]) == ["w0"]
    assert due(["w0", "w2"], heard, 220.0, 50.0, default=160.0) == ["w0", "w2"]
    assert due(["w0"], heard, 1e9, 0.0, default=0.0) == []  # 0 = never


def test_expiry_batch_drops_g1_g2_keeps_volumes_and_replays_the_same() -> None:
    idx = PrefixIndex()
    idx.apply_batch(EventBatch(1, "w0", 7, 0, 1_000, [store(1, 1, None, 10, "g1"), store(1, 1, None, 10, "slow"),
                                                      store(2, 1, 1, 10, "g2")]))
    idx.apply_batch(EventBatch(1, "w1", 9, 0, 2_000, [store(1, 1, None, 10, "g1")]))
    assert private_blocks(idx, "w0") == 2
    b = expiry_batch("w0", idx.sources()["w0"])
    assert b.seq == EXPIRY_SEQ_BASE + 1 and b.epoch == 7 and b.ts_ns == 1_000 and is_expiry(b)
    assert decode_batch(encode_batch(b)) == b  # a valid wire batch: it is journaled as one
    idx.apply_batch(b)
    assert private_blocks(idx, "w0") == 0
    assert idx.blocks_at("slow") == {1} and idx.blocks_at("w1/g1") == {1}
    assert idx.sources()["w0"].last_ts_ns == 1_000  # last seen is still the real one
    # the source goes on with its next real batch
    idx.apply_batch(EventBatch(1, "w0", 7, 1, 3_000, [store(5, 5, None, 10, "g1")]))
    assert idx.blocks_at("w0/g1") == {5}
