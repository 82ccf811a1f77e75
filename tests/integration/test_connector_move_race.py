"""A block the advisor moves while a worker reads it is loaded right or reported as a load
error (the engine recomputes it), never served with wrong bytes.

The worker is the connector as vLLM runs it (a :class:`KvbmLeader` matching on the shared
catalog, a :class:`KvbmConnectorWorker` over a G1-less :class:`BlockManager`, loads into an
engine KV cache); the advisor is the real :class:`advisor.moves.mover.Mover` on its own storage
agent.  Both open the volumes and the catalog from ONE storage declaration (an advisor
config read with :class:`DeploymentStorage`).  Each round stores a prompt's blocks on
``fast``, then loads them while the mover moves them ``fast`` <-> ``slow``: once in the
window between the worker's catalog look-up and its read (the old segment is gone when the
read starts: deterministic) in even rounds, continuously from another thread in odd ones."""

from __future__ import annotations

import json
import os
import pickle
import threading
import time
from pathlib import Path

import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from advisor.moves.mover import Mover  # noqa: E402
from advisor.policy.plan import PlanItem, PlanKind, PlanStatus  # noqa: E402
from event_plane import NullPublisher  # noqa: E402
from kvbm_runtime.leader import KvbmLeader, shared_lookup  # noqa: E402
from storage_backends import BlockKey  # noqa: E402
from storage_backends.deployment import DeploymentStorage  # noqa: E402
from conftest import deployment_agent, engine_worker  # noqa: E402

PAGE, LAYERS, INNER, BLOCKS = 4, 2, 64, 40
N = 12  # blocks per prompt
ROUNDS = 50


class _MoveOnLookup:
    """The worker agent's catalog: once armed, the next look-up returns its answer and
    then lets the advisor move the blocks (so the read that follows meets old placements
    whose segments are gone)."""

    def __init__(self, inner: object) -> None:
        self._inner = inner
        self.armed: list[PlanItem] | None = None
        self.mover: Mover | None = None
        self.moved = 0

    def get_many(self, keys):  # noqa: ANN001, ANN201
        got = self._inner.get_many(keys)  # type: ignore[attr-defined]
        items, self.armed = self.armed, None
        if items and self.mover is not None:
            done = self.mover.execute_many(items)
            self.moved += sum(r.status is PlanStatus.DONE for r in done)
        return got

    def __getattr__(self, name: str) -> object:
        return getattr(self._inner, name)


def _declaration(tmp: Path) -> Path:
    vols = [
        {"id": v, "kind": "posix", "media": m, "capacity_bytes": 256 << 20, "root": str(tmp / "volumes" / v),
         "segment_bytes": 64 << 10}
        for v, m in (("fast", "nvme"), ("slow", "hdd"))
    ]
    path = tmp / "advisor.json"
    path.write_text(json.dumps({"catalog_path": str(tmp / "catalog.sqlite"), "volumes": vols,
                                "fast_volume": "fast", "slow_volumes": ["slow"], "volume_roots": [str(tmp / "volumes")]}))
    return path


def test_blocks_moved_during_the_read_load_right_or_fail_never_wrong(tmp_path: Path) -> None:
    dep = DeploymentStorage.load(_declaration(tmp_path))
    advisor_agent = deployment_agent(dep, "race-advisor")
    worker_agent = deployment_agent(dep, "race-worker")
    hooked = _MoveOnLookup(worker_agent.catalog)
    worker_agent.catalog = hooked  # type: ignore[assignment]
    manager, worker, kv = engine_worker(worker_agent, "race-worker", layers=LAYERS, page=PAGE, inner=INNER, blocks=BLOCKS)
    names = [f"l{i}" for i in range(LAYERS)]
    leader = KvbmLeader(PAGE, shared=shared_lookup(advisor_agent.catalog, [manager.namespace]))
    mover = Mover(advisor_agent, NullPublisher("advisor"), [manager.namespace], lambda h: None, BlockKey)
    hooked.mover = mover
    stop = threading.Event()
    current: list[int] = []
    moves = {"done": 0}

    def churn() -> None:  # the advisor, moving the round's blocks back and forth
        while not stop.is_set():
            for h in list(current):
                p = advisor_agent.locate([BlockKey(manager.namespace, h)])[0]
                if p is None:
                    continue
                dst = "slow" if p.volume_id == "fast" else "fast"
                (r,) = mover.execute_many([PlanItem(PlanKind.DEMOTE, "race", p.volume_id, dst, h, manager.namespace)])
                moves["done"] += r.status is PlanStatus.DONE
            time.sleep(0.001)

    mover_thread = threading.Thread(target=churn, daemon=True)
    mover_thread.start()
    outcomes = {"right": 0, "error": 0}
    try:
        for rnd in range(ROUNDS):
            hashes = [(rnd << 16) + k + 1 for k in range(N)]
            # the round's blocks, stored on the landing volume by a worker: engine block
            # k holds the value rnd * 100 + k everywhere
            for k in range(N):
                for t in kv:
                    t[k].fill_(float(rnd * 100 + k))
            advisor_agent.put([(BlockKey(manager.namespace, h), worker.layout.read_bytes(k)) for k, h in enumerate(hashes)],
                              "fast")
            dst = list(range(N, 2 * N))
            for t in kv:
                t[N : 2 * N].fill_(-1.0)
            if rnd % 2 == 0:  # even rounds: every block moves between the look-up and the read
                hooked.armed = [PlanItem(PlanKind.DEMOTE, "race", "fast", "slow", h, manager.namespace) for h in hashes]
            else:  # odd rounds: the churn thread moves them while the read runs
                current[:] = hashes
            tokens, load_async = leader.match(f"r{rnd}", hashes, N * PAGE + 1, 0)
            assert (tokens, load_async) == (N * PAGE, True)
            leader.plan_load(f"r{rnd}", dst + [2 * N], N * PAGE)
            errors: set[int] = set()
            recving: set[str] | None = None
            deadline = time.monotonic() + 30
            while not recving:
                assert time.monotonic() < deadline, f"round {rnd}: the load never finished"
                worker.bind_connector_metadata(pickle.loads(pickle.dumps(leader.build_meta([]))))
                worker.start_load_kv(None)
                for n in names:
                    worker.wait_for_layer_load(n)
                worker.wait_for_save()
                _, recving = worker.get_finished(set())
                errors |= worker.get_block_ids_with_load_errors()
                worker.clear_connector_metadata()
                report = worker.take_report()
                if report is not None:
                    leader.apply_report(report)
            current.clear()
            for k, b in enumerate(dst):
                if b in errors:
                    outcomes["error"] += 1  # reported: vLLM recomputes it
                    continue
                for t in kv:
                    assert torch.all(t[b] == float(rnd * 100 + k)), f"round {rnd}: block {k} loaded with wrong bytes"
                outcomes["right"] += 1
    finally:
        stop.set()
        mover_thread.join(timeout=30)
        worker.close()
        manager.close()
        worker_agent.close()
        advisor_agent.close()
    # the race was real: half the rounds had every block moved between look-up and read,
    # and the churn moved blocks throughout
    assert hooked.moved == (ROUNDS // 2) * N
    assert moves["done"] > 0
    assert outcomes["right"] + outcomes["error"] == ROUNDS * N
    assert outcomes["right"] >= (ROUNDS // 2) * N, outcomes  # moved blocks are re-read at their new place
