"""REST API over an index-only advisor (no volumes): TestClient and one real uvicorn socket."""

from __future__ import annotations

from collections.abc import Iterator

import httpx
import pytest
from fastapi.testclient import TestClient

from advisor import AdvisorService, AdvisorSettings
from api import create_app, serve_in_thread
from event_plane.schema import EventBatch, remove, store

BS = 2048
H = [0xF000_0000_0000_0001, 11, 12, 13]  # first hash above 2**63


def chain(hashes: list[int], loc: str) -> list:
    out, parent = [], None
    for h in hashes:
        out.append(store(h, hashes[0], parent, BS, loc))
        parent = h
    return out


@pytest.fixture
def service(tmp_path) -> Iterator[AdvisorService]:  # noqa: ANN001
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False))
    svc.start()
    try:
        yield svc
    finally:
        svc.stop()


@pytest.fixture
def client(service: AdvisorService) -> TestClient:
    return TestClient(create_app(service.query()), base_url="http://127.0.0.1")


def test_block_by_decimal_and_hex(service: AdvisorService, client: TestClient) -> None:
    service.ingest(EventBatch(1, "w0", 5, 0, 100, chain(H, "g1") + chain(H[:2], "slow")))
    r = client.get(f"/v1/blocks/{H[0]}")
    assert r.status_code == 200
    body = r.json()
    assert body["sequence_hash"] == H[0]
    assert body["sequence_hash_hex"] == "0xf000000000000001"
    assert body["locations"] == ["slow", "w0/g1"]
    assert body["size_bytes"] == BS and body["parent"] is None and body["prefix_hash"] == H[0]
    assert body["children"] == [11] and body["hits"] == 0 and body["orphan"] is False
    r2 = client.get("/v1/blocks/0x0b")
    assert r2.status_code == 200 and r2.json()["parent"] == H[0] and r2.json()["locations"] == ["slow", "w0/g1"]


def test_unknown_and_bad_hashes_get_clear_errors(client: TestClient) -> None:
    r = client.get("/v1/blocks/42")
    assert r.status_code == 404
    assert r.json()["error"] == "unknown_block" and "42" in r.json()["detail"]
    for bad in ("xyz", "-1", str(1 << 64), "0xzz"):
        r = client.get(f"/v1/blocks/{bad}")
        assert r.status_code == 400, bad
        assert r.json()["error"] == "bad_sequence_hash"
    r = client.post("/v1/lookup", json={"sequence_hashes": [1, "nope"]})
    assert r.status_code == 422
    assert r.json()["error"] == "invalid_request" and "sequence_hashes[1]" in r.json()["detail"]
    r = client.post("/v1/lookup", json={"hashes": [1]})
    assert r.status_code == 422 and r.json()["error"] == "invalid_request"


def test_lookup_longest_prefix_per_location(service: AdvisorService, client: TestClient) -> None:
    service.ingest(EventBatch(1, "w0", 5, 0, 100, chain(H, "g1") + chain(H[:2], "slow")))
    service.ingest(EventBatch(1, "w1", 6, 0, 100, chain(H[:3], "g2")))
    r = client.post("/v1/lookup", json={"sequence_hashes": [hex(H[0]), *H[1:], 99]})
    assert r.status_code == 200
    assert r.json() == {
        "requested": 5,
        "prefix_blocks": {"slow": 2, "w0/g1": 4, "w1/g2": 3},
        "any_location": 4,
        "longest": 4,
        "per_tier": {"G1": 4, "G2": 3, "G3": 2},  # "slow" is not an S3 volume here: G3
        "per_worker": {"w0": {"G1": 4}, "w1": {"G2": 3}},
        "best_worker": "w0",  # its G1 holds all four leading blocks
        "served_per_tier": {"G1": 4},  # each block from its fastest tier: G1 before slow
        "sequence_hashes_hex": None,
    }
    assert client.post("/v1/lookup", json={"sequence_hashes": []}).json()["longest"] == 0
    # the hit rates count what each tier serves: G1 served, G2 and G3 held but were not needed
    tiers = client.get("/v1/stats").json()["hit_rates"]["lookup"]["total"]["tiers"]
    assert {t: v["blocks"] for t, v in tiers.items()} == {"G1": 4}


