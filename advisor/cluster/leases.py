"""Partition ownership through leases in a JetStream KV bucket (scaled mode, docs/design.md §8).

Each advisor of a cluster runs a :class:`LeaseKeeper`.  The bucket (``KVADVISOR_LEASES`` by
default, replicated like the event stream: ``replicas=3`` on a 3-node cluster) holds

* ``member.<advisor id>``: the advisor is alive; refreshed every ``heartbeat_s``;
* ``part.<n>``: partition ``n`` is owned by the advisor named in the value (JSON
  ``{"owner": id, "since_ns": t}``).

The bucket's ``ttl`` (JetStream ``max_age``) is the lease time: an entry that is not
rewritten within it disappears, so a dead advisor's membership and leases expire by
themselves; no home-made failure detector or consensus is involved, only JetStream's
compare-and-set on a key's revision:

* acquire: ``kv.create("part.<n>")`` succeeds for exactly one advisor while no live entry
  exists;
* renew: ``kv.update(..., last=revision)`` succeeds only for the holder of the latest
  revision; a failure means another advisor holds it now, and the lease is dropped at once;
* release: the owner stops using the partition (``on_release`` returns) and then deletes
  the key with ``last=revision``.

**Local expiry.**  An owner counts a lease as held only until ``renewed_at + ttl ×
safety`` (``safety`` 0.8 by default; ``renewed_at`` is taken *before* the renewal is sent).
The bucket keeps the entry at least ``ttl`` after the server stored it, so an owner that
cannot reach the server (a partition, a paused process) stops acting on a partition before
another advisor can acquire it, as long as clocks advance at the same rate (leases measure
intervals on each side's monotonic clock, never wall time).

**Balance.**  With ``M`` live members and ``P`` partitions each advisor aims at
``ceil(P / M)`` partitions: it acquires free ones up to that, and releases its extras (the
most recently acquired first) when it holds more, so a joining advisor gets partitions and
a dead one's are taken over after the TTL.  A new member takes nothing during its first
``join_delay_s``: advisors started together split the partitions at once.

Callbacks ``on_acquire(partition)`` and ``on_release(partition, reason)`` run one at a
time, in the order they were queued, on a worker thread of the keeper's loop; ``reason``
is ``"rebalance"``, ``"lost"`` (a renewal failed or the local expiry passed), ``"stop"``,
or ``"failed"``: ``on_acquire`` returned ``False`` or raised (it cannot serve the
partition), and the lease is handed back at once.  Renewals (and the member entry) run in
a task of their own every ``heartbeat_s`` and never wait for a callback: an owner that
takes long to open a partition (a slow stream, a large snapshot) or to close one (its last
snapshot) keeps every lease it holds, that one included, instead of letting them expire
locally and churning them to its peers.  A lease being released is no longer
:meth:`LeaseKeeper.owned` once its ``on_release`` is queued, and stays renewed until it
returns; then its entry is deleted.
"""

from __future__ import annotations

import asyncio
import json
import logging
import math
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import nats.errors
from nats.js.api import KeyValueConfig, StorageType
from nats.js.errors import BucketNotFoundError, KeyNotFoundError, KeyWrongLastSequenceError
from nats.js.errors import APIError

from event_plane.nats_auth import redact_url
from event_plane.nats_transport import connect_nats

__all__ = ["LeaseError", "LeaseKeeper", "LeaseSettings", "lease_owners"]

logger = logging.getLogger(__name__)

_ID_CHARS = set("abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789_-")


class LeaseError(RuntimeError):
    """The lease bucket cannot be reached, created or bound, or settings are impossible."""


