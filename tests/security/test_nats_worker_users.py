"""NATS worker users for workers of one's own (docs/security.md "Scaled mode (NATS) threat
model"): ``kvadvisor nats add-worker`` / ``remove-worker`` / ``list-workers`` on the topology
of ``kvadvisor up``, and password files instead of passwords on command lines.

The topology here is a real 3-node nats-server cluster with the authorization ``up`` ships
(:class:`kvadvisor.localcluster.NatsCluster`), and the ``cluster.json`` ``up`` writes,
naming these servers; the Redis and S3 fields name nothing, as the ``nats`` commands read
only the NATS part. Every command runs as its own process, as a user types it.

* a worker made by ``add-worker`` publishes its own subject through the real JetStream
  publisher, with the password file given in the URL or in
  ``$KVADVISOR_NATS_PASSWORD_FILE``, and is refused on another worker's subject; the
  password is in no process's command line (nor its environment: only the file's path is);
* ``kvadvisor events relay`` and ``worker-sim`` publish as such a worker;
* 8 ``add-worker`` processes at once all end up in ``users.json`` and ``auth.conf``, and
  writers of ``users.json`` racing in tight loops lose no user (the file is locked);
* ``remove-worker`` closes the worker's connections and refuses it from then on;
* a password (or token) file that group or others may read is refused, naming the file and
  ``chmod 600``, never the secret.
"""

from __future__ import annotations

import asyncio
import json
import os
import signal
import subprocess
import sys
import uuid
from collections.abc import Iterator
from dataclasses import asdict
from pathlib import Path
from typing import Any

import nats
import pytest
from security_helpers import as_advisor

from event_plane import PublisherConfig, make_publisher, store
from event_plane.config import StreamLimits
from event_plane.errors import EventURLError
from event_plane.nats_auth import NatsAuth, read_password_file, write_password_file
from event_plane.nats_transport import STREAM_NAME, JetStreamPublisher, connect_nats, ensure_stream
from event_plane.urls import nats_connection
from kvadvisor.localcluster import NatsCluster, NatsUsers
from kvadvisor.up import ClusterUp
from storage_backends.local_s3 import free_port
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]
NS = "own"
PARTITIONS = 2
ONE = PublisherConfig(max_events=1, max_delay_s=0.05)

# a worker's own process: publishes one Store event as SOURCE to URL, prints its publisher's
# counts, then waits for its stdin to close (the test reads /proc/<pid>/ meanwhile)
PUBLISHER = """
import json, sys
from event_plane import PublisherConfig, make_publisher, store
url, source = sys.argv[1], sys.argv[2]
pub = make_publisher(url, source, epoch=7, config=PublisherConfig(max_events=1, max_delay_s=0.05))
pub.publish([store(11, 11, None, 4096, source + "/g1")])
pub.flush()
st = pub.stats()
print(json.dumps({"batches": st.batches, "dropped": st.dropped}), flush=True)
sys.stdin.read()
pub.close()
"""


async def _quiet(exc: Exception) -> None:
    pass


@pytest.fixture(scope="module")
def topology(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Path, NatsCluster]]:
    """``(directory, cluster)``: the NATS part of a ``kvadvisor up`` topology, its stream
    made by the advisor user, and its ``cluster.json``."""
    root = tmp_path_factory.mktemp("up")
    root.chmod(0o700)
    with NatsCluster(root / "nats", nodes=3) as c:

        async def make_stream() -> None:
            nc = await connect_nats(c.advisor_url, 5.0, {})
            await ensure_stream(nc.jetstream(), StreamLimits(replicas=3))
            await nc.close()

        asyncio.run(make_stream())
        assert c.users is not None
        state = ClusterUp(root=str(root), nats_urls=c.urls, redis_url="", s3_endpoint="", s3_access_key="",
                          s3_secret_key="", s3_bucket="", namespace=NS, partitions=PARTITIONS, replicas=3,
                          advisors=[], pids={f"nats-{i}": p.pid for i, p in enumerate(c.procs) if p is not None},
                          nats_users=str(c.users.path))
        fd = os.open(root / "cluster.json", os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(state), f)
        yield root, c


def _kvadvisor(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-c", "from kvadvisor.cli import app; app()", *args], cwd=ROOT,
                          env=env, capture_output=True, text=True, timeout=180)


