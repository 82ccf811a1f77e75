"""Finding 9: counters, mover figures and recent plans survive a restart."""

from __future__ import annotations

from pathlib import Path

from advisor import AdvisorService, PlanStatus
from tests.faults._world import Worker, hot, settings


def test_counters_and_plans_survive_a_restart(tmp_path: Path) -> None:
    s = settings(tmp_path)
    w = Worker(s)
    try:
        with AdvisorService(s) as svc:
            hot(w, svc, [11, 12, 13])
            res = svc.run_policies_once()
            assert [r.status for r in res] == [PlanStatus.DONE] * 3
            before = svc.query().stats()
            plans = [(p.item.kind, p.item.sequence_hash, p.status, p.detail) for p in svc.query().plans()]
        with AdvisorService(s) as again:
            st = again.query().stats()
            assert st["ingest"]["ingested_batches"] == before["ingest"]["ingested_batches"] > 0
            assert st["ingest"]["policy_rounds"] == 1
            assert st["moves"]["promotions"] == 3 and st["moves"]["done"] == before["moves"]["done"]
            assert st["moves"]["bytes_moved"] == before["moves"]["bytes_moved"] > 0
            assert [(p.item.kind, p.item.sequence_hash, p.status, p.detail) for p in again.query().plans()] == plans
            again.run_policies_once()
            assert again.query().stats()["ingest"]["policy_rounds"] == 2
    finally:
        w.close()
