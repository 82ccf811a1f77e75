"""schemathesis (from PyPI) against the live OpenAPI of a running advisor, with an admin
token: a bounded number of examples per route, 0 server errors, 0 schema violations
(responses conform to the documented status codes, content types, headers and bodies)."""

from __future__ import annotations

import os
import re
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from pydantic import SecretStr

from advisor import AdvisorService, AdvisorSettings
from api import serve_query
from api.auth import ApiSecuritySettings
from event_plane.schema import EventBatch, store

ADMIN = "schemathesis-admin-token-0123456789"
MAX_EXAMPLES = int(os.environ.get("KVADVISOR_SCHEMATHESIS_EXAMPLES", "25"))
CHECKS = ",".join([
    "not_a_server_error", "status_code_conformance", "content_type_conformance",
    "response_headers_conformance", "response_schema_conformance",
])


@pytest.fixture
def live_url(tmp_path: Path) -> Iterator[str]:
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False))
    svc.start()
    parent = None
    evs = []
    for h in (1 << 63, 11, 12, 13):
        evs.append(store(h, 1 << 63, parent, 2048, "g1"))
        parent = h
    svc.ingest(EventBatch(1, "w0", 5, 0, 100, evs))
    handle = serve_query(svc.query(), "127.0.0.1", 0, security=ApiSecuritySettings(admin_tokens=[SecretStr(ADMIN)]))
    try:
        yield handle.url
    finally:
        handle.stop()
        svc.stop()


def test_schemathesis_finds_no_server_error_and_no_schema_violation(live_url: str, tmp_path: Path) -> None:
    cmd = [
        sys.executable, "-m", "schemathesis.cli", "run", f"{live_url}/openapi.json",
        "--checks", CHECKS, "--max-examples", str(MAX_EXAMPLES), "--seed", "1",
        "--phases", "examples,coverage,fuzzing", "--workers", "1",
        "-H", f"Authorization: Bearer {ADMIN}", "--suppress-health-check", "all",
        "--report", "junit", "--report-dir", str(tmp_path / "report"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True, timeout=900, cwd=tmp_path, check=False)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-6000:]
    generated = re.search(r"(\d+) generated", out)
    assert generated is not None and int(generated.group(1)) >= 100, out[-3000:]  # every route was exercised
    assert "Tested: " in out and "Selected: " in out, out[-3000:]