def test_blocks_per_location(service: AdvisorService, client: TestClient) -> None:
    service.ingest(EventBatch(1, "w0", 5, 0, 100, chain(H, "g1") + chain(H[:2], "slow")))
    assert client.get("/v1/locations").json() == {"locations": {"slow": 2, "w0/g1": 4}}
    r = client.get("/v1/locations/w0/g1/blocks").json()
    assert r == {"location": "w0/g1", "count": 4, "sequence_hashes": sorted(H),
                 "sequence_hashes_hex": [f"0x{h:016x}" for h in sorted(H)], "next_cursor": None}
    assert client.get("/v1/locations/slow/blocks").json()["sequence_hashes"] == sorted(H[:2])
    assert client.get("/v1/locations/nowhere/blocks").json() == {"location": "nowhere", "count": 0,
                                                                 "sequence_hashes": [], "sequence_hashes_hex": [],
                                                                 "next_cursor": None}


def test_duplicate_store_batch_counts_once_in_rest_stats(service: AdvisorService, client: TestClient) -> None:  # C3
    b = EventBatch(1, "w0", 5, 0, 100, chain(H[1:], "g1"))
    assert service.ingest(b) is True
    assert service.ingest(b) is False  # the journal recognises the re-sent batch
    # the same Stores again in a new batch (e.g. re-published after a reconnect)
    service.ingest(EventBatch(1, "w0", 5, 1, 200, chain(H[1:], "g1")))
    st = client.get("/v1/stats").json()
    assert st["blocks"] == 3
    assert st["blocks_per_location"] == {"w0/g1": 3}
    assert st["index_counters"]["duplicate_stores"] == 3
    assert st["ingest"]["duplicate_batches"] == 1
    assert st["sources"]["w0"] == {"epoch": 5, "last_seq": 1, "batches": 2, "events": 6, "last_ts_ns": 200,
                                   "last_seen_s": 2e-07, "last_seen": "1970-01-01T00:00:00.000+00:00"}
    assert st["journal_position"] == 2 and st["batches_applied"] == 2 and st["events_applied"] == 6
    assert st["advisor_events"] == 0
    assert st["moves"]["promotions"] == 0 and st["moves"]["done"] == {"promote": 0, "demote": 0, "compact": 0}


def test_stats_counts_index_anomalies(service: AdvisorService, client: TestClient) -> None:
    service.ingest(EventBatch(1, "w0", 5, 0, 100, [store(3, 1, 1, BS, "g1"), store(7, 7, 7, BS, "g1"),
                                                   remove(99, 99, None, BS, "g1")]))
    st = client.get("/v1/stats").json()
    c = st["index_counters"]
    assert (c["orphans"], c["self_parent_rejected"], c["unknown_removes"]) == (1, 1, 1)
    assert st["orphans_pending"] == 1


def test_metrics_volumes_plans_health(service: AdvisorService, client: TestClient) -> None:
    service.ingest(EventBatch(1, "w0", 5, 0, 100, chain(H, "g1")))
    text = client.get("/metrics").text
    assert 'kvadvisor_index_blocks{location="w0/g1"} 4.0' in text
    assert "kvadvisor_events_applied_total 4.0" in text
    assert "kvadvisor_batches_applied_total 1.0" in text
    assert "kvadvisor_subscriber_gaps_total 0.0" in text
    assert client.get("/v1/volumes").json() == {"volumes": [], "next_cursor": None}
    assert client.get("/v1/plans").json() == {"plans": [], "summary": {}, "next_cursor": None}
    assert client.post("/v1/plans/run").json() == {"plans": [], "summary": {}, "next_cursor": None}  # no storage
    h = client.get("/healthz").json()
    assert h == {"status": "ok", "journal_position": 1, "subscribed": False, "storage": False, "reason": None}


