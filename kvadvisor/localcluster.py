"""Local servers for the scaled topology without Docker: a NATS JetStream cluster on
loopback ports (docs/design.md §8; ``compose/`` describes the same topology in containers).

:class:`NatsCluster` writes one configuration file per node (``server_name``, client port,
cluster port, routes to the others, JetStream store directory), starts the installed
``nats-server`` binaries, waits until JetStream has a meta leader, and can kill, stop and
restart single nodes (fault drills).  Only loopback addresses are used.
"""

from __future__ import annotations

import asyncio
import shutil
import signal
import socket
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path

from storage_backends.ports import free_port

__all__ = ["NatsCluster", "free_port"]


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

    def __post_init__(self) -> None:
        self.root = Path(self.root)
        self.exe = self.exe or shutil.which("nats-server") or "/usr/sbin/nats-server"
        if not self.client_ports:
            self.client_ports = [free_port() for _ in range(self.nodes)]
            self.cluster_ports = [free_port() for _ in range(self.nodes)]
        self.procs = [None] * self.nodes

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
        conf.write_text(
            f'server_name: "n{i}"\n'
            f"listen: 127.0.0.1:{self.client_ports[i]}\n"
            f'jetstream {{ store_dir: "{store}" }}\n' + cluster)
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
        """Wait until every running node answers and JetStream answers account info."""
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

        try:
            nc = await nats.connect(self.urls, connect_timeout=1, max_reconnect_attempts=0,
                                    allow_reconnect=False)
        except Exception:  # noqa: BLE001 - not yet
            return False
        try:
            await nc.jetstream(timeout=1).account_info()
            return True
        except Exception:  # noqa: BLE001 - no meta leader yet
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
