"""Event URLs: what each scheme builds, and clear errors for bad ones."""

from __future__ import annotations

import pytest

from event_plane import (
    EventURLError,
    MultiSubscriber,
    NatsSubscriber,
    NullPublisher,
    ZmqPublisher,
    ZmqSubscriber,
    make_publisher,
    subscribe,
)
from event_plane.nats_transport import JetStreamSubscriber
from storage_backends.local_s3 import free_port


@pytest.mark.parametrize(
    "url",
    [
        "http://127.0.0.1:1",
        "zmq://127.0.0.1",  # no port
        "zmq://127.0.0.1:x",
        "zmq://127.0.0.1:5557?replay=abc",
        "zmq://127.0.0.1:5557?bogus=1",
        "nats://127.0.0.1:4222?topic=x",
        "nats://127.0.0.1:4222?namespace=a&namespace=b",
        "",
    ],
)
def test_bad_urls_raise_event_url_error(url: str) -> None:
    with pytest.raises(EventURLError):
        make_publisher(url, "w0")
    with pytest.raises(EventURLError):
        subscribe(url)


def test_subscriber_needs_concrete_host_and_no_null() -> None:
    with pytest.raises(EventURLError):
        subscribe("zmq://*:5557")
    with pytest.raises(EventURLError):
        subscribe("null://")
    with pytest.raises(EventURLError):
        subscribe([])


def test_null_and_zmq_publishers_from_urls() -> None:
    assert isinstance(make_publisher("null://", "w0"), NullPublisher)
    port, replay = free_port(), free_port()
    pub = make_publisher(f"zmq://127.0.0.1:{port}?replay={replay}&topic=kv@podA", "w0", epoch=5)
    try:
        assert isinstance(pub, ZmqPublisher)
        assert pub.endpoint == f"tcp://127.0.0.1:{port}"
        assert pub.replay_endpoint == f"tcp://127.0.0.1:{replay}"
        assert pub.topic == b"kv@podA" and pub.epoch == 5
    finally:
        pub.close()


def test_subscribe_builds_the_right_kinds() -> None:
    assert isinstance(subscribe("zmq://127.0.0.1:1?replay=2"), ZmqSubscriber)
    assert type(subscribe("nats://127.0.0.1:4222?namespace=ns")) is NatsSubscriber
    js = subscribe("jetstream://127.0.0.1:4222?namespace=ns&durable=d1")
    assert isinstance(js, JetStreamSubscriber) and js.subject == "kvadvisor.events.ns.>"
    multi = subscribe(["zmq://127.0.0.1:1", "nats://127.0.0.1:4222"])
    assert isinstance(multi, MultiSubscriber)


@pytest.mark.parametrize("value", ["0", "-1", "x", "", "inf", "nan"])
def test_replay_timeout_must_be_positive_seconds(value: str) -> None:
    for scheme in ("zmq", "vllm+zmq"):
        with pytest.raises(EventURLError, match="replay_timeout"):
            subscribe(f"{scheme}://127.0.0.1:5557?replay=5558&replay_timeout={value}")


def test_replay_timeout_reaches_zmq_and_adapter_subscribers_and_is_not_a_publisher_parameter() -> None:
    for scheme in ("zmq", "vllm+zmq", "sglang+zmq"):
        sub = subscribe(f"{scheme}://127.0.0.1:5557?replay=5558&replay_timeout=7.5")
        assert sub._replay_timeout_s == 7.5
    assert subscribe("zmq://127.0.0.1:5557?replay=5558")._replay_timeout_s == 2.0
    with pytest.raises(EventURLError, match="subscriber parameter"):
        make_publisher(f"zmq://127.0.0.1:{free_port()}?replay_timeout=1", "w0")
