"""``kvadvisor up`` / ``kvadvisor down``: the scaled topology on this machine, without Docker.

Started from installed binaries, on loopback ports only (docs/design.md §8; ``compose/``
describes the same topology in containers):

* a NATS JetStream cluster of ``nodes`` servers (:class:`kvadvisor.localcluster.NatsCluster`)
  with authorization: the advisors and the API connect as the ``advisor`` user, each worker
  as a user of its own that may only publish its own subject (``<dir>/nats/users.json``, mode
  0600; :func:`add_worker` adds one and writes its password file for the worker's own
  process, ``kvadvisor nats add-worker``; :func:`worker_nats_url` one for a worker in this
  process; docs/security.md);
* ``redis-server`` (snapshots and the placement catalog), with a random password;
* an S3 endpoint (``moto_server``) with a bucket of its own;
* ``advisors`` cluster advisors (``python -m advisor.cluster``) sharing ``partitions``
  partitions of the index through leases, each moving the blocks of its partitions between
  the topology's volumes (``<dir>/storage.json``: ``fast`` and ``slow`` POSIX volumes under
  ``<dir>/volumes`` and the ``s3`` volume on the S3 endpoint, placement catalog in Redis;
  :mod:`advisor.cluster.mover`);
* the cluster's REST API (``python -m api.cluster_api``) on a loopback port.

Every process runs in its own session, so it outlives the command; ``up`` returns once all
partitions are owned and writes ``<dir>/cluster.json`` (mode 0600: it holds the Redis
password and the S3 keys), which ``kvadvisor demo --scaled`` and ``kvadvisor down`` read.
Logs go to ``<dir>/logs/``.
"""

from __future__ import annotations

import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from urllib.parse import urlencode

from event_plane.nats_auth import write_password_file
from kvadvisor.localcluster import ADVISOR_USER, NatsCluster, NatsUsers, free_port, reload_nats, user_url, wait_accepts

__all__ = ["ClusterUp", "UpError", "WorkerUser", "add_worker", "down", "list_workers", "load", "password_file_path",
           "remove_worker", "up", "worker_nats_url"]

STATE_FILE = "cluster.json"


class UpError(RuntimeError):
    """The topology could not be started, read or stopped."""


@dataclass
class ClusterUp:
    """What ``kvadvisor up`` started (the contents of ``cluster.json``).

    Attributes:
        root: the directory holding state, stores and logs.
        nats_urls: client URL of every NATS node.
        redis_url: ``redis://:PASSWORD@127.0.0.1:PORT/0``.
        s3_endpoint, s3_access_key, s3_secret_key, s3_bucket: the S3 endpoint.
        namespace: event namespace; partitions: index partitions (trunk 1, stretch 64).
        replicas: JetStream replicas (3 on a 3-node cluster).
        advisors: advisor ids; pids: every process started, by name.
        api_url: the cluster's REST API.
        storage: the advisors' storage settings file (``--storage``), which the workers of
            ``kvadvisor demo --scaled`` use too; ``""`` when the advisors move nothing.
        nats_users: the NATS users file (:class:`~kvadvisor.localcluster.NatsUsers`, 0600);
            ``""``: NATS without authorization (a topology of an older version).
    """

    root: str
    nats_urls: list[str]
    redis_url: str
    s3_endpoint: str
    s3_access_key: str
    s3_secret_key: str
    s3_bucket: str
    namespace: str
    partitions: int
    replicas: int
    advisors: list[str]
    pids: dict[str, int] = field(default_factory=dict)
    api_url: str = ""
    storage: str = ""
    nats_users: str = ""

    @property
    def nats_url(self) -> str:
        """All NATS nodes, comma-separated (no credentials: fit for a message)."""
        return ",".join(self.nats_urls)

    @property
    def advisor_nats_url(self) -> str:
        """All NATS nodes with the advisor's credentials (holds a password: never print
        it or put it on a command line); :attr:`nats_url` without authorization."""
        if not self.nats_users:
            return self.nats_url
        return user_url(self.nats_urls, ADVISOR_USER, NatsUsers(Path(self.nats_users)).advisor_password)

    def nats_pids(self) -> list[int]:
        """The pids of the NATS servers."""
        return [pid for name, pid in self.pids.items() if name.startswith("nats-")]


