"""S3 volumes: retries on 5xx/throttling, lifecycle, credentials from the AWS chain.

Faults come from a real HTTP proxy in front of the real S3 endpoint (moto_server): it
answers chosen requests with ``503 SlowDown`` and forwards every other one unchanged, so
boto3 and NIXL OBJ (aws-sdk-cpp) both see a throttling S3.
"""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import boto3
import pytest
import torch
from s3_proxy import S3FaultProxy

from storage_backends import (
    BlockKey,
    InvalidRequestError,
    LocalS3,
    MediaClass,
    SqliteCatalog,
    StorageAgent,
    TransferError,
    VolumeConfigError,
    VolumeDescriptor,
    VolumeFullError,
    VolumeKind,
)
from storage_backends.s3_volume import S3Volume

_ids = itertools.count()


@pytest.fixture
def agent(tmp_path: Path) -> Iterator[StorageAgent]:
    cat = SqliteCatalog(tmp_path / "c.sqlite")
    a = StorageAgent(cat, name=f"s3-admin-{tmp_path.name}")
    yield a
    a.close()
    cat.close()


def desc(endpoint: str, s3: LocalS3 | None, vid: str = "cold", prefix: str = "kv", bucket: str | None = None) -> VolumeDescriptor:
    return VolumeDescriptor(
        vid, VolumeKind.S3, MediaClass.OBJECT, 1 << 30, endpoint=endpoint, prefix=prefix,
        bucket=bucket or f"kvadvisor-admin-{next(_ids)}",
        access_key=s3.access_key if s3 else None, secret_key=s3.secret_key if s3 else None,
    )


def block(h: int, n: int = 50_000) -> torch.Tensor:
    g = torch.Generator().manual_seed(h)
    return torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)


def test_admin_calls_retry_on_503_slowdown(agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy) -> None:
    proxy.fail(2)  # bucket HEAD twice
    vol = agent.register_volume(desc(proxy.endpoint, local_s3))
    assert [r.split()[0] for r in proxy.injected] == ["HEAD", "HEAD"]
    assert vol.counters.extra["s3_retries"] == 2
    (p,) = agent.put([(BlockKey("ns", 1), block(1))], "cold")
    proxy.fail(1, {"GET"})  # listing throttled once
    assert vol.list_segments() == [p.segment_id]
    assert len(proxy.injected) == 1 and vol.counters.extra["s3_retries"] == 3
    proxy.fail(1, {"DELETE"})  # the segment delete throttled once
    assert agent.delete([BlockKey("ns", 1)]) == 1
    assert proxy.requests.count(proxy.injected[0]) == 2  # the DELETE was sent again
    assert vol.list_segments() == []


def test_admin_calls_give_up_after_the_attempts(agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy) -> None:
    proxy.fail(100, {"HEAD"})
    with pytest.raises(VolumeConfigError, match="503|SlowDown"):
        agent.register_volume(desc(proxy.endpoint, local_s3))
    assert len(proxy.injected) == S3Volume.attempts
    assert agent.volumes() == [] and agent.catalog.volume_specs() != {}  # recorded, not opened


def test_nixl_obj_transfers_survive_throttling(agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy) -> None:
    agent.register_volume(desc(proxy.endpoint, local_s3))
    keys = [BlockKey("ns", i) for i in range(4)]
    proxy.fail(1, {"PUT"})  # the segment upload
    agent.put([(k, block(i)) for i, k in enumerate(keys)], "cold")
    assert len(proxy.injected) == 1 and proxy.injected[0].startswith("PUT /")
    assert proxy.requests.count(proxy.injected[0]) >= 2  # sent again after the 503
    proxy.fail(1, {"GET"})  # the ranged GET of the read
    got = agent.get(keys)
    assert len(proxy.injected) == 1
    assert all(torch.equal(g, block(i)) for i, g in enumerate(got))


