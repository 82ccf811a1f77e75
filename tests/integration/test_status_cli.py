"""``kvadvisor status`` against a running advisor API with tokens: the figures it prints are
the API's, a missing token is a one-line error, an unreachable API too."""

from __future__ import annotations

from pydantic import SecretStr
from typer.testing import CliRunner

from advisor import AdvisorService, AdvisorSettings
from api import serve_query
from api.auth import ApiSecuritySettings
from event_plane.schema import EventBatch, store
from kvadvisor.cli import app
from storage_backends.local_s3 import free_port

READ = "status-read-token-0123456789"


def test_status_prints_the_api_figures(tmp_path) -> None:  # noqa: ANN001
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False))
    svc.start()
    evs, parent = [], None
    for h in range(1, 1235):
        evs.append(store(h, 1, parent, 2048, "g1"))
        parent = h
    svc.ingest(EventBatch(1, "worker-7", 0xABC, 41, 1_764_600_000_000_000_000, evs))
    handle = serve_query(svc.query(), "127.0.0.1", 0, security=ApiSecuritySettings(read_tokens=[SecretStr(READ)]))
    try:
        runner = CliRunner()
        r = runner.invoke(app, ["status", "--url", handle.url], env={"KVADVISOR_API_TOKEN": READ, "COLUMNS": "200"})
        assert r.exit_code == 0, r.output
        assert "status ok" in r.output and "1,234" in r.output  # blocks
        assert "worker-7/g1" in r.output and "0x0000000000000abc" in r.output and "41" in r.output
        assert "2025-12-01 14:40:00" in r.output  # the last batch's timestamp
        r = runner.invoke(app, ["status", "--url", handle.url], env={"KVADVISOR_API_TOKEN": ""})
        assert r.exit_code == 2 and "401 (unauthorized" in r.output
    finally:
        handle.stop()
        svc.stop()
    r = CliRunner().invoke(app, ["status", "--url", f"http://127.0.0.1:{free_port()}"])
    assert r.exit_code == 2 and "no advisor API answers at" in r.output and "pass --url" in r.output
