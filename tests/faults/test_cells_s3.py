"""Fault cells: the S3 archive answering 503 (retried) or 403 (refused) during demotions,
through a fault-injecting proxy on loopback in front of a real S3 endpoint."""

from __future__ import annotations

from pathlib import Path

from advisor import AdvisorService, PlanKind, PlanStatus
from storage_backends.local_s3 import LocalS3
from tests.faults._invariants import acknowledged_read_back, catalog_equals_volumes, index_equals_fold
from tests.faults._world import Worker, chain, settings
from tests.s3_proxy import S3FaultProxy

HASHES = list(range(401, 419))  # 18 blocks on a 20-block fast volume: above the 0.8 watermark


def _run(tmp: Path, local_s3: LocalS3, proxy: S3FaultProxy, status: int, n: int) -> tuple[list, object, Worker]:
    s = settings(tmp, fast_blocks=20, archive=(proxy.endpoint, local_s3.access_key, local_s3.secret_key))
    w = Worker(s)
    svc = AdvisorService(s)
    svc.start()
    try:
        w.put(HASHES, "fast")
        w.send(svc, "w0", *chain(HASHES, "fast"))
        proxy.fail(n, {"PUT"}, status=status)
        res = svc.run_policies_once()
        assert res and all(r.item.kind is PlanKind.DEMOTE for r in res)
        assert proxy.injected  # the fault was really seen
        index_equals_fold(svc)
        return res, s, w
    finally:
        svc.stop()


def test_s3_503_during_demotion_is_retried(tmp_path: Path, local_s3: LocalS3, proxy: S3FaultProxy) -> None:
    res, s, w = _run(tmp_path, local_s3, proxy, 503, 2)
    try:
        assert all(r.status is PlanStatus.DONE for r in res)
        moved = [r.item.sequence_hash for r in res]
        assert w.where(moved) == ["s3"] * len(moved)
        acknowledged_read_back(w.agent, HASHES)
        assert catalog_equals_volumes(s) == []
    finally:
        w.close()


def test_s3_403_during_demotion_fails_and_loses_nothing(tmp_path: Path, local_s3: LocalS3,
                                                         proxy: S3FaultProxy) -> None:
    res, s, w = _run(tmp_path, local_s3, proxy, 403, 10_000)
    try:
        assert all(r.status is PlanStatus.FAILED for r in res)
        assert w.where(HASHES) == ["fast"] * len(HASHES)
        proxy.set_rule(lambda m, p, n: None)
        acknowledged_read_back(w.agent, HASHES)
        assert catalog_equals_volumes(s) == []
        with AdvisorService(s) as again:  # the next advisor demotes normally: it recovers by itself
            assert all(r.status is PlanStatus.DONE for r in again.run_policies_once())
        acknowledged_read_back(w.agent, HASHES)
        assert catalog_equals_volumes(s) == []
    finally:
        w.close()