def test_real_uvicorn_socket(service: AdvisorService) -> None:
    service.ingest(EventBatch(1, "w0", 5, 0, 100, chain(H, "fast")))
    handle = serve_in_thread(create_app(service.query()), "127.0.0.1", 0)
    try:
        assert handle.port > 0
        with httpx.Client(base_url=handle.url, timeout=5.0) as c:
            assert c.get("/healthz").json()["status"] == "ok"
            assert c.post("/v1/lookup", json={"sequence_hashes": H}).json()["prefix_blocks"] == {"fast": 4}
            assert c.get(f"/v1/blocks/{H[3]}").json()["parent"] == H[2]
            assert c.get("/metrics").headers["content-type"].startswith("text/plain")
    finally:
        handle.stop()
    with pytest.raises(httpx.TransportError):
        httpx.get(handle.url + "/healthz", timeout=1.0)


@pytest.mark.parametrize("text", ["1_0", "\u0661", "0x", "0x1_0", "+1", "1e3", "0x" + "f" * 17])
def test_sequence_hash_text_must_be_plain_ascii_decimal_or_hex(text: str) -> None:
    from api.models import HashParseError, parse_sequence_hash

    with pytest.raises(HashParseError):
        parse_sequence_hash(text)
    assert parse_sequence_hash(" 0xFF ") == 255 and parse_sequence_hash("18446744073709551615") == 2**64 - 1


def test_lookup_refuses_json_booleans_and_floats() -> None:
    from pydantic import ValidationError

    from api.models import LookupRequest

    for bad in ([True], [1.0], [None]):
        with pytest.raises(ValidationError):
            LookupRequest(sequence_hashes=bad)
    assert LookupRequest(sequence_hashes=[1, "0x2", "3"]).sequence_hashes == [1, 2, 3]


def test_forged_locations_do_not_create_one_metric_series_each(tmp_path) -> None:  # noqa: ANN001
    """5,000 Stores at 5,000 forged volume names: the scrape shows the configured bound of
    location series (the biggest locations first) plus one "_other" series holding the
    rest, so the totals still add up."""
    # the location quota (default 256 volume names) is raised: this test is about the metric
    svc = AdvisorService(AdvisorSettings(journal_path=str(tmp_path / "j.sqlite"), api_enabled=False,
                                         metrics_max_locations=8, quota_max_locations=10_000))
    svc.start()
    try:
        svc.ingest(EventBatch(1, "w0", 5, 0, 100, chain(H, "g1")))
        svc.ingest(EventBatch(1, "evil", 1, 0, 100, [store(100 + i, 100 + i, None, BS, f"v{i:05d}")
                                                    for i in range(5000)]))
        text = TestClient(create_app(svc.query()), base_url="http://127.0.0.1").get("/metrics").text
        series = {line.split('"')[1]: float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
                  if line.startswith("kvadvisor_index_blocks{")}
        assert len(series) == 9
        assert series["w0/g1"] == 4.0 and series["_other"] == 5000 - 7
        assert sum(series.values()) == 5004
        assert [loc for loc in series if loc.startswith("v")] == [f"v{i:05d}" for i in range(7)]
        # the default bound applies to any AdvisorMetrics over the same state
        from prometheus_client import generate_latest

        from advisor.embedded.metrics import AdvisorMetrics

        text = generate_latest(AdvisorMetrics(svc._metrics_snapshot).registry).decode()
        assert sum(line.startswith("kvadvisor_index_blocks{") for line in text.splitlines()) == 64 + 1
    finally:
        svc.stop()


