"""The whole loop with real engines, scaled mode: two vLLM engines with the connector on the
cluster's Redis placement catalog, a cluster advisor (:class:`advisor.cluster.node.ClusterNode`
with its mover) folding the events from JetStream, a POSIX volume ``fast`` and an S3 volume
``archive`` (moto on loopback).  The cluster advisors' storage file (``--storage``) is the
one declaration of the volumes and the catalog; the engines read it (``storage_config``)
and the Redis URL from ``$KVADVISOR_CLUSTER_REDIS_URL``, as the advisors do.

In order: engine A offloads two prompts to ``fast``, over the demotion watermark; a policy
round demotes them (cold) to S3; engine B onboards prompt ``a`` from S3 with the outputs of
vLLM without a connector (its own KV events, relayed to JetStream, make ``a`` hot); the next
round promotes ``a`` back, and B's third run onboards it from ``fast``."""

from __future__ import annotations

import subprocess
import sys
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from loop_cases import (
    FULL_BLOCKS, connector_env, engine_namespace, prompt_hashes, volumes, wait_for, where, write_private_json,
)
from vllm_cases import PAGE, run, run_offloaded

from advisor.cluster.node import ClusterNode, ClusterSettings
from advisor.cluster.mover import ClusterStorageSettings
from event_plane.partition import PartitionScheme
from kvbm_runtime.testing.vllm_engine import Completion, llm_engine, metric
from storage_backends import RedisCatalog
from storage_backends.deployment import REDIS_URL_ENV
from storage_backends.local_s3 import LocalS3, free_port

pytestmark = [pytest.mark.vllm, pytest.mark.timeout(900)]  # two engine starts on a loaded machine

SCHEME = "partitions=1&trunk_depth=1&stretch=64"


@pytest.fixture(scope="module")
def cluster_loop(llama_dir: Path, tmp_path_factory: pytest.TempPathFactory, local_s3: LocalS3, nats_url: str,
                 redis_url: str) -> Iterator[dict[str, Any]]:
    """A cluster advisor with its mover, engines A and B on its storage file, and a relay of
    B's own KV events into the cluster's stream."""
    work = tmp_path_factory.mktemp("vllm-loop-cluster")
    ns = engine_namespace(llama_dir)
    run_id = uuid.uuid4().hex[:8]
    events_ns = f"loop{run_id}"
    prefix = f"kvadvisor:{events_ns}:catalog"
    # fast holds 1.5 MiB in 128 KiB segments: two prompts (34 blocks of 32 KiB, 1088 KiB)
    # are over its 0.6 demotion watermark, one (544 KiB) fits under it, so the hot one can
    # come back whole
    vols = volumes(work, local_s3, f"kvbm-loop-{run_id}")
    vols[0].update(capacity_bytes=3 << 19, segment_bytes=128 << 10)
    storage = write_private_json(work / "storage.json", {
        "catalog_prefix": prefix, "key_namespaces": [ns], "volumes": vols,
        "fast_volume": "fast", "archive_volume": "archive", "volume_roots": [str(work / "volumes")],
        "policy_interval_s": 3600,  # rounds only when the test runs one
        "policy": {"promotion": {"min_hits": 1}, "demotion": {"high_watermark": 0.6, "low_watermark": 0.0},
                   "planner": {"min_move_interval_s": 0}},
    })
    node = ClusterNode(ClusterSettings(
        nats_url=nats_url, redis_url=redis_url, advisor_id=f"adv-{run_id}", namespace=events_ns,
        scheme=PartitionScheme(1, 1, 64), lease_ttl_s=5.0, heartbeat_s=0.5, snapshot_interval_s=3600.0,
        source_ttl_s=0.0), ClusterStorageSettings.load(storage)).start()
    jetstream = f"jetstream://{nats_url.removeprefix('nats://')}?namespace={events_ns}&{SCHEME}"
    vb = free_port(count=2)  # vLLM replays on vb + 1
    relay = subprocess.Popen(
        [sys.executable, "-c", "from kvadvisor.cli import app; app()", "events", "relay",
         f"vllm+zmq://127.0.0.1:{vb}?replay={vb + 1}&source=vllm-b&topic=kv&model={llama_dir}&media=GPU", jetstream],
        stdout=subprocess.DEVNULL, stderr=open(work / "relay.log", "w"))  # noqa: SIM115 - owned by the process
    catalog = RedisCatalog(redis_url, prefix=prefix)
    pa, pb = free_port(), free_port()
    try:
        wait_for(lambda: 0 in node.serving(), "the advisor owns the partition")
        common = {"storage_config": str(storage), "events_url": jetstream, "g2_blocks": 40}
        with llm_engine(llama_dir, connector={**common, "source": "kvbm-a"},
                        env={**connector_env(pa), REDIS_URL_ENV: redis_url}) as llm_a, \
             llm_engine(llama_dir, connector={**common, "source": "kvbm-b"},
                        env={**connector_env(pb), REDIS_URL_ENV: redis_url},
                        kv_events_endpoint=f"tcp://127.0.0.1:{vb}") as llm_b:
            yield {"a": llm_a, "b": llm_b, "metrics_a": f"http://127.0.0.1:{pa}/metrics", "node": node,
                   "catalog": catalog, "namespace": ns}
    finally:
        relay.terminate()
        relay.wait(timeout=30)
        node.stop()
        catalog.destroy()
        catalog.close()


