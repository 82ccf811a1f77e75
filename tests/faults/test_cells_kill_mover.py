"""Fault cells: the advisor process killed (-9) at each step of a move (docs/design.md §7):
before the copy, after the copy (not committed), after the catalog commit (events not yet
journaled), after the events were journaled. A new advisor then recovers by itself
(reconcile and garbage collection at start): every block reads back byte-exact, the index
equals a fresh fold of the journal, index, catalog and volumes agree, and the next round
finishes the promotions."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

from advisor import AdvisorService, PlanStatus
from tests.faults._invariants import acknowledged_read_back, catalog_equals_volumes, index_equals_fold
from tests.faults._world import REPO, Worker, hot, settings

HOT = [601, 602, 603, 604]

CHILD = r"""
import os, sys
from advisor import AdvisorService, AdvisorSettings
from advisor.embedded.service import AdvisorService as _S
from storage_backends import StorageAgent

cfg, step = sys.argv[1], sys.argv[2]

def die():
    sys.stdout.flush()
    os.kill(os.getpid(), 9)

copy, commit, ingest = StorageAgent.copy_many, StorageAgent.commit_move, _S.ingest
if step == "before_copy":
    StorageAgent.copy_many = lambda self, *a, **k: die()
elif step == "after_copy":
    def copy_then_die(self, *a, **k):
        copy(self, *a, **k)
        die()
    StorageAgent.copy_many = copy_then_die
elif step == "after_commit":
    def commit_then_die(self, *a, **k):
        commit(self, *a, **k)
        die()
    StorageAgent.commit_move = commit_then_die
elif step == "after_journal":
    def ingest_then_die(self, batch, *a, **k):
        ok = ingest(self, batch, *a, **k)
        if batch.source == self.settings.source:
            die()
        return ok
    _S.ingest = ingest_then_die
svc = AdvisorService(AdvisorSettings.from_json_file(cfg))
svc.start()
print("ROUND", flush=True)
svc.run_policies_once()
print("NOT KILLED", flush=True)
"""


@pytest.mark.parametrize("step", ["before_copy", "after_copy", "after_commit", "after_journal"])
def test_advisor_killed_at_a_mover_step_recovers(tmp_path: Path, step: str) -> None:
    s = settings(tmp_path, gc_min_age_s=0)
    w = Worker(s)
    try:
        with AdvisorService(s) as svc:  # the events reach the journal; no round yet
            hot(w, svc, HOT)
        cfg = tmp_path / "advisor.json"
        cfg.write_text(s.model_dump_json())
        cfg.chmod(0o600)
        env = dict(os.environ, PYTHONPATH=str(REPO) + os.pathsep + os.environ.get("PYTHONPATH", ""))
        r = subprocess.run([sys.executable, "-c", CHILD, str(cfg), step], capture_output=True, text=True, env=env,
                           timeout=300)
        assert r.returncode == -9 and "ROUND" in r.stdout and "NOT KILLED" not in r.stdout, (r.stdout, r.stderr[-3000:])
        acknowledged_read_back(w.agent, HOT)  # whatever the step, every block is readable
        with AdvisorService(s) as again:  # recovers by itself: reconcile + garbage collection
            index_equals_fold(again)
            assert catalog_equals_volumes(s) == []
            done = {r.item.sequence_hash for r in again.run_policies_once() if r.status is PlanStatus.DONE}
            assert set(w.where(HOT)) == {"fast"}, (step, done)
            index_equals_fold(again)
            assert again.index.blocks_at("fast") == set(HOT)
        acknowledged_read_back(w.agent, HOT)
        assert catalog_equals_volumes(s) == []
        assert not [p for p in (tmp_path / "fast").rglob("seg-*") if p.stat().st_size == 0]
    finally:
        w.close()
