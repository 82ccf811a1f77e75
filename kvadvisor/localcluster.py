"""Local servers for the scaled topology without Docker: a NATS JetStream cluster on
loopback ports (docs/design.md §8; ``compose/`` describes the same topology in containers).

:class:`NatsCluster` writes one configuration file per node (``server_name``, client port,
cluster port, routes to the others, JetStream store directory), starts the installed
``nats-server`` binaries, waits until JetStream has a meta leader, and can kill, stop and
restart single nodes (fault drills).  Only loopback addresses are used.

Authorization is on by default (:class:`NatsUsers`, docs/security.md "Scaled mode"): an
``advisor`` user with every right (the advisors and the cluster API: streams, consumers,
the lease bucket, queries) and one user per worker source, which may only publish its own
subject ``kvadvisor.events.*.<source>`` and read its own inbox ``_INBOX.<source>.>``
(JetStream acks).  A client without credentials is refused.
"""

from __future__ import annotations

import asyncio
import json
import os
import re
import secrets
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from filelock import FileLock

from event_plane.secret_files import write_private_file

__all__ = ["ADVISOR_USER", "NatsCluster", "NatsUsers", "free_port", "reload_nats", "user_url"]

ADVISOR_USER = "advisor"
LOCK_TIMEOUT_S = 60.0
"""Seconds a change of the users waits for the lock (each holder keeps it for one small
read and two small writes)."""
_WORKER = re.compile(r"^[A-Za-z0-9_\-@:+=~]{1,128}$")  # one subject token (event_plane.nats_transport)


def free_port(host: str = "127.0.0.1", count: int = 1) -> int:
    """:func:`storage_backends.ports.free_port`, imported at the first call: the
    ``storage_backends`` package imports torch, which ``kvadvisor nats`` never needs (each
    command would take seconds longer to start)."""
    from storage_backends.ports import free_port as pick

    return pick(host, count)


def user_url(urls: list[str], user: str, password: str) -> str:
    """``urls`` (``nats://HOST:PORT`` each) with ``user:password@`` in every node, comma-separated
    (what :func:`event_plane.nats_transport.connect_nats` and the ``--nats`` options take).
    The result holds a password: pass it through the environment or a 0600 file, never argv
    or a log."""
    return ",".join(u.replace("://", f"://{user}:{password}@", 1) for u in urls)


