"""Loads from a local POSIX volume run within the engine step, like G2 loads; loads that
touch any other volume stay asynchronous.

vLLM runs an asynchronous load (``load_async``) by parking the request until a later step
reports it finished and scheduling it in the step after that: at least one more engine
step of the request's TTFT, a whole prefill of other requests on a busy engine, for a read
of milliseconds.  The leader decides per request from where the shared placement catalog
places its blocks at match time (``sync_volumes``).  The worker is the real connector
worker over a real storage agent (two POSIX volumes declared once, as the advisor declares
them); the leader matches on the same catalog."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path
from typing import Any

import pytest
import torch

os.environ.setdefault("NIXL_LOG_LEVEL", "WARN")

from kvbm_runtime.connector import KvbmConnectorWorker  # noqa: E402
from kvbm_runtime.leader import KvbmLeader, shared_lookup  # noqa: E402
from kvbm_runtime.residency import STORAGE, STORED, ResidencyReport  # noqa: E402
from storage_backends import BlockKey, StorageAgent  # noqa: E402
from storage_backends.deployment import DeploymentStorage  # noqa: E402
from conftest import deployment_agent, engine_worker  # noqa: E402

PAGE, LAYERS, INNER, BLOCKS = 4, 2, 16, 32
N = 6  # blocks per prompt


@pytest.fixture()
def world(tmp_path: Path):  # noqa: ANN201
    vols = [{"id": v, "kind": "posix", "media": m, "capacity_bytes": 64 << 20, "root": str(tmp_path / "volumes" / v),
             "segment_bytes": 64 << 10} for v, m in (("fast", "nvme"), ("slow", "hdd"))]
    decl = tmp_path / "advisor.json"
    decl.write_text(json.dumps({"catalog_path": str(tmp_path / "catalog.sqlite"), "volumes": vols,
                                "fast_volume": "fast", "volume_roots": [str(tmp_path / "volumes")]}))
    dep = DeploymentStorage.load(decl)
    agent = deployment_agent(dep, "sync-loads")
    manager, worker, kv = engine_worker(agent, "sync-loads", layers=LAYERS, page=PAGE, inner=INNER, blocks=BLOCKS)
    yield agent, manager, worker, kv
    worker.close()
    manager.close()
    agent.close()


def _store(agent: StorageAgent, manager: Any, worker: KvbmConnectorWorker, kv: list[torch.Tensor],
           hashes: list[int], volumes: list[str]) -> None:
    """Block k of the prompt holds the value ``hash % 1000`` everywhere, stored on volumes[k]."""
    for k, h in enumerate(hashes):
        for t in kv:
            t[k].fill_(float(h % 1000))
        agent.put([(BlockKey(manager.namespace, h), worker.layout.read_bytes(k))], volumes[k])


def test_a_prompt_on_the_posix_volume_loads_within_the_step_with_the_right_bytes(world) -> None:  # noqa: ANN001
    agent, manager, worker, kv = world
    leader = KvbmLeader(PAGE, shared=shared_lookup(agent.catalog, [manager.namespace]), sync_volumes={"fast"})
    hashes = [5000 + k for k in range(N)]
    _store(agent, manager, worker, kv, hashes, ["fast"] * N)
    assert leader.match("r1", hashes, N * PAGE + 1, 0) == (N * PAGE, False)
    dst = list(range(N, 2 * N))
    for t in kv:
        t[N : 2 * N].fill_(-1.0)
    leader.plan_load("r1", dst + [2 * N], N * PAGE)
    meta = pickle.loads(pickle.dumps(leader.build_meta([])))
    assert [(r.request_id, r.load_async, len(r.blocks)) for r in meta.loads] == [("r1", False, N)]
    # one step: the loads are in place once the first layer waits for them
    worker.bind_connector_metadata(meta)
    worker.start_load_kv(None)
    worker.wait_for_layer_load("l0")
    for k, b in enumerate(dst):
        for t in kv:
            assert torch.all(t[b] == float(hashes[k] % 1000)), f"block {k}"
    worker.wait_for_save()
    assert worker.get_finished(set()) == (None, None)  # nothing for the engine to wait for
    assert worker.get_block_ids_with_load_errors() == set()
    worker.clear_connector_metadata()
    assert manager.metrics.onboarded_by_volume() == {"fast": N}


def test_a_block_on_another_volume_or_without_sync_volumes_keeps_the_load_asynchronous(world) -> None:  # noqa: ANN001
    agent, manager, worker, kv = world
    shared = shared_lookup(agent.catalog, [manager.namespace])
    hashes = [6000 + k for k in range(N)]
    _store(agent, manager, worker, kv, hashes, ["fast"] * (N - 1) + ["slow"])
    assert shared(hashes) == ["fast"] * (N - 1) + ["slow"]
    leader = KvbmLeader(PAGE, shared=shared, sync_volumes={"fast"})
    assert leader.match("r1", hashes, N * PAGE + 1, 0) == (N * PAGE, True)
    leader.plan_load("r1", list(range(N, 2 * N + 1)), N * PAGE)
    assert [r.load_async for r in leader.build_meta([]).loads] == [True]
    # the first N - 1 blocks alone are all on fast
    assert leader.match("r2", hashes[: N - 1], (N - 1) * PAGE + 1, 0) == ((N - 1) * PAGE, False)
    # no sync volume (the default): every storage load is asynchronous, as before
    assert KvbmLeader(PAGE, shared=shared).match("r3", hashes[: N - 1], (N - 1) * PAGE + 1, 0) == ((N - 1) * PAGE, True)


def test_the_directorys_own_storage_blocks_are_located_in_the_catalog(world) -> None:  # noqa: ANN001
    agent, manager, worker, kv = world
    hashes = [7000 + k for k in range(N)]
    _store(agent, manager, worker, kv, hashes, ["fast"] * N)
    leader = KvbmLeader(PAGE, shared=shared_lookup(agent.catalog, [manager.namespace]), sync_volumes={"fast"})
    # the workers reported the blocks stored (the directory answers first)
    leader.apply_report(ResidencyReport(0, [(STORED, STORAGE, hashes)]))
    assert leader.match("r1", hashes, N * PAGE + 1, 0) == (N * PAGE, False)
    # the advisor demotes the last block to slow: the directory still says "storage",
    # the catalog says where, and the load becomes asynchronous
    p = agent.locate([BlockKey(manager.namespace, hashes[-1])])[0]
    assert p is not None
    agent.commit_move(p, agent.copy(p, "slow"))
    assert leader.match("r2", hashes, N * PAGE + 1, 0) == (N * PAGE, True)
