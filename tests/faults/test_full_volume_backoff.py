"""Finding 5: a full fast volume (a 1 MiB tmpfs: real ENOSPC) does not loop. The failed
promotions are reported, the next rounds hold the moves back instead of re-reading the
blocks, and moves are tried again after the backoff."""

from __future__ import annotations

from pathlib import Path

from advisor import AdvisorService, PlanKind, PlanStatus
from tests.faults._mounts import small_tmpfs
from tests.faults._world import Worker, hot, settings

HOT = list(range(201, 221))  # 20 blocks of 64 KiB: 1.25 MiB, more than the tmpfs holds


def _slow_reads(svc: AdvisorService) -> int:
    return next(v.reads for v in svc.agent.stats() if v.volume_id == "slow")


def test_full_fast_volume_backs_off_and_reports(tmp_path: Path) -> None:
    with small_tmpfs(tmp_path / "fastfs", "1m") as fastfs:
        s = settings(tmp_path, fast_root=fastfs / "fast", fast_blocks=200, full_backoff_s=2.0, full_backoff_max_s=8.0)
        w = Worker(s)
        try:
            with AdvisorService(s) as svc:
                # the backoff's clock is the test's: on the wall clock, a stall of 2 s between
                # the first round and the second (a loaded machine) ended the backoff, and the
                # second round tried again (a guard timed from the second round missed that)
                now = [1000.0]
                svc.full_backoff._clock = lambda: now[0]
                hot(w, svc, HOT)
                first = svc.run_policies_once()
                assert first and all(r.item.kind is PlanKind.PROMOTE for r in first)
                failed = [r for r in first if r.status is PlanStatus.FAILED]
                assert failed and all("VolumeFullError" in r.detail for r in failed)
                assert svc.query().stats()["moves"]["failed"]["promote"] == len(failed)
                reads = _slow_reads(svc)
                now[0] += 1.9
                second = svc.run_policies_once()  # inside the backoff: nothing read, nothing tried
                assert second == []
                assert _slow_reads(svc) == reads
                assert svc.counters["deferred_volume_full"] > 0
                assert svc.full_backoff.status()["fast"]["failures"] == 1
                now[0] += 0.2  # the 2 s backoff is over
                third = svc.run_policies_once()  # tried again after the backoff, still full
                assert third and any(r.status is PlanStatus.FAILED for r in third)
                assert svc.full_backoff.status()["fast"]["delay_s"] == 4.0  # doubled
                assert w.reads_back(HOT)  # nothing lost: the blocks stay on slow
        finally:
            w.close()


def test_demo_report_names_failed_moves(capsys, monkeypatch) -> None:  # noqa: ANN001
    from rich.console import Console

    from kvadvisor import cli
    from kvadvisor.cli import _print_report
    from kvadvisor.demo import DemoReport

    monkeypatch.setattr(cli, "console", Console(width=200))

    r = DemoReport(requests=1, workers=1, blocks=1, failed_moves={"promote": 256, "demote": 0, "compact": 0},
                   deferred_volume_full=512, offload_failed={"VolumeFullError": 16})
    _print_report(r)
    out = capsys.readouterr().out
    assert "blocks the workers could not offload (kept on G1/G2)" in out and "VolumeFullError=16" in out
    assert "FAILED promotions / demotions / compactions" in out and "256 / 0 / 0" in out
    assert "512 held back: volume full" in out
