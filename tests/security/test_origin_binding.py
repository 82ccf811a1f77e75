"""Each source bound to its origin, over real ZMQ (two publisher endpoints) and real NATS
(two namespaces, and a forged subject): a batch with the victim's source name and a new
epoch from another origin changes nothing, is counted, and stays refused after an advisor
restart; an operator's release lets the source move."""

from __future__ import annotations

import asyncio
import secrets
import time
from pathlib import Path
from typing import Any

import nats
from security_fixtures import advisor, keys  # noqa: F401 - fixtures
from security_helpers import chain, per_location, settings, wait_for

from event_plane import PublisherConfig, make_publisher
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch
from storage_backends.local_s3 import free_port

ONE = PublisherConfig(max_events=1, max_delay_s=0.05)
VICTIM = "w-victim"


def _refused(svc: Any, transport: str) -> float:
    return svc.metrics.registry.get_sample_value("kvadvisor_origin_refused_total", {"transport": transport}) or 0.0


def _zmq_url() -> str:
    return f"zmq://127.0.0.1:{free_port()}?replay={free_port()}"


def test_zmq_forged_epoch_from_another_endpoint_changes_nothing_and_survives_restart(
    tmp_path: Path, advisor: Any
) -> None:
    at_a, at_b = _zmq_url(), _zmq_url()
    victim = make_publisher(at_a, VICTIM, config=ONE, epoch=1)
    forger = make_publisher(at_b, VICTIM, config=ONE, epoch=2)  # victim's name, a new epoch
    try:
        svc = advisor(settings(tmp_path, [at_a, at_b]))
        victim.publish(chain([1, 2, 3], "g1"))
        victim.flush()
        wait_for(lambda: per_location(svc, [1, 2, 3]) == {f"{VICTIM}/g1": 3}, what="victim indexed")
        assert svc.origins.origin_of(VICTIM) == f"zmq:{at_a.split('?')[0].replace('zmq://', 'tcp://')}"

        forger.publish(chain([1, 2, 3, 4], "g2"))  # would drop the victim's g1 (new epoch) and add g2
        forger.flush()
        wait_for(lambda: svc.counters["origin_refused"] >= 1, what="forged batch refused")
        assert _refused(svc, "zmq") >= 1
        assert per_location(svc, [1, 2, 3]) == {f"{VICTIM}/g1": 3}
        assert per_location(svc, [1, 2, 3, 4]) == {f"{VICTIM}/g1": 3}
        assert svc.query().stats()["sources"][VICTIM]["epoch"] == 1
        # the victim's later batches are still applied (its epoch was not retired)
        victim.publish(chain([1, 2, 3, 4, 5], "g1"))
        victim.flush()
        wait_for(lambda: per_location(svc, [1, 2, 3, 4, 5]) == {f"{VICTIM}/g1": 5}, what="victim's later batch")
        position = svc.position
        svc.stop()

        # restart, subscribed to the forger's endpoint only: the binding came from disk, so
        # the forged batches (replayed from its buffer, and new ones) are refused again
        svc = advisor(settings(tmp_path, [at_b]))
        forger.publish(chain([1, 2, 3, 4, 5, 6], "g2"))
        forger.flush()
        wait_for(lambda: svc.counters["origin_refused"] >= 2, what="forged batches refused after restart")
        time.sleep(1.0)  # time passes: a forged batch applied by mistake would show below
        assert svc.position == position
        assert per_location(svc, [1, 2, 3, 4, 5]) == {f"{VICTIM}/g1": 5}

        # an operator releases the source (it moved to the other endpoint): the next
        # batch from there binds it and is applied
        assert svc.release_origin(VICTIM) is True
        # (a second release of VICTIM is not asked here: a forged batch still in flight, a
        # replay of the forger's buffer, may bind it again in between, as it may any time)
        assert svc.release_origin("w-never-bound") is False
        forger.publish(chain([7], "g2"))
        forger.flush()
        wait_for(lambda: per_location(svc, [7]) == {f"{VICTIM}/g2": 1}, what="moved source applied")
        assert svc.origins.origin_of(VICTIM) == f"zmq:{at_b.split('?')[0].replace('zmq://', 'tcp://')}"
        svc.stop()
        # the release and the new binding were persisted
        svc = advisor(settings(tmp_path, []))
        assert svc.origins is None  # nothing subscribed: no guard
        from advisor.ingest.origin_store import SqliteOriginStore

        store_ = SqliteOriginStore(settings(tmp_path, []).origins_file)
        assert store_.load() == {VICTIM: f"zmq:{at_b.split('?')[0].replace('zmq://', 'tcp://')}"}
        store_.close()
    finally:
        victim.close()
        forger.close()


