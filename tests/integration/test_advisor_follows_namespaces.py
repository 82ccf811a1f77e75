"""An advisor left on the default namespace manages what its workers store.

A worker's blocks are keyed by its model fingerprint's namespace (the vLLM connector's too),
which nothing made the advisor know: a drain of the worker's volume answered ``done: 0``.
The advisor now follows every namespace its catalog holds blocks in (under
``max_namespaces``), and a drain that moves nothing says why.

The worker is the real runtime (:class:`kvbm_runtime.BlockManager`, G1/G2 pools, G3 on the
``fast`` volume of the shared SQLite catalog) publishing over ZMQ to the real advisor
service, whose settings name no namespace."""

from __future__ import annotations

import os
from pathlib import Path

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from fastapi.testclient import TestClient  # noqa: E402

from advisor import AdvisorService  # noqa: E402
from tests.polling import wait_until  # noqa: E402
from advisor.settings import AdvisorSettings  # noqa: E402
from api import create_app  # noqa: E402
from event_plane import make_publisher  # noqa: E402
from kvadvisor.demo import runtime_config  # noqa: E402
from kvadvisor.settings import DemoSettings  # noqa: E402
from kvbm_runtime import BlockManager, fill_synthetic_kv  # noqa: E402
from storage_backends import SqliteCatalog, StorageAgent, free_port  # noqa: E402


def _volumes(tmp: Path) -> list[dict]:
    return [{"id": v, "kind": "posix", "media": m, "capacity_bytes": 256 << 20, "root": str(tmp / v),
             "segment_bytes": 1 << 20} for v, m in (("fast", "nvme"), ("slow", "hdd"))]


def _settings(tmp: Path, sub: str, **kw) -> AdvisorSettings:  # noqa: ANN003
    return AdvisorSettings(journal_path=str(tmp / "journal.sqlite"), catalog_path=str(tmp / "catalog.sqlite"),
                           subscribe_urls=[sub], volumes=_volumes(tmp), fast_volume="fast", slow_volumes=["slow"],
                           policy_interval_s=0, api_enabled=False, reconcile_on_start=False, **kw)


class _Worker:
    """The runtime storing its blocks on ``fast`` (the disk-offload filter off: every block
    offloaded from G2 lands there) and publishing its events over ZMQ."""

    def __init__(self, tmp: Path, pub: str) -> None:
        s = DemoSettings(g1_blocks=8, g2_blocks=8, disk_offload_filter=False, requests=1)
        self.catalog = SqliteCatalog(tmp / "catalog.sqlite")
        self.agent = StorageAgent(self.catalog, name="worker-0")
        for v in _settings(tmp, "zmq://127.0.0.1:1").volumes:
            self.agent.register_volume(v.to_descriptor())
        self.publisher = make_publisher(pub, source="worker-0")
        self.mgr = BlockManager(runtime_config(s), self.publisher, store=self.agent, g3_volume="fast")
        self.page = s.page_size

    def serve(self, prompts: int) -> None:
        for i in range(prompts):
            self.mgr.serve([1000 * i + t for t in range(self.page * 6)], fill_synthetic_kv)
        self.publisher.flush()

    def close(self) -> None:
        self.mgr.close()
        self.publisher.close()
        self.agent.close()
        self.catalog.close()


def test_an_advisor_on_the_default_namespace_drains_the_workers_volume(tmp_path: Path) -> None:
    pub_port, rep_port = free_port(), free_port()
    url = f"zmq://127.0.0.1:{pub_port}?replay={rep_port}"
    worker = _Worker(tmp_path, url)
    svc = AdvisorService(_settings(tmp_path, url))  # namespace: "default", nothing else set
    try:
        svc.start()
        ns = worker.mgr.namespace
        assert ns != "default"
        worker.serve(8)
        on_fast = lambda: {p.key.sequence_hash for p in worker.catalog.iter_volume("fast")}  # noqa: E731
        assert on_fast() and all(p.key.namespace == ns for p in worker.catalog.iter_volume("fast"))
        wait_until(lambda: svc.query().stats()["blocks_per_location"].get("fast", 0) == len(on_fast()), 60,
                   "the index places every stored block on 'fast'")
        c = TestClient(create_app(svc.query()), base_url="http://127.0.0.1")
        # /v1/stats looks at the catalog's namespaces every few seconds
        wait_until(lambda: ns in c.get("/v1/stats").json()["namespaces"]["managed"], 60, "the worker's namespace managed")
        nss = c.get("/v1/stats").json()["namespaces"]
        assert nss["managed"] == ["default", ns] and nss["left"] == {}, nss
        stored = on_fast()
        r = c.post("/v1/volumes/fast/drain", json={"to": "slow"}).json()
        assert r["counts"] == {"done": len(stored), "skipped": 0, "failed": 0}, r
        assert r["hint"] is None and r["other_namespaces"] == {}
        assert on_fast() == set() and stored <= {p.key.sequence_hash for p in worker.catalog.iter_volume("slow")}
        # the index follows the moves (the advisor's own events), the worker reads its blocks from slow
        wait_until(lambda: svc.query().stats()["blocks_per_location"].get("fast", 0) == 0, 60, "'fast' drained in the index")
        # a drain that finds nothing says what it looked for and what the catalog holds
        r = c.post("/v1/volumes/fast/drain", json={"to": "slow"}).json()
        assert r["counts"] == {"done": 0, "skipped": 0, "failed": 0}
        assert r["hint"] == (f"0 blocks of namespace(s) default, {ns} on volume 'fast': nothing to move; "
                             f"namespaces seen in the catalog: {ns} (slow={len(stored):,})"), r
    finally:
        svc.stop()
        worker.close()


def test_namespaces_beyond_the_quota_are_left_and_named(tmp_path: Path) -> None:
    """``max_namespaces`` bounds what the catalog's writers can make an advisor manage; the
    ones left are listed in /v1/stats and a drain names them."""
    pub_port, rep_port = free_port(), free_port()
    url = f"zmq://127.0.0.1:{pub_port}?replay={rep_port}"
    worker = _Worker(tmp_path, url)
    svc = AdvisorService(_settings(tmp_path, url, max_namespaces=1))
    try:
        svc.start()
        ns = worker.mgr.namespace
        worker.serve(4)
        n = len(list(worker.catalog.iter_volume("fast")))
        assert n > 0
        c = TestClient(create_app(svc.query()), base_url="http://127.0.0.1")
        r = c.post("/v1/volumes/fast/drain", json={"to": "slow"}).json()
        assert r["counts"] == {"done": 0, "skipped": 0, "failed": 0} and r["other_namespaces"] == {ns: n}, r
        assert ns in r["hint"] and "max_namespaces" in r["hint"]
        nss = c.get("/v1/stats").json()["namespaces"]  # the drain looked at the catalog just now
        assert nss["managed"] == ["default"] and nss["left"] == {ns: n}, nss
    finally:
        svc.stop()
        worker.close()