@dataclass(frozen=True, slots=True)
class LeaseSettings:
    """Lease parameters.

    Attributes:
        partitions: partitions of the index (1 … 4096).
        ttl_s: lease time in seconds (the bucket's ``max_age``), > 0.
        heartbeat_s: seconds between renewals; at most ``ttl_s / 3``.
        safety: fraction of ``ttl_s`` an owner trusts a renewal for (0 < safety < 1).
        bucket: KV bucket name.
        replicas: bucket replicas (1, or 3 on a 3-node cluster).
        connect_timeout_s: bound on the first connect.
        join_delay_s: seconds after joining before an advisor takes its first partitions
            (``None``: one ``heartbeat_s``), so advisors started together see each other
            and split the partitions at once instead of one taking all and handing half
            over; the idea of Kafka's ``group.initial.rebalance.delay.ms``.

    Raises:
        LeaseError: a value out of range.
    """

    partitions: int
    ttl_s: float = 10.0
    heartbeat_s: float = 2.0
    safety: float = 0.8
    bucket: str = "KVADVISOR_LEASES"
    replicas: int = 1
    connect_timeout_s: float = 5.0
    join_delay_s: float | None = None

    def __post_init__(self) -> None:
        if not 1 <= self.partitions <= 4096:
            raise LeaseError(f"lease settings: partitions={self.partitions} must be in [1, 4096]")
        if not self.ttl_s > 0 or not 0 < self.heartbeat_s <= self.ttl_s / 3:
            raise LeaseError(f"lease settings: need ttl_s > 0 and 0 < heartbeat_s <= ttl_s / 3 "
                             f"(ttl_s={self.ttl_s}, heartbeat_s={self.heartbeat_s})")
        if not 0 < self.safety < 1:
            raise LeaseError(f"lease settings: safety={self.safety} must be in (0, 1)")
        if self.replicas not in (1, 3, 5):
            raise LeaseError(f"lease settings: replicas={self.replicas} must be 1, 3 or 5")
        if self.join_delay_s is not None and not 0 <= self.join_delay_s <= self.ttl_s:
            raise LeaseError(f"lease settings: join_delay_s={self.join_delay_s} must be in [0, ttl_s]")
        if not self.bucket or not set(self.bucket) <= _ID_CHARS:
            raise LeaseError(f"lease settings: bucket {self.bucket!r} must be letters, digits, '_' or '-'")


@dataclass(slots=True)
class _Lease:
    revision: int
    renewed_at: float  # monotonic, taken before the request that produced ``revision``
    acquired_at: float
    token: int = 0  # the revision the lease was created at (a fencing token: only grows)
    epoch: int = 0  # the bucket's creation time (µs) when the lease was created: its incarnation
    releasing: bool = False  # on_release is running: no longer owned(), still renewed until deleted