class NatsUsers:
    """The users of an authorized NATS (module docstring), kept in ``path`` (JSON, mode
    0600: ``{"advisor": PASSWORD, "workers": {source: PASSWORD}}``) and rendered as an
    ``authorization`` block (:meth:`conf`) that the servers include.

    Passwords are 48 random hex digits (:func:`secrets.token_hex`); they are never logged.
    Every change is a read-modify-write under an exclusive lock (``users.json.lock``, a
    :class:`filelock.FileLock`: an ``flock`` the kernel drops when its holder dies), and
    both files are replaced atomically: processes adding workers at once (``kvadvisor nats
    add-worker``, ``kvadvisor demo --scaled``) lose none of them.

    Raises (``add_worker``, ``remove_worker``): ValueError for a source that is not one
    subject token, is the advisor's name or ends in ``-mover`` (a cluster mover's source); (any change) filelock.Timeout when the lock is
    not free within :data:`LOCK_TIMEOUT_S` seconds.
    """

    def __init__(self, path: Path) -> None:
        self.path = Path(path)
        self.advisor_password = ""
        self.workers: dict[str, str] = {}
        if not self.path.exists():
            with self._locked():  # made once, by whoever comes first
                if not self.path.exists():
                    self.advisor_password = secrets.token_hex(24)
                    self._write()
                    return
        self._load()

    @property
    def lock_path(self) -> Path:
        """The lock file of every change (``users.json.lock``, mode 0600)."""
        return self.path.with_name(self.path.name + ".lock")

    def _locked(self) -> FileLock:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        return FileLock(str(self.lock_path), timeout=LOCK_TIMEOUT_S, mode=0o600)

    def _load(self) -> None:
        data = json.loads(self.path.read_text())
        self.advisor_password = data["advisor"]
        self.workers = dict(data["workers"])

    def _write(self) -> None:
        """Write ``path`` and the ``authorization`` include next to it (both 0600, atomic);
        the caller holds the lock."""
        write_private_file(self.path, json.dumps({"advisor": self.advisor_password, "workers": self.workers}))
        write_private_file(self.conf_path, self.conf())

    def add_worker(self, source: str) -> str:
        """The password of worker ``source`` (made and saved when it is new; the users
        other processes added meanwhile are read first and kept)."""
        _check_worker(source)
        with self._locked():
            self._load()
            if source not in self.workers:
                self.workers[source] = secrets.token_hex(24)
                self._write()
            return self.workers[source]

    def remove_worker(self, source: str) -> str | None:
        """Remove worker ``source``; returns the password it had (``None``: there was no
        such worker). The users other processes added meanwhile are read first and kept."""
        _check_worker(source)
        with self._locked():
            self._load()
            password = self.workers.pop(source, None)
            if password is not None:
                self._write()
            return password

    @property
    def conf_path(self) -> Path:
        """The ``authorization`` block the server configurations include (``auth.conf``)."""
        return self.path.with_name("auth.conf")

    def conf(self) -> str:
        """The ``authorization`` block: the advisor with every right, each worker with
        publish ``kvadvisor.events.*.<source>`` and subscribe ``_INBOX.<source>.>`` only."""
        users = [f'  {{ user: "{ADVISOR_USER}", password: "{self.advisor_password}" }}']
        for source, password in sorted(self.workers.items()):
            users.append(f'  {{ user: "{source}", password: "{password}", permissions: {{\n'
                         f'      publish: {{ allow: ["kvadvisor.events.*.{source}"] }},\n'
                         f'      subscribe: {{ allow: ["_INBOX.{source}.>"] }} }} }}')
        return "authorization {\n users = [\n" + ",\n".join(users) + "\n ]\n}\n"


def _check_worker(source: str) -> None:
    if not isinstance(source, str) or not _WORKER.match(source) or source == ADVISOR_USER:
        raise ValueError(f"worker name {source!r} must be one NATS subject token other than {ADVISOR_USER!r}")
    from advisor.cluster.parts import MOVER_SUFFIX, is_mover_source  # noqa: PLC0415 - the cluster's rule, loaded on use

    if is_mover_source(source):
        # the partitions take batches of <advisor id>-mover as the cluster movers' own
        # (no state quotas, not requests): only the advisor user may publish those
        raise ValueError(f"worker name {source!r} must not end in {MOVER_SUFFIX!r} (the cluster movers' sources)")


def reload_nats(pids: list[int]) -> None:
    """Ask each running ``nats-server`` of ``pids`` to reload its configuration (SIGHUP):
    the authorization include takes effect without a restart.  A pid that is gone, or now
    belongs to another program (``/proc/<pid>/cmdline`` names no ``nats-server``), is skipped."""
    for pid in pids:
        try:
            if b"nats-server" not in Path(f"/proc/{pid}/cmdline").read_bytes():
                continue
            os.kill(pid, signal.SIGHUP)
        except (ProcessLookupError, FileNotFoundError, PermissionError):
            pass


def _answers(port: int) -> bool:
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


