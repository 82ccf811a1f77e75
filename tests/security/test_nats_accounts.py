"""Scaled mode's NATS is not an open admin plane (docs/security.md "Scaled mode"), over a real
3-node JetStream cluster on loopback with the authorization ``kvadvisor up`` ships
(:class:`kvadvisor.localcluster.NatsCluster`: an ``advisor`` user, one user per worker).

Each attack is tried by a client without credentials and by worker ``w0``, against the
authorized cluster (refused) and against the same cluster without authorization (where it
works: what today's ``main`` shipped), so every test shows what the authorization stops:

* purge or delete the event stream, read another worker's batches from it;
* bind, rewrite or delete the lease bucket;
* answer ``kvadvisor.query.*`` requests (forged answers to the cluster API);
* publish on another worker's subject.

Two more hold with or without authorization (on main the first failed on both clusters,
the second on the authorized one): a worker that sends the ``Nats-Msg-Id`` s of another
worker's next batches first (ids as they were: namespace, source, epoch, seq) does not get
the victim's batches dropped as duplicates; and a JetStream publisher calls no JetStream
API at start, so a worker user (which has no right to it) publishes.
"""

from __future__ import annotations

import asyncio
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import msgspec
import nats
import pytest
from security_helpers import as_advisor, chain

from advisor.cluster.node import ClusterClient, PartitionUnavailable, query_subject
from event_plane import PublisherConfig, make_publisher
from event_plane.codec import encode_batch
from event_plane.config import StreamLimits
from event_plane.nats_transport import STREAM_NAME, connect_nats, ensure_stream, subject_for
from event_plane.partition import PartitionScheme
from event_plane.schema import EventBatch
from kvadvisor.localcluster import NatsCluster

BUCKET = "KVADVISOR_LEASES"
NS = "sec"
ONE = PublisherConfig(max_events=1, max_delay_s=0.05)
REFUSED_S = 2.0  # a refused JetStream API request gets no answer: the client gives up after this


async def _quiet(exc: Exception) -> None:
    pass