def _forge_on_subject(server: str, subject: str, batch: EventBatch) -> None:
    """Publish ``batch`` raw on ``subject`` (what a client allowed to publish there can do)."""

    async def go() -> None:
        nc = await nats.connect(server)
        await nc.publish(subject, encode_batch(batch))
        await nc.flush()
        await nc.close()

    asyncio.run(go())


def test_nats_forged_epoch_from_another_subject_changes_nothing_and_survives_restart(
    tmp_path: Path, advisor: Any, nats_url: str
) -> None:
    ns1, ns2 = "o1" + secrets.token_hex(3), "o2" + secrets.token_hex(3)
    url1, url2 = f"{nats_url}?namespace={ns1}", f"{nats_url}?namespace={ns2}"
    svc = advisor(settings(tmp_path, [url1, url2]))
    victim = make_publisher(url1, VICTIM, config=ONE, epoch=1)
    forger = make_publisher(url2, VICTIM, config=ONE, epoch=2)
    try:
        victim.publish(chain([11, 12, 13], "g1"))
        victim.flush()
        wait_for(lambda: per_location(svc, [11, 12, 13]) == {f"{VICTIM}/g1": 3}, what="victim indexed")
        assert svc.origins.origin_of(VICTIM) == f"nats:kvadvisor.events.{ns1}.{VICTIM}"

        # same name, new epoch, from another namespace (another subject)
        forger.publish(chain([11, 12, 13, 14], "g2"))
        forger.flush()
        wait_for(lambda: svc.counters["origin_refused"] >= 1, what="forged batch refused")
        # same namespace, a subject of its own carrying the victim's name
        _forge_on_subject(nats_url, f"kvadvisor.events.{ns1}.mallory",
                          EventBatch(1, VICTIM, 3, 0, time.time_ns(), chain([11, 12, 13, 14, 15], "g2")))
        wait_for(lambda: svc.counters["origin_refused"] >= 2, what="forged subject refused")
        assert _refused(svc, "nats") >= 2
        assert per_location(svc, [11, 12, 13, 14, 15]) == {f"{VICTIM}/g1": 3}
        victim.publish(chain([11, 12, 13, 14], "g1"))
        victim.flush()
        wait_for(lambda: per_location(svc, [11, 12, 13, 14]) == {f"{VICTIM}/g1": 4}, what="victim's later batch")
        position = svc.position
        svc.stop()

        svc = advisor(settings(tmp_path, [url2]))  # the forger's namespace only
        refused_before = svc.counters["origin_refused"]
        forger.publish(chain([11, 12, 13, 14, 15, 16], "g2"))
        forger.flush()
        wait_for(lambda: svc.counters["origin_refused"] > refused_before, what="refused after restart")
        time.sleep(0.5)  # time passes: a forged batch applied by mistake would show below
        assert svc.position == position
        assert per_location(svc, [11, 12, 13, 14]) == {f"{VICTIM}/g1": 4}
    finally:
        victim.close()
        forger.close()


def test_jetstream_forged_epoch_from_another_namespace_is_refused_after_restart_too(
    tmp_path: Path, advisor: Any, js_url: str
) -> None:
    base = js_url.replace("nats://", "jetstream://")
    url1, url2 = f"{base}?namespace=js1&durable=d1", f"{base}?namespace=js2&durable=d2"
    svc = advisor(settings(tmp_path, [url1, url2]))
    victim = make_publisher(url1, VICTIM, config=ONE, epoch=1)
    forger = make_publisher(url2, VICTIM, config=ONE, epoch=2)
    try:
        victim.publish(chain([31, 32], "g1"))
        victim.flush()
        wait_for(lambda: per_location(svc, [31, 32]) == {f"{VICTIM}/g1": 2}, what="victim indexed")
        forger.publish(chain([31, 32, 33], "g2"))
        forger.flush()
        wait_for(lambda: svc.counters["origin_refused"] >= 1, what="forged batch refused")
        assert per_location(svc, [31, 32, 33]) == {f"{VICTIM}/g1": 2}
        victim.publish(chain([31, 32, 33], "g1"))
        victim.flush()
        wait_for(lambda: per_location(svc, [31, 32, 33]) == {f"{VICTIM}/g1": 3}, what="victim's later batch")
        position = svc.position
        svc.stop()
        svc = advisor(settings(tmp_path, [url2]))
        forger.publish(chain([31, 32, 33, 34], "g2"))
        forger.flush()
        wait_for(lambda: svc.counters["origin_refused"] >= 1, what="refused after restart")
        time.sleep(0.5)  # time passes: a forged batch applied by mistake would show below
        assert svc.position == position and per_location(svc, [31, 32, 33]) == {f"{VICTIM}/g1": 3}
    finally:
        victim.close()
        forger.close()


