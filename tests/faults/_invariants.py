"""The invariants every fault cell asserts once the fault is over (docs/reliability.md)."""

from __future__ import annotations

from collections.abc import Iterable

import torch

from advisor import AdvisorService, AdvisorSettings
from advisor.ingest.journal import SqliteJournal
from kvadvisor.check import check, fold_journal
from storage_backends import BlockKey, StorageAgent, StorageError
from tests.faults._world import NS, data


def index_equals_fold(svc: AdvisorService) -> None:
    """The live index equals a fresh fold of the journal."""
    assert svc.journal is not None
    fresh = SqliteJournal(svc.settings.journal_path)
    try:
        folded, pos = fold_journal(fresh)
    finally:
        fresh.close()
    with svc.lock:
        assert pos == svc.position
        assert folded.dump() == svc.index.dump()


def acknowledged_read_back(agent: StorageAgent, hashes: Iterable[int], lost: Iterable[int] = ()) -> None:
    """Every acknowledged block reads back byte-exact, except those reported lost, which
    fail with a StorageError (never wrong bytes)."""
    lost = set(lost)
    for h in hashes:
        if h in lost:
            try:
                got = agent.get([BlockKey(NS, h)])[0]
            except StorageError:
                continue
            assert torch.equal(got, data(h)), f"block {h:#x} served with wrong bytes"
        else:
            assert torch.equal(agent.get([BlockKey(NS, h)])[0], data(h)), f"block {h:#x} not byte-exact"


def catalog_equals_volumes(settings: AdvisorSettings, allow: Iterable[str] = ()) -> list[str]:
    """``kvadvisor check --deep``: index (fold), catalog and volumes agree; returns the
    differences of the kinds in ``allow`` (any other kind fails)."""
    report = check(settings, deep=True)
    allow = set(allow)
    bad = [d.line() for d in report.differences if d.kind not in allow]
    assert not bad, bad
    return [d.line() for d in report.differences]
