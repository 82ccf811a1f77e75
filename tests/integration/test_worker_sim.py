"""``kvadvisor worker-sim`` (kvadvisor/worker_sim.py): a real KVBM worker replays the bundled
trace into a private NATS JetStream server, partitioned for the cluster advisors and whole
for the API's advisor, and serves its kvbm_* metrics while it runs."""

from __future__ import annotations

import subprocess
import sys
import uuid
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from event_plane.partitioned import partition_namespace
from kvadvisor.trace import bundled_trace, read_mooncake
from kvadvisor.worker_sim import WorkerSimSettings, run_worker_sim
from tests.logs import fold_log

ROOT = Path(__file__).resolve().parents[2]


def test_worker_sim_publishes_partitioned_and_whole_and_serves_kvbm_metrics(js_url: str, tmp_path: Path) -> None:
    ns = "w" + uuid.uuid4().hex[:8]
    s = WorkerSimSettings(nats_url=js_url, namespace=ns, source="sim-0", manage_stream=True,
                          partitions=4, stretch=4, requests=500,
                          interval_s=0.0, workdir=tmp_path / "sim", g1_blocks=64, g2_blocks=128, metrics_port=0)
    scraped: dict[str, float] = {}
    urls: list[str | None] = []
    hashes: set[int] = set()

    def on_request(n: int, res: Any) -> None:
        hashes.update(res.sequence_hashes)
        if n % 10 == 0:  # the endpoint is up until the worker stops
            text = httpx.get(urls[0] or "", timeout=5).text
            for fam in text_string_to_metric_families(text):
                for smp in fam.samples:
                    if smp.labels.get("worker") == "sim-0":
                        scraped[smp.name] = smp.value

    fits = sum(len(r.hash_ids) <= s.g1_blocks for r in read_mooncake(bundled_trace(), limit=s.requests))
    assert run_worker_sim(s, on_request=on_request, on_ready=urls.append) == fits < s.requests  # longer: skipped
    assert urls[0] is not None and urls[0].startswith("http://127.0.0.1:")
    # the KVBM panels' metrics moved: G1 (64 blocks) overflowed to host and disk, prefixes matched
    assert scraped["kvbm_offload_blocks_d2h_total"] > 0
    assert scraped["kvbm_offload_blocks_h2d_total"] > 0
    assert scraped["kvbm_matched_tokens_total"] > 0
    assert 0.0 <= scraped["kvbm_host_cache_hit_rate"] <= 1.0
    whole = fold_log(js_url, ns)
    parts = [fold_log(js_url, partition_namespace(ns, k)) for k in range(s.partitions)]
    assert set(whole.hashes()) <= hashes and len(whole.hashes()) > 0
    # the partitions together hold exactly what the whole log holds
    assert set().union(*(set(p.hashes()) for p in parts)) == set(whole.hashes())


def test_worker_sim_cli_refuses_bad_settings_in_one_line() -> None:
    r = subprocess.run([sys.executable, "-m", "kvadvisor.cli", "worker-sim", "--partitions", "0"],
                       capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert r.returncode == 2
    assert r.stderr.startswith("error: configuration error:") and "partitions" in r.stderr
    assert len(r.stderr.strip().splitlines()) == 1


def test_worker_sim_offloads_into_the_cluster_catalog_with_storage(js_url: str, redis_url: str, tmp_path: Path) -> None:
    """With ``storage`` (the cluster advisors' --storage file) G3 is the file's slow volume in
    the shared Redis catalog: the blocks the worker announces on it are those the catalog
    places there, and they read back."""
    import json

    from advisor.cluster.mover import ClusterStorageSettings
    from storage_backends import RedisCatalog, StorageAgent

    ns = "w" + uuid.uuid4().hex[:8]
    prefix = f"kvadvisor:{ns}:catalog"
    conf = {"catalog_prefix": prefix, "volume_roots": [str(tmp_path / "vols")],
            "volumes": [{"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 1 << 30,
                         "root": str(tmp_path / "vols" / "slow"), "segment_bytes": 1 << 20}],
            "slow_volumes": ["slow"]}
    (tmp_path / "vols" / "slow").mkdir(parents=True)
    storage = tmp_path / "storage.json"
    storage.write_text(json.dumps(conf))
    s = WorkerSimSettings(nats_url=js_url, namespace=ns, source="sim-1", manage_stream=True,
                          partitions=2, requests=120, interval_s=0.0,
                          workdir=tmp_path / "sim", g1_blocks=64, g2_blocks=64, metrics_port=None,
                          storage=storage, redis_url=redis_url)
    assert run_worker_sim(s) > 0
    whole = fold_log(js_url, ns)
    announced = whole.blocks_at("slow")
    cat = RedisCatalog(redis_url, prefix=prefix)
    agent = StorageAgent(cat, name="check")
    try:
        for v in ClusterStorageSettings.model_validate(conf).volumes:
            agent.register_volume(v.to_descriptor())
        placed = list(cat.iter_volume("slow"))
        assert announced and {p.key.sequence_hash for p in placed} == announced
        assert not (tmp_path / "sim" / "catalog.sqlite").exists()  # no private catalog
        got = agent.get([p.key for p in placed[:50]])
        assert all(t.numel() * t.element_size() == p.length for t, p in zip(got, placed[:50]))
    finally:
        agent.close()
        cat.destroy()
        cat.close()
