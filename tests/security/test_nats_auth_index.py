"""A NATS server with authorization and per-user subject permissions, and the advisor's
real ingest path: publishers without credentials or with wrong ones get nothing into the
index; a user publishing under a source name it may not use gets nothing in; a user
that forges another source's name on its own subject is refused by the origin binding;
a publisher with its credentials is indexed."""

from __future__ import annotations

import asyncio
import secrets
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import nats
import pytest
from security_fixtures import advisor  # noqa: F401 - fixture
from security_helpers import chain, nats_server, per_location, settings, wait_for

from event_plane import PublisherConfig, TransportError, make_publisher
from event_plane.codec import encode_batch
from event_plane.schema import EventBatch

ONE = PublisherConfig(max_events=1, max_delay_s=0.05)
NS = "sec"


@pytest.fixture()
def passwords() -> dict[str, str]:
    return {user: f"pw-{user}-" + secrets.token_hex(8) for user in ("w0", "w1", "advisor")}


@pytest.fixture()
def server(tmp_path: Path, passwords: dict[str, str]) -> Iterator[int]:
    """Each worker may publish on its own source's subject only; the advisor may read all."""
    users = []
    for worker in ("w0", "w1"):
        users.append(f'{{ user: {worker}, password: "{passwords[worker]}", permissions: {{ '
                     f'publish: ["kvadvisor.events.{NS}.{worker}"], subscribe: ["_INBOX.>"] }} }}')
    users.append(f'{{ user: advisor, password: "{passwords["advisor"]}", permissions: {{ '
                 f'publish: ["_INBOX.>"], subscribe: ["kvadvisor.events.>", "_INBOX.>"] }} }}')
    yield from nats_server(tmp_path, "authorization { users = [\n" + "\n".join(users) + "\n] }\n")


def test_only_authenticated_permitted_publishers_reach_the_index(
    tmp_path: Path, advisor: Any, server: int, passwords: dict[str, str]
) -> None:
    base = f"127.0.0.1:{server}"
    svc = advisor(settings(tmp_path, [f"nats://{base}?namespace={NS}"], nats_user="advisor",
                           nats_password=passwords["advisor"]))

    # no credentials, or a wrong password: the server refuses the connection
    with pytest.raises(TransportError, match="(?i)authorization"):
        make_publisher(f"nats://{base}?namespace={NS}", "w0", connect_timeout_s=2)
    with pytest.raises(TransportError, match="(?i)authorization"):
        make_publisher(f"nats://w0:wrong-{secrets.token_hex(4)}@{base}?namespace={NS}", "w0", connect_timeout_s=2)

    async def raw_without_credentials() -> None:
        await nats.connect(f"nats://{base}", connect_timeout=2, allow_reconnect=False, max_reconnect_attempts=0)

    with pytest.raises(Exception, match="(?i)authorization"):
        asyncio.run(raw_without_credentials())

    # w0's credentials, but publishing under w1's name: the subject is not w0's, the
    # server drops the messages
    sneaky = make_publisher(f"nats://w0:{passwords['w0']}@{base}?namespace={NS}", "w1", config=ONE)
    try:
        sneaky.publish(chain([50, 51], "g1"))
        sneaky.flush()
    finally:
        sneaky.close()
    time.sleep(1.0)  # time passes: a batch let in by mistake would show below
    assert svc.position == 0 and per_location(svc, [50, 51]) == {}

    # with their credentials, w0 and w1 are indexed
    w0 = make_publisher(f"nats://w0:{passwords['w0']}@{base}?namespace={NS}", "w0", config=ONE)
    w1 = make_publisher(f"nats://w1:{passwords['w1']}@{base}?namespace={NS}", "w1", config=ONE, epoch=1)
    try:
        w0.publish(chain([1, 2, 3], "g1"))
        w1.publish(chain([21, 22], "g1"))
        w0.flush()
        w1.flush()
        wait_for(lambda: per_location(svc, [1, 2, 3]) == {"w0/g1": 3} and per_location(svc, [21, 22]) == {"w1/g1": 2},
                 what="authenticated publishers indexed")
        position = svc.position

        # w0 forges w1's name (new epoch) on the one subject it may use: the origin binding
        # (w1 is bound to kvadvisor.events.sec.w1) refuses it
        async def forge() -> None:
            nc = await nats.connect(f"nats://w0:{passwords['w0']}@{base}")
            batch = EventBatch(1, "w1", 2, 0, time.time_ns(), chain([21, 22, 23], "g2"))
            await nc.publish(f"kvadvisor.events.{NS}.w0", encode_batch(batch))
            await nc.flush()
            await nc.close()

        asyncio.run(forge())
        wait_for(lambda: svc.counters["origin_refused"] == 1, what="forged name refused")
        assert svc.position == position
        assert per_location(svc, [21, 22, 23]) == {"w1/g1": 2}
        w1.publish(chain([21, 22, 23], "g1"))
        w1.flush()
        wait_for(lambda: per_location(svc, [21, 22, 23]) == {"w1/g1": 3}, what="w1's later batch")
    finally:
        w0.close()
        w1.close()
    # nothing from the refused publishers ever reached the index
    assert per_location(svc, [50, 51]) == {}
