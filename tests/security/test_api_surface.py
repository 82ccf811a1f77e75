"""The API's own surface, over a real uvicorn server with tokens: a request repeating Host
(or Origin, Content-Length, Authorization) is refused whole (which copy counts differs
between proxies and us); ``/docs`` and ``/redoc`` do not exist (they load JavaScript from a
CDN into the API's origin); ``/openapi.json`` needs the read scope."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest
from pydantic import SecretStr

from advisor.service import AdvisorService
from advisor.settings import AdvisorSettings
from api.auth import ApiSecuritySettings
from api.server import serve_query

READ = "r" * 24
ADMIN = "a" * 24


@pytest.fixture()
def api(tmp_path: Path) -> Iterator[str]:
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False,
                                         snapshot_store="none"))
    svc.start()
    sec = ApiSecuritySettings(admin_tokens=[SecretStr(ADMIN)], read_tokens=[SecretStr(READ)])
    handle = serve_query(svc.query(), "127.0.0.1", 0, security=sec)
    try:
        yield handle.url
    finally:
        handle.stop()
        svc.stop()


def raw_get(url: str, lines: list[str]) -> int:
    """Send ``GET /v1/stats`` with exactly these header lines; the status code."""
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(("GET /v1/stats HTTP/1.1\r\n" + "".join(f"{h}\r\n" for h in lines)
                   + "Connection: close\r\n\r\n").encode())
        data = b""
        while chunk := s.recv(65536):
            data += chunk
    return int(data.split(b" ", 2)[1])


def test_a_repeated_host_header_is_refused(api: str) -> None:
    auth = f"Authorization: Bearer {READ}"
    assert raw_get(api, ["Host: 127.0.0.1", auth]) == 200
    assert raw_get(api, ["Host: evil.example", "Host: 127.0.0.1", auth]) == 400
    assert raw_get(api, ["Host: 127.0.0.1", "Host: evil.example", auth]) == 400
    assert raw_get(api, ["Host: 127.0.0.1", auth, "Authorization: Bearer x"]) == 400


def test_no_cdn_docs_and_the_schema_needs_a_token(api: str) -> None:
    with httpx.Client(base_url=api, timeout=10) as c:
        assert c.get("/docs").status_code == 404
        assert c.get("/redoc").status_code == 404
        assert c.get("/openapi.json").status_code == 401
        r = c.get("/openapi.json", headers={"Authorization": f"Bearer {READ}"})
        assert r.status_code == 200 and "/v1/stats" in r.json()["paths"]
