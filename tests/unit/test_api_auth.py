"""Auth, Host / Origin checks, body limits, the one error shape and paging of the REST API."""

from __future__ import annotations

import hmac
from collections.abc import Iterator

import httpx
import pytest
from fastapi.routing import APIRoute
from fastapi.testclient import TestClient
from pydantic import SecretStr, ValidationError

from advisor import AdvisorService, AdvisorSettings, AdvisorError
from api import ServerError, create_app, serve_query
from api.auth import ApiSecuritySettings, check_bind, require_admin, scope_of, tokens_equal
from event_plane.schema import EventBatch, store

ADMIN, READ = "admin-token-0123456789abcdef", "read-token-0123456789abcdef"
SEC = ApiSecuritySettings(admin_tokens=[SecretStr(ADMIN)], read_tokens=[SecretStr(READ)], max_body_bytes=64 * 1024)
MUTATING = {("POST", "/v1/volumes"), ("DELETE", "/v1/volumes/{volume_id}"), ("POST", "/v1/plans/run"), ("POST", "/v1/actions/invalidate"), ("POST", "/v1/volumes/{volume_id}/drain"), ("DELETE", "/v1/volumes/{volume_id}/drain"), ("POST", "/register"), ("POST", "/unregister"), ("POST", "/load")}
OPEN = {("GET", "/healthz"), ("GET", "/health")}


@pytest.fixture
def service(tmp_path) -> Iterator[AdvisorService]:  # noqa: ANN001
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False))
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


def _client(service: AdvisorService, sec: ApiSecuritySettings = SEC, token: str | None = None) -> TestClient:
    headers = {"Authorization": f"Bearer {token}"} if token else {}
    return TestClient(create_app(service.query(), security=sec), base_url="http://127.0.0.1", headers=headers)


def _routes(app) -> list[tuple[str, str, APIRoute]]:  # noqa: ANN001
    out = []
    for r in app.routes:
        if isinstance(r, APIRoute) and r.include_in_schema:
            for m in r.methods:
                out.append((m, r.path, r))
    return out


def _path(path: str) -> str:
    return path.replace("{sequence_hash}", "1").replace("{location:path}", "w0/g1").replace("{volume_id}", "fast")


def test_every_mutating_route_needs_admin(service: AdvisorService) -> None:
    app = create_app(service.query(), security=SEC)
    admin = {(m, p) for m, p, r in _routes(app) if any(d.call is require_admin for d in r.dependant.dependencies)}
    assert admin == MUTATING
    anon, reader = _client(service), _client(service, token=READ)
    for m, p in sorted(MUTATING):
        p = _path(p)
        r = anon.request(m, p, json={})
        assert r.status_code == 401, (m, p)
        assert r.json()["error"] == "unauthorized" and r.headers["www-authenticate"] == "Bearer"
        r = reader.request(m, p, json={})
        assert r.status_code == 403, (m, p)
        assert r.json() == {"error": "forbidden", "detail": "this route needs an admin token"}
    assert _client(service, token="x" * 30).post("/v1/plans/run").status_code == 401  # unknown token
    assert _client(service, token=ADMIN).post("/v1/plans/run").status_code == 200


def test_read_routes_need_a_token_and_health_is_open(service: AdvisorService) -> None:
    app = create_app(service.query(), security=SEC)
    anon, reader = _client(service), _client(service, token=READ)
    for m, p, _ in _routes(app):
        if (m, p) in MUTATING:
            continue
        body = {"sequence_hashes": []} if p == "/v1/lookup" else {}
        if (m, p) in OPEN:
            assert anon.request(m, p).status_code == 200
            continue
        assert anon.request(m, _path(p), json=body).status_code == 401, (m, p)
        assert reader.request(m, _path(p), json=body).status_code in (200, 404, 422), (m, p)


def test_no_tokens_means_loopback_only(service: AdvisorService, tmp_path) -> None:  # noqa: ANN001
    none = ApiSecuritySettings()
    for host in ("0.0.0.0", "::", "10.1.2.3", "example.com"):
        with pytest.raises(ServerError, match="without tokens"):
            serve_query(service.query(), host, 0, security=none)
    check_bind("127.0.0.1", none)
    check_bind("::1", none)
    check_bind("0.0.0.0", SEC)  # tokens configured: allowed
    # the advisor refuses to start with such an API
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "k.sqlite"), api_host="0.0.0.0", api_port=0))
    with pytest.raises((AdvisorError, ServerError)):
        svc.start()
    svc.stop()


def test_weak_tokens_are_refused_without_echoing_them(monkeypatch: pytest.MonkeyPatch) -> None:
    with pytest.raises(ValidationError):
        ApiSecuritySettings(admin_tokens=[SecretStr("short")])
    with pytest.raises(ValidationError):
        ApiSecuritySettings(read_tokens=[SecretStr("has a space in it, 123456")])
    monkeypatch.setenv("KVADVISOR_API_ADMIN_TOKENS", '["tiny-secret"]')
    with pytest.raises(ValidationError) as info:
        ApiSecuritySettings()
    assert "tiny-secret" not in str(info.value) and "at least 16" in str(info.value)


def test_token_compare_is_constant_time(monkeypatch: pytest.MonkeyPatch) -> None:
    assert tokens_equal(ADMIN, ADMIN) and not tokens_equal(ADMIN, ADMIN[:-1] + "X") and not tokens_equal(ADMIN, "")
    calls: list[tuple[bytes, bytes]] = []
    real = hmac.compare_digest

    def spy(a: bytes, b: bytes) -> bool:
        calls.append((a, b))
        return real(a, b)

    monkeypatch.setattr(hmac, "compare_digest", spy)
    sec = ApiSecuritySettings(admin_tokens=[SecretStr(ADMIN), SecretStr("b" * 20)], read_tokens=[SecretStr(READ)])
    assert scope_of(ADMIN, sec) == "admin"  # the first token matched, every token still compared
    assert len(calls) == 3
    calls.clear()
    assert scope_of("w" * 25, sec) is None and len(calls) == 3
    assert scope_of(READ, sec) == "read"