@pytest.fixture(scope="module", params=["authorized", "open"])
def cluster(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[NatsCluster]:
    """The 3-node cluster with the stream and the lease bucket an advisor made, and
    workers ``w0`` and ``w1``; ``open``: the same without authorization."""
    auth = request.param == "authorized"
    root = tmp_path_factory.mktemp(f"nats-{request.param}")
    with NatsCluster(root, nodes=3, auth=auth, workers=["w0", "w1"]) as c:

        async def setup() -> None:
            nc = await connect_nats(c.advisor_url, 5.0, {})
            js = nc.jetstream()
            await ensure_stream(js, StreamLimits(replicas=3))
            kv = await js.create_key_value(bucket=BUCKET, replicas=3)
            await kv.put("p0", b"advisor-0")
            await nc.close()

        asyncio.run(setup())
        yield c


def _authorized(c: NatsCluster) -> bool:
    return c.users is not None


async def _attacker(c: NatsCluster, who: str) -> Any:
    """A connection as ``who`` (``anonymous`` or ``w0``); raises when the server refuses it."""
    url = c.url if who == "anonymous" else c.worker_url("w0")
    return await connect_nats(url, 3.0, {"error_cb": _quiet, "allow_reconnect": False})


def _attack(c: NatsCluster, who: str, act: Any) -> str:
    """Run ``act(nc)`` as ``who``: ``"done"``, or why not (``"no connection"``, the error)."""

    async def run() -> str:
        try:
            nc = await _attacker(c, who)
        except Exception:  # noqa: BLE001 - the server refused the connection
            return "no connection"
        try:
            await act(nc)
            await nc.flush(timeout=5)
            return "done"
        except Exception as exc:  # noqa: BLE001 - refused
            return type(exc).__name__
        finally:
            await nc.close()

    if who == "w0":
        c.worker_url("w0")  # the worker user exists (sync: reloads the servers)
    return asyncio.run(run())


def _batch(source: str, epoch: int, seq: int) -> bytes:
    return encode_batch(EventBatch(1, source, epoch, seq, 1, []))


WHO = ["anonymous", "w0"]


def test_a_client_without_credentials_is_refused(cluster: NatsCluster) -> None:
    got = _attack(cluster, "anonymous", lambda nc: nc.flush())
    assert got == ("no connection" if _authorized(cluster) else "done")


@pytest.mark.parametrize("who", WHO)
def test_no_one_but_an_advisor_purges_deletes_or_reads_the_stream(cluster: NatsCluster, who: str) -> None:
    async def seed(nc: Any) -> int:
        await nc.jetstream().publish(subject_for(NS, "w1"), _batch("w1", 5, 0))
        return int((await nc.jetstream().stream_info(STREAM_NAME)).state.messages)

    before = as_advisor(cluster, seed)
    assert before > 0
    read = _attack(cluster, who, lambda nc: nc.jetstream(timeout=REFUSED_S).get_last_msg(STREAM_NAME,
                                                                                          subject_for(NS, "w1")))
    purged = _attack(cluster, who, lambda nc: nc.jetstream(timeout=REFUSED_S).purge_stream(STREAM_NAME))
    after_purge = as_advisor(cluster, lambda nc: nc.jetstream().stream_info(STREAM_NAME))
    if _authorized(cluster):
        assert read != "done" and purged != "done"
        assert after_purge.state.messages >= before  # nothing lost
        deleted = _attack(cluster, who, lambda nc: nc.jetstream(timeout=REFUSED_S).delete_stream(STREAM_NAME))
        assert deleted != "done"
        assert as_advisor(cluster, lambda nc: nc.jetstream().stream_info(STREAM_NAME)).config.name == STREAM_NAME
    else:
        assert read == "done" and purged == "done" and after_purge.state.messages == 0


@pytest.mark.parametrize("who", WHO)
def test_no_one_but_an_advisor_touches_the_lease_bucket(cluster: NatsCluster, who: str) -> None:
    async def rewrite(nc: Any) -> None:
        kv = await nc.jetstream(timeout=REFUSED_S).key_value(BUCKET)
        await kv.put("p0", b"intruder")

    async def raw_put(nc: Any) -> None:  # the KV write without the JetStream API: a plain publish
        await nc.publish(f"$KV.{BUCKET}.p0", b"intruder")

    async def lease(nc: Any) -> bytes:
        return bytes((await (await nc.jetstream().key_value(BUCKET)).get("p0")).value)

    results = [_attack(cluster, who, rewrite), _attack(cluster, who, raw_put)]
    held = as_advisor(cluster, lease)
    if _authorized(cluster):
        assert results[0] != "done" and held == b"advisor-0"
        gone = _attack(cluster, who, lambda nc: nc.jetstream(timeout=REFUSED_S).delete_key_value(BUCKET))
        assert gone != "done"
        assert as_advisor(cluster, lease) == b"advisor-0"
    else:
        assert results == ["done", "done"] and held == b"intruder"
        as_advisor(cluster, lambda nc: _put_back(nc))


async def _put_back(nc: Any) -> None:
    await (await nc.jetstream().key_value(BUCKET)).put("p0", b"advisor-0")


@pytest.mark.parametrize("who", WHO)
def test_no_one_but_an_advisor_answers_queries(cluster: NatsCluster, who: str) -> None:
    ns = "q" + uuid.uuid4().hex[:8]
    forged = msgspec.msgpack.encode({"locations": {"fast": 64}, "position": 1, "any": 64})

    async def forge(nc: Any) -> None:
        async def reply(msg: Any) -> None:
            await msg.respond(forged)

        await nc.subscribe(query_subject(ns, 0), cb=reply)
        await nc.flush(timeout=5)
        loop = asyncio.get_running_loop()
        # ask while the forger listens (the client is synchronous: it runs in a thread)
        out = await loop.run_in_executor(None, _ask, cluster, ns)
        answers.append(out)

    answers: list[Any] = []
    got = _attack(cluster, who, forge)
    if _authorized(cluster):
        assert got == "no connection" or answers == ["no owner"], (got, answers)
    else:
        assert got == "done" and answers == [{"fast": 64}]


def _ask(c: NatsCluster, ns: str) -> Any:
    client = ClusterClient(c.advisor_url, PartitionScheme(partitions=1), ns, timeout_s=3.0)
    try:
        return client.ask(0, [1, 2, 3])[0]
    except PartitionUnavailable as exc:
        return str(exc).rsplit(": ", 1)[1]
    finally:
        client.close()


@pytest.mark.parametrize("who", WHO)
def test_no_one_publishes_as_another_worker(cluster: NatsCluster, who: str) -> None:
    subject = subject_for(NS, "w1")

    async def count(nc: Any) -> int:
        info = await nc.jetstream().stream_info(STREAM_NAME, subjects_filter=subject)
        return int((info.state.subjects or {}).get(subject, 0))

    before = as_advisor(cluster, count)
    got = _attack(cluster, who, lambda nc: nc.jetstream().publish(subject, _batch("w1", 9, 0), timeout=REFUSED_S))
    after = as_advisor(cluster, count)
    if _authorized(cluster):
        assert got != "done" and after == before
    else:
        assert got == "done" and after == before + 1


def test_ids_sent_first_by_another_worker_do_not_drop_a_workers_batches(cluster: NatsCluster) -> None:
    epoch, ns = 4242, "ids" + uuid.uuid4().hex[:6]
    # w0 knows w1's epoch (the cluster API shows it) and sends the ids of w1's next batches
    # on its own subject, as the ids were built before: "<namespace>.<source>:<epoch>:<seq>"
    ahead = [f"{ns}.w1:{epoch}:{seq}" for seq in range(3)]

    async def presend(nc: Any) -> None:
        for i, mid in enumerate(ahead):
            await nc.jetstream().publish(subject_for(ns, "w0"), _batch("w0", 1, i), headers={"Nats-Msg-Id": mid})

    assert _attack(cluster, "w0", presend) == "done"
    url = cluster.worker_url("w1").split(",")[0].replace("nats://", "jetstream://") + f"?namespace={ns}"
    pub = make_publisher(url, "w1", epoch=epoch, config=ONE)
    try:
        pub.publish(chain([11, 12, 13], "w1/g1"))  # one event a batch: seqs 0, 1, 2
        pub.flush()
        assert pub.stats().dropped == 0
    finally:
        pub.close()

    async def w1_batches(nc: Any) -> int:
        info = await nc.jetstream().stream_info(STREAM_NAME, subjects_filter=subject_for(ns, "w1"))
        return int((info.state.subjects or {}).get(subject_for(ns, "w1"), 0))

    assert as_advisor(cluster, w1_batches) == 3  # none was taken for a duplicate


def test_a_worker_user_publishes_to_jetstream_without_the_jetstream_api(cluster: NatsCluster) -> None:
    ns = "pub" + uuid.uuid4().hex[:6]
    url = cluster.worker_url("w0").split(",")[0].replace("nats://", "jetstream://") + f"?namespace={ns}"
    pub = make_publisher(url, "w0", epoch=7, config=ONE)  # on main: stream info at start, refused
    try:
        pub.publish(chain([21], "w0/g1"))
        pub.flush()
        assert pub.stats().dropped == 0 and pub.stats().batches == 1
    finally:
        pub.close()

    async def stored(nc: Any) -> Any:
        return await nc.jetstream().get_last_msg(STREAM_NAME, subject_for(ns, "w0"))

    assert as_advisor(cluster, stored).data  # the batch is in the stream, acked to the worker


def test_a_worker_added_to_running_servers_gets_its_own_subject_only(cluster: NatsCluster) -> None:
    name = "late" + uuid.uuid4().hex[:6]
    url = cluster.worker_url(name)  # a new user: the running servers reload their authorization

    async def publish(subject: str) -> str:
        nc = await connect_nats(url, 3.0, {"error_cb": _quiet, "allow_reconnect": False})
        try:
            await nc.jetstream().publish(subject, _batch(name, 1, 0), timeout=REFUSED_S)
            return "done"
        except Exception as exc:  # noqa: BLE001 - refused
            return type(exc).__name__
        finally:
            await nc.close()

    assert asyncio.run(publish(subject_for(NS, name))) == "done"
    other = asyncio.run(publish(subject_for(NS, "w0")))
    assert other != "done" if _authorized(cluster) else other == "done"