def test_lookup_by_token_ids_hashes_as_the_runtime_does(service: AdvisorService, client: TestClient) -> None:
    from kvbm_runtime.hashing import ModelFingerprint, salt_hash, sequence_hashes

    model = {"name": "m", "dtype": "float16", "layout": "FullyContiguous", "block_size": 4}
    tokens = list(range(1, 21))  # 5 blocks of 4
    seed = salt_hash(ModelFingerprint("m", "float16", "FullyContiguous", 4), "lora-x", None)
    hs = sequence_hashes(tokens, 4, seed)
    service.ingest(EventBatch(1, "w0", 5, 0, 100, chain(hs, "g1") + chain(hs[:2], "slow")))
    service.ingest(EventBatch(1, "w1", 6, 0, 100, chain(hs[:3], "g2")))
    r = client.post("/v1/lookup", json={"token_ids": tokens + [99], "model": model, "lora_name": "lora-x"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["sequence_hashes_hex"] == [f"0x{h:016x}" for h in hs]
    assert body["prefix_blocks"] == {"slow": 2, "w0/g1": 5, "w1/g2": 3}
    assert body["per_tier"] == {"G1": 5, "G2": 3, "G3": 2}
    assert body["per_worker"] == {"w0": {"G1": 5}, "w1": {"G2": 3}}
    by_hash = client.post("/v1/lookup", json={"sequence_hashes": hs}).json()
    assert {k: v for k, v in by_hash.items() if k != "sequence_hashes_hex"} == \
        {k: v for k, v in body.items() if k != "sequence_hashes_hex"} | {"requested": 5}
    # another LoRA (or none) is another salt: nothing cached
    other = client.post("/v1/lookup", json={"token_ids": tokens, "model": model}).json()
    assert other["longest"] == 0 and other["per_tier"] == {}
    for bad in ({"token_ids": tokens}, {"token_ids": [1.5], "model": model}, {"token_ids": [-1] * 4, "model": model}):
        r = client.post("/v1/lookup", json=bad)
        assert r.status_code == 422 and r.json()["error"] == "invalid_request", bad


def test_openapi_has_an_example_for_every_route_and_examples_validate(client: TestClient) -> None:
    spec = client.get("/openapi.json").json()
    comps = spec["components"]["schemas"]

    def example_of(schema: dict | None) -> bool:  # type: ignore[type-arg]
        if not schema:
            return False
        if "$ref" in schema:
            return example_of(comps[schema["$ref"].rsplit("/", 1)[1]])
        if "examples" in schema or "example" in schema:
            return True
        return any(example_of(schema.get(k)) for k in ("items", "additionalProperties") if isinstance(schema.get(k), dict))

    missing = []
    for path, ops in spec["paths"].items():
        for method, op in ops.items():
            body = op.get("requestBody", {}).get("content", {}).get("application/json", {}).get("schema")
            content = next(iter(op["responses"]["200"].get("content", {}).values()), {})
            if not (example_of(body) or example_of(content.get("schema")) or "example" in content):
                missing.append(f"{method.upper()} {path}")
    assert missing == []
    # every model-level example is a valid instance of its model
    import api.indexer as ix
    import api.models as m
    from pydantic import BaseModel

    checked = 0
    for mod in (m, ix):
        for obj in vars(mod).values():
            if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel:
                for ex in (obj.model_config.get("json_schema_extra") or {}).get("examples", []):
                    obj.model_validate(ex)
                    checked += 1
    assert checked >= 15


def test_invalidate_without_storage_is_a_clear_409(client: TestClient) -> None:
    r = client.post("/v1/actions/invalidate", json={"namespace": "abc"})
    assert r.status_code == 409 and r.json()["error"] == "no_storage" and "no storage" in r.json()["detail"]


def test_segments_of_an_unknown_volume_are_a_404(client: TestClient) -> None:
    r = client.get("/v1/volumes/nope/segments")
    assert r.status_code == 404 and r.json()["error"] == "unknown_volume"


def test_a_router_reports_how_a_request_finished(service: AdvisorService, client: TestClient) -> None:
    r = client.post("/v1/finished", json={"sequence_hashes": [hex(h) for h in H], "finish_reason": "tool_calls"})
    assert r.status_code == 200 and r.json() == {"taken": True, "finish_class": "tool_call"}
    r = client.post("/v1/finished", json={"sequence_hashes": [11, 12], "finish_reason": "end_turn"})
    assert r.json() == {"taken": True, "finish_class": "end_turn"}
    assert service.selector.stats()["finish_hints"] == 2
    # an empty prompt is no hint; a missing, empty or oversized reason is a clear 422
    assert client.post("/v1/finished", json={"sequence_hashes": [], "finish_reason": "stop"}).json()["taken"] is False
    for bad in ({"sequence_hashes": [11]}, {"sequence_hashes": [11], "finish_reason": ""},
                {"sequence_hashes": [11], "finish_reason": "x" * 65}):
        assert client.post("/v1/finished", json=bad).status_code == 422
    assert service.selector.stats()["finish_hints"] == 2
