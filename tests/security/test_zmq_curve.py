"""ZMQ CURVE on the event sockets, over real ZMQ: only a publisher on the advisor's
allowed list gets batches into its index; secret key files must be private; gap replay
works over CURVE; ``kvadvisor events keygen`` writes a usable keypair."""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any
from urllib.parse import quote

import pytest
import zmq.auth
import zmq.utils.z85
from security_fixtures import advisor, keys  # noqa: F401 - fixtures
from security_helpers import chain, per_location, settings, wait_for
from typer.testing import CliRunner

from advisor.settings import SettingsError
from event_plane import EventURLError, PublisherConfig, make_publisher, subscribe
from event_plane.curve import load_secret
from event_plane.errors import ConfigError
from event_plane.schema import EventBatch
from event_plane.zmq_transport import ZmqPublisher
from kvadvisor.cli import app
from storage_backends.local_s3 import free_port

ONE = PublisherConfig(max_events=1, max_delay_s=0.05)


def _pub(url: str, source: str, **kw: Any) -> Any:
    return make_publisher(url, source, config=ONE, **kw)


def test_only_a_publisher_on_the_allowed_list_gets_into_the_index(tmp_path: Path, keys: Any, advisor: Any) -> None:
    good_pub, good_sec = keys("good")
    evil_pub, evil_sec = keys("evil")
    port, replay = free_port(), free_port()
    at = f"zmq://127.0.0.1:{port}?replay={replay}"
    svc = advisor(settings(tmp_path, [f"{at}&curve_server_key={good_pub}"],
                           zmq_allowed_publishers=str(tmp_path / "good")))

    # a publisher with its own key (not the one the advisor expects) takes the endpoint:
    # the CURVE handshake fails, live batches and replays alike
    evil = _pub(f"{at}&curve_secret={evil_sec}", "w-evil")
    try:
        for h in range(3):
            evil.publish(chain([100 + h], "g1"))
        evil.flush()
        time.sleep(2.5)  # several idle probes of the replay socket
    finally:
        evil.close()
    # a publisher without CURVE at the same endpoint: nothing either
    plain = _pub(at, "w-plain")
    try:
        for h in range(3):
            plain.publish(chain([200 + h], "g1"))
        plain.flush()
        time.sleep(2.5)
    finally:
        plain.close()
    assert svc.position == 0 and svc.subscriber.stats().batches == 0
    assert per_location(svc, [100]) == {} and per_location(svc, [200]) == {}

    # the allowed publisher: its batches (sent before and after it was found) are indexed
    good = _pub(f"{at}&curve_secret={good_sec}", "w-good")
    try:
        good.publish(chain([1, 2, 3], "g1"))
        good.flush()
        wait_for(lambda: per_location(svc, [1, 2, 3]) == {"w-good/g1": 3}, what="allowed publisher indexed")
        good.publish(chain([1, 2, 3, 4], "g2"))
        good.flush()
        wait_for(lambda: per_location(svc, [1, 2, 3, 4]) == {"w-good/g1": 3, "w-good/g2": 4})
    finally:
        good.close()
    assert per_location(svc, [100]) == {} and per_location(svc, [200]) == {}


def test_a_url_naming_a_key_off_the_list_or_no_key_is_refused(tmp_path: Path, keys: Any, advisor: Any) -> None:
    good_pub, _ = keys("good")
    evil_pub, _ = keys("evil")
    at = f"zmq://127.0.0.1:{free_port()}?replay={free_port()}"
    allowed = str(tmp_path / "good")
    with pytest.raises(EventURLError, match="not on the allowed publishers list"):
        subscribe(f"{at}&curve_server_key={evil_pub}", zmq_allowed_publishers=allowed)
    with pytest.raises(EventURLError, match="not on the allowed publishers list"):
        subscribe(f"{at}&curve_server_key={evil_pub}&allowed_publishers={allowed}")
    with pytest.raises(EventURLError, match="no curve_server_key"):
        subscribe(at, zmq_allowed_publishers=allowed)
    with pytest.raises(EventURLError, match="no CURVE key"):
        subscribe(f"vllm+zmq://127.0.0.1:{free_port()}?source=v", zmq_allowed_publishers=allowed)
    # the key may also be given inline (Z85 percent-encoded, or hex), checked the same way
    z85 = zmq.auth.load_certificate(str(good_pub))[0]
    subscribe(f"{at}&curve_server_key={quote(z85.decode(), safe='')}", zmq_allowed_publishers=allowed).close()
    subscribe(f"{at}&curve_server_key={zmq.utils.z85.decode(z85).hex()}", zmq_allowed_publishers=allowed).close()
    evil_hex = zmq.utils.z85.decode(zmq.auth.load_certificate(str(evil_pub))[0]).hex()
    with pytest.raises(EventURLError, match="not on the allowed publishers list"):
        subscribe(f"{at}&curve_server_key={evil_hex}", zmq_allowed_publishers=allowed)
    # the advisor refuses to start rather than ingest from a publisher off the list
    with pytest.raises(EventURLError, match="not on the allowed publishers list"):
        advisor(settings(tmp_path, [f"{at}&curve_server_key={evil_pub}"], zmq_allowed_publishers=allowed))