def _add_worker(root: Path, source: str) -> tuple[Path, str, str]:
    """``kvadvisor nats add-worker SOURCE``: ``(password file, publisher URL, password)``;
    the command's output shows neither the password nor anything but the file's path."""
    r = _kvadvisor("nats", "add-worker", source, "--dir", str(root))
    assert r.returncode == 0, r.stderr
    path = root / "nats" / "workers" / f"{source}.json"
    assert f"password file: {path} " in r.stdout
    url = next(line.split(": ", 1)[1] for line in r.stdout.splitlines() if line.startswith("publisher URL: "))
    user, password = read_password_file(path)
    assert user == source and os.stat(path).st_mode & 0o777 == 0o600
    assert password not in r.stdout + r.stderr and password not in url
    return path, url, password


def _stored(c: NatsCluster, source: str) -> int:
    """Batches of ``source`` in the stream, in any namespace (the advisor reads them)."""
    subject = f"kvadvisor.events.*.{source}"

    async def count(nc: Any) -> int:
        info = await nc.jetstream().stream_info(STREAM_NAME, subjects_filter=subject)
        return sum((info.state.subjects or {}).values())

    return int(as_advisor(c, count))


def _connects(url: str, path: Path) -> bool:
    """Whether the server at ``url`` takes the credentials of password file ``path``."""

    async def run() -> bool:
        try:
            nc = await nats.connect(url, connect_timeout=2, max_reconnect_attempts=0, allow_reconnect=False,
                                    error_cb=_quiet, **NatsAuth(password_file=str(path)).connect_options())
        except Exception:  # noqa: BLE001 - refused
            return False
        await nc.close()
        return True

    return asyncio.run(run())


