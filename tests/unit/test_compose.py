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
    assert targets == ["advisor:8080", "host.docker.internal:6880"]  # the advisor, then the workers' kvbm_*


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
    r = subprocess.run([*cmd, "--env-file", str(COMPOSE / "secrets.env.example"), "-f", str(COMPOSE / "docker-compose.yml"),
                        "config", "-q"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr


def test_compose_takes_every_secret_from_the_env_file() -> None:
    """No default password in the file: API tokens, Redis, MinIO and Grafana secrets are all
    required interpolations (compose stops while one is unset), and the example names each."""
    text = (COMPOSE / "docker-compose.yml").read_text()
    spec = yaml.safe_load(text)
    assert "kvadvisor-secret" not in text
    example = (COMPOSE / "secrets.env.example").read_text()
    env = {**spec["services"]["advisor"]["environment"], **spec["services"]["minio"]["environment"],
           **spec["services"]["grafana"]["environment"]}
    assert "${KVADVISOR_READ_TOKEN:?" in spec["services"]["prometheus"]["environment"]["KVADVISOR_READ_TOKEN"]
    for key in ("KVADVISOR_API_ADMIN_TOKENS", "KVADVISOR_API_READ_TOKENS", "AWS_SECRET_ACCESS_KEY",
                "MINIO_ROOT_PASSWORD", "GF_SECURITY_ADMIN_PASSWORD", "KVADVISOR_ADVISOR_REDIS_URL"):
        assert "${" in env[key] and ":?" in env[key], key
    assert any("--requirepass" == a for a in spec["services"]["redis"]["command"])
    for var in ("KVADVISOR_ADMIN_TOKEN", "KVADVISOR_READ_TOKEN", "REDIS_PASSWORD", "MINIO_ROOT_PASSWORD",
                "GRAFANA_ADMIN_PASSWORD"):
        assert f"{var}=" in example and f"${{{var}:?" in text, var
    prom = yaml.safe_load((COMPOSE / "prometheus" / "prometheus.yml").read_text())
    assert prom["scrape_configs"][0]["authorization"]["credentials_file"] == "/prometheus/advisor-read-token"
    # the advisor listens on 0.0.0.0 in its container: with these tokens the API accepts it
    assert AdvisorSettings.from_json_file(COMPOSE / "config" / "advisor.json").api_host == "0.0.0.0"


def test_docker_compose_refuses_to_start_without_the_secrets(tmp_path: Path) -> None:
    exe = shutil.which("docker-compose")
    cmd = [exe] if exe else ["docker", "compose"]
    assert exe or shutil.which("docker"), "docker-compose missing: run .ci/services.sh (installs it)"
    empty = tmp_path / "empty.env"
    empty.write_text("")
    r = subprocess.run([*cmd, "--env-file", str(empty), "-f", str(COMPOSE / "docker-compose.yml"), "config", "-q"],
                       capture_output=True, text=True, cwd=tmp_path, env={"PATH": "/usr/bin:/bin:/usr/local/bin"})
    assert r.returncode != 0 and "in compose/secrets.env" in r.stderr, r.stderr
