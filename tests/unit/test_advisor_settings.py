"""AdvisorSettings from the environment and from JSON; clear errors; the events/s meter."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest

from advisor import AdvisorSettings, SettingsError
from advisor.embedded import service
from advisor.embedded.service import RateMeter

VOLS = [
    {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 1000, "root": "/tmp/f"},
    {"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1000, "endpoint": "http://x", "bucket": "b",
     "access_key": "ak", "secret_key": "sk"},
]


def test_json_file_and_environment(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setenv("KVADVISOR_ADVISOR_POLICY__DEMOTION__HIGH_WATERMARK", "0.9")
    monkeypatch.setenv("KVADVISOR_ADVISOR_API_PORT", "9999")
    cfg = tmp_path / "a.json"
    cfg.write_text(json.dumps({"catalog_path": "c.sqlite", "volumes": VOLS, "fast_volume": "fast",
                               "archive_volume": "s3", "api_port": 8123, "extra_namespaces": ["b", "a", "b"],
                               "namespace": "a"}))
    cfg.chmod(0o600)  # it holds a secret: a file readable by others is refused (tests/faults)
    s = AdvisorSettings.from_json_file(cfg)
    assert s.api_port == 8123  # the file wins over the environment
    assert s.policy.demotion.high_watermark == 0.9  # the environment fills the rest
    assert s.namespaces == ["a", "b"]
    d = s.volumes[1].to_descriptor()
    assert (d.id, d.kind.value, d.media.value, d.access_key, d.secret_key) == ("s3", "s3", "object", "ak", "sk")
    assert "sk" not in repr(s.volumes[1])


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"volumes": VOLS, "catalog_path": "c", "fast_volume": "nope"}, "unknown volume ids ['nope']"),
        ({"volumes": VOLS, "catalog_path": "c", "fast_volume": "fast", "archive_volume": "fast"}, "one role only"),
        ({"volumes": VOLS + VOLS[:1], "catalog_path": "c"}, "repeated: ['fast']"),
        ({"volumes": VOLS}, "catalog_path is not set"),
        ({"volumes": [{**VOLS[0], "capacity_bytes": 0}], "catalog_path": "c"}, "volumes.0.capacity_bytes"),
        ({"policy": {"demotion": {"low_watermark": 0.95}}}, "must be below high_watermark"),
        ({"polcy": {}}, "polcy: Extra inputs are not permitted"),
    ],
)
def test_invalid_settings_name_the_problem(tmp_path, data: dict, message: str) -> None:  # noqa: ANN001
    cfg = tmp_path / "a.json"
    cfg.write_text(json.dumps(data))
    with pytest.raises(SettingsError, match="invalid advisor config") as ei:
        AdvisorSettings.from_json_file(cfg)
    assert message in str(ei.value)


def test_unreadable_config(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(SettingsError, match="cannot read"):
        AdvisorSettings.from_json_file(tmp_path / "missing.json")
    bad = tmp_path / "bad.json"
    bad.write_text("[1, 2]")
    with pytest.raises(SettingsError, match="JSON object"):
        AdvisorSettings.from_json_file(bad)


def test_rate_meter_window(monkeypatch: pytest.MonkeyPatch) -> None:
    # the meter's clock is the test's: with the wall clock, a stall of ~0.7 s between the
    # last add and the first look (a loaded machine) let the 0.5 s window pass, and the
    # "still counted" look read 0
    now = [1000.0]
    monkeypatch.setattr(service, "time", SimpleNamespace(monotonic=lambda: now[0]))
    r = RateMeter(window_s=0.5)
    assert r.rate() == 0.0
    for _ in range(6):
        r.add(100)
        now[0] += 0.1
    assert 0 < r.rate() <= 600  # at most 600 events over at least 1 s (the meter floor)
    now[0] += 1.2  # the 0.5 s window (and the 1 s floor) is over
    assert r.rate() == 0.0
    assert r.total == 600


def test_jetstream_stream_limits_defaults_environment_and_errors(monkeypatch) -> None:  # noqa: ANN001
    from event_plane import StreamLimits

    assert AdvisorSettings().stream_limits() == StreamLimits(1 << 30, 24 * 3600.0, "old", False)
    monkeypatch.setenv("KVADVISOR_ADVISOR_JETSTREAM_MAX_BYTES", "unlimited")
    monkeypatch.setenv("KVADVISOR_ADVISOR_JETSTREAM_MAX_AGE_S", "600")
    monkeypatch.setenv("KVADVISOR_ADVISOR_JETSTREAM_DISCARD", "new")
    monkeypatch.setenv("KVADVISOR_ADVISOR_JETSTREAM_STRICT_STREAM", "true")
    assert AdvisorSettings().stream_limits() == StreamLimits(None, 600.0, "new", True)
    # the replicas of the stream on a 3-node cluster (compose: R3, as the cluster advisors)
    monkeypatch.setenv("KVADVISOR_ADVISOR_JETSTREAM_REPLICAS", "3")
    assert AdvisorSettings().stream_limits() == StreamLimits(None, 600.0, "new", True, replicas=3)
    for field, value in [("jetstream_max_bytes", 0), ("jetstream_max_age_s", -1.0), ("jetstream_discard", "all"),
                         ("jetstream_replicas", 2),
                         ("jetstream_max_age_s", float("inf")), ("jetstream_max_bytes", "lots")]:
        with pytest.raises(Exception, match=field):
            AdvisorSettings(**{field: value})