@dataclass
class LeaseKeeper:
    """Takes, renews and balances partition leases for one advisor (module docstring).

    Args:
        url: NATS server URL (``nats://``; any URL the event plane takes for NATS, with
            credentials and TLS from it).
        advisor_id: this advisor's name (letters, digits, ``_``, ``-``), unique in the cluster.
        settings: :class:`LeaseSettings`.
        on_acquire, on_release: callbacks (module docstring).
        connect_options: passed to ``nats.connect`` (credentials, TLS).

    Raises:
        LeaseError: from :meth:`start`, when the server or bucket cannot be used within
            ``connect_timeout_s``; a bad ``advisor_id``.
    """

    url: str
    advisor_id: str
    settings: LeaseSettings
    on_acquire: Callable[[int], None] | None = None
    on_release: Callable[[int, str], None] | None = None
    connect_options: dict[str, Any] = field(default_factory=dict)
    _leases: dict[int, _Lease] = field(default_factory=dict, init=False, repr=False)
    _lock: threading.Lock = field(default_factory=threading.Lock, init=False, repr=False)
    _thread: threading.Thread | None = field(default=None, init=False, repr=False)
    _loop: asyncio.AbstractEventLoop | None = field(default=None, init=False, repr=False)
    _stop: asyncio.Event | None = field(default=None, init=False, repr=False)
    _js: Any = field(default=None, init=False, repr=False)  # the keeper thread's JetStream context
    _crash: bool = field(default=False, init=False, repr=False)
    _ready: threading.Event = field(default_factory=threading.Event, init=False, repr=False)
    _error: BaseException | None = field(default=None, init=False, repr=False)
    _joined_at: float | None = field(default=None, init=False, repr=False)
    _kv: Any = field(default=None, init=False, repr=False)  # the bound bucket (rebound after a failed round)
    # asyncio objects bind to the loop that first waits on them (the keeper thread's)
    _kv_lock: asyncio.Lock = field(default_factory=asyncio.Lock, init=False, repr=False)
    _calls: asyncio.Queue[Any] = field(default_factory=asyncio.Queue, init=False, repr=False)
    _renew_stop: asyncio.Event = field(default_factory=asyncio.Event, init=False, repr=False)
    counters: dict[str, int] = field(default_factory=lambda: {
        "acquired": 0, "released": 0, "lost": 0, "renewals": 0, "errors": 0, "refused": 0}, init=False)

    def __post_init__(self) -> None:
        if not self.advisor_id or not set(self.advisor_id) <= _ID_CHARS:
            raise LeaseError(f"advisor id {self.advisor_id!r} must be letters, digits, '_' or '-'")

    # ------------------------------------------------------------------ public, any thread
    def start(self) -> LeaseKeeper:
        """Connect, bind or create the bucket, join, and start the keeper thread.

        Raises:
            LeaseError: the server or bucket cannot be used (message without secrets).
        """
        self._thread = threading.Thread(target=self._run, name=f"leases-{self.advisor_id}", daemon=True)
        self._thread.start()
        self._ready.wait(2 * self.settings.connect_timeout_s + 20.0)
        if self._error is not None:
            raise LeaseError(f"lease bucket {self.settings.bucket!r} at {redact_url(self.url)}: {self._error}")
        if not self._ready.is_set():
            raise LeaseError(f"lease bucket {self.settings.bucket!r} at {redact_url(self.url)}: no answer")
        return self

    def owned(self) -> frozenset[int]:
        """Partitions this advisor holds now (leases within their local expiry)."""
        now = time.monotonic()
        with self._lock:
            return frozenset(p for p, lease in self._leases.items()
                             if not self._lapsed(lease, now) and not lease.releasing)

    def _lapsed(self, lease: _Lease, now: float) -> bool:
        """Whether ``lease`` is past its local expiry at ``now`` (monotonic; module docstring)."""
        return now - lease.renewed_at >= self.settings.ttl_s * self.settings.safety

    def token(self, partition: int) -> int | None:
        """The fencing token of this advisor's lease on ``partition``: the bucket revision
        at which the lease was created (revisions only grow, so a later owner's token is
        higher), or ``None`` when it does not hold the lease."""
        with self._lock:
            lease = self._leases.get(partition)
            return lease.token if lease is not None else None

    def epoch(self, partition: int) -> int | None:
        """The incarnation of the bucket that issued :meth:`token` (its stream's creation
        time in microseconds, read when the lease was created; ``0`` when the server does
        not say), or ``None`` when it does not hold the lease.  A bucket created again
        (NATS data lost, the bucket deleted) numbers its revisions from 1 again: fences
        compare ``(epoch, token)`` (``storage_backends.Fence``), so its tokens still rank
        above the former bucket's."""
        with self._lock:
            lease = self._leases.get(partition)
            return lease.epoch if lease is not None else None

    def stop(self, timeout_s: float = 10.0) -> None:
        """Release every lease (``on_release(p, "stop")`` first), leave, and disconnect,
        waiting up to ``timeout_s`` seconds for that; a keeper still busy then (NATS not
        answering) is logged and left to end on its own: its leases lapse at their TTL."""
        self._signal_stop()
        if self._thread is not None:
            self._thread.join(timeout_s)
            if self._thread.is_alive():
                logger.warning("lease keeper %s: still stopping after %.0f s (leases lapse at their TTL)",
                               self.advisor_id, timeout_s)

    def crash(self) -> None:
        """Stop without releasing anything (as a killed process would): for tests and drills."""
        self._crash = True
        self.stop()

    def _signal_stop(self) -> None:
        loop, ev = self._loop, self._stop
        if loop is not None and ev is not None and not loop.is_closed():
            try:
                loop.call_soon_threadsafe(ev.set)
            except RuntimeError:
                pass

    # ------------------------------------------------------------------ keeper thread
    def _run(self) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        try:
            loop.run_until_complete(self._main())
        except BaseException as exc:  # noqa: BLE001 - reported to start() or logged
            if not self._ready.is_set():
                self._error = exc
                self._ready.set()
            else:
                logger.exception("lease keeper %s stopped", self.advisor_id)
        finally:
            loop.close()

    async def _main(self) -> None:
        s = self.settings
        self._stop = asyncio.Event()
        nc = await connect_nats(self.url, s.connect_timeout_s, dict(self.connect_options))
        caller = asyncio.create_task(self._run_callbacks())
        renewer: asyncio.Task[None] | None = None
        try:
            js = nc.jetstream(timeout=s.connect_timeout_s)
            self._js = js
            # a replicated bucket just created (by us or a peer) answers once its stream has a
            # leader: retry the first round for a while before calling the start failed
            deadline = time.monotonic() + s.connect_timeout_s + 10.0
            first = True
            while True:
                try:
                    if first:
                        self._kv = await self._bucket(js)
                        await self._keepalive(self._kv)
                        first = False
                        renewer = asyncio.create_task(self._renew_loop())
                    await self._balance(self._kv)
                    break
                except LeaseError:
                    raise
                except Exception as exc:  # noqa: BLE001 - retried until the deadline
                    if time.monotonic() > deadline:
                        raise
                    logger.info("lease keeper %s: bucket not ready yet (%s), retrying", self.advisor_id, exc)
                    await asyncio.sleep(0.3)
            self._ready.set()
            while not await _set_within(self._stop, s.heartbeat_s):
                try:
                    await self._balance(self._kv)
                except Exception as exc:  # noqa: BLE001 - a round failed: leases expire locally
                    self.counters["errors"] += 1
                    logger.warning("lease keeper %s: round failed: %s", self.advisor_id, exc)
                    self._expire_local()
                    # the bucket may be gone (deleted by someone with JetStream rights):
                    # bind it again, creating it if needed, so the next round can succeed
                    # (a new bucket has a new epoch, so no old lease fences a new one)
                    try:
                        self._kv = await self._bucket(js)
                    except Exception as again:  # noqa: BLE001 - the next round tries again
                        logger.warning("lease keeper %s: cannot bind the lease bucket: %s", self.advisor_id, again)
            if not self._crash:
                for p in sorted(set(self._leases)):  # renewed meanwhile: the last ones do not lapse
                    await self._release(self._kv, p, "stop")
            await self._stop_renewer(renewer)
            if not self._crash:
                try:
                    await self._kv.delete(f"member.{self.advisor_id}")
                except Exception:  # noqa: BLE001 - the entry expires anyway
                    pass
        finally:
            await self._stop_renewer(renewer)
            self._calls.put_nowait(None)  # the callbacks already queued run first
            await caller
            if self._crash:
                # a crashed process says nothing: drop the connection without a goodbye
                with self._lock:
                    self._leases.clear()
            await nc.close()

    async def _bucket(self, js: Any) -> Any:
        s = self.settings
        try:
            kv = await js.key_value(s.bucket)
            status = await kv.status()
            have = status.ttl or 0.0
            if abs(have - s.ttl_s) > 1e-3:
                raise LeaseError(f"bucket exists with ttl {have} s, configured {s.ttl_s} s "
                                 "(every advisor of a cluster must use the same lease ttl)")
            return kv
        except BucketNotFoundError:
            pass
        try:
            return await js.create_key_value(KeyValueConfig(
                bucket=s.bucket, history=1, ttl=s.ttl_s, replicas=s.replicas, storage=StorageType.FILE,
                description="kvadvisor partition leases"))
        except APIError:
            return await js.key_value(s.bucket)  # another advisor created it meanwhile

    # -- callbacks: one task runs them on a worker thread, one at a time, in queue order
    async def _run_callbacks(self) -> None:
        while (item := await self._calls.get()) is not None:
            fn, args, done = item
            try:
                result = await asyncio.to_thread(fn, *args)
            except Exception:  # noqa: BLE001 - the owner's error: logged, an acquisition counts as refused
                logger.exception("lease keeper %s: %s%r failed", self.advisor_id, getattr(fn, "__name__", fn), args)
                result = False
            if not done.done():
                done.set_result(result)

    def _queue_callback(self, fn: Callable[..., Any] | None, *args: Any) -> asyncio.Future[Any] | None:
        """Queue ``fn(*args)`` for the callback task; a future of its result, ``None`` without ``fn``."""
        if fn is None:
            return None
        done: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
        self._calls.put_nowait((fn, args, done))
        return done

    # -- renewals: a task of their own, never waiting for a callback
    async def _renew_loop(self) -> None:
        """Renew the held leases and the member entry every ``heartbeat_s`` (module docstring)."""
        while not await _set_within(self._renew_stop, self.settings.heartbeat_s):
            try:
                await self._keepalive(self._kv)
            except Exception as exc:  # noqa: BLE001 - a failed renewal: the leases expire locally
                self.counters["errors"] += 1
                logger.warning("lease keeper %s: renewal failed: %s", self.advisor_id, exc)
                self._expire_local()

    async def _stop_renewer(self, renewer: asyncio.Task[None] | None) -> None:
        """Stop the renewals between two passes (never in the middle of an update, whose new
        revision a later delete needs); again once stopped, it returns at once."""
        if renewer is not None:
            self._renew_stop.set()
            await asyncio.gather(renewer, return_exceptions=True)

    async def _keepalive(self, kv: Any) -> None:
        await kv.put(f"member.{self.advisor_id}", json.dumps({"since_ns": time.time_ns()}).encode())
        if self._joined_at is None:
            self._joined_at = time.monotonic()
        await self._renew(kv)

    async def _renew(self, kv: Any) -> None:
        with self._lock:
            held = list(self._leases)
        for p in held:
            async with self._kv_lock:  # a release deletes with the revision it reads under it
                with self._lock:
                    lease = self._leases.get(p)
                if lease is None:
                    continue
                t0 = time.monotonic()
                if self._lapsed(lease, t0):
                    self._lose(p, lease)
                    continue
                try:
                    rev = await kv.update(f"part.{p}", self._value(), last=lease.revision)
                except (KeyWrongLastSequenceError, KeyNotFoundError, APIError) as exc:
                    logger.warning("lease keeper %s: lost partition %d (%s)", self.advisor_id, p, exc)
                    self._lose(p, lease)
                    continue
                with self._lock:
                    lease.revision = rev
                    lease.renewed_at = t0
            self.counters["renewals"] += 1

    def _lose(self, p: int, lease: _Lease) -> None:
        """Forget ``lease`` on ``p`` (if it is still the one held) and queue ``on_release(p, "lost")``."""
        with self._lock:
            if self._leases.get(p) is not lease:
                return  # released, or lost and taken again, meanwhile: not this lease
            del self._leases[p]
        self.counters["lost"] += 1
        if not lease.releasing:  # else its on_release is queued already
            self._queue_callback(self.on_release, p, "lost")

    def _expire_local(self) -> None:
        now = time.monotonic()
        with self._lock:
            gone = [(p, lease) for p, lease in self._leases.items() if self._lapsed(lease, now)]
        for p, lease in gone:
            self._lose(p, lease)

    # -- balance: the main loop
    async def _balance(self, kv: Any) -> None:
        s = self.settings
        members, owners = _parse(await _entries(self._js, kv, s.bucket, s.connect_timeout_s))
        target = math.ceil(s.partitions / max(1, len(members)))
        mine = self.owned()
        if len(mine) > target:
            with self._lock:
                extra = sorted(mine, key=lambda p: -self._leases[p].acquired_at)[: len(mine) - target]
            for p in extra:
                await self._release(kv, p, "rebalance")
        elif len(mine) < target and time.monotonic() - self._joined_at >= self._join_delay():
            free = [p for p in range(s.partitions) if p not in owners and p not in self._leases]
            # start at an offset of our own so joiners do not all race for partition 0
            off = sum(map(ord, self.advisor_id)) % s.partitions
            free.sort(key=lambda p: (p - off) % s.partitions)
            for p in free[: target - len(mine)]:
                if self._stop is not None and self._stop.is_set():
                    break
                await self._acquire(kv, p)

    async def _acquire(self, kv: Any, p: int) -> None:
        t0 = time.monotonic()
        try:
            rev = await kv.create(f"part.{p}", self._value())
        except (KeyWrongLastSequenceError, APIError):
            return  # someone else took it first
        epoch = await _bucket_epoch(kv)
        if epoch is None:
            # without its incarnation the lease would fence with epoch 0, which loses to every
            # fence a former incarnation left, so the owner could write nothing for the whole
            # ownership: hand it back at once; it is taken again (by anyone) at a later round
            self.counters["refused"] += 1
            logger.warning("lease keeper %s: partition %d: the bucket's creation time could not be read; "
                           "lease released", self.advisor_id, p)
            await _delete_lease(kv, p, rev)
            return
        with self._lock:
            self._leases[p] = _Lease(rev, t0, t0, rev, epoch)
        self.counters["acquired"] += 1
        logger.info("lease keeper %s: acquired partition %d", self.advisor_id, p)
        done = self._queue_callback(self.on_acquire, p)
        if done is not None and await done is False:
            # the owner could not serve it (e.g. the stream did not answer in time): hand the
            # lease back at once instead of holding a partition nobody serves; it is taken
            # again (by anyone) at a later round
            self.counters["refused"] += 1
            logger.warning("lease keeper %s: partition %d could not be served; lease released", self.advisor_id, p)
            await self._release(kv, p, "failed")

    async def _release(self, kv: Any, p: int, reason: str) -> None:
        """Stop using ``p`` (``on_release``, the lease still renewed meanwhile), then delete its entry."""
        with self._lock:
            lease = self._leases.get(p)
            if lease is None or lease.releasing:
                return
            lease.releasing = True
        done = self._queue_callback(self.on_release, p, reason)
        if done is not None:
            await done  # stop using it before anyone else may take it
        async with self._kv_lock:  # no renewal between this read of the revision and the delete
            with self._lock:
                if self._leases.get(p) is not lease:
                    return  # lost meanwhile: nothing of ours to delete
                del self._leases[p]
            await _delete_lease(kv, p, lease.revision)
        self.counters["released"] += 1

    def _join_delay(self) -> float:
        d = self.settings.join_delay_s
        return self.settings.heartbeat_s if d is None else d

    def _value(self) -> bytes:
        return json.dumps({"owner": self.advisor_id, "since_ns": time.time_ns()}).encode()


