"""An advisor config file readable by group or others is refused when a URL in it carries a
password or token (``nats://user:pass@…``, ``redis://:pass@…``, ``?token=``), as it already
is for the secret fields: the secret is exposed, so the advisor does not start on it. The
error names the fields, never the secret."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest

from advisor.settings import AdvisorSettings, SettingsError

SECRET = "hunter2-correct-horse"


@pytest.mark.parametrize("field,value", [
    ("subscribe_urls", [f"nats://worker:{SECRET}@127.0.0.1:4222"]),
    ("subscribe_urls", [f"jetstream://127.0.0.1:4222?token={SECRET}"]),
    ("redis_url", f"redis://:{SECRET}@127.0.0.1:6379/0"),
    ("publish_url", f"nats://a:{SECRET}@127.0.0.1:4222,nats://127.0.0.1:4223"),
])
def test_a_readable_config_with_a_password_in_a_url_is_refused(tmp_path: Path, field: str, value: object) -> None:
    path = tmp_path / "advisor.json"
    path.write_text(json.dumps({"journal_path": str(tmp_path / "j.sqlite"), field: value}))
    os.chmod(path, 0o644)
    with pytest.raises(SettingsError) as err:
        AdvisorSettings.from_json_file(path)
    assert field in str(err.value) and SECRET not in str(err.value)
    os.chmod(path, 0o600)
    assert AdvisorSettings.from_json_file(path).journal_path.endswith("j.sqlite")


def test_urls_without_secrets_are_fine_in_a_readable_file(tmp_path: Path) -> None:
    path = tmp_path / "advisor.json"
    path.write_text(json.dumps({"journal_path": str(tmp_path / "j.sqlite"),
                                "subscribe_urls": ["nats://127.0.0.1:4222?namespace=x", "zmq://127.0.0.1:5557"],
                                "redis_url": "redis://127.0.0.1:6379/0"}))
    os.chmod(path, 0o644)
    assert AdvisorSettings.from_json_file(path).subscribe_urls[1] == "zmq://127.0.0.1:5557"
