"""The connector split as vLLM runs it: a KvbmLeader (scheduler side, no memory) and a
KvbmConnectorWorker over a G1-less BlockManager, talking only through plain metadata
(leader → worker) and residency reports (worker → leader), with a real POSIX volume.
Exact event order, async loads from storage, disk-only saves, failed loads."""

from __future__ import annotations

import os
import pickle
import time
from pathlib import Path

import pytest
import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from event_plane import NullPublisher  # noqa: E402
from kvbm_runtime import BlockManager, RuntimeConfig  # noqa: E402
from kvbm_runtime.connector import ConnectorError, KvbmConnectorWorker  # noqa: E402
from kvbm_runtime.handshake import WorkerEndpoint, WorkerJoinError, endpoint_path, join_workers  # noqa: E402
from kvbm_runtime.leader import KvbmLeader, StepRequest  # noqa: E402
from kvbm_runtime.residency import HOST, REMOVED, STORAGE, STORED, ReportingSink, ResidencyDirectory, ResidencyReport  # noqa: E402
from conftest import posix_agent  # noqa: E402

PAGE, LAYERS, INNER, BLOCKS = 4, 2, 8, 16


def _config(**kw: object) -> RuntimeConfig:
    base = dict(num_layers=LAYERS, outer_dim=2, page_size=PAGE, inner_dim=INNER, kv_dtype="float32", g1_blocks=BLOCKS, g2_blocks=4)
    base.update(kw)
    return RuntimeConfig(**base)


class Rig:
    """Leader + worker + an engine KV cache ``[layers][BLOCKS, 2, PAGE, INNER]``."""

    def __init__(self, tmp: Path, *, store: bool, disk_only: bool = False, g2_blocks: int = 4) -> None:
        self.events: list[tuple[str, str, int]] = []
        pub = NullPublisher("w0", on_flush=lambda b, _p: self.events.extend((e.type.name, e.storage_location, e.sequence_hash) for e in b.events))
        self.sink = ReportingSink(pub)
        self.agent = posix_agent(tmp, "lw") if store else None
        cfg = _config(g2_blocks=g2_blocks, disable_disk_offload_filter=True)  # every block to the volume
        self.manager = BlockManager(cfg, self.sink, self.agent, "fast" if store else None, engine_g1=True)
        self.worker = KvbmConnectorWorker(self.manager, self.sink, disk_only=disk_only)
        self.kv = [torch.zeros(BLOCKS, 2, PAGE, INNER) for _ in range(LAYERS)]
        self.names = [f"l{i}" for i in range(LAYERS)]
        self.worker.register_kv_caches(dict(zip(self.names, self.kv)))
        self.leader = KvbmLeader(PAGE)

    def step(self, reqs: list[StepRequest], finished: set[str] = frozenset()) -> tuple[set[str] | None, set[str] | None, set[int]]:
        """One engine step: metadata crosses as pickled bytes, the report comes back."""
        meta = pickle.loads(pickle.dumps(self.leader.build_meta(reqs)))
        w = self.worker
        w.bind_connector_metadata(meta)
        w.start_load_kv(None)
        for n in self.names:
            w.wait_for_layer_load(n)
        w.wait_for_save()
        sending, recving = w.get_finished(set(finished))
        errors = w.get_block_ids_with_load_errors()
        w.clear_connector_metadata()
        report = w.take_report()
        if report is not None:
            self.leader.apply_report(pickle.loads(pickle.dumps(report)))
        return sending, recving, errors

    def settle(self) -> None:
        self.worker.wait_for_storage(timeout=30)
        self.manager.flush()

    def close(self) -> None:
        self.worker.close()
        self.manager.close()
        if self.agent is not None:
            self.agent.close()


def _fill(kv: list[torch.Tensor], block_id: int, value: float) -> None:
    for t in kv:
        t[block_id].fill_(value)