async def _set_within(event: asyncio.Event, timeout_s: float) -> bool:
    """Whether ``event`` is set within ``timeout_s`` seconds (at once when it already is)."""
    try:
        await asyncio.wait_for(event.wait(), timeout_s)
    except asyncio.TimeoutError:
        pass
    return event.is_set()


async def _delete_lease(kv: Any, p: int, revision: int) -> None:
    """Delete ``part.<p>`` if it is still at ``revision`` (ours); expired or taken meanwhile,
    there is nothing of ours to delete."""
    try:
        await kv.delete(f"part.{p}", last=revision)
    except (KeyWrongLastSequenceError, KeyNotFoundError, APIError):
        pass


async def _bucket_epoch(kv: Any, attempts: int = 3, backoff_s: float = 0.2) -> int | None:
    """The bucket's stream creation time in microseconds: ``0`` when the server does not
    report one (then every lease of the bucket has epoch 0 and tokens alone order them),
    ``None`` when it cannot be read in ``attempts`` tries, ``backoff_s`` × the try apart."""
    for attempt in range(1, attempts + 1):
        try:
            created = (await kv.status()).stream_info.created
        except Exception as exc:  # noqa: BLE001 - any failure of the read is retried, then reported
            logger.warning("lease bucket: cannot read its creation time (try %d of %d): %s", attempt, attempts, exc)
            if attempt < attempts:
                await asyncio.sleep(backoff_s * attempt)
            continue
        return int(created.timestamp() * 1_000_000) if created is not None else 0
    return None