def test_the_sdk_inside_nixl_tries_as_often_as_configured(
    agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy, monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``s3_sdk_max_attempts=1``: the aws-sdk inside NIXL OBJ sends a throttled segment PUT
    once, and the volume's own backoff sends the wave again (counted in ``s3_retries``); by
    default the SDK sends it again by itself and the volume sees no failure.  The
    environment the SDK read its retry strategy from is the process's again afterwards."""
    import os

    for var in ("AWS_RETRY_MODE", "AWS_MAX_ATTEMPTS"):
        monkeypatch.delenv(var, raising=False)
    default = agent.register_volume(desc(proxy.endpoint, local_s3, vid="sdk-default"))
    one = agent.register_volume(replace(desc(proxy.endpoint, local_s3, vid="sdk-one"), s3_sdk_max_attempts=1))
    assert "AWS_RETRY_MODE" not in os.environ and "AWS_MAX_ATTEMPTS" not in os.environ
    for vol, h in ((default, 1), (one, 2)):
        proxy.fail(1, {"PUT"})
        agent.put([(BlockKey("ns", h), block(h))], vol.desc.id)
        assert len(proxy.injected) == 1 and proxy.injected[0].startswith("PUT /")
        assert torch.equal(agent.get([BlockKey("ns", h)])[0], block(h))
    assert default.counters.extra.get("s3_retries", 0) == 0  # the SDK sent the PUT again
    assert one.counters.extra["s3_retries"] == 1  # the volume did


def test_s3_client_timeouts_and_sdk_attempts_are_checked_and_used(agent: StorageAgent, local_s3: LocalS3) -> None:
    vol = agent.register_volume(replace(desc(local_s3.endpoint, local_s3), s3_connect_timeout_s=2.5,
                                        s3_read_timeout_s=7))
    assert isinstance(vol, S3Volume)
    assert (vol.client.meta.config.connect_timeout, vol.client.meta.config.read_timeout) == (2.5, 7)
    assert S3Volume.engine_env(vol.desc) == {}
    assert S3Volume.engine_env(replace(vol.desc, s3_sdk_max_attempts=3)) == {
        "AWS_RETRY_MODE": "standard", "AWS_MAX_ATTEMPTS": "3"}
    for bad in ({"s3_sdk_max_attempts": 0}, {"s3_sdk_max_attempts": True}, {"s3_connect_timeout_s": 0},
                {"s3_read_timeout_s": -1.0}, {"s3_read_timeout_s": "5"}):
        with pytest.raises(VolumeConfigError, match=next(iter(bad))):
            agent.register_volume(replace(desc(local_s3.endpoint, local_s3, vid="bad"), **bad))


def test_configure_lifecycle_keeps_other_rules(agent: StorageAgent, local_s3: LocalS3) -> None:
    bucket = f"kvadvisor-lc-{next(_ids)}"
    a = agent.register_volume(desc(local_s3.endpoint, local_s3, vid="a", prefix="kv", bucket=bucket))
    b = agent.register_volume(desc(local_s3.endpoint, local_s3, vid="b%β", prefix="kv", bucket=bucket))
    assert isinstance(a, S3Volume) and isinstance(b, S3Volume)
    a.configure_lifecycle(7)
    b.configure_lifecycle(30)
    a.configure_lifecycle(3)  # replaces a's rule, keeps b's
    c = boto3.client("s3", endpoint_url=local_s3.endpoint, aws_access_key_id=local_s3.access_key,
                     aws_secret_access_key=local_s3.secret_key, region_name="us-east-1")
    cid = agent.catalog.catalog_id()  # segment keys are scoped by the owning catalog; its owner marker is not expired
    rules = {r["ID"].replace(cid, "CID"): r for r in c.get_bucket_lifecycle_configuration(Bucket=bucket)["Rules"]}
    assert set(rules) == {"kvadvisor-kv/a/CID/", "kvadvisor-kv/b%25%CE%B2/CID/"}
    assert rules["kvadvisor-kv/a/CID/"]["Expiration"]["Days"] == 3
    assert rules["kvadvisor-kv/b%25%CE%B2/CID/"]["Expiration"]["Days"] == 30
    assert rules["kvadvisor-kv/a/CID/"]["Filter"]["Prefix"] == f"kv/a/{cid}/"
    assert rules["kvadvisor-kv/a/CID/"]["Status"] == "Enabled"
    for bad in (0, -1, 1.5, True):
        with pytest.raises(InvalidRequestError, match="days"):
            a.configure_lifecycle(bad)  # type: ignore[arg-type]


def test_credentials_from_the_standard_aws_chain(
    agent: StorageAgent, local_s3: LocalS3, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    for var in ("AWS_PROFILE", "AWS_SESSION_TOKEN", "AWS_SECURITY_TOKEN"):
        monkeypatch.delenv(var, raising=False)
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_CONFIG_FILE", str(tmp_path / "none"))
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")
    monkeypatch.delenv("AWS_ACCESS_KEY_ID", raising=False)
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY", raising=False)
    d = desc(local_s3.endpoint, None)
    assert d.access_key is None and d.secret_key is None
    with pytest.raises(VolumeConfigError, match="no credentials"):
        agent.register_volume(d)
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", "env-access-key")
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", "env-secret-key")
    backend, params = S3Volume.engine_spec(d)
    assert backend == "OBJ" and (params["access_key"], params["secret_key"]) == ("env-access-key", "env-secret-key")
    vol = agent.register_volume(d)
    creds = vol.client._request_signer._credentials  # type: ignore[attr-defined]
    assert creds.access_key == "env-access-key"
    (p,) = agent.put([(BlockKey("ns", 5), block(5))], "cold")
    assert torch.equal(agent.get([p.key])[0], block(5))


def _objects(vol: S3Volume) -> list[str]:
    return sorted(o["Key"] for o in vol.client.list_objects_v2(Bucket=vol.desc.bucket).get("Contents", [])
                  if not o["Key"].endswith("/owner"))  # the volume's owner marker aside


def test_a_put_of_several_segments_is_one_transfer_of_concurrent_puts(
    agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy,
) -> None:
    """Four segments: one NIXL WRITE (one PUT each, no HEAD after them); one PUT throttled:
    the wave is sent again as a whole and every block reads back."""
    vol = agent.register_volume(replace(desc(proxy.endpoint, local_s3), segment_bytes=64 << 10))
    assert isinstance(vol, S3Volume) and vol.write_concurrency == S3Volume.threads
    keys = [BlockKey("ns", 100 + i) for i in range(4)]
    proxy.fail(1, {"PUT"})
    placed = agent.put([(k, block(100 + i)) for i, k in enumerate(keys)], "cold")
    assert len({p.segment_id for p in placed}) == 4  # 50 kB blocks, 64 KiB segments
    assert vol.counters.extra["put_transfers"] == 1 and vol.counters.segments_written == 4
    assert len(proxy.injected) == 1 and proxy.injected[0].startswith("PUT /")
    methods = [r.split()[0] for r in proxy.requests]
    assert "HEAD" not in methods and methods.count("PUT") >= 5  # 4, and the wave sent again
    assert _objects(vol) == sorted(vol.key(p.segment_id) for p in placed)
    got = agent.get(keys)
    assert all(torch.equal(g, block(100 + i)) for i, g in enumerate(got))


def test_a_put_that_keeps_failing_leaves_nothing_behind(
    agent: StorageAgent, local_s3: LocalS3, proxy: S3FaultProxy, monkeypatch: pytest.MonkeyPatch,
) -> None:
    import gc

    import storage_backends.s3_volume as s3mod

    states: list[bool] = []
    orig_yield = s3mod.gc_pause_yield

    def spy() -> None:  # each backoff ends the put's collector pause
        orig_yield()
        states.append(gc.isenabled())

    monkeypatch.setattr(s3mod, "gc_pause_yield", spy)
    vol = agent.register_volume(replace(desc(proxy.endpoint, local_s3), segment_bytes=64 << 10))
    assert isinstance(vol, S3Volume)
    (kept,) = agent.put([(BlockKey("ns", 1), block(1))], "cold")
    keys = [BlockKey("ns", 200 + i) for i in range(3)]
    # 403: the aws-sdk does not retry it on its own (a 503 forever takes it ~25 s a try),
    # our backoff tries the whole wave S3Volume.attempts times
    proxy.fail(10_000, {"PUT"}, status=403)
    with pytest.raises(TransferError, match="ERR|failed") as ei:
        agent.put([(k, block(200 + i)) for i, k in enumerate(keys)], "cold")
    assert ei.value.stored == []
    assert len(proxy.injected) == 3 * S3Volume.attempts and vol.counters.extra["s3_retries"] == S3Volume.attempts - 1
    assert states == [gc.isenabled()] * (S3Volume.attempts - 1)
    proxy.fail(0)
    assert agent.exists(keys) == [False] * 3
    assert [s.segment_id for s in agent.segments("cold")] == [kept.segment_id]  # the 3 were released
    assert _objects(vol) == [vol.key(kept.segment_id)]  # and their objects deleted
    assert torch.equal(agent.get([kept.key])[0], block(1))


def test_a_volume_that_fills_up_mid_wave_keeps_the_segments_that_had_room(
    agent: StorageAgent, local_s3: LocalS3,
) -> None:
    d = replace(desc(local_s3.endpoint, local_s3), segment_bytes=64 << 10, capacity_bytes=2 * 50_000)
    vol = agent.register_volume(d)
    keys = [BlockKey("ns", 300 + i) for i in range(4)]
    with pytest.raises(VolumeFullError) as ei:
        agent.put([(k, block(300 + i)) for i, k in enumerate(keys)], "cold")
    assert [p.key for p in ei.value.stored] == keys[:2]
    assert agent.exists(keys) == [True, True, False, False]
    assert vol.counters.extra["put_transfers"] == 1 and len(_objects(vol)) == 2
    got = agent.get(keys[:2])
    assert all(torch.equal(g, block(300 + i)) for i, g in enumerate(got))