@pytest.mark.parametrize("given", ["url", "environment"])
def test_an_added_worker_publishes_its_own_subject_from_a_password_file_and_no_other(
        topology: tuple[Path, NatsCluster], given: str, monkeypatch: pytest.MonkeyPatch) -> None:
    root, c = topology
    source = f"pod-{given[:3]}"
    path, url, password = _add_worker(root, source)
    env = dict(os.environ)
    env.pop("KVADVISOR_NATS_PASSWORD_FILE", None)
    if given == "environment":  # a URL without credentials (e.g. a vLLM connector's events_url)
        url = url.replace(f"&password_file={path}", "")
        assert "password_file" not in url
        env["KVADVISOR_NATS_PASSWORD_FILE"] = str(path)
    proc = subprocess.Popen([sys.executable, "-c", PUBLISHER, url, source], cwd=ROOT, env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        assert proc.stdout is not None
        counts = json.loads(proc.stdout.readline() or "{}")
        assert counts.get("dropped") == 0 and counts.get("batches", 0) >= 1, proc.stderr.read() if proc.stderr else ""
        cmdline = Path(f"/proc/{proc.pid}/cmdline").read_bytes()
        environ = Path(f"/proc/{proc.pid}/environ").read_bytes()
        assert password.encode() not in cmdline and password.encode() not in environ
        assert str(path).encode() in (cmdline if given == "url" else environ)
    finally:
        proc.communicate(timeout=60)
    assert proc.returncode == 0
    assert _stored(c, source) == counts["batches"]  # each acked by JetStream, in the stream

    # the same password file, another worker's source: refused by the server, nothing stored
    victim = f"victim-{given[:3]}"
    monkeypatch.setattr(JetStreamPublisher, "retry_for_s", 2.0)  # a refused publish is never acked
    pub = make_publisher(url if given == "url" else f"{url}&password_file={path}", victim, epoch=8, config=ONE)
    try:
        pub.publish([store(12, 12, None, 4096, f"{victim}/g1")])
        pub.flush()
        assert pub.stats().dropped > 0
    finally:
        pub.close()
    assert _stored(c, victim) == 0


def test_relay_and_worker_sim_publish_as_an_added_worker(topology: tuple[Path, NatsCluster], tmp_path: Path) -> None:
    from kvadvisor.trace import bundled_trace, read_mooncake
    from kvadvisor.worker_sim import WorkerSimSettings, run_worker_sim

    root, c = topology
    path, url, password = _add_worker(root, "relayed")
    # the relay: its destination without credentials, the password file from the environment
    port, rport = free_port(), free_port()
    dst = url.replace(f"&password_file={path}", "")
    env = {**os.environ, "KVADVISOR_NATS_PASSWORD_FILE": str(path)}
    relay = subprocess.Popen([sys.executable, "-c", "from kvadvisor.cli import app; app()", "events", "relay",
                              f"zmq://127.0.0.1:{port}?replay={rport}", dst, "--count", "1"],
                             cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    engine = make_publisher(f"zmq://127.0.0.1:{port}?replay={rport}", "relayed", config=ONE)
    try:
        assert password.encode() not in Path(f"/proc/{relay.pid}/cmdline").read_bytes()
        seq = iter(range(1000, 100_000))

        def relayed() -> bool:  # the engine's events keep coming until the relay joined
            engine.publish([store(next(seq), 1000, None, 4096, "relayed/g1")])
            engine.flush()
            return relay.poll() is not None

        wait_until(relayed, 60, "the relay relays one event and stops", every=0.2)
        out, err = relay.communicate(timeout=30)
    finally:
        engine.close()
        if relay.poll() is None:
            relay.send_signal(signal.SIGINT)
            relay.communicate(timeout=30)
    assert relay.returncode == 0, err
    assert json.loads(out.splitlines()[-1])["events"] >= 1
    assert _stored(c, "relayed") >= 1

    # worker-sim with its password file setting
    sim_file, _url, _pw = _add_worker(root, "sim-own")
    s = WorkerSimSettings(nats_url=c.urls[0], password_file=sim_file, namespace=NS, source="sim-own",
                          partitions=PARTITIONS, replicas=3, requests=3, interval_s=0.0, workdir=tmp_path / "sim",
                          metrics_port=None)
    fits = sum(len(r.hash_ids) <= s.g1_blocks for r in read_mooncake(bundled_trace(), limit=s.requests))
    assert run_worker_sim(s) == fits > 0
    assert _stored(c, "sim-own") >= 2  # the whole namespace and the partitions


def test_concurrent_add_worker_commands_all_end_up_in_users_and_auth_conf(
        topology: tuple[Path, NatsCluster]) -> None:
    root, c = topology
    names = [f"burst-{i}" for i in range(8)]
    procs = [subprocess.Popen([sys.executable, "-c", "from kvadvisor.cli import app; app()", "nats", "add-worker",
                               name, "--dir", str(root)], cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.PIPE,
                              text=True) for name in names]
    results = [(p.communicate(timeout=300), p.returncode) for p in procs]
    assert [rc for _out, rc in results] == [0] * len(names), [err for (_o, err), _rc in results]
    users = json.loads((root / "nats" / "users.json").read_text())["workers"]
    conf = (root / "nats" / "auth.conf").read_text()
    assert set(names) <= set(users)
    for name in names:
        assert f'user: "{name}"' in conf and f'"kvadvisor.events.*.{name}"' in conf
        path = root / "nats" / "workers" / f"{name}.json"
        assert read_password_file(path) == (name, users[name])
        assert all(_connects(u, path) for u in c.urls), name  # every server loaded every one
    listed = _kvadvisor("nats", "list-workers", "--dir", str(root))
    assert listed.returncode == 0
    assert {line.split("\t")[0] for line in listed.stdout.splitlines()} >= set(names)
    assert not any(users[n] in listed.stdout for n in names)


# 8 writers of one users.json, each adding 40 workers as fast as it can, started together
RACER = """
import pathlib, sys, time
from kvadvisor.localcluster import NatsUsers
path, me, go = pathlib.Path(sys.argv[1]), sys.argv[2], pathlib.Path(sys.argv[3])
(go.parent / ("ready-" + me)).touch()
while not go.exists():
    time.sleep(0.001)
for j in range(40):
    NatsUsers(path).add_worker(f"{me}-{j}")
"""


def test_racing_writers_of_users_json_lose_no_worker(tmp_path: Path) -> None:
    users = tmp_path / "nats" / "users.json"
    advisor = NatsUsers(users).advisor_password
    go = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", RACER, str(users), f"r{i}", str(go)], cwd=ROOT,
                              stderr=subprocess.PIPE, text=True) for i in range(8)]
    try:
        wait_until(lambda: len(list(tmp_path.glob("ready-*"))) == 8, 120, "8 writers ready")
        go.touch()
        errors = [p.communicate(timeout=120)[1] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0] * 8, errors
    after = NatsUsers(users)
    assert after.advisor_password == advisor
    assert set(after.workers) == {f"r{i}-{j}" for i in range(8) for j in range(40)}
    conf = after.conf_path.read_text()
    assert all(f'user: "r{i}-{j}"' in conf for i in range(8) for j in range(40))
    assert users.stat().st_mode & 0o777 == 0o600 and after.conf_path.stat().st_mode & 0o777 == 0o600