async def _entries(js: Any, kv: Any, bucket: str, timeout_s: float) -> dict[str, bytes]:
    """Every live ``key -> value`` of the bucket: its keys from the bucket stream's subject
    list (``KV_<bucket>``, subjects ``$KV.<bucket>.<key>``, NATS ADR-8; one stream-info
    request with a subject filter), then each key's value (``kv.get``, concurrently).  A
    key deleted or expired in between is left out.

    Not a watcher (``kv.watchall()``, an ordered consumer delivering each key's last
    message): a key rewritten while the watcher reads (``history=1`` deletes its older
    message before delivery) can be left out, and the last delivery still reports nothing
    pending.  Every entry here is rewritten each heartbeat (renewals, member entries), and
    with two keys rewritten in a loop beside it 2,986 of 4,828 watcher reads missed one
    (nats-server 2.9.10, nats-py); an advisor that missed a member entry counted too few
    members, took more than its share and handed it back (seen in a loaded test run).  This
    read missed none of 12,170 under the same writes
    (``tests/integration/test_advisor_leases.py`` reads under such writes).

    Raises:
        LeaseError: the bucket's subjects or a value cannot be read within ``timeout_s``.
    """
    prefix = f"$KV.{bucket}."
    try:
        state = (await asyncio.wait_for(js.stream_info(f"KV_{bucket}", subjects_filter=f"{prefix}>"),
                                        timeout_s)).state
    except (asyncio.TimeoutError, nats.errors.TimeoutError):
        raise LeaseError(f"lease bucket {bucket!r}: its keys could not be listed within {timeout_s} s") from None
    subjects = state.subjects or {}
    if not subjects and state.messages:
        raise LeaseError(f"lease bucket {bucket!r}: the server listed no keys for {state.messages} messages")

    async def value(key: str) -> bytes | None:
        try:
            entry = await kv.get(key)
        except KeyNotFoundError:  # a delete marker (nats-py raises it for KV_DEL / KV_PURGE) or expired
            return None
        return entry.value or None

    keys = [subject[len(prefix):] for subject in subjects if subject.startswith(prefix)]
    try:
        values = await asyncio.wait_for(asyncio.gather(*(value(k) for k in keys)), timeout_s)
    except (asyncio.TimeoutError, nats.errors.TimeoutError):
        raise LeaseError(f"lease bucket {bucket!r}: {len(keys)} values could not be read within {timeout_s} s") from None
    return {k: v for k, v in zip(keys, values) if v is not None}