def test_world_readable_secret_key_files_are_refused(tmp_path: Path, keys: Any) -> None:
    pub_file, sec_file = keys("w")
    secret = load_secret(sec_file).secret.decode()
    os.chmod(sec_file, 0o644)
    at = f"zmq://127.0.0.1:{free_port()}?replay={free_port()}"
    with pytest.raises(EventURLError, match="chmod 600") as info:
        make_publisher(f"{at}&curve_secret={sec_file}", "w0")
    assert secret not in str(info.value)
    with pytest.raises(EventURLError, match="chmod 600"):
        subscribe(f"{at}&curve_server_key={pub_file}&curve_secret={sec_file}")
    with pytest.raises(ConfigError, match="chmod 600"):
        load_secret(sec_file)
    with pytest.raises((SettingsError, ValueError), match="chmod 600"):
        settings(tmp_path, [], zmq_curve_secret_file=str(sec_file))
    os.chmod(sec_file, 0o640)  # group-readable is refused too
    with pytest.raises(ConfigError, match="0640"):
        load_secret(sec_file)
    os.chmod(sec_file, 0o600)
    assert load_secret(sec_file).secret.decode() == secret
    assert secret not in repr(load_secret(sec_file))
    # a public key file is not a secret key
    with pytest.raises(EventURLError, match="no secret key"):
        os.chmod(pub_file, 0o600)
        make_publisher(f"{at}&curve_secret={pub_file}", "w0")


def test_curve_publisher_may_bind_beyond_loopback_without_allow_remote(keys: Any) -> None:
    _, sec = keys("w")
    with pytest.raises(EventURLError, match="allow_remote=1"):
        make_publisher(f"zmq://0.0.0.0:{free_port()}", "w0")
    pub = make_publisher(f"zmq://0.0.0.0:{free_port()}?curve_secret={sec}", "w0")
    pub.close()


class _LossyPublisher(ZmqPublisher):
    """Batches whose seq is in ``skip_live`` go to the replay buffer only (lost on the PUB)."""

    skip_live: set[int] = set()

    def _send(self, batch: EventBatch, payload: bytes) -> None:
        if batch.seq in self.skip_live:
            with self._buffer_lock:
                self._buffer.append((batch.seq, payload))
            return
        super()._send(batch, payload)


def test_gap_replay_works_over_curve_and_checks_client_keys(tmp_path: Path, keys: Any) -> None:
    server_pub, server_sec = keys("server")
    client_pub, client_sec = keys("client")
    port, replay = free_port(), free_port()
    pub = _LossyPublisher("w0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}", config=ONE,
                          curve=load_secret(server_sec), curve_clients=str(tmp_path / "client"))
    pub.skip_live = {3, 4, 5}
    at = f"zmq://127.0.0.1:{port}?replay={replay}&curve_server_key={server_pub}"
    sub = subscribe(f"{at}&curve_secret={client_sec}")
    stranger = subscribe(at)  # CURVE with a fresh key: not among the publisher's clients
    sub.start()
    stranger.start()
    try:
        time.sleep(0.3)
        for i in range(8):
            pub.publish([chain([1000 + i], "g1")[0]])
        pub.flush()
        got = sub.get_many(8, 15.0)
        assert [b.seq for b in got] == list(range(8))
        assert [b.events[0].sequence_hash for b in got] == [1000 + i for i in range(8)]
        st = sub.stats()
        assert (st.gaps, st.replayed, st.unrecovered) == (1, 3, 0)
        assert pub.replay_stats()["served"] >= 1
        assert stranger.get_many(1, 1.5) == []
    finally:
        sub.close()
        stranger.close()
        pub.close()


def test_keygen_command_writes_a_private_keypair(tmp_path: Path) -> None:
    out = tmp_path / "keys"
    result = CliRunner().invoke(app, ["events", "keygen", str(out), "--name", "worker1"])
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    public, secret = zmq.auth.load_certificate(str(out / "worker1.key_secret"))
    assert report["public_key"] == public.decode() and secret.decode() not in result.output
    assert os.stat(out / "worker1.key_secret").st_mode & 0o777 == 0o600
    assert zmq.auth.load_certificate(str(out / "worker1.key"))[1] is None  # the public file has no secret
    assert [p.name for p in out.iterdir()] == sorted(["worker1.key", "worker1.key_secret"]) or \
        sorted(p.name for p in out.iterdir()) == ["worker1.key", "worker1.key_secret"]
    again = CliRunner().invoke(app, ["events", "keygen", str(out), "--name", "worker1"])
    assert again.exit_code == 2 and "already exists" in again.output
    assert load_secret(out / "worker1.key_secret").public == public