def _spawn(name: str, cmd: list[str], logs: Path, env: dict[str, str] | None = None) -> subprocess.Popen[bytes]:
    log = open(logs / f"{name}.log", "ab")  # noqa: SIM115 - owned by the child
    proc = subprocess.Popen(cmd, stdout=log, stderr=log, stdin=subprocess.DEVNULL, start_new_session=True,
                            env=env)
    log.close()
    return proc


def _wait_port(port: int, proc: subprocess.Popen[bytes], what: str, timeout_s: float) -> None:
    import socket

    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        if proc.poll() is not None:
            raise UpError(f"{what} exited with code {proc.returncode}")
        try:
            with socket.create_connection(("127.0.0.1", port), timeout=0.2):
                return
        except OSError:
            time.sleep(0.05)
    raise UpError(f"{what} did not answer on 127.0.0.1:{port} within {timeout_s} s")


def up(root: Path, *, nodes: int = 3, advisors: int = 3, partitions: int = 8, namespace: str = "demo",
       policy_interval_s: float = 5.0, timeout_s: float = 90.0) -> ClusterUp:
    """Start the scaled topology under ``root`` and return what runs.

    ``policy_interval_s`` (seconds, > 0) is the advisors' time between policy rounds (the
    ``policy_interval_s`` of ``storage.json``): ``kvadvisor demo --scaled`` waits for the
    movers' rounds after its replay, so it also sets how long that wait lasts.

    A stopped topology's NATS stores and volumes under ``root`` (``nats/``, ``volumes/``) are
    removed first: its placement catalog, snapshots and S3 objects lived in the memory of
    its redis-server and S3 endpoint and are gone, so its stream would index blocks no
    catalog places, and its segment files would collide with the new catalog's (a worker's
    offload then failed with "File exists").

    Raises:
        UpError: ``root`` already holds a running topology, ``policy_interval_s`` is not
            > 0, a binary is missing, or a process does not come up within ``timeout_s``
            (everything started is stopped).
    """
    if not policy_interval_s > 0:
        raise UpError(f"policy interval must be > 0 seconds, got {policy_interval_s}")
    root = Path(root).resolve()
    if (root / STATE_FILE).exists():
        raise UpError(f"{root / STATE_FILE} exists: a topology runs there (kvadvisor down --dir {root} first)")
    redis_exe = shutil.which("redis-server")
    if redis_exe is None:
        raise UpError("redis-server not found on PATH (Debian: apt-get install redis-server)")
    for stale in ("nats", "volumes"):  # a stopped topology's, its catalog gone (docstring)
        shutil.rmtree(root / stale, ignore_errors=True)
    root.mkdir(parents=True, exist_ok=True)
    root.chmod(0o700)  # logs/, nats/ (every event) and volumes/ (KV bytes) are for this user only
    logs = root / "logs"
    logs.mkdir(mode=0o700, exist_ok=True)
    started: dict[str, subprocess.Popen[bytes]] = {}
    nats = NatsCluster(root / "nats", nodes=nodes)  # authorization on: users in nats/users.json
    try:
        nats.root.mkdir(parents=True, exist_ok=True)
        for i in range(nodes):
            nats.start_node(i)
        for i, proc in enumerate(nats.procs):
            assert proc is not None
            started[f"nats-{i}"] = proc
        nats.wait_ready(timeout_s)

        rport, password = free_port(), secrets.token_hex(16)
        conf = root / "redis.conf"
        conf.write_text(f"bind 127.0.0.1\nport {rport}\nrequirepass {password}\nsave \"\"\nappendonly no\n"
                        f"dir {root}\n")
        conf.chmod(0o600)
        started["redis"] = _spawn("redis", [redis_exe, str(conf)], logs)
        _wait_port(rport, started["redis"], "redis-server", timeout_s)
        redis_url = f"redis://:{password}@127.0.0.1:{rport}/0"

        s3_port = free_port()
        moto = os.path.join(os.path.dirname(sys.executable), "moto_server")
        if not os.path.exists(moto):
            moto = shutil.which("moto_server") or moto
        started["s3"] = _spawn("s3", [moto, "-H", "127.0.0.1", "-p", str(s3_port)], logs)
        _wait_port(s3_port, started["s3"], "moto_server", timeout_s)
        endpoint = f"http://127.0.0.1:{s3_port}"
        bucket = "kvadvisor-" + secrets.token_hex(4)
        access, secret = "kv" + secrets.token_hex(8), secrets.token_hex(20)
        import boto3

        boto3.client("s3", endpoint_url=endpoint, aws_access_key_id=access, aws_secret_access_key=secret,
                     region_name="us-east-1").create_bucket(Bucket=bucket)

        storage = _write_storage(root, namespace, endpoint, bucket, access, secret, policy_interval_s)
        ids = [f"advisor-{i}" for i in range(advisors)]
        # the Redis URL (with its password) goes through the environment, never argv (ps shows argv)
        # so do the NATS URLs with the advisor's password
        env = dict(os.environ, NIXL_LOG_LEVEL="WARN", KVADVISOR_CLUSTER_REDIS_URL=redis_url,
                   KVADVISOR_CLUSTER_NATS_URL=nats.advisor_url)
        repo = str(Path(__file__).resolve().parents[1])
        env["PYTHONPATH"] = repo + os.pathsep + env.get("PYTHONPATH", "")
        for a in ids:
            started[a] = _spawn(a, [sys.executable, "-m", "advisor.cluster",
                                    "--id", a, "--namespace", namespace, "--partitions", str(partitions),
                                    "--replicas", str(3 if nodes >= 3 else 1), "--lease-ttl", "6",
                                    "--heartbeat", "1", "--snapshot-interval", "10", "--storage", str(storage)],
                                logs, env)
        api_port = free_port()
        started["api"] = _spawn("api", [sys.executable, "-m", "api.cluster_api",
                                        "--namespace", namespace, "--partitions", str(partitions),
                                        "--port", str(api_port), "--retry-after", "6"], logs, env)
        state = ClusterUp(root=str(root), nats_urls=nats.urls, redis_url=redis_url, s3_endpoint=endpoint,
                          s3_access_key=access, s3_secret_key=secret, s3_bucket=bucket, namespace=namespace,
                          partitions=partitions, replicas=3 if nodes >= 3 else 1, advisors=ids,
                          pids={k: p.pid for k, p in started.items()}, api_url=f"http://127.0.0.1:{api_port}",
                          storage=str(storage), nats_users=str(nats.users.path) if nats.users else "")
        _wait_port(api_port, started["api"], "the cluster API", timeout_s)
        _wait_owned(state, started, timeout_s)
        path = root / STATE_FILE
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        with os.fdopen(fd, "w") as f:
            json.dump(asdict(state), f, indent=2)
        return state
    except BaseException:
        for proc in started.values():
            if proc.poll() is None:
                proc.kill()
        raise


