"""Leader / worker join at engine start, under KVBM's init timeout.

In NVIDIA Dynamo's KVBM the leader (the scheduler-side connector) waits at start-up until
every worker has joined, for at most ``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS`` (1,800 s
by default), and refuses to start otherwise.  Here each worker rank, once it holds the
engine's KV caches, answers on a ZMQ ``REP`` socket (IPC, in a directory only this user
can enter) with what it runs: page size, storage namespace, block bytes, pool sizes.  The
leader asks every rank and checks that they agree with it before the engine serves
anything.  The per-step traffic does not use this channel: it rides in the engine's own
step messages (see :mod:`kvbm_runtime.residency`).

Before it can answer, a worker says what it is doing (:class:`WorkerProgress`: a small
file beside its socket, e.g. "allocating the G2 host cache: 200.0 GiB"), so a join that
times out names what the late rank was doing and for how long, not just its number.
Sizing the timeout: a worker's start-up is dominated by allocating and touching its G2
host cache (``cpu_cache_gb``); allow that at the host's memory bandwidth for first
touches (a few GB/s per worker on a loaded host, so 200 GiB may take minutes) plus the
engine's own start (docs/operations.md, "KVBM settings").
"""

from __future__ import annotations

import json
import logging
import os
import tempfile
import threading
import time
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import zmq

from .errors import KvbmError

logger = logging.getLogger(__name__)

TIMEOUT_SETTING = "DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS"


class WorkerJoinError(KvbmError):
    """A worker did not join the leader in time, or runs another configuration."""


def endpoint_path(engine_id: str, rank: int, directory: str | os.PathLike[str] | None = None) -> str:
    """IPC endpoint of ``rank``'s join socket for one engine.

    The socket lives in ``<tmp>/kvbm-<uid>`` (mode 0700, created when missing), so other
    users of the machine can neither connect nor squat the name.

    Raises:
        WorkerJoinError: the directory exists but belongs to another user or is open to
            others.
    """
    base = Path(directory) if directory is not None else Path(tempfile.gettempdir()) / f"kvbm-{os.getuid()}"
    base.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = base.stat()
    if st.st_uid != os.getuid() or st.st_mode & 0o077:
        raise WorkerJoinError(f"{base} must belong to uid {os.getuid()} with mode 0700 (it is {oct(st.st_mode & 0o777)})")
    safe = "".join(c if c.isalnum() or c in "-_" else "_" for c in engine_id)[:64]
    return f"ipc://{base}/{safe}-rank{rank}.sock"


def progress_path(endpoint: str) -> Path:
    """The progress file of the worker rank answering on ``endpoint`` (beside its socket)."""
    return Path(endpoint.removeprefix("ipc://") + ".phase")