def _parse(entries: dict[str, bytes]) -> tuple[list[str], dict[int, str]]:
    """``(members, {partition: owner})`` from the bucket's entries; malformed ones are skipped."""
    members: list[str] = []
    owners: dict[int, str] = {}
    for key, value in entries.items():
        kind, _, name = key.partition(".")
        try:
            if kind == "member":
                members.append(name)
            elif kind == "part":
                owners[int(name)] = str(json.loads(value)["owner"])
        except (ValueError, KeyError, TypeError):
            logger.warning("lease bucket: skipped malformed entry %r", key)
    return sorted(members), owners


def lease_owners(url: str, bucket: str = "KVADVISOR_LEASES", timeout_s: float = 5.0,
                 **connect_options: Any) -> dict[int, str]:
    """Current ``{partition: owner}`` of a lease bucket (partitions without a live lease
    are absent): what the API consults to route a lookup or answer 503 during a takeover.

    Raises:
        LeaseError: the server or bucket cannot be read.
    """
    async def read() -> dict[int, str]:
        nc = await connect_nats(url, timeout_s, connect_options)
        try:
            js = nc.jetstream(timeout=timeout_s)
            kv = await js.key_value(bucket)
            return _parse(await _entries(js, kv, bucket, timeout_s))[1]
        finally:
            await nc.close()

    try:
        return asyncio.run(read())
    except LeaseError:
        raise
    except Exception as exc:  # noqa: BLE001 - one clear error without secrets
        raise LeaseError(f"lease bucket {bucket!r} at {redact_url(url)}: {exc}") from exc
