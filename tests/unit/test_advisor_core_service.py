"""The advisor service folds journal entries with ``PrefixIndex.apply_payload`` and stream
entries with ``decode_batch``, the quotas and ``apply_batch`` (``advisor/ingest/quotas.py``); the
error handling is the same either way: a stream entry that
does not decode is counted and skipped (position advances, nothing applied), and so is a
journal entry at replay (counted in ``journal_skipped``): one bad entry must never keep the
advisor from starting."""

from __future__ import annotations

import sqlite3

import pytest

from advisor import AdvisorService, AdvisorSettings
from advisor.index.reference import ReferencePrefixIndex
from advisor.ingest.journal import SqliteJournal
from event_plane.codec import encode_batch, encode_batch_parts, encode_event
from event_plane.schema import EventBatch, store

BS = 4096


def batches() -> list[EventBatch]:
    return [
        EventBatch(1, "w0", 1, 0, 10, [store(1, 1, None, BS, "g1"), store(2, 1, 1, BS, "g1")]),
        EventBatch(1, "w0", 1, 1, 20, [store(2, 1, 1, BS, "fast", {"hits": 2}), store(3, 1, 2, BS, "g1")]),
    ]


def test_stream_entries_fold_through_apply_payload_and_bad_ones_are_skipped(tmp_path) -> None:  # noqa: ANN001
    # "w0" may report hits (the default trusts none: tests/security/test_forged_hits.py)
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[],
                                         api_enabled=False, reported_hits_sources=["w0"]))
    ref = ReferencePrefixIndex()
    b0, b1 = batches()
    assert svc._apply_logged(1, encode_batch(b0))
    ref.apply_batch(b0)
    before = svc.index.dump()
    assert not svc._apply_logged(2, b"\x96\x02\xa2w0")  # version 2 / truncated: not a v1 batch
    assert svc.counters["bad_batches"] == 1 and svc.position == 2 and svc.index.dump() == before
    assert svc._apply_logged(3, encode_batch(b1))
    ref.apply_batch(b1)
    assert not svc._apply_logged(3, encode_batch(b1))  # at or below the position: skipped
    assert svc.counters["ingested_batches"] == 2 and svc.counters["duplicate_batches"] == 1
    assert svc.index.dump() == ref.dump()


def _insert_raw(path, source: str, epoch: int, seq: int, payload: bytes) -> None:  # noqa: ANN001
    """Append a row the way ``SqliteJournal.append`` writes one (same columns), bypassing its
    checks: a journal written by an older build, or damaged on disk."""
    db = sqlite3.connect(path)
    db.execute("INSERT INTO journal (source, epoch, seq, ts_ns, events, payload) VALUES (?,?,?,?,?,?)",
               (source, epoch, seq, 0, 2, payload))
    db.commit()
    db.close()


def _deep_metadata_payload(source: str, seq: int, depth: int) -> bytes:
    """A batch whose second Store carries ``extra_metadata`` nested ``depth`` levels deep."""
    deep = encode_event(store(8, 7, 7, BS, "g1"))[:-1] + b"\x81\xa1a" * depth + b"\x01"
    return encode_batch_parts(source, 1, seq, 30, [encode_event(store(7, 7, None, BS, "g1")), deep])


def test_journal_replay_skips_and_counts_bad_entries_and_applies_the_others(tmp_path) -> None:  # noqa: ANN001
    """A corrupt entry (damaged bytes) and a too-deep one (metadata an older build accepted
    live, which a replay on a deeper stack could not decode) are skipped and counted; every
    other entry, before and after them, is applied, and the advisor starts."""
    path = tmp_path / "j.sqlite"
    j = SqliteJournal(path)
    b0, b1 = batches()
    j.append(encode_batch(b0), b0)
    j.close()
    _insert_raw(path, "w0", 1, 1, b"\x96\x01\xa2w0\x01")  # position 2: truncated
    _insert_raw(path, "w9", 1, 0, _deep_metadata_payload("w9", 0, 980))  # position 3: too deep
    j = SqliteJournal(path)
    b1 = EventBatch(1, "w0", 1, 2, 20, b1.events)
    j.append(encode_batch(b1), b1)  # position 4
    j.close()
    settings = AdvisorSettings(journal_path=str(path), subscribe_urls=[], api_enabled=False, snapshot_store="none")
    svc = AdvisorService(settings)
    try:
        svc.start()
        ref = ReferencePrefixIndex()
        for b in (b0, b1):
            ref.apply_batch(b)
        assert svc.index.dump() == ref.dump()
        assert (svc.counters["replayed_batches"], svc.counters["journal_skipped"], svc.position) == (2, 2, 4)
        assert svc.metrics.journal_skipped._value.get() == 2
        assert svc.block_info(7) is None and svc.block_info(8) is None
    finally:
        svc.stop()
