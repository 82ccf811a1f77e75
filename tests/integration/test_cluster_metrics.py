"""``python -m advisor.cluster --metrics-port``: a cluster advisor serves Prometheus metrics of
the partitions it owns (advisor/cluster/metrics.py), read by the compose topology's
Prometheus.  Real NATS (private, JetStream), real Redis, a real advisor process."""

from __future__ import annotations

import os
import subprocess
import sys
import time
import uuid
from pathlib import Path

import httpx
from prometheus_client.parser import text_string_to_metric_families

from advisor.cluster.node import ClusterClient, PartitionUnavailable
from event_plane.partition import PartitionScheme
from event_plane.partitioned import PartitionedPublisher, partition_url
from event_plane.schema import store
from event_plane.urls import make_publisher

SCHEME = PartitionScheme(partitions=4, trunk_depth=1, stretch=4)
ROOT = Path(__file__).resolve().parents[2]


def _samples(url: str) -> dict[tuple[str, tuple[tuple[str, str], ...]], float]:
    text = httpx.get(url, timeout=5).text
    return {(s.name, tuple(sorted(s.labels.items()))): s.value
            for fam in text_string_to_metric_families(text) for s in fam.samples}


def test_cluster_advisor_serves_partition_metrics(js_url: str, redis_url: str, tmp_path: Path) -> None:
    ns = "m" + uuid.uuid4().hex[:8]
    env = {**os.environ, "KVADVISOR_CLUSTER_REDIS_URL": redis_url}  # the password-free way of compose
    log = open(tmp_path / "advisor.log", "w")  # noqa: SIM115 - owned by the process
    proc = subprocess.Popen(
        [sys.executable, "-m", "advisor.cluster", "--nats", js_url, "--id", "adv-m", "--namespace", ns,
         "--partitions", str(SCHEME.partitions), "--trunk-depth", str(SCHEME.trunk_depth),
         "--stretch", str(SCHEME.stretch), "--lease-ttl", "3", "--heartbeat", "0.5", "--metrics-port", "0"],
        stdout=subprocess.PIPE, stderr=log, text=True, cwd=ROOT, env=env)
    log.close()
    try:
        assert proc.stdout is not None
        assert proc.stdout.readline().strip() == "advisor adv-m ready"
        line = proc.stdout.readline().strip()
        assert line.startswith("advisor adv-m metrics at http://127.0.0.1:"), line  # loopback by default
        url = line.rsplit(" ", 1)[1]
        pub = PartitionedPublisher(SCHEME, lambda k: make_publisher(
            partition_url(js_url.replace("nats://", "jetstream://") + f"?namespace={ns}", k), "w0", epoch=7))
        chain = [1000 + i for i in range(12)]  # one chain of 12 blocks over trunk + partitions
        with pub:
            pub.publish([store(h, h, chain[i - 1] if i else None, 4096, "g2") for i, h in enumerate(chain)])
        client = ClusterClient(js_url, SCHEME, ns, timeout_s=2.0)
        try:
            deadline = time.monotonic() + 60
            answer: dict[str, int] = {}
            while time.monotonic() < deadline:
                try:
                    answer = client.lookup(chain)
                    if answer.get("w0/g2") == len(chain):
                        break
                except PartitionUnavailable:
                    pass
                time.sleep(0.2)
            assert answer.get("w0/g2") == len(chain), answer
        finally:
            client.close()
        s = _samples(url)
        assert s[("kvadvisor_cluster_partitions_owned", (("advisor", "adv-m"),))] == SCHEME.partitions
        parts = {dict(k[1])["partition"] for k in s if k[0] == "kvadvisor_cluster_partition_position"}
        assert parts == {str(p) for p in range(SCHEME.partitions)}  # bounded by the partition count
        applied = sum(v for k, v in s.items() if k[0] == "kvadvisor_cluster_batches_applied_total")
        assert applied >= SCHEME.partitions  # the trunk block went to every partition
        lookups = sum(v for k, v in s.items() if k[0] == "kvadvisor_cluster_lookups_total")
        assert lookups >= len(SCHEME.pieces(chain))
        blocks = sum(v for k, v in s.items() if k[0] == "kvadvisor_cluster_partition_blocks")
        assert blocks >= len(chain)
        assert sum(v for k, v in s.items() if k[0] == "kvadvisor_cluster_batches_refused_total") == 0
    finally:
        proc.terminate()
        proc.wait(30)
