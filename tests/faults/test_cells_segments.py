"""Fault cells: a corrupted and a truncated segment, and clock skew in batch timestamps.

After each fault: no block is served with a wrong checksum, every other acknowledged block
reads back byte-exact, the damaged ones are reported lost with a reason, the index equals a
fresh fold of the journal, and after a restart of the advisor (its reconcile, no manual
step) index, catalog and volumes agree (``kvadvisor check --deep``: 0 differences)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from advisor import AdvisorService
from storage_backends import BlockKey, ChecksumMismatchError, StorageError
from tests.faults._invariants import acknowledged_read_back, catalog_equals_volumes, index_equals_fold
from tests.faults._world import NS, Worker, chain, settings

HASHES = list(range(301, 317))  # 16 blocks of 64 KiB: one 1 MiB segment on slow


def _stored(tmp: Path) -> tuple[object, Worker, AdvisorService]:
    s = settings(tmp)
    w = Worker(s)
    svc = AdvisorService(s)
    svc.start()
    w.put(HASHES, "slow")
    w.send(svc, "w0", *chain(HASHES, "g1"), *chain(HASHES, "slow"))
    return s, w, svc


def _segment_file(tmp: Path, w: Worker, h: int) -> tuple[Path, object]:
    p = w.agent.locate([BlockKey(NS, h)])[0]
    assert p is not None
    [f] = list((tmp / "slow").rglob(f"seg-{p.segment_id:012d}*"))
    return f, p


@pytest.mark.parametrize("damage", ["corrupt", "truncate"])
def test_damaged_segment(tmp_path: Path, damage: str) -> None:
    s, w, svc = _stored(tmp_path)
    try:
        victim = HASHES[5]
        f, p = _segment_file(tmp_path, w, victim)
        if damage == "corrupt":
            with open(f, "r+b") as fh:
                fh.seek(p.offset + 100)  # type: ignore[attr-defined]
                b = fh.read(1)
                fh.seek(p.offset + 100)  # type: ignore[attr-defined]
                fh.write(bytes([b[0] ^ 0xFF]))
            lost = [victim]
        else:
            os.truncate(f, p.offset)  # type: ignore[attr-defined]
            lost = HASHES[5:]
        diffs = catalog_equals_volumes(s, allow={"lost", "corrupt"})  # reported, with the reason
        assert {int(d.split(": ")[2].split()[1], 16) for d in diffs} == set(lost)
        assert all(("checksum" in d) if damage == "corrupt" else ("holds" in d) for d in diffs)
        with pytest.raises((ChecksumMismatchError, StorageError)):
            w.agent.get([BlockKey(NS, victim)])  # never served with a wrong checksum
        acknowledged_read_back(w.agent, HASHES, lost=lost)  # the damaged ones quarantined on read
        assert {q.key.sequence_hash for q, _ in w.catalog.quarantined()} == set(lost)
        index_equals_fold(svc)
    finally:
        svc.stop()
    with AdvisorService(s) as again:  # reconcile at start: the index forgets the lost copies
        index_equals_fold(again)
        assert again.index.blocks_at("slow") == set(HASHES) - set(lost)
    assert catalog_equals_volumes(s) == []
    w.close()


@pytest.mark.parametrize("skew", ["zero", "far_future", "backwards"])
def test_clock_skew_in_batch_timestamps(tmp_path: Path, skew: str) -> None:
    s = settings(tmp_path)
    w = Worker(s)
    try:
        with AdvisorService(s) as svc:
            w.put(HASHES, "slow")
            for i, h in enumerate(HASHES):
                ts = {"zero": 0, "far_future": (1 << 64) - 1 - i, "backwards": 10**18 - i * 10**12}[skew]
                b = w.batch("w0", *chain([h], "slow"))
                assert svc.ingest(type(b)(b.version, b.source, b.epoch, b.seq, ts, b.events))
            assert svc.index.blocks_at("slow") == set(HASHES)
            index_equals_fold(svc)
        with AdvisorService(s) as again:  # the journal keeps the skewed batches; replay is equal
            index_equals_fold(again)
            assert again.index.blocks_at("slow") == set(HASHES)
        acknowledged_read_back(w.agent, HASHES)
        assert catalog_equals_volumes(s) == []
    finally:
        w.close()
