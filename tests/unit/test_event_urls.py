"""Event URLs: what each scheme builds, and clear errors for bad ones."""

from __future__ import annotations

import pytest

from event_plane import (
    ConfigError,
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


@pytest.mark.parametrize(
    ("query", "name"),
    [
        ("max_bytes=0", "max_bytes"),
        ("max_bytes=-1", "max_bytes"),
        ("max_bytes=1.5", "max_bytes"),
        ("max_bytes=1GiB", "max_bytes"),
        ("max_bytes=", "max_bytes"),
        ("max_age=0", "max_age"),
        ("max_age=-3", "max_age"),
        ("max_age=inf", "max_age"),
        ("max_age=nan", "max_age"),
        ("max_age=1h", "max_age"),
        ("discard=oldest", "discard"),
        ("strict_stream=maybe", "strict_stream"),
    ],
)
def test_bad_stream_parameters_are_refused_before_connecting(query: str, name: str) -> None:
    url = f"jetstream://127.0.0.1:{free_port()}?namespace=ns&{query}"  # nothing listens there
    with pytest.raises(EventURLError, match=name):
        make_publisher(url, "w0")
    with pytest.raises(EventURLError, match=name):
        subscribe(url)


@pytest.mark.parametrize("query", ["max_bytes=1024", "max_age=60", "discard=new", "strict_stream=1"])
def test_stream_parameters_belong_to_jetstream_urls_only(query: str) -> None:
    with pytest.raises(EventURLError, match="unknown parameter"):
        make_publisher(f"nats://127.0.0.1:4222?{query}", "w0")
    with pytest.raises(EventURLError, match="unknown parameter"):
        subscribe(f"zmq://127.0.0.1:5557?{query}")


def test_stream_parameters_reach_the_jetstream_subscriber_over_the_given_limits() -> None:
    from event_plane import StreamLimits

    default = subscribe("jetstream://127.0.0.1:4222?namespace=ns")
    assert default.stream_limits == StreamLimits(1 << 30, 24 * 3600.0, "old", False)
    base = StreamLimits(max_bytes=4096, max_age_s=30.0, discard="new")
    sub = subscribe("jetstream://127.0.0.1:4222?namespace=ns&max_age=unlimited&strict_stream=true", stream=base)
    assert sub.stream_limits == StreamLimits(max_bytes=4096, max_age_s=None, discard="new", strict=True)
    sub = subscribe("jetstream://127.0.0.1:4222?max_bytes=unlimited&max_age=90.5&discard=old&strict_stream=0",
                    stream=base)
    assert sub.stream_limits == StreamLimits(max_bytes=None, max_age_s=90.5, discard="old", strict=False)
    # other schemes ignore ``stream`` (the advisor passes its settings to every URL)
    assert isinstance(subscribe(["zmq://127.0.0.1:1", "nats://127.0.0.1:4222"], stream=base), MultiSubscriber)


@pytest.mark.parametrize(
    "kwargs",
    [{"max_bytes": 0}, {"max_bytes": -1}, {"max_bytes": 1.5}, {"max_bytes": True}, {"max_age_s": 0},
     {"max_age_s": float("inf")}, {"max_age_s": float("nan")}, {"max_age_s": "60"}, {"discard": "NEW"},
     {"strict": 1}],
)
def test_stream_limits_refuse_bad_values(kwargs: dict) -> None:
    from event_plane import ConfigError, StreamLimits

    with pytest.raises(ConfigError, match=next(iter(kwargs)).split("_s")[0]):
        StreamLimits(**kwargs)


@pytest.mark.parametrize("host", ["*", "0.0.0.0", "[::]", "10.1.2.3", "192.168.0.7", "eth0", "example.com"])
def test_zmq_publisher_refuses_a_host_other_machines_reach_without_allow_remote(host: str) -> None:
    """The ZMQ sockets have no authentication: a bind beyond loopback needs an explicit
    opt-in, and the error says how and why; nothing is bound."""
    port = free_port()
    with pytest.raises(EventURLError, match="allow_remote=1") as err:
        make_publisher(f"zmq://{host}:{port}?replay={free_port()}", "w0")
    assert "authentication" in str(err.value)
    with pytest.raises(ConfigError, match="allow_remote=True"):
        ZmqPublisher("w0", f"tcp://{host}:{port}")


def test_zmq_publisher_binds_loopback_by_default_and_any_host_when_allowed() -> None:
    for host in ("127.0.0.1", "localhost", "127.0.0.2"):
        pub = make_publisher(f"zmq://{host}:{free_port()}?replay={free_port()}", "w0")
        pub.close()
    with pytest.raises(EventURLError, match="allow_remote=1"):
        make_publisher(f"zmq://0.0.0.0:{free_port()}?replay={free_port()}&allow_remote=0", "w0")
    port = free_port()
    pub = make_publisher(f"zmq://*:{port}?replay={free_port()}&allow_remote=1", "w0")
    try:
        assert pub.endpoint == f"tcp://0.0.0.0:{port}"
    finally:
        pub.close()
    with pytest.raises(EventURLError, match="allow_remote must be 1 or 0"):
        make_publisher(f"zmq://*:{free_port()}?allow_remote=maybe", "w0")
    with pytest.raises(EventURLError, match="publisher parameter"):
        subscribe("zmq://10.0.0.5:5557?replay=5558&allow_remote=1")


@pytest.mark.parametrize(
    ("endpoint", "loopback"),
    [("tcp://127.0.0.1:5557", True), ("tcp://127.9.9.9:*", True), ("tcp://localhost:1", True),
     ("tcp://[::1]:1", True), ("ipc:///tmp/x", True), ("inproc://x", True), ("tcp://*:1", False),
     ("tcp://0.0.0.0:1", False), ("tcp://[::]:1", False), ("tcp://10.0.0.1:1", False), ("tcp://eth0:1", False),
     ("udp://127.0.0.1:1", False)],
)
def test_is_loopback_endpoint(endpoint: str, loopback: bool) -> None:
    from event_plane.zmq_transport import is_loopback_endpoint

    assert is_loopback_endpoint(endpoint) is loopback