class WorkerProgress:
    """What a worker rank is doing before it answers the join (one JSON file, replaced
    atomically at each phase: ``{"phase", "since"}``, wall-clock seconds).

    Args:
        endpoint: the rank's join endpoint (:func:`endpoint_path`).
    """

    def __init__(self, endpoint: str) -> None:
        self.path = progress_path(endpoint)
        self.started = time.time()

    def phase(self, what: str) -> None:
        """Record that the worker now does ``what`` (best effort: a failure is logged)."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        try:
            tmp.write_text(json.dumps({"phase": what, "since": time.time(), "started": self.started}))
            os.replace(tmp, self.path)
        except OSError as exc:
            logger.warning("KVBM worker: cannot record its start-up phase in %s: %s", self.path, exc)

    def done(self) -> None:
        """Remove the file (the worker answers the join now)."""
        try:
            self.path.unlink()
        except FileNotFoundError:
            pass


def describe_progress(endpoint: str, now: float | None = None) -> str:
    """What the rank at ``endpoint`` reported doing, for an error message: ``"was
    <phase> (for N s, N s since it started)"``, or that it reported nothing (its process
    may not have started, or died)."""
    try:
        rec = json.loads(progress_path(endpoint).read_text())
    except (OSError, ValueError):
        return "reported no start-up progress (its process may not have started, or it died before)"
    now = time.time() if now is None else now
    return (f"was {rec.get('phase', '?')} (for {now - float(rec.get('since', now)):.0f} s, "
            f"{now - float(rec.get('started', now)):.0f} s since it started)")


class WorkerEndpoint:
    """A worker rank's join socket: answers every request with ``info`` (JSON).

    Args:
        endpoint: from :func:`endpoint_path`.
        info: what the worker runs (JSON-serialisable).
        context: ZMQ context (the process-wide one when ``None``).

    Raises:
        zmq.ZMQError: the endpoint cannot be bound.
    """

    def __init__(self, endpoint: str, info: Mapping[str, Any], context: zmq.Context[Any] | None = None) -> None:
        self.endpoint = endpoint
        self._reply = json.dumps(dict(info)).encode()
        ctx = context or zmq.Context.instance()
        path = endpoint.removeprefix("ipc://")
        if os.path.exists(path):  # left by a dead engine with the same id
            os.unlink(path)
        self._sock = ctx.socket(zmq.REP)
        self._sock.setsockopt(zmq.LINGER, 0)
        self._sock.bind(endpoint)
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="kvbm-join", daemon=True)
        self._thread.start()

    def _serve(self) -> None:
        poller = zmq.Poller()
        poller.register(self._sock, zmq.POLLIN)
        while not self._stop.is_set():
            if not poller.poll(100):
                continue
            try:
                self._sock.recv()
                self._sock.send(self._reply)
            except zmq.ZMQError:
                return

    def close(self) -> None:
        """Stop answering and remove the socket file (idempotent)."""
        if self._stop.is_set():
            return
        self._stop.set()
        self._thread.join(timeout=2)
        self._sock.close(0)
        path = self.endpoint.removeprefix("ipc://")
        if os.path.exists(path):
            os.unlink(path)


def join_workers(
    endpoints: Sequence[str],
    timeout_s: float,
    expect: Mapping[str, Any],
    context: zmq.Context[Any] | None = None,
) -> list[dict[str, Any]]:
    """Wait until every worker endpoint answers, then check it runs what ``expect`` says.

    Args:
        endpoints: one per rank, in rank order.
        timeout_s: the whole wait, seconds (``DYN_KVBM_LEADER_WORKER_INIT_TIMEOUT_SECS``).
        expect: keys every worker's answer must have with these values (e.g.
            ``page_size``, ``namespace``).

    Returns:
        The workers' answers, in rank order.

    Raises:
        WorkerJoinError: a rank did not answer within ``timeout_s`` (naming the rank, the
            endpoint, the setting and what the rank last reported doing, with how long:
            :class:`WorkerProgress`), or answered something that differs from ``expect``.
    """
    ctx = context or zmq.Context.instance()
    deadline = time.monotonic() + timeout_s
    out: list[dict[str, Any]] = []
    for rank, ep in enumerate(endpoints):
        sock = ctx.socket(zmq.REQ)
        sock.setsockopt(zmq.LINGER, 0)
        try:
            sock.connect(ep)
            sock.send(b"join")
            left_ms = max(0, int((deadline - time.monotonic()) * 1000))
            if not sock.poll(left_ms, zmq.POLLIN):
                raise WorkerJoinError(
                    f"KVBM worker rank {rank} did not join the leader within {timeout_s:g} s ({TIMEOUT_SETTING}; "
                    f"{ep}): it {describe_progress(ep)}; raise {TIMEOUT_SETTING} if workers start slowly "
                    "(a large cpu_cache_gb takes minutes to allocate)"
                )
            info = json.loads(sock.recv())
        finally:
            sock.close(0)
        bad = {k: (v, info.get(k)) for k, v in expect.items() if info.get(k) != v}
        if bad:
            detail = ", ".join(f"{k}: leader {a!r}, worker {b!r}" for k, (a, b) in bad.items())
            raise WorkerJoinError(f"KVBM worker rank {rank} runs another configuration ({detail})")
        out.append(info)
    logger.info("KVBM leader: %d worker(s) joined: %s", len(out), out)
    return out
