"""One storage declaration for advisors and workers: the advisor's config (SQLite catalog)
or the cluster advisors' storage file (Redis catalog), read by
:class:`storage_backends.deployment.DeploymentStorage`."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from advisor.cluster.mover import ClusterStorageSettings
from advisor.settings import AdvisorSettings
from storage_backends.deployment import REDIS_URL_ENV, DeploymentStorage, SettingsError

VOLS = [
    {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 1 << 20, "root": "/tmp/x/fast"},
    {"id": "cold", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30, "endpoint": "http://127.0.0.1:1",
     "bucket": "b", "access_key": "AK", "secret_key": "SK"},
]


def _write(path: Path, data: dict, mode: int = 0o600) -> Path:
    path.write_text(json.dumps(data))
    os.chmod(path, mode)
    return path


def test_the_advisor_config_declares_a_sqlite_catalog_and_its_namespaces(tmp_path: Path) -> None:
    cfg = _write(tmp_path / "advisor.json", {
        "journal_path": str(tmp_path / "j.sqlite"), "catalog_path": str(tmp_path / "cat.sqlite"),
        "namespace": "ns1", "extra_namespaces": ["ns2"], "follow_catalog_namespaces": False, "volumes": VOLS,
        "fast_volume": "fast", "archive_volume": "cold", "policy_interval_s": 5})
    AdvisorSettings.from_json_file(cfg)  # the advisor reads the very same file
    dep = DeploymentStorage.load(cfg)
    assert dep.catalog == "sqlite" and dep.catalog_path == str(tmp_path / "cat.sqlite")
    assert [d.id for d in dep.descriptors()] == ["fast", "cold"]
    assert dep.descriptors()[1].secret_key == "SK"
    assert (dep.fast_volume, dep.archive_volume) == ("fast", "cold")
    assert dep.manages("ns2") and not dep.manages("other")
    # by default the advisor follows every namespace of its catalog: a worker's is managed
    follow = _write(tmp_path / "follow.json", {**json.loads(cfg.read_text()), "follow_catalog_namespaces": True})
    assert AdvisorSettings.from_json_file(follow).follow_catalog_namespaces
    assert DeploymentStorage.load(follow).manages("other")
    assert dep.volume_roots == (str(tmp_path.resolve()),)  # the advisor's default: the catalog's directory
    cat = dep.open_catalog()
    try:
        assert (tmp_path / "cat.sqlite").exists()
    finally:
        cat.close()


def test_the_cluster_storage_file_declares_a_redis_catalog(tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
                                                           redis_url: str) -> None:
    path = _write(tmp_path / "storage.json", {"catalog_prefix": "kvadvisor:t-dep:catalog", "volumes": VOLS,
                                              "fast_volume": "fast", "archive_volume": "cold"})
    ClusterStorageSettings.load(path)
    dep = DeploymentStorage.load(path)
    assert (dep.catalog, dep.catalog_prefix, dep.namespaces) == ("redis", "kvadvisor:t-dep:catalog", None)
    assert dep.manages("anything")
    monkeypatch.delenv(REDIS_URL_ENV, raising=False)
    with pytest.raises(SettingsError, match=REDIS_URL_ENV):
        dep.open_catalog()
    monkeypatch.setenv(REDIS_URL_ENV, redis_url)
    cat = dep.open_catalog()
    cat.close()
    with pytest.raises(SettingsError, match="Redis catalog"):
        dep.open_catalog("/tmp/some.sqlite")


@pytest.mark.parametrize(("data", "match"), [
    ({"volumes": []}, "no volumes declared"),
    ({"volumes": VOLS, "fast_volume": "nvme0"}, "fast_volume 'nvme0' is not one of the volumes"),
    ({"volumes": VOLS + VOLS[:1]}, "unique"),
    ([1, 2], "JSON object"),
])
def test_bad_declarations_are_refused_naming_the_field(tmp_path: Path, data: object, match: str) -> None:
    path = tmp_path / "s.json"
    path.write_text(json.dumps(data))
    with pytest.raises(SettingsError, match=match):
        DeploymentStorage.load(path)


def test_a_readable_file_with_a_secret_is_refused_without_echoing_it(tmp_path: Path) -> None:
    path = _write(tmp_path / "storage.json", {"volumes": VOLS}, mode=0o644)
    with pytest.raises(SettingsError, match=r"volumes\[1\].secret_key") as ei:
        DeploymentStorage.load(path)
    assert "SK" not in str(ei.value)