def test_save_report_match_load_from_g2_then_storage(tmp_path: Path) -> None:
    rig = Rig(tmp_path, store=True)
    try:
        hashes = [101, 102, 103]
        for i in range(3):
            _fill(rig.kv, i, float(i + 1))
        # step 1: the request computes 13 tokens = 3 full blocks, saved behind the step
        sending, _, _ = rig.step([StepRequest("r1", hashes, [0, 1, 2], 0, 13)])
        assert rig.leader.finished("r1") is True
        deadline = time.monotonic() + 10
        while not sending and time.monotonic() < deadline:
            sending, _, _ = rig.step([], finished={"r1"})
        assert sending == {"r1"}
        rig.settle()
        rig.step([])  # a step carries the G2 → volume report
        assert rig.leader.directory.match(hashes) == [HOST, HOST, HOST]
        assert rig.events == [("STORE", "g2", h) for h in hashes] + [("STORE", "fast", h) for h in hashes]
        # a new request with the same prefix: 3 blocks match (13 tokens: never the whole prompt)
        assert rig.leader.match("r2", hashes, 13, 0) == (12, False)
        rig.leader.plan_load("r2", [7, 8, 9, 10], 12)
        _, _, errors = rig.step([])
        assert errors == set()
        for dst, value in zip([7, 8, 9], [1.0, 2.0, 3.0]):
            assert all(torch.all(t[dst] == value) for t in rig.kv)
        # evict from G2 (4 blocks): the next request's blocks take their place
        for i, h in enumerate([201, 202, 203, 204]):
            _fill(rig.kv, 4 + i, 9.0)
        rig.step([StepRequest("r3", [201, 202, 203, 204], [4, 5, 6, 7], 0, 16)])
        rig.leader.finished("r3")
        rig.settle()
        rig.step([], finished={"r3"})
        assert rig.leader.directory.match(hashes) == [STORAGE, STORAGE, STORAGE]
        # from storage: asynchronous, finished_recving when done
        assert rig.leader.match("r4", hashes, 13, 0) == (12, True)
        rig.leader.plan_load("r4", [11, 12, 13, 14], 12)
        recving: set[str] | None = None
        deadline = time.monotonic() + 10
        _, recving, errors = rig.step([])
        while not recving and time.monotonic() < deadline:
            _, recving, errors = rig.step([])
        assert recving == {"r4"} and errors == set()
        for dst, value in zip([11, 12, 13], [1.0, 2.0, 3.0]):
            assert all(torch.all(t[dst] == value) for t in rig.kv)
    finally:
        rig.close()


def test_failed_storage_load_reports_blocks_and_forgets_the_lost_one(tmp_path: Path) -> None:
    rig = Rig(tmp_path, store=True, g2_blocks=2)
    try:
        hashes = [301, 302]
        rig.step([StepRequest("a", hashes, [0, 1], 0, 9)])
        rig.leader.finished("a")
        rig.settle()
        rig.step([], finished={"a"})
        rig.step([StepRequest("b", [401, 402], [2, 3], 0, 9)])  # evicts a's G2 copies
        rig.leader.finished("b")
        rig.settle()
        rig.step([], finished={"b"})
        assert rig.leader.directory.match(hashes) == [STORAGE, STORAGE]
        # corrupt the volume's segments: the checksum catches it
        for p in (tmp_path / "fast").rglob("*"):
            if p.is_file():
                data = bytearray(p.read_bytes())
                for i in range(0, len(data), 64):
                    data[i] ^= 0xFF
                p.write_bytes(data)
        assert rig.leader.match("c", hashes, 9, 0) == (8, True)
        rig.leader.plan_load("c", [5, 6, 7], 8)
        errors: set[int] = set()
        recving = None
        deadline = time.monotonic() + 10
        while not recving and time.monotonic() < deadline:
            _, recving, got = rig.step([])
            errors |= got
        assert recving == {"c"}
        assert errors == {5, 6}  # the failed block and the ones after it: recomputed
        assert rig.leader.stats.load_failures == 2
        assert rig.manager.metrics.sample("kvbm_onboard_errors") == 2
        # the corrupt block is gone from the directory; the next one is only not loaded
        assert rig.leader.directory.tier_of(301) is None
    finally:
        rig.close()


def test_failed_storage_load_publishes_a_remove_for_every_dropped_copy(tmp_path: Path) -> None:
    """A load whose read quarantines copies (checksum mismatch) announces Remove(<volume>)
    for each of them, to the advisor (events) and to the leader (the step's report): no
    index keeps placing the block on the volume, and the next save stores it again."""
    rig = Rig(tmp_path, store=True, g2_blocks=2)
    try:
        hashes = [311, 312]
        rig.step([StepRequest("a", hashes, [0, 1], 0, 9)])
        rig.leader.finished("a")
        rig.settle()
        rig.step([], finished={"a"})
        rig.step([StepRequest("b", [411, 412], [2, 3], 0, 9)])  # evicts a's G2 copies
        rig.leader.finished("b")
        rig.settle()
        rig.step([], finished={"b"})
        for p in (tmp_path / "fast").rglob("*"):
            if p.is_file() and p.name != "catalog.sqlite":
                data = bytearray(p.read_bytes())
                for i in range(0, len(data), 64):
                    data[i] ^= 0xFF
                p.write_bytes(data)
        rig.events.clear()
        assert rig.leader.match("c", hashes, 9, 0) == (8, True)
        rig.leader.plan_load("c", [5, 6, 7], 8)
        recving = None
        deadline = time.monotonic() + 10
        while not recving and time.monotonic() < deadline:
            _, recving, _ = rig.step([])
        rig.manager.flush()
        # both copies were quarantined by the read (the second in the same failed batch)
        assert sorted(e for e in rig.events if e[0] == "REMOVE") == [("REMOVE", "fast", 311), ("REMOVE", "fast", 312)]
        assert rig.agent is not None and rig.agent.exists([rig.manager.block_key(h) for h in hashes]) == [False, False]
        assert rig.leader.directory.match(hashes) == []
    finally:
        rig.close()