def test_a_binding_that_cannot_be_recorded_refuses_the_batch() -> None:
    from event_plane.origins import OriginGuard

    def broken(_source: str, _origin: str) -> None:
        raise OSError("disk full")

    refusals: list[tuple[str, str]] = []
    guard = OriginGuard(on_bind=broken, on_refuse=lambda t, o: refusals.append((t, o)))
    assert guard.admit("w0", "zmq:tcp://127.0.0.1:1") is False
    assert (guard.store_errors, guard.refused, guard.origin_of("w0")) == (1, 0, None)
    guard = OriginGuard({"w0": "nats:kvadvisor.events.a.w0"}, on_refuse=lambda t, o: refusals.append((t, o)))
    assert guard.admit("w0", "nats:kvadvisor.events.a.w0") is True
    assert guard.admit("w0", "nats:kvadvisor.events.b.w0") is False
    assert guard.admit("w0", "tcp:elsewhere") is False
    assert refusals == [("nats", "nats:kvadvisor.events.b.w0"), ("other", "tcp:elsewhere")]
    assert guard.release("w0") and not guard.release("w0")
    assert guard.admit("w0", "tcp:elsewhere") is True and guard.bindings() == {"w0": "tcp:elsewhere"}


def test_operator_lists_and_releases_bindings_of_a_stopped_advisor(tmp_path: Path, advisor: Any) -> None:
    import json

    from typer.testing import CliRunner

    from kvadvisor.cli import app

    at = _zmq_url()
    s = settings(tmp_path, [at])
    pub = make_publisher(at, VICTIM, config=ONE)
    try:
        svc = advisor(s)
        pub.publish(chain([41], "g1"))
        pub.flush()
        wait_for(lambda: per_location(svc, [41]) == {f"{VICTIM}/g1": 1}, what="indexed")
        svc.stop()
    finally:
        pub.close()
    cfg = tmp_path / "advisor.json"
    cfg.write_text(s.model_dump_json())
    listed = CliRunner().invoke(app, ["advisor", "origins", "--config", str(cfg)])
    assert listed.exit_code == 0, listed.output
    origin = f"zmq:{at.split('?')[0].replace('zmq://', 'tcp://')}"
    assert json.loads(listed.stdout)["bindings"] == {VICTIM: origin}
    gone = CliRunner().invoke(app, ["advisor", "origins", "--config", str(cfg), "--release", VICTIM, "--release", "nope"])
    assert gone.exit_code == 1
    report = json.loads(gone.stdout)
    assert (report["bindings"], report["released"], report["not_bound"]) == ({}, [VICTIM], ["nope"])
    assert advisor(s).origins.origin_of(VICTIM) is None  # the next start has no binding for it


def test_nats_embedded_refuses_a_source_that_is_not_its_subjects(tmp_path: Path, advisor: Any, nats_url: str) -> None:
    """Under per-user permissions w0 may publish only on its own subject, but may put any
    source name in its batches: a batch naming ``w1`` on w0's subject must not bind ``w1``
    (the real w1 would then be refused for good); it is refused and counted."""
    ns = "sq" + secrets.token_hex(3)
    url = f"{nats_url}?namespace={ns}"
    svc = advisor(settings(tmp_path, [url]))
    w1 = make_publisher(url, "w1", config=ONE, epoch=1)
    try:
        deadline = time.monotonic() + 15
        while svc.counters["origin_refused"] == 0 and time.monotonic() < deadline:  # the SUB may join late
            _forge_on_subject(nats_url, f"kvadvisor.events.{ns}.w0",
                              EventBatch(1, "w1", 9, 0, time.time_ns(), chain([41, 42], "g1")))
            time.sleep(0.2)
        assert svc.counters["origin_refused"] >= 1 and _refused(svc, "nats") >= 1
        assert svc.origins.origin_of("w1") is None
        assert per_location(svc, [41, 42]) == {}
        w1.publish(chain([41, 42, 43], "g1"))
        w1.flush()
        wait_for(lambda: per_location(svc, [41, 42, 43]) == {"w1/g1": 3}, what="the real w1 indexed")
        assert svc.origins.origin_of("w1") == f"nats:kvadvisor.events.{ns}.w1"
    finally:
        w1.close()