def _write_storage(root: Path, namespace: str, endpoint: str, bucket: str, access: str, secret: str,
                   policy_interval_s: float) -> Path:
    """Write ``<root>/storage.json`` (the advisors' and the demo workers' volumes and policy)
    and the S3 secret key file it names (both mode 0600); returns the settings file."""
    vols = root / "volumes"
    for v in ("fast", "slow"):
        (vols / v).mkdir(parents=True, exist_ok=True)
    key = root / "s3.secret"
    fd = os.open(key, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.write(secret + "\n")
    conf = {
        "catalog_prefix": f"kvadvisor:{namespace}:catalog",
        "volumes": [
            {"id": "fast", "kind": "posix", "media": "nvme", "capacity_bytes": 16 << 20, "root": str(vols / "fast"),
             "segment_bytes": 4 << 20},
            {"id": "slow", "kind": "posix", "media": "hdd", "capacity_bytes": 4 << 30, "root": str(vols / "slow"),
             "segment_bytes": 8 << 20},
            {"id": "s3", "kind": "s3", "media": "object", "capacity_bytes": 1 << 40, "endpoint": endpoint,
             "bucket": bucket, "prefix": "kv", "access_key": access, "secret_key_file": str(key)},
        ],
        "fast_volume": "fast", "slow_volumes": ["slow"], "archive_volume": "s3",
        "volume_roots": [str(vols)],
        "policy_interval_s": policy_interval_s,
    }
    path = root / "storage.json"
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump(conf, f, indent=2)
    return path


def _wait_owned(state: ClusterUp, procs: dict[str, subprocess.Popen[bytes]], timeout_s: float) -> None:
    from advisor.cluster.leases import LeaseError, lease_owners

    end = time.monotonic() + timeout_s
    owners: dict[int, str] = {}
    while time.monotonic() < end:
        for name, proc in procs.items():
            if proc.poll() is not None:
                raise UpError(f"{name} exited with code {proc.returncode} (log: {state.root}/logs/{name}.log)")
        try:
            owners = lease_owners(state.advisor_nats_url)
        except LeaseError:
            owners = {}
        if len(owners) == state.partitions:
            return
        time.sleep(0.3)
    raise UpError(f"only {len(owners)} of {state.partitions} partitions owned after {timeout_s} s "
                  f"(logs: {state.root}/logs/)")


def worker_nats_url(state: ClusterUp, source: str, timeout_s: float = 15.0) -> str:
    """All NATS nodes with worker ``source``'s credentials: the user is made when new (a
    random password in ``nats_users``), the servers reload their authorization (SIGHUP)
    and are waited for until each accepts it.  The result holds a password (never print it;
    for a worker in another process, :func:`add_worker` writes a password file instead).
    Without authorization (``nats_users`` empty): :attr:`ClusterUp.nats_url`.

    Raises:
        UpError: ``source`` is not a valid worker name, or a server does not accept the
            new user within ``timeout_s``.
    """
    if not state.nats_users:
        return state.nats_url
    return user_url(state.nats_urls, source, _worker_password(state, source, timeout_s))


def _worker_password(state: ClusterUp, source: str, timeout_s: float, reload: bool = False) -> str:
    """Worker ``source``'s password, the user made when new and loaded by every server
    (``reload``: the servers reload and are waited for even when the user exists)."""
    users = NatsUsers(Path(state.nats_users))
    try:
        known = source in users.workers
        password = users.add_worker(source)
        if reload or not known:
            reload_nats(state.nats_pids())
            wait_accepts(state.nats_urls, source, password, timeout_s)
    except (ValueError, RuntimeError, TimeoutError) as exc:  # TimeoutError: the users file stayed locked
        raise UpError(f"NATS worker user {source!r}: {exc}") from exc
    return password


@dataclass(frozen=True)
class WorkerUser:
    """A NATS worker user of a topology, as :func:`add_worker` made it.

    Attributes:
        source: the user name, which is the source name it may publish (one subject token).
        password_file: its password file (JSON user and password, mode 0600;
            :func:`event_plane.nats_auth.read_password_file`).
        publisher_url: a ``jetstream://`` publisher URL of the topology's partitions for
            it: the first NATS node, the namespace, partitions and replicas of ``up``, and
            ``password_file=`` (no secret in it: fit for a command line).
    """

    source: str
    password_file: Path
    publisher_url: str


def password_file_path(state: ClusterUp, source: str) -> Path:
    """Where :func:`add_worker` writes worker ``source``'s password file:
    ``<dir>/nats/workers/<source>.json``."""
    return Path(state.nats_users).parent / "workers" / f"{source}.json"


def add_worker(state: ClusterUp, source: str, timeout_s: float = 15.0) -> WorkerUser:
    """Make NATS worker user ``source`` for a worker in a process of its own (a vLLM engine
    with the connector, ``kvadvisor events relay``, ``kvadvisor worker-sim``): the user may
    publish ``kvadvisor.events.*.<source>`` and read ``_INBOX.<source>.>`` only; the
    running servers reload their authorization (SIGHUP) and are waited for until each
    accepts it; its password file is written (mode 0600, :func:`password_file_path`).
    A worker that exists keeps its password (the servers reload all the same, and its file
    is written again).  Safe to run in
    several processes at once (:class:`~kvadvisor.localcluster.NatsUsers` locks).

    Raises:
        UpError: the topology's NATS runs without authorization, ``source`` is not a valid
            worker name, or a server does not accept the user within ``timeout_s``.
    """
    if not state.nats_users:
        raise UpError(f"the NATS of {state.root} runs without authorization: any client may publish")
    password = _worker_password(state, source, timeout_s, reload=True)
    path = password_file_path(state, source)
    path.parent.mkdir(mode=0o700, exist_ok=True)
    write_password_file(path, source, password)
    query = urlencode({"namespace": state.namespace, "partitions": state.partitions, "replicas": state.replicas,
                       "password_file": str(path)}, safe="/")
    return WorkerUser(source, path, f"jetstream://{state.nats_urls[0].split('://', 1)[1]}?{query}")


def remove_worker(state: ClusterUp, source: str, timeout_s: float = 15.0) -> bool:
    """Remove NATS worker user ``source``: the running servers reload their authorization
    (its connections are closed) and are waited for until each refuses it; its password
    file is deleted.  Returns whether the user existed.

    Raises:
        UpError: the topology's NATS runs without authorization, ``source`` is not a valid
            worker name, or a server still accepts the user ``timeout_s`` after the reload.
    """
    if not state.nats_users:
        raise UpError(f"the NATS of {state.root} runs without authorization: it has no users")
    try:
        password = NatsUsers(Path(state.nats_users)).remove_worker(source)
        if password is not None:
            reload_nats(state.nats_pids())
            wait_accepts(state.nats_urls, source, password, timeout_s, accepted=False)
    except (ValueError, RuntimeError, TimeoutError) as exc:  # TimeoutError: the users file stayed locked
        raise UpError(f"NATS worker user {source!r}: {exc}") from exc
    password_file_path(state, source).unlink(missing_ok=True)
    return password is not None


def list_workers(state: ClusterUp) -> list[str]:
    """The NATS worker users of the topology, sorted (``[]`` without authorization)."""
    if not state.nats_users:
        return []
    return sorted(NatsUsers(Path(state.nats_users)).workers)


def load(root: Path) -> ClusterUp:
    """The topology ``kvadvisor up`` started under ``root``.

    Raises:
        UpError: no ``cluster.json`` there, or it is unreadable.
    """
    path = Path(root).resolve() / STATE_FILE
    try:
        return ClusterUp(**json.loads(path.read_text()))
    except FileNotFoundError:
        raise UpError(f"no topology under {path.parent} (run `kvadvisor up --dir {path.parent}` first)") from None
    except (ValueError, TypeError) as exc:
        raise UpError(f"{path} is unreadable: {exc}") from exc


def down(root: Path, timeout_s: float = 20.0) -> list[str]:
    """Stop what ``up`` started under ``root`` (SIGTERM, then SIGKILL after ``timeout_s``):
    advisors first (they save their final snapshots), then the servers.  Returns the names
    stopped; removes ``cluster.json``.

    Raises:
        UpError: no topology under ``root``.
    """
    state = load(root)
    first = [n for n in state.pids if n.startswith("advisor") or n == "api"]
    stopped = []
    for group in (first, [n for n in state.pids if n not in first]):
        for name in group:
            try:
                os.kill(state.pids[name], signal.SIGTERM)
                stopped.append(name)
            except ProcessLookupError:
                pass
        end = time.monotonic() + timeout_s
        for name in group:
            while time.monotonic() < end and _alive(state.pids[name]):
                time.sleep(0.05)
            if _alive(state.pids[name]):
                os.kill(state.pids[name], signal.SIGKILL)
    (Path(state.root) / STATE_FILE).unlink(missing_ok=True)
    return stopped


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie child of this process counts as gone
        done, _ = os.waitpid(pid, os.WNOHANG)
        return done == 0
    except ChildProcessError:
        return True
