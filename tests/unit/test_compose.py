"""The scaled deployment in compose/ is well-formed and mirrors the design's topology."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import yaml

from advisor.settings import AdvisorSettings

COMPOSE = Path(__file__).resolve().parents[2] / "compose"


def test_compose_has_the_scaled_topology() -> None:
    spec = yaml.safe_load((COMPOSE / "docker-compose.yml").read_text())
    assert set(spec["services"]) == {"nats", "redis", "minio", "advisor", "prometheus", "grafana"}
    assert "-js" in spec["services"]["nats"]["command"]  # JetStream is the durable log
    advisor = spec["services"]["advisor"]
    assert set(advisor["depends_on"]) == {"nats", "redis", "minio"}
    mounted = [v.split(":")[0] for v in advisor["volumes"]]
    assert "./config/advisor.json" in mounted
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    targets = [t for job in prom["scrape_configs"] for sc in job["static_configs"] for t in sc["targets"]]
    assert targets == ["advisor:8080"]


def test_compose_advisor_config_is_valid_scaled_mode() -> None:
    s = AdvisorSettings.from_json_file(COMPOSE / "config" / "advisor.json")
    assert (s.log, s.snapshot_store) == ("jetstream", "redis")
    assert s.publish_url.startswith("jetstream://nats:4222")
    assert {v.id: v.kind for v in s.volumes} == {"fast": "posix", "slow": "posix", "s3": "s3"}
    assert s.api_port == 8080


def test_docker_compose_config_accepts_the_file() -> None:
    exe = shutil.which("docker-compose")
    cmd = [exe] if exe else ["docker", "compose"]
    assert exe or shutil.which("docker"), "docker-compose missing: run .ci/services.sh (installs it)"
    r = subprocess.run([*cmd, "-f", str(COMPOSE / "docker-compose.yml"), "config", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
