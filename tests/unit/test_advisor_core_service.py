"""The advisor service folds raw payloads with ``PrefixIndex.apply_payload``; its error
handling must stay what it was with ``decode_batch`` + ``apply_batch``: a stream entry that
does not decode is counted and skipped (position advances, nothing applied), and a journal
entry that does not decode stops the replay with ``JournalError("journal entry N is
corrupt: ...")``."""

from __future__ import annotations

import sqlite3

import pytest

from advisor import AdvisorService, AdvisorSettings
from advisor.index_reference import ReferencePrefixIndex
from advisor.journal import JournalError, SqliteJournal
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch, store

BS = 4096


def batches() -> list[EventBatch]:
    return [
        EventBatch(1, "w0", 1, 0, 10, [store(1, 1, None, BS, "g1"), store(2, 1, 1, BS, "g1")]),
        EventBatch(1, "w0", 1, 1, 20, [store(2, 1, 1, BS, "fast", {"hits": 2}), store(3, 1, 2, BS, "g1")]),
    ]


def test_stream_entries_fold_through_apply_payload_and_bad_ones_are_skipped(tmp_path) -> None:  # noqa: ANN001
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), subscribe_urls=[],
                                         api_enabled=False))
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


def test_journal_replay_folds_payloads_and_reports_a_corrupt_entry(tmp_path) -> None:  # noqa: ANN001
    path = tmp_path / "j.sqlite"
    j = SqliteJournal(path)
    for b in batches():
        j.append(encode_batch(b), b)
    j.close()
    settings = AdvisorSettings(journal_path=str(path), subscribe_urls=[], api_enabled=False, snapshot_store="none")
    svc = AdvisorService(settings)
    svc.start()
    try:
        ref = ReferencePrefixIndex()
        for b in batches():
            ref.apply_batch(b)
        assert svc.index.dump() == ref.dump() and svc.counters["replayed_batches"] == 2
    finally:
        svc.stop()
    db = sqlite3.connect(path)
    db.execute("UPDATE journal SET payload = ? WHERE position = 2", (b"\x96\x01\xa2w0\x01",))
    db.commit()
    db.close()
    again = AdvisorService(settings)
    try:
        with pytest.raises(JournalError, match="journal entry 2 is corrupt"):
            again.start()
        assert again.position == 1 and len(again.index) == 2
    finally:
        again.stop()
