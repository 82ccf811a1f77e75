"""The scaled deployment in compose/ is well-formed and mirrors the design's topology
(docs/design.md §8): a 3-node JetStream cluster, Redis and MinIO with secrets from
compose/.env, three cluster advisors, the API, a worker, Prometheus scraping each, Grafana."""

from __future__ import annotations

import re
import shutil
import subprocess
from pathlib import Path

import pytest
import yaml

from advisor.settings import AdvisorSettings

ROOT = Path(__file__).resolve().parents[2]
COMPOSE = ROOT / "compose"
ADVISORS = ["advisor-1", "advisor-2", "advisor-3"]
NATS = ["nats-1", "nats-2", "nats-3"]
SECRETS = ["KVADVISOR_ADMIN_TOKEN", "KVADVISOR_READ_TOKEN", "REDIS_PASSWORD", "MINIO_ROOT_USER",
           "MINIO_ROOT_PASSWORD", "GRAFANA_ADMIN_PASSWORD", "NATS_ADVISOR_PASSWORD", "NATS_WORKER_SIM_PASSWORD"]
NATS_ENV = {"NATS_ADVISOR_PASSWORD": "pw-advisor", "NATS_WORKER_SIM_PASSWORD": "pw-sim"}


def _spec() -> dict:
    return yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())


def _compose() -> list[str]:
    exe = shutil.which("docker-compose")
    assert exe or shutil.which("docker"), "docker-compose missing: run .ci/services.sh as root (installs it)"
    return [exe] if exe else ["docker", "compose"]


def _flag(cmd: list[str], name: str) -> str:
    return cmd[cmd.index(name) + 1]


def test_compose_has_the_scaled_topology() -> None:
    services = _spec()["services"]
    assert set(services) == {*NATS, "redis", "minio", "minio-init", *ADVISORS, "api", "worker-sim",
                             "prometheus", "grafana"}
    def nats_urls(user: str, var: str) -> str:  # every node, as ``user``, the password from compose/.env
        return ",".join(f"nats://{user}:${{{var}:?set {var} in compose/.env}}@{n}:4222" for n in NATS)

    for a in ADVISORS:
        svc = services[a]
        assert svc["entrypoint"] == ["python", "-m", "advisor.cluster"]
        cmd = svc["command"]
        assert (_flag(cmd, "--id"), _flag(cmd, "--replicas")) == (a, "3")
        assert "--nats" not in cmd  # the URLs with the advisor's password come from the environment
        assert svc["environment"]["KVADVISOR_CLUSTER_NATS_URL"] == nats_urls("advisor", "NATS_ADVISOR_PASSWORD")
        assert _flag(cmd, "--partitions") == "8" and _flag(cmd, "--metrics-port") == "9100"
        assert "--redis" not in cmd  # the URL with the password comes from the environment
        assert "${REDIS_PASSWORD:?" in svc["environment"]["KVADVISOR_CLUSTER_REDIS_URL"]
        assert set(svc["depends_on"]) == {*NATS, "redis", "minio-init"}
        assert svc["depends_on"]["minio-init"] == {"condition": "service_completed_successfully"}
        assert "ports" not in svc  # /metrics has no authentication: inside the network only
        # the mover: the shared storage settings, the shared volumes, S3 keys from the environment
        assert _flag(cmd, "--storage") == "/etc/kvadvisor/cluster-storage.json"
        assert "./config/cluster-storage.json:/etc/kvadvisor/cluster-storage.json:ro" in svc["volumes"]
        assert "kv-volumes:/var/lib/kvadvisor/volumes" in svc["volumes"]
        assert "${MINIO_ROOT_PASSWORD:?" in svc["environment"]["AWS_SECRET_ACCESS_KEY"]
    sim_svc = services["worker-sim"]
    sim = sim_svc["command"]
    assert sim[0] == "worker-sim" and "--loop" in sim
    assert (_flag(sim, "--partitions"), _flag(sim, "--replicas")) == ("8", "3") and "--nats" not in sim
    # the worker connects as its own NATS user, and never gets the advisor's password
    assert sim_svc["environment"]["KVADVISOR_WORKER_SIM_NATS_URL"] == nats_urls("worker-sim", "NATS_WORKER_SIM_PASSWORD")
    assert not any("NATS_ADVISOR_PASSWORD" in str(v) for v in sim_svc["environment"].values())
    # the worker offloads to the advisors' slow volume, in the same Redis catalog
    assert _flag(sim, "--storage") == "/etc/kvadvisor/cluster-storage.json"
    assert "kv-volumes:/var/lib/kvadvisor/volumes" in sim_svc["volumes"]
    assert "${REDIS_PASSWORD:?" in sim_svc["environment"]["KVADVISOR_CLUSTER_REDIS_URL"]
    api = services["api"]
    assert api["command"] == ["advisor", "run", "--config", "/etc/kvadvisor/advisor.json"]
    assert "./config/advisor.json" in [v.split(":")[0] for v in api["volumes"]]
    assert api["depends_on"]["minio-init"] == {"condition": "service_completed_successfully"}
    init = services["minio-init"]
    assert init["image"].startswith("minio/mc") and "mc mb --ignore-existing kv/kvadvisor" in init["command"][0]
    assert init["restart"] == "no"