def test_a_remove_then_a_store_leaves_the_block_held() -> None:
    """Events are folded in the order they happened: G2 evicts X, then the same step saves
    X again (Remove X, Store X): the scheduler side must see X held, not gone."""
    from event_plane.schema import EventType, KVEvent

    sink = ReportingSink(NullPublisher("w0"))
    x, y = 0xAB, 0xCD
    sink.publish([KVEvent(EventType.STORE, x, x, None, 64, HOST), KVEvent(EventType.STORE, y, y, None, 64, "fast")])
    sink.publish([KVEvent(EventType.REMOVE, x, x, None, 64, HOST), KVEvent(EventType.REMOVE, y, y, None, 64, "fast")])
    sink.publish([KVEvent(EventType.STORE, x, x, None, 64, HOST)])
    report = sink.take_report()
    assert report is not None
    d = ResidencyDirectory()
    d.apply(pickle.loads(pickle.dumps(report)))  # as it crosses from the worker to the scheduler
    assert d.tier_of(x) == HOST
    assert d.tier_of(y) is None
    # and across reports: stored in one step, removed in the next
    sink.publish([KVEvent(EventType.REMOVE, x, x, None, 64, HOST)])
    d.apply(sink.take_report())  # type: ignore[arg-type]
    assert d.tier_of(x) is None


def test_disk_only_saves_go_straight_to_the_volume(tmp_path: Path) -> None:
    rig = Rig(tmp_path, store=True, disk_only=True)
    try:
        for i in range(2):
            _fill(rig.kv, i, 5.0 + i)
        rig.step([StepRequest("d", [501, 502], [0, 1], 0, 8)])
        rig.leader.finished("d")
        sending = None
        deadline = time.monotonic() + 10
        while not sending and time.monotonic() < deadline:
            sending, _, _ = rig.step([], finished={"d"})
        assert sending == {"d"}
        rig.manager.flush()
        rig.step([])
        assert rig.events == [("STORE", "fast", 501), ("STORE", "fast", 502)]  # no G2 on the way
        assert rig.manager.g2.stats().stores_published == 0  # G2 untouched
        assert rig.leader.directory.match([501, 502]) == [STORAGE, STORAGE]
    finally:
        rig.close()


def test_disk_only_needs_a_volume(tmp_path: Path) -> None:
    manager = BlockManager(_config(), NullPublisher("w"), engine_g1=True)
    try:
        with pytest.raises(ConnectorError, match="disk-only"):
            KvbmConnectorWorker(manager, None, disk_only=True)
    finally:
        manager.close()


def test_directory_needs_every_rank_and_reports_merge() -> None:
    d = ResidencyDirectory(world_size=2)
    r0 = ResidencyReport(0, [(STORED, HOST, [1, 2])])
    d.apply(r0)
    assert d.match([1, 2]) == []  # rank 1 has not stored them
    d.apply(ResidencyReport(1, [(STORED, HOST, [1])]).merge(ResidencyReport(0, [(STORED, STORAGE, [2])])))
    assert d.match([1, 2]) == [HOST]
    d.apply(ResidencyReport(1, [(STORED, STORAGE, [2]), (REMOVED, HOST, [1])]))
    assert d.match([1, 2]) == []
    with pytest.raises(ValueError, match="rank 2"):
        d.apply(ResidencyReport(2))


def test_leader_refuses_misaligned_and_overlong_requests() -> None:
    leader = KvbmLeader(PAGE)
    leader.apply_report(ResidencyReport(0, [(STORED, HOST, [1, 2])]))
    with pytest.raises(ConnectorError):
        leader.match("x", [1, 2], 9, 3)
    assert leader.match("x", [1, 2], 9, 0) == (8, False)
    with pytest.raises(ConnectorError, match="external tokens"):
        leader.plan_load("x", [0, 1, 2], 12)


def test_workers_join_or_the_leader_names_the_timeout_setting(tmp_path: Path) -> None:
    ep = endpoint_path("engine-x", 0, tmp_path / "sockets")
    worker = WorkerEndpoint(ep, {"page_size": 32, "namespace": "ns"})
    try:
        assert join_workers([ep], 5, {"page_size": 32})[0]["namespace"] == "ns"
        with pytest.raises(WorkerJoinError, match="another configuration"):
            join_workers([ep], 5, {"page_size": 16})
    finally:
        worker.close()
    missing = endpoint_path("engine-x", 1, tmp_path / "sockets")
    t = time.monotonic()
    with pytest.raises(WorkerJoinError, match="DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS"):
        join_workers([missing], 0.5, {})
    assert time.monotonic() - t > 0.4  # it waited for the worker as long as it was told


def test_join_directory_must_be_private(tmp_path: Path) -> None:
    d = tmp_path / "open"
    d.mkdir(mode=0o777)
    d.chmod(0o777)
    with pytest.raises(WorkerJoinError, match="0700"):
        endpoint_path("e", 0, d)
