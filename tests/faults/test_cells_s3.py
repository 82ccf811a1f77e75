"""Fault cells: the S3 archive answering 503 (retried) or 403 (refused) during demotions,
through a fault-injecting proxy on loopback in front of a real S3 endpoint."""

from __future__ import annotations

from pathlib import Path

import pytest

from advisor import AdvisorService, PlanKind, PlanStatus
from storage_backends.local_s3 import LocalS3
from tests.faults._invariants import acknowledged_read_back, catalog_equals_volumes, index_equals_fold
from tests.faults._world import Worker, chain, settings
from tests.s3_proxy import S3FaultProxy

HASHES = list(range(401, 419))  # 18 blocks on a 20-block fast volume: above the 0.8 watermark


def _run(tmp: Path, local_s3: LocalS3, proxy: S3FaultProxy, status: int, n: int) -> tuple[list, object, Worker]:
    s = settings(tmp, fast_blocks=20, archive=(proxy.endpoint, local_s3.access_key, local_s3.secret_key),
                 slow_volumes=[])  # fast demotes straight to the archive (no slow tier in between)
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


def test_slow_s3_during_demotion(tmp_path: Path, local_s3: LocalS3, proxy: S3FaultProxy) -> None:
    s = settings(tmp_path, fast_blocks=20, archive=(proxy.endpoint, local_s3.access_key, local_s3.secret_key),
                 slow_volumes=[])  # fast demotes straight to the archive (no slow tier in between)
    w = Worker(s)
    try:
        with AdvisorService(s) as svc:
            w.put(HASHES, "fast")
            w.send(svc, "w0", *chain(HASHES, "fast"))
            proxy.set_rule(lambda m, p, n: ("delay", 0.5) if m == "PUT" and "/seg-" in p else None)
            res = svc.run_policies_once()
            assert res and all(r.status is PlanStatus.DONE for r in res)
            assert any(a == ("delay", 0.5) for _, _, _, a in proxy.log)
            index_equals_fold(svc)
        acknowledged_read_back(w.agent, HASHES)
        assert catalog_equals_volumes(s) == []
    finally:
        w.close()


@pytest.mark.parametrize("how", ["cut", "short"])
def test_dropping_s3_during_promotion_from_the_archive(tmp_path: Path, local_s3: LocalS3, proxy: S3FaultProxy,
                                                       how: str) -> None:
    s = settings(tmp_path, archive=(proxy.endpoint, local_s3.access_key, local_s3.secret_key),
                 policy={"promotion": {"min_hits": 2, "from_archive": True}})  # archive -> slow, one tier up
    w = Worker(s)
    hs = HASHES[:6]
    try:
        with AdvisorService(s) as svc:
            w.put(hs, "s3")
            w.send(svc, "w0", *chain(hs, "g1"), *chain(hs, "s3"))
            w.send(svc, "w1", *chain(hs, "g1"))
            w.send(svc, "w2", *chain(hs, "g1"))
            proxy.set_rule(lambda m, p, n: (how, 0) if m == "GET" and "/seg-" in p and n == 0 else None)
            res = svc.run_policies_once()
            assert [a for _, m, _, a in proxy.log if m == "GET"][0] == (how, 0)  # the fault was served
            assert res and all(r.item.kind is PlanKind.PROMOTE and r.status is PlanStatus.DONE for r in res)
            assert w.where(hs) == ["slow"] * len(hs)
            index_equals_fold(svc)
        acknowledged_read_back(w.agent, hs)
        assert catalog_equals_volumes(s) == []
    finally:
        w.close()


def test_s3_endpoint_killed_mid_run_and_restarted(tmp_path: Path, local_s3: LocalS3, proxy: S3FaultProxy) -> None:
    """The archive's endpoint goes away (connections refused) during a round of demotions and
    comes back on the same address with its objects: the round's moves fail and lose nothing,
    and the next round demotes by itself.

    The aws-sdk inside NIXL makes one try per request (``s3_sdk_max_attempts=1``): the volume's
    own 4 tries with backoff still run, without the SDK's 10 retries over about 25 s each."""
    s = settings(tmp_path, fast_blocks=20, archive=(proxy.endpoint, local_s3.access_key, local_s3.secret_key),
                 archive_options={"s3_sdk_max_attempts": 1},
                 slow_volumes=[])  # fast demotes straight to the archive (no slow tier in between)
    w = Worker(s)
    try:
        with AdvisorService(s) as svc:
            w.put(HASHES, "fast")
            w.send(svc, "w0", *chain(HASHES, "fast"))
            proxy.down()
            try:
                res = svc.run_policies_once()
            finally:
                proxy.up()
            assert res and all(r.item.kind is PlanKind.DEMOTE and r.status is PlanStatus.FAILED for r in res)
            assert w.where(HASHES) == ["fast"] * len(HASHES)
            index_equals_fold(svc)
            acknowledged_read_back(w.agent, HASHES)
            again = svc.run_policies_once()  # the endpoint is back: no manual step
            assert again and all(r.status is PlanStatus.DONE for r in again)
            moved = [r.item.sequence_hash for r in again]
            assert w.where(moved) == ["s3"] * len(moved)
            index_equals_fold(svc)
        acknowledged_read_back(w.agent, HASHES)
        assert catalog_equals_volumes(s) == []
    finally:
        w.close()