@dataclass
class NatsCluster:
    """A JetStream cluster of ``nodes`` ``nats-server`` processes on loopback.

    Args:
        root: directory for configuration files, stores and logs (created).
        nodes: number of servers (3 gives R3 streams that survive one node's loss).
        name: cluster name.
        exe: the ``nats-server`` binary (default: found on ``PATH`` or ``/usr/sbin``).
        auth: authorization on (:class:`NatsUsers` in ``root/users.json``); off: any
            client may do anything (tests that show what authorization stops).
        workers: worker users made before the start (:meth:`add_worker` adds more).

    :attr:`urls` / :attr:`url` are the bare addresses (a client without credentials);
    :attr:`advisor_url` carries the advisor's credentials and :meth:`worker_url` a
    worker's (both hold passwords: never print them or put them on a command line).

    Raises (from :meth:`start`): RuntimeError when a server does not come up, or JetStream
    elects no leader, within ``timeout_s``.
    """

    root: Path
    nodes: int = 3
    name: str = "kvadvisor"
    exe: str | None = None
    client_ports: list[int] = field(default_factory=list)
    cluster_ports: list[int] = field(default_factory=list)
    procs: list[subprocess.Popen[bytes] | None] = field(default_factory=list)
    auth: bool = True
    workers: list[str] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.exe = self.exe or shutil.which("nats-server") or "/usr/sbin/nats-server"
        if not self.client_ports:
            self.client_ports = [free_port() for _ in range(self.nodes)]
            self.cluster_ports = [free_port() for _ in range(self.nodes)]
        self.procs = [None] * self.nodes
        self.users: NatsUsers | None = None
        if self.auth:
            self.root.mkdir(parents=True, exist_ok=True)
            self.root.chmod(0o700)
            self.users = NatsUsers(self.root / "users.json")
            for w in self.workers:
                self.users.add_worker(w)

    @property
    def advisor_url(self) -> str:
        """Every node's URL with the advisor's credentials (:attr:`url` without authorization)."""
        if self.users is None:
            return self.url
        return user_url(self.urls, ADVISOR_USER, self.users.advisor_password)

    def worker_url(self, source: str) -> str:
        """Every node's URL with worker ``source``'s credentials (made and loaded into the
        running servers when new: :meth:`add_worker`); :attr:`url` without authorization."""
        if self.users is None:
            return self.url
        return user_url(self.urls, source, self.add_worker(source))

    def add_worker(self, source: str, timeout_s: float = 15.0) -> str:
        """Make worker user ``source`` (when new), reload the running servers and wait until
        every one of them accepts it; returns its password.

        Raises:
            ValueError: authorization is off, or ``source`` is not a valid worker name.
            RuntimeError: a server does not accept the new user within ``timeout_s``.
        """
        if self.users is None:
            raise ValueError("this NATS cluster runs without authorization")
        if source in self.users.workers:
            return self.users.workers[source]
        password = self.users.add_worker(source)
        running = [p for p in self.procs if p is not None and p.poll() is None]
        reload_nats([p.pid for p in running])
        wait_accepts([u for u, p in zip(self.urls, self.procs) if p is not None and p.poll() is None],
                     source, password, timeout_s)
        return password

    @property
    def urls(self) -> list[str]:
        """Client URLs of every node."""
        return [f"nats://127.0.0.1:{p}" for p in self.client_ports]

    @property
    def url(self) -> str:
        """Every node's URL, comma-separated (nats-py tries them all and fails over)."""
        return ",".join(self.urls)

    def _config(self, i: int) -> Path:
        routes = ", ".join(f"nats://127.0.0.1:{p}" for j, p in enumerate(self.cluster_ports) if j != i)
        store = self.root / f"n{i}"
        store.mkdir(parents=True, exist_ok=True)
        conf = self.root / f"n{i}.conf"
        # one node: a plain JetStream server (a cluster block without routes is refused:
        # "JetStream cluster requires configured routes")
        cluster = (f"cluster {{\n  name: {self.name}\n  listen: 127.0.0.1:{self.cluster_ports[i]}\n"
                   f"  routes: [{routes}]\n}}\n") if self.nodes > 1 else ""
        auth = f'include "{self.users.conf_path.name}"\n' if self.users is not None else ""
        conf.write_text(
            f'server_name: "n{i}"\n'
            f"listen: 127.0.0.1:{self.client_ports[i]}\n"
            f'jetstream {{ store_dir: "{store}" }}\n' + cluster + auth)
        return conf

    def start_node(self, i: int) -> None:
        """Start node ``i`` (again), with its store as it was."""
        log = open(self.root / f"n{i}.log", "ab")  # noqa: SIM115 - owned by the process
        self.procs[i] = subprocess.Popen([str(self.exe), "-c", str(self._config(i))], stdout=log, stderr=log)
        log.close()

    def start(self, timeout_s: float = 30.0) -> NatsCluster:
        """Start every node and wait for the JetStream meta leader."""
        self.root.mkdir(parents=True, exist_ok=True)
        try:
            for i in range(self.nodes):
                self.start_node(i)
            self.wait_ready(timeout_s)
        except BaseException:
            self.stop()  # a failed start leaves no server behind
            raise
        return self

    def wait_ready(self, timeout_s: float = 30.0) -> None:
        """Wait until every running node answers and JetStream places a stream on all of
        them (a memory stream with one replica per node, created and deleted)."""
        end = time.monotonic() + timeout_s
        for i, p in enumerate(self.client_ports):
            while self.procs[i] is not None and not _answers(p):
                if time.monotonic() > end or self.procs[i].poll() is not None:  # type: ignore[union-attr]
                    raise RuntimeError(f"nats-server n{i} did not come up (log: {self.root / f'n{i}.log'})")
                time.sleep(0.05)
        while not asyncio.run(self._js_ready()):
            if time.monotonic() > end:
                raise RuntimeError(f"the NATS cluster elected no JetStream leader in {timeout_s} s")
            time.sleep(0.2)

    async def _js_ready(self) -> bool:
        import nats

        creds = {"user": ADVISOR_USER, "password": self.users.advisor_password} if self.users is not None else {}
        try:
            nc = await nats.connect(self.urls, connect_timeout=1, max_reconnect_attempts=0,
                                    allow_reconnect=False, error_cb=_quiet, **creds)
        except Exception:  # noqa: BLE001 - not yet
            return False
        try:
            js = nc.jetstream(timeout=2)
            await js.account_info()
            # every node is a JetStream peer: a stream on all of them can be placed (right
            # after a start, "no suitable peers for placement" until the routes are up)
            probe = "KVADVISOR_READY_" + secrets.token_hex(4)
            await js.add_stream(name=probe, subjects=[f"kvadvisor.ready.{probe}"], storage="memory",
                                num_replicas=self.nodes if self.nodes in (1, 3, 5) else 1)
            await js.delete_stream(probe)
            return True
        except Exception:  # noqa: BLE001 - no meta leader yet, or not every peer known
            return False
        finally:
            await nc.close()

    def kill(self, i: int, sig: int = signal.SIGKILL) -> None:
        """Kill node ``i`` (SIGKILL by default: no goodbye to the cluster)."""
        proc = self.procs[i]
        if proc is not None and proc.poll() is None:
            proc.send_signal(sig)
            proc.wait(10)
        self.procs[i] = None

    def stop(self) -> None:
        """Stop every node."""
        for i, proc in enumerate(self.procs):
            if proc is not None and proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(10)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(5)
            self.procs[i] = None

    def __enter__(self) -> NatsCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()


async def _quiet(exc: Exception) -> None:  # nats-py's default logs a traceback per try
    pass


def wait_accepts(urls: list[str], user: str, password: str, timeout_s: float, accepted: bool = True) -> None:
    """Wait until every server of ``urls`` accepts ``user`` with ``password`` (after a
    reload that added it); ``accepted=False``: until every one refuses it (after a reload
    that removed it).

    Raises:
        RuntimeError: one still refuses (accepts) it after ``timeout_s``.
    """
    import nats

    async def accepts(url: str) -> bool:
        try:
            nc = await nats.connect(url, user=user, password=password, connect_timeout=1,
                                    max_reconnect_attempts=0, allow_reconnect=False, error_cb=_quiet)
        except Exception:  # noqa: BLE001 - not reloaded yet
            return False
        await nc.close()
        return True

    end = time.monotonic() + timeout_s
    for url in urls:
        while asyncio.run(accepts(url)) != accepted:
            if time.monotonic() > end:
                raise RuntimeError(f"NATS at {url} still {'refuses' if accepted else 'accepts'} user {user!r} "
                                   f"{timeout_s} s after a reload")
            time.sleep(0.1)
