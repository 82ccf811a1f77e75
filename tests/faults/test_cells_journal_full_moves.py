"""A full journal during a policy round (a 16 MiB tmpfs: real ENOSPC).  The mover's
Store/Remove announcements of committed moves are retried with ingest's backpressure (the
round waits for the journal), not dropped: once space is back the index agrees with the
catalog without a restart (docs/reliability.md)."""

from __future__ import annotations

import threading
from pathlib import Path

from advisor import AdvisorService, PlanKind, PlanStatus
from kvadvisor.check import check
from tests.faults._invariants import acknowledged_read_back, index_equals_fold
from tests.faults._mounts import fill, small_tmpfs
from tests.faults._world import Worker, hot, settings, wait_until

HOT = list(range(401, 411))  # 10 blocks on slow, hit by three workers: promoted



def test_announcements_of_moves_wait_for_a_full_journal(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "jfs", "16m") as jfs:
        s = settings(tmp_path, journal_path=str(jfs / "journal.sqlite"))
        w = Worker(s)
        try:
            with AdvisorService(s) as svc:
                hot(w, svc, HOT)
                assert svc.index.blocks_at("slow") == set(HOT)
                filler = jfs / "filler"
                fill(filler)
                out: dict[str, object] = {}
                rnd = threading.Thread(target=lambda: out.update(results=svc.run_policies_once()), daemon=True)
                rnd.start()
                wait_until(lambda: svc.counters["journal_failures"] > 0)  # the round's announcements hit ENOSPC
                assert svc.journal_error is not None and "journal append failed" in svc.journal_error
                filler.unlink()  # space is back
                rnd.join(timeout=120)
                assert not rnd.is_alive()
                results = out["results"]
                assert isinstance(results, list)
                promoted = {r.item.sequence_hash for r in results
                            if r.item.kind is PlanKind.PROMOTE and r.status is PlanStatus.DONE}
                assert promoted == set(HOT), [(r.item.sequence_hash, r.status, r.detail) for r in results]
                assert svc.mover is not None and svc.mover.announce_failed == 0
                assert w.where(HOT) == ["fast"] * len(HOT)
                # the live index agrees with the catalog, without a restart
                wait_until(lambda: svc.index.blocks_at("fast") == set(HOT) and not svc.index.blocks_at("slow"), 30)
                index_equals_fold(svc)
                report = check(s, deep=True)
                assert report.differences == [], [d.line() for d in report.differences]
                assert svc.journal_error is None
            acknowledged_read_back(w.agent, HOT)
        finally:
            w.close()