def test_remove_worker_closes_its_connections_and_refuses_it(topology: tuple[Path, NatsCluster],
                                                             tmp_path: Path) -> None:
    root, c = topology
    path, _url, password = _add_worker(root, "leaving")

    async def connected_while_removed() -> bool:
        gone = asyncio.Event()

        async def closed() -> None:
            gone.set()

        nc = await nats.connect(c.urls[0], allow_reconnect=False, error_cb=_quiet, closed_cb=closed,
                                **NatsAuth(password_file=str(path)).connect_options())
        try:
            r = await asyncio.to_thread(_kvadvisor, "nats", "remove-worker", "leaving", "--dir", str(root))
            assert r.returncode == 0, r.stderr
            assert password not in r.stdout + r.stderr
            await asyncio.wait_for(gone.wait(), 60)  # the server closed the removed user's connection
            return bool(nc.is_closed)
        finally:
            await nc.close()

    assert asyncio.run(connected_while_removed())
    assert not path.exists()
    assert "leaving" not in NatsUsers(root / "nats" / "users.json").workers
    again = tmp_path / "leaving-copy.json"  # the old credentials, kept by hand: refused everywhere
    write_password_file(again, "leaving", password)
    assert not any(_connects(u, again) for u in c.urls)
    assert _kvadvisor("nats", "remove-worker", "leaving", "--dir", str(root)).returncode == 1  # no such worker


def test_a_password_or_token_file_others_may_read_is_refused(topology: tuple[Path, NatsCluster],
                                                             tmp_path: Path) -> None:
    root, c = topology
    path, url, password = _add_worker(root, "careless")
    path.chmod(0o644)
    try:
        with pytest.raises(EventURLError, match="chmod 600") as info:
            make_publisher(url, "careless", config=ONE)
        assert str(path) in str(info.value) and password not in str(info.value)
        # the same file from the environment
        env = {**os.environ, "KVADVISOR_NATS_PASSWORD_FILE": str(path)}
        bare = url.replace(f"&password_file={path}", "")
        proc = subprocess.run([sys.executable, "-c", PUBLISHER, bare, "careless"], cwd=ROOT, env=env, input="",
                              capture_output=True, text=True, timeout=120)
        assert proc.returncode != 0 and "chmod 600" in proc.stderr and password not in proc.stderr
        # the relay refuses it before it reads anything
        r = _kvadvisor("events", "relay", f"zmq://127.0.0.1:{free_port()}", bare, "--password-file", str(path),
                       "--duration", "30")
        assert r.returncode == 2 and r.stderr.startswith("error:") and "chmod 600" in r.stderr
        assert password not in r.stdout + r.stderr
    finally:
        path.chmod(0o600)
    assert _connects(c.urls[0], path)  # the same file at 0600 is taken
    token = tmp_path / "token"
    token.write_text("tok-" + uuid.uuid4().hex)
    token.chmod(0o640)
    with pytest.raises(EventURLError, match="chmod 600"):
        nats_connection(f"nats://127.0.0.1:1?token_file={token}")


def test_a_worker_cannot_be_named_as_a_cluster_mover(tmp_path: Path) -> None:
    # the partitions take <advisor id>-mover batches as the movers' own (no state quotas):
    # a worker user by such a name could publish past them, so none is made
    users = NatsUsers(tmp_path / "users.json")
    for name in ("adv-1-mover", "x-mover"):
        with pytest.raises(ValueError, match="must not end in '-mover'"):
            users.add_worker(name)
    assert users.add_worker("mover-1")  # the suffix only
    assert "x-mover" not in users.conf() and "mover-1" in users.conf()
