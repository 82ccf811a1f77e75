"""Finding 10: secrets never land world-readable, posix volume roots are confined, and
``api_factory`` names only a module of the ``api`` package."""

from __future__ import annotations

import json
import stat
from pathlib import Path

import pytest
from pydantic import ValidationError

from advisor import AdvisorService, AdvisorSettings
from advisor.settings import SettingsError
from storage_backends import VolumeConfigError


def _vol(vid: str, root: Path) -> dict:
    return {"id": vid, "kind": "posix", "media": "nvme", "capacity_bytes": 1 << 24, "root": str(root)}


@pytest.mark.parametrize("factory", ["os:system", "subprocess:run", "apix.server:serve_query", "api.server"])
def test_api_factory_outside_the_api_package_is_refused(factory: str) -> None:
    with pytest.raises(ValidationError, match="api_factory"):
        AdvisorSettings(api_factory=factory)
    assert AdvisorSettings(api_factory="api.server:serve_query").api_factory == "api.server:serve_query"


def test_a_volume_root_outside_the_catalog_directory_is_refused(tmp_path: Path) -> None:
    home = tmp_path / "home"
    home.mkdir()
    outside = tmp_path / "elsewhere" / "fast"
    s = AdvisorSettings(journal_path=str(home / "j.sqlite"), catalog_path=str(home / "c.sqlite"),
                        volumes=[_vol("fast", outside)], api_enabled=False, policy_interval_s=0,
                        snapshot_store="none")
    svc = AdvisorService(s)
    try:
        with pytest.raises(VolumeConfigError, match="outside the allowed roots"):
            svc.start()
    finally:
        svc.stop()
    assert not outside.exists()  # refused before anything was created there
    # an operator who means it names the root
    s2 = s.model_copy(update={"volume_roots": [str(tmp_path / "elsewhere")]})
    with AdvisorService(s2) as svc2:
        assert [v.volume_id for v in svc2.agent.stats()] == ["fast"]


def test_a_world_readable_config_with_a_secret_is_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "advisor.json"
    vol = {"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30,
           "endpoint": "http://127.0.0.1:9", "bucket": "b", "access_key": "AK", "secret_key": "TOP-SECRET"}
    cfg.write_text(json.dumps({"catalog_path": str(tmp_path / "c.sqlite"), "volumes": [vol]}))
    cfg.chmod(0o644)
    with pytest.raises(SettingsError, match=r"volumes\[0\]\.secret_key") as ei:
        AdvisorSettings.from_json_file(cfg)
    assert "TOP-SECRET" not in str(ei.value)
    cfg.chmod(0o600)
    assert AdvisorSettings.from_json_file(cfg).volumes[0].to_descriptor().secret_key == "TOP-SECRET"


def test_secret_key_file_must_be_private(tmp_path: Path) -> None:
    secret = tmp_path / "s3-secret"
    secret.write_text("FILE-SECRET\n")
    secret.chmod(0o644)
    s = AdvisorSettings(catalog_path=str(tmp_path / "c.sqlite"), volumes=[
        {"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30, "endpoint": "http://127.0.0.1:9",
         "bucket": "b", "access_key": "AK", "secret_key_file": str(secret)}])
    with pytest.raises(SettingsError, match="readable by group or others"):
        s.volumes[0].to_descriptor()
    secret.chmod(0o600)
    assert s.volumes[0].to_descriptor().secret_key == "FILE-SECRET"


def test_demo_writes_no_secret_into_its_config_and_keeps_files_private(tmp_path: Path) -> None:
    from kvadvisor.demo import write_advisor_config

    cfg = {"catalog_path": str(tmp_path / "c.sqlite"), "volumes": [
        {"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1 << 30, "endpoint": "http://127.0.0.1:9",
         "bucket": "b", "access_key": "AK", "secret_key": "DEMO-SECRET"}]}
    path = write_advisor_config(cfg, tmp_path)
    text = path.read_text()
    assert "DEMO-SECRET" not in text
    for f in (path, Path(json.loads(text)["volumes"][0]["secret_key_file"])):
        assert stat.S_IMODE(f.stat().st_mode) == 0o600, f
    assert AdvisorSettings.from_json_file(path).volumes[0].to_descriptor().secret_key == "DEMO-SECRET"