def test_every_published_port_is_on_loopback() -> None:
    published = {name: svc.get("ports", []) for name, svc in _spec()["services"].items()}
    assert published["api"] == ["127.0.0.1:8080:8080"]
    for name, ports in published.items():
        for p in ports:
            assert p.startswith("127.0.0.1:"), (name, p)
    assert {n for n, p in published.items() if p} == {"api", "prometheus", "grafana", "minio"}


def test_nats_cluster_routes_and_jetstream() -> None:
    services = _spec()["services"]
    for n in NATS:
        assert f"./nats/{n}.conf:/etc/nats/nats.conf:ro" in services[n]["volumes"]
        assert "./nats/auth.conf:/etc/nats/auth.conf:ro" in services[n]["volumes"]
        assert services[n]["environment"] == {k: f"${{{k}:?set {k} in compose/.env}}" for k in NATS_ENV}
        assert services[n]["command"] == ["-c", "/etc/nats/nats.conf"]
        conf = (COMPOSE / "nats" / f"{n}.conf").read_text()
        assert f'server_name: "{n}"' in conf
        assert re.search(r'jetstream \{ store_dir: "/data" \}', conf)
        assert re.search(r"cluster \{\s*name: kvadvisor\s*listen: 0\.0\.0\.0:6222", conf)
        routes = set(re.findall(r"nats://(nats-\d):6222", conf))
        assert routes == set(NATS) - {n}  # each node routes to the two others: R3 survives one loss


@pytest.mark.parametrize("node", NATS)
def test_nats_configs_parse(node: str) -> None:
    exe = shutil.which("nats-server") or "/usr/sbin/nats-server"
    r = subprocess.run([exe, "-c", str(COMPOSE / "nats" / f"{node}.conf"), "-t"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin", **NATS_ENV})
    assert r.returncode == 0 and "is valid" in r.stderr + r.stdout, r.stderr
    # without the passwords in its environment the server refuses the configuration
    r = subprocess.run([exe, "-c", str(COMPOSE / "nats" / f"{node}.conf"), "-t"], capture_output=True, text=True,
                       env={"PATH": "/usr/bin:/bin"})
    assert r.returncode != 0 and "NATS_ADVISOR_PASSWORD" in r.stderr + r.stdout, r.stderr


def test_nats_authorization_gives_the_worker_its_own_subject_only() -> None:
    conf = (COMPOSE / "nats" / "auth.conf").read_text()
    assert 'user: "advisor", password: $NATS_ADVISOR_PASSWORD }' in conf
    worker = conf[conf.index('user: "worker-sim"'):]
    assert 'publish: { allow: ["kvadvisor.events.*.worker-sim"] }' in worker
    assert 'subscribe: { allow: ["_INBOX.worker-sim.>"] }' in worker
    assert "$JS" not in conf and "$KV" not in conf and "kvadvisor.query" not in conf
    for n in NATS:
        assert "include ./auth.conf" in (COMPOSE / "nats" / f"{n}.conf").read_text()


def test_prometheus_scrapes_every_process() -> None:
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    jobs = {j["job_name"]: j for j in prom["scrape_configs"]}
    targets = {name: [t for sc in j["static_configs"] for t in sc["targets"]] for name, j in jobs.items()}
    assert targets == {"kvadvisor-api": ["api:8080"],
                       "kvadvisor-cluster": [f"{a}:9100" for a in ADVISORS],
                       "kvbm-workers": ["worker-sim:6880"]}
    # the API's /metrics takes the read token, from a file the entrypoint writes privately
    assert jobs["kvadvisor-api"]["authorization"] == {"type": "Bearer",
                                                      "credentials_file": "/prometheus/api-read-token"}
    prom_svc = _spec()["services"]["prometheus"]
    assert "umask 077" in prom_svc["command"][0] and "/prometheus/api-read-token" in prom_svc["command"][0]
    # the ports scraped are the ports the processes serve on
    services = _spec()["services"]
    assert _flag(services["worker-sim"]["command"], "--metrics-port") == "6880"
    assert AdvisorSettings.from_json_file(COMPOSE / "config" / "advisor.json").api_port == 8080


def test_grafana_provisions_the_dashboards() -> None:
    graf = _spec()["services"]["grafana"]
    mounts = {v.split(":")[1]: v.split(":")[0] for v in graf["volumes"]}
    assert mounts == {"/etc/grafana/provisioning": "./grafana/provisioning",
                      "/var/lib/grafana/dashboards": "./grafana/dashboards"}
    prov = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "dashboards" / "kvadvisor.yml").read_text())
    assert [p["options"]["path"] for p in prov["providers"]] == ["/var/lib/grafana/dashboards"]
    ds = yaml.safe_load((COMPOSE / "grafana" / "provisioning" / "datasources" / "prometheus.yml").read_text())
    assert [(d["uid"], d["url"]) for d in ds["datasources"]] == [("prometheus", "http://prometheus:9090")]
    names = sorted(p.name for p in (COMPOSE / "grafana" / "dashboards").glob("*.json"))
    assert names == ["advisor.json", "api.json", "kvbm.json"]