def test_host_and_origin_are_checked(service: AdvisorService) -> None:
    c = _client(service, ApiSecuritySettings(), token=None)
    assert c.get("/healthz").status_code == 200
    r = c.get("/v1/stats", headers={"Host": "evil.example"})
    assert r.status_code == 403 and r.json()["error"] == "host_refused"
    # a browser's cross-origin "simple" POST never runs a policy round
    before = service.query().stats()
    r = c.post("/v1/plans/run", content=b"{}", headers={"Origin": "http://evil.example", "Content-Type": "text/plain"})
    assert r.status_code == 403 and r.json()["error"] == "origin_refused"
    assert "access-control-allow-origin" not in r.headers
    assert service.query().stats()["journal_position"] == before["journal_position"]
    assert c.get("/v1/stats", headers={"Origin": "http://127.0.0.1"}).status_code == 200  # same origin
    # allowed origins get CORS; others none
    sec = ApiSecuritySettings(allowed_origins=["https://ops.example"], allowed_hosts=["advisor.internal"])
    c2 = _client(service, sec)
    r = c2.get("/v1/stats", headers={"Origin": "https://ops.example"})
    assert r.status_code == 200 and r.headers["access-control-allow-origin"] == "https://ops.example"
    r = c2.options("/v1/stats", headers={"Origin": "https://ops.example", "Access-Control-Request-Method": "GET"})
    assert r.status_code == 204 and "GET" in r.headers["access-control-allow-methods"]
    assert c2.get("/v1/stats", headers={"Host": "advisor.internal:8080"}).status_code == 200


def test_bodies_are_limited_and_422_never_echoes(service: AdvisorService) -> None:
    c = _client(service, token=ADMIN)
    big = b'{"sequence_hashes": [' + b'"nope",' * 20_000 + b'1]}'
    r = c.post("/v1/lookup", content=big, headers={"Content-Type": "application/json"})
    assert r.status_code == 413 and r.json()["error"] == "body_too_large"
    marker = "Z" * 5000
    r = c.post("/v1/lookup", json={"sequence_hashes": [marker] * 10})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"
    assert len(r.text) < 1000 and marker[:100] not in r.text
    r = c.post("/v1/lookup", json={"sequence_hashes": [], "token_ids": [1]})
    assert r.status_code == 422 and "either" in r.json()["detail"]


def test_streamed_body_over_the_limit_gets_413_on_a_real_socket(service: AdvisorService) -> None:
    handle = serve_query(service.query(), "127.0.0.1", 0, security=SEC)
    try:
        def chunks() -> Iterator[bytes]:  # no Content-Length: chunked transfer
            yield b'{"sequence_hashes": ['
            for _ in range(200):
                yield b"1," * 512
            yield b"1]}"

        with httpx.Client(base_url=handle.url, timeout=10.0, headers={"Authorization": f"Bearer {READ}"}) as c:
            r = c.post("/v1/lookup", content=chunks(), headers={"Content-Type": "application/json"})
            assert r.status_code == 413 and r.json()["error"] == "body_too_large"
            assert c.get("/healthz").status_code == 200
    finally:
        handle.stop()


def test_error_bodies_have_one_shape(service: AdvisorService) -> None:
    c = _client(service, token=READ)
    cases = [
        (c.get("/v1/blocks/xyz"), 400), (_client(service).get("/v1/stats"), 401),
        (c.post("/v1/plans/run"), 403), (c.get("/v1/blocks/42"), 404), (c.get("/no/such/route"), 404),
        (c.post("/v1/lookup", json={"hashes": [1]}), 422), (c.get("/v1/plans", params={"cursor": "abc"}), 400),
        (c.delete("/v1/stats"), 405),
    ]
    for r, status in cases:
        assert r.status_code == status, r.request.url
        assert set(r.json()) == {"error", "detail"} and all(isinstance(v, str) for v in r.json().values())


def test_location_blocks_page_with_hex(service: AdvisorService) -> None:
    hashes = [(1 << 63) + i for i in range(25)]
    evs, parent = [], None
    for h in hashes:
        evs.append(store(h, hashes[0], parent, 2048, "g1"))
        parent = h
    service.ingest(EventBatch(1, "w0", 5, 0, 100, evs))
    c = _client(service, token=READ)
    got, cursor, pages = [], None, 0
    while True:
        r = c.get("/v1/locations/w0/g1/blocks", params={"limit": 10, **({"cursor": cursor} if cursor else {})}).json()
        assert r["count"] == 25 and len(r["sequence_hashes"]) <= 10
        assert r["sequence_hashes_hex"] == [f"0x{h:016x}" for h in r["sequence_hashes"]]
        got += r["sequence_hashes"]
        pages += 1
        cursor = r["next_cursor"]
        if cursor is None:
            break
    assert got == sorted(hashes) and pages == 3
    assert c.get("/v1/locations/w0/g1/blocks", params={"limit": 1001}).status_code == 422
    assert c.get("/v1/locations/w0/g1/blocks", params={"limit": 3}).json()["sequence_hashes"] == sorted(hashes)[:3]
    b = c.get(f"/v1/blocks/{hashes[1]}").json()
    assert b["parent_hex"] == f"0x{hashes[0]:016x}" and b["children_hex"] == [f"0x{hashes[2]:016x}"]
