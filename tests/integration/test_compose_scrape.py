"""The compose stack's monitoring, run on loopback without Docker: the topology of
compose/docker-compose.yml (a 3-node NATS JetStream cluster, three cluster advisors with
``--metrics-port``, the API advisor over the whole log, ``kvadvisor worker-sim``) scraped by
a real Prometheus with compose/prometheus/prometheus.yml (targets and the token file moved
to loopback), and every query of every Grafana dashboard evaluated by that Prometheus.

Needs the ``prometheus`` and ``promtool`` binaries (.ci/services.sh installs them)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import time
import uuid
from collections.abc import Iterator
from contextlib import ExitStack
from pathlib import Path

import httpx
import pytest
import yaml

from advisor.cluster.node import ClusterClient, PartitionUnavailable
from event_plane.partition import PartitionScheme
from kvadvisor.localcluster import NatsCluster, free_port

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
REDIS = os.environ.get("KVADVISOR_TEST_REDIS", "redis://127.0.0.1:6379/0")
SCHEME = PartitionScheme(8, 1, 64)  # the compose advisors' --partitions 8 (trunk depth and stretch: defaults)
# metrics with no series until something happens that this run does not provoke: moves (the
# API advisor here has no volumes), origin refusals, and the counters of a ZMQ/NATS
# subscriber (an advisor with log=jetstream, as in compose, reads the stream itself), and
# the API's hit-rate windows (they fill with router lookups through its REST routes)
MAY_BE_EMPTY = {"kvadvisor_moves_total", "kvadvisor_bytes_moved_total", "kvadvisor_origin_refused_total",
                "kvadvisor_subscriber_total", "kvadvisor_api_hit_rate", "kvadvisor_api_lookup_tokens_total",
                "kvadvisor_api_lookups_total", "kvadvisor_api_lookup_blocks_total"}


def _exe(name: str) -> str:
    exe = shutil.which(name)
    assert exe, f"{name} missing: run .ci/services.sh as root (installs Debian's prometheus package)"
    return exe


def _line(proc: subprocess.Popen[str], prefix: str, timeout_s: float = 120.0) -> str:
    end = time.monotonic() + timeout_s
    assert proc.stdout is not None
    while time.monotonic() < end:
        line = proc.stdout.readline()
        if not line:
            raise AssertionError(f"process exited ({proc.poll()}) before printing {prefix!r}")
        if line.startswith(prefix):
            return line.strip()
    raise AssertionError(f"no {prefix!r} line in {timeout_s} s")


def _start(stack: ExitStack, args: list[str], log: Path, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    with open(log, "w") as err:
        proc = subprocess.Popen([sys.executable, *args], stdout=subprocess.PIPE, stderr=err, text=True, cwd=ROOT,
                                env={**os.environ, **(env or {})})

    def stop() -> None:
        proc.terminate()
        try:
            proc.wait(20)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait(5)
    stack.callback(stop)
    return proc


def _port(url: str) -> int:
    m = re.search(r":(\d+)(?:/|$)", url)
    assert m, url
    return int(m.group(1))


def _panels() -> Iterator[tuple[str, str, str]]:
    for path in sorted((COMPOSE / "grafana" / "dashboards").glob("*.json")):
        for panel in json.loads(path.read_text())["panels"]:
            for t in panel["targets"]:
                yield path.name, panel["title"], t["expr"]


def _prometheus_config(tmp: Path, targets: dict[str, list[str]], token: str) -> Path:
    """compose/prometheus/prometheus.yml with the compose host names replaced by the loopback
    addresses of the same processes and the token file at ``tmp`` (as the entrypoint writes it)."""
    cfg = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    cfg["global"]["scrape_interval"] = "1s"
    token_file = tmp / "api-read-token"
    token_file.write_text(token)
    token_file.chmod(0o600)
    for job in cfg["scrape_configs"]:
        assert len(job["static_configs"][0]["targets"]) == len(targets[job["job_name"]]), job["job_name"]
        job["static_configs"] = [{"targets": targets[job["job_name"]]}]
        if "authorization" in job:
            job["authorization"]["credentials_file"] = str(token_file)
    path = tmp / "prometheus.yml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def test_promtool_accepts_the_compose_prometheus_config(tmp_path: Path) -> None:
    cfg = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    targets = {j["job_name"]: j["static_configs"][0]["targets"] for j in cfg["scrape_configs"]}
    path = _prometheus_config(tmp_path, targets, "t")  # same targets, token file present
    r = subprocess.run([_exe("promtool"), "check", "config", str(path)], capture_output=True, text=True)
    assert r.returncode == 0 and "SUCCESS" in r.stdout + r.stderr, r.stdout + r.stderr


def test_prometheus_scrapes_every_process_and_every_panel_has_data(tmp_path: Path) -> None:
    prometheus = _exe("prometheus")
    ns = "g" + uuid.uuid4().hex[:8]
    with ExitStack() as stack:
        cluster = stack.enter_context(NatsCluster(tmp_path / "nats", nodes=3))
        cluster_targets = []
        for i in (1, 2, 3):
            proc = _start(stack, ["-m", "advisor.cluster", "--id", f"advisor-{i}",
                                  "--namespace", ns, "--partitions", "8", "--replicas", "3", "--lease-ttl", "3",
                                  "--heartbeat", "0.5", "--metrics-port", "0"],
                          tmp_path / f"advisor-{i}.log", {"KVADVISOR_CLUSTER_REDIS_URL": REDIS,
                                                          "KVADVISOR_CLUSTER_NATS_URL": cluster.advisor_url})
            _line(proc, f"advisor advisor-{i} ready")
            cluster_targets.append(f"127.0.0.1:{_port(_line(proc, f'advisor advisor-{i} metrics at'))}")
        api_config = json.loads((COMPOSE / "config" / "advisor.json").read_text())
        api_config.update({"jetstream_url": cluster.urls[0], "jetstream_namespace": ns, "publish_url": "null://",
                           "snapshot_store": "none", "journal_path": str(tmp_path / "api" / "journal.sqlite"),
                           "catalog_path": None, "volumes": [], "fast_volume": None, "slow_volumes": [],
                           "archive_volume": None, "api_host": "127.0.0.1", "api_port": free_port()})
        (tmp_path / "api").mkdir()
        (tmp_path / "api.json").write_text(json.dumps(api_config))
        # the API's advisor reads the stream as the advisor user (compose: the same from compose/.env)
        api = _start(stack, ["-m", "advisor", "--config", str(tmp_path / "api.json")], tmp_path / "api.log",
                     {"KVADVISOR_ADVISOR_NATS_USER": "advisor",
                      "KVADVISOR_ADVISOR_NATS_PASSWORD": cluster.users.advisor_password})
        api_url = _line(api, "ADVISOR READY").split()[-1]
        sim = _start(stack, ["-m", "kvadvisor.cli", "worker-sim", "--namespace", ns,
                             "--partitions", "8", "--replicas", "3", "--loop", "--workdir", str(tmp_path / "sim"),
                             "--metrics-port", "0"], tmp_path / "sim.log",
                     {"KVADVISOR_WORKER_SIM_NATS_URL": cluster.worker_url("worker-sim")})
        sim_url = _line(sim, "worker worker-sim ready, metrics:").split()[-1]
        prom_port = free_port()
        cfg = _prometheus_config(tmp_path, {"kvadvisor-api": [f"127.0.0.1:{_port(api_url)}"],
                                            "kvadvisor-cluster": cluster_targets,
                                            "kvbm-workers": [f"127.0.0.1:{_port(sim_url)}"]}, "read-token")
        with open(tmp_path / "prometheus.log", "w") as err:
            prom = subprocess.Popen([prometheus, f"--config.file={cfg}", f"--storage.tsdb.path={tmp_path / 'tsdb'}",
                                     f"--web.listen-address=127.0.0.1:{prom_port}"], stdout=err, stderr=err)
        stack.callback(lambda: (prom.terminate(), prom.wait(20)))
        http = stack.enter_context(httpx.Client(base_url=f"http://127.0.0.1:{prom_port}", timeout=10))

        def query(expr: str) -> list[dict]:
            # raise_for_status: a starting Prometheus answers 503 "Service Unavailable" (not JSON) until its
            # TSDB is open; the loops below retry an HTTPError, so a slow start is waited out, not a failure
            resp = http.get("/api/v1/query", params={"query": expr})
            resp.raise_for_status()
            body = resp.json()
            assert body["status"] == "success", (expr, body)
            return body["data"]["result"]

        ready_by = time.monotonic() + 120
        while time.monotonic() < ready_by:  # /-/ready: 200 once the TSDB is open and the API serves queries
            try:
                if http.get("/-/ready").status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        client = ClusterClient(cluster.advisor_url, SCHEME, ns, timeout_s=2.0)
        stack.callback(client.close)
        end = time.monotonic() + 180
        up: dict[str, float] = {}
        while time.monotonic() < end:
            try:  # lookups through the cluster, so the lookup panel has something to show
                client.lookup([1, 2, 3])
            except PartitionUnavailable:
                pass
            try:
                up = {r["metric"]["job"] + "/" + r["metric"]["instance"]: float(r["value"][1]) for r in query("up")}
                owned = sum(float(r["value"][1]) for r in query("kvadvisor_cluster_partitions_owned"))
                applied = query("sum(rate(kvadvisor_cluster_batches_applied_total[1m])) > 0")
                matched = query("sum(kvbm_offload_blocks_d2h_total) > 0")
                if len(up) == 5 and all(v == 1 for v in up.values()) and owned == 8 and applied and matched:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(1)
        assert len(up) == 5 and all(v == 1 for v in up.values()), up  # the API, 3 advisors, the worker
        # a few more scrapes, so every rate() has two samples: polled (a loaded machine scrapes late)
        deadline = time.monotonic() + 60
        while True:
            empty = []
            for dashboard, title, expr in _panels():
                if not query(expr) and not set(re.findall(r"\b(?:kvadvisor|kvbm)_\w+", expr)) <= MAY_BE_EMPTY:
                    empty.append((dashboard, title, expr))
            if not empty or time.monotonic() > deadline:
                break
            time.sleep(2)
        assert not empty, empty
        assert sum(float(r["value"][1]) for r in query("kvadvisor_cluster_partitions_owned")) == 8
        assert query("sum(kvadvisor_index_blocks_total) > 0"), "the API advisor folded the whole log"