def test_no_default_passwords_anywhere() -> None:
    text = "\n".join(p.read_text() for p in COMPOSE.rglob("*") if p.is_file() and p.suffix in {".yml", ".json", ".conf", ".example"})
    assert "minioadmin" not in text.lower()
    assert "kvadvisor-secret" not in text
    services = _spec()["services"]
    env = {k: str(v) for svc in services.values() for k, v in (svc.get("environment") or {}).items()}
    assert env["MINIO_ROOT_USER"] == "${MINIO_ROOT_USER:?set MINIO_ROOT_USER in compose/.env}"
    assert env["GF_SECURITY_ADMIN_PASSWORD"].startswith("${GRAFANA_ADMIN_PASSWORD:?")  # never admin/admin
    for key in ("MINIO_ROOT_PASSWORD", "REDIS_PASSWORD", "AWS_SECRET_ACCESS_KEY", "KVADVISOR_API_ADMIN_TOKENS",
                "KVADVISOR_API_READ_TOKENS", "KVADVISOR_READ_TOKEN", "NATS_ADVISOR_PASSWORD", "NATS_WORKER_SIM_PASSWORD",
                "KVADVISOR_ADVISOR_NATS_PASSWORD", "KVADVISOR_CLUSTER_NATS_URL", "KVADVISOR_WORKER_SIM_NATS_URL"):
        assert re.search(r"\$\{[A-Z_]+:\?", env[key]), key  # required: no default value
    redis = services["redis"]["command"][0]
    assert 'requirepass "%s"' in redis and "$$REDIS_PASSWORD" in redis  # never an empty password
    for url in (env["KVADVISOR_ADVISOR_REDIS_URL"], env["KVADVISOR_CLUSTER_REDIS_URL"]):
        assert url.startswith("redis://:${REDIS_PASSWORD:?")
    example = (COMPOSE / ".env.example").read_text()
    keys = [line.split("=", 1)[0] for line in example.splitlines() if line and not line.startswith("#")]
    assert keys == SECRETS
    assert all("replace-with" in line for line in example.splitlines() if "=" in line and not line.startswith("#"))
    assert "compose/.env" in (ROOT / ".gitignore").read_text().splitlines()


def test_compose_advisor_config_is_valid_scaled_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    raw = (COMPOSE / "config" / "advisor.json").read_text()
    assert "redis_url" not in raw  # with its password, from KVADVISOR_ADVISOR_REDIS_URL
    monkeypatch.setenv("KVADVISOR_ADVISOR_REDIS_URL", "redis://:pw@redis:6379/0")
    s = AdvisorSettings.from_json_file(COMPOSE / "config" / "advisor.json")
    assert (s.log, s.snapshot_store, s.redis_url) == ("jetstream", "redis", "redis://:pw@redis:6379/0")
    assert s.jetstream_url == "nats://nats-1:4222" and s.stream_limits().replicas == 3
    assert s.publish_url == "jetstream://nats-1:4222?namespace=default&replicas=3"
    assert s.jetstream_namespace == "default"  # the worker's unpartitioned log; the cluster reads default-p<k>
    # queries only: the cluster advisors move the blocks, in the Redis catalog
    assert (s.catalog_path, s.volumes, s.policy_interval_s) == (None, [], 0)
    assert (s.api_host, s.api_port) == ("0.0.0.0", 8080)


def test_compose_cluster_storage_is_the_shared_catalog_and_volumes() -> None:
    from advisor.cluster.mover import ClusterStorageSettings

    st = ClusterStorageSettings.load(COMPOSE / "config" / "cluster-storage.json")
    assert st.catalog_prefix == "kvadvisor:default:catalog"
    assert {v.id: v.kind for v in st.volumes} == {"fast": "posix", "slow": "posix", "s3": "s3"}
    assert (st.fast_volume, st.slow_volumes, st.archive_volume) == ("fast", ["slow"], "s3")
    s3 = next(v for v in st.volumes if v.id == "s3")
    assert (s3.endpoint, s3.bucket, s3.access_key, s3.secret_key) == ("http://minio:9000", "kvadvisor", None, None)
    assert all(v.root is not None and v.root.startswith("/var/lib/kvadvisor/volumes/")
               for v in st.volumes if v.kind == "posix")


def test_docker_compose_config_accepts_the_file() -> None:
    r = subprocess.run([*_compose(), "--env-file", str(COMPOSE / ".env.example"), "-f", str(COMPOSE / "docker-compose.yml"),
                        "config", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_docker_compose_refuses_to_start_without_the_secrets(tmp_path: Path) -> None:
    empty = tmp_path / "empty.env"
    empty.write_text("# nothing set\n")
    r = subprocess.run([*_compose(), "--env-file", str(empty), "-f", str(COMPOSE / "docker-compose.yml"), "config", "-q"],
                       capture_output=True, text=True, env={"PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert r.returncode != 0 and "in compose/.env" in r.stderr, r.stderr