def test_cluster_advisor_demotes_to_s3_and_promotes_back_on_the_redis_catalog(
    cluster_loop: dict[str, Any], vllm_reference: dict[str, Completion],
) -> None:
    llm_a, llm_b, node = cluster_loop["a"], cluster_loop["b"], cluster_loop["node"]
    catalog, ns = cluster_loop["catalog"], cluster_loop["namespace"]
    full = FULL_BLOCKS * PAGE
    rep = node.serving()[0]

    def at_fast() -> set[int]:
        with rep.lock:
            return rep.index.blocks_at("fast")

    def hits(h: int) -> int:
        with rep.lock:
            info = rep.index.block(h)
            return 0 if info is None else info.hits

    # 1. engine A offloads two prompts to the landing volume: 'fast' is over its watermark
    first = run_offloaded(llm_a, cluster_loop["metrics_a"], "a", "c")
    assert [c.token_ids for c in first] == [vllm_reference["a"].token_ids, vllm_reference["c"].token_ids]
    on_fast = wait_for(lambda: (h := prompt_hashes(catalog, ns, "fast")) and len(h) == 2 * FULL_BLOCKS and h,
                       "both prompts' blocks on 'fast' in the Redis catalog")
    wait_for(lambda: at_fast() >= set(on_fast), "the cluster advisor's index places them on 'fast'")

    # 2. a policy round demotes the cold blocks to S3; both engines forget their prefix caches
    results = node.mover.run_round()
    demoted = {r.item.sequence_hash for r in results if r.item.kind.value == "demote" and r.status.value == "done"}
    assert demoted == set(on_fast), [(r.item.kind.value, r.status.value, r.detail) for r in results]
    assert where(catalog, ns, on_fast) == ["archive"] * len(on_fast)
    llm_a.reset_prefix_cache()
    llm_b.reset_prefix_cache()

    # 3. engine B onboards prompt a from S3 (vLLM's own counts), outputs unchanged
    hits0 = metric(llm_b, "vllm:external_prefix_cache_hits")
    (second,) = run(llm_b, "a")
    assert metric(llm_b, "vllm:external_prefix_cache_hits") - hits0 >= 0.9 * full
    assert second.num_cached_tokens >= 0.9 * full
    assert second.token_ids == vllm_reference["a"].token_ids

    # 4. B's onboarding (its G1 events, relayed) made a's blocks hot: the next round
    # promotes them back to 'fast'; c's stay in S3
    wait_for(lambda: sum(hits(h) >= 1 for h in on_fast) == FULL_BLOCKS, "B's onboarding counted as hits of a's blocks")
    hot = [h for h in on_fast if hits(h) >= 1]
    results = node.mover.run_round()
    promoted = {r.item.sequence_hash for r in results if r.item.kind.value == "promote" and r.status.value == "done"}
    assert promoted == set(hot), [(r.item.kind.value, r.status.value, r.detail) for r in results]
    assert where(catalog, ns, hot) == ["fast"] * FULL_BLOCKS
    assert sorted(where(catalog, ns, [h for h in on_fast if h not in hot])) == ["archive"] * FULL_BLOCKS

    # 5. B's third run onboards a from 'fast'
    llm_b.reset_prefix_cache()
    hits1 = metric(llm_b, "vllm:external_prefix_cache_hits")
    (third,) = run(llm_b, "a")
    assert metric(llm_b, "vllm:external_prefix_cache_hits") - hits1 >= 0.9 * full
    assert third.token_ids == vllm_reference["a"].token_ids
