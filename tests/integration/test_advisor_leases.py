"""Partition leases in a JetStream KV bucket (advisor/cluster/leases.py), on a private nats-server:
every partition has exactly one owner, a crashed owner's partitions are taken over after
the TTL, a joining advisor gets its share, and a process killed with SIGKILL loses its
partitions to the others."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import math
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable
from typing import Any

import nats
import pytest

from advisor.cluster.leases import LeaseError, LeaseKeeper, LeaseSettings, lease_owners
from tests.nats_proxy import NatsDeliveryDelayProxy

P = 8
SETTINGS = LeaseSettings(partitions=P, ttl_s=3.0, heartbeat_s=0.5)


def _wait(cond: Callable[[], bool], timeout_s: float, what: str) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if cond():
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


class _Recorder:
    """Records (event, partition) per keeper and checks no two keepers hold a partition at
    once, from their own callbacks (the view a mover acts on)."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.holder: dict[int, str] = {}
        self.overlaps: list[tuple[int, str, str]] = []
        self.events: list[tuple[str, str, int]] = []

    def keeper(self, url: str, name: str, settings: LeaseSettings = SETTINGS,
               cls: type[LeaseKeeper] = LeaseKeeper) -> LeaseKeeper:
        def acq(p: int) -> None:
            with self.lock:
                if p in self.holder:
                    self.overlaps.append((p, self.holder[p], name))
                self.holder[p] = name
                self.events.append(("acquire", name, p))

        def rel(p: int, reason: str) -> None:
            with self.lock:
                if self.holder.get(p) == name:
                    del self.holder[p]
                self.events.append((reason, name, p))

        return cls(url, name, settings, on_acquire=acq, on_release=rel)


def _balanced(keepers: list[LeaseKeeper]) -> bool:
    sets = [k.owned() for k in keepers]
    union = set().union(*sets)
    disjoint = sum(map(len, sets)) == len(union)
    target = -(-P // len(keepers))
    return disjoint and union == set(range(P)) and all(len(s) <= target for s in sets)


def test_leases_balance_take_over_and_rebalance(js_url: str) -> None:
    rec = _Recorder()
    ks = [rec.keeper(js_url, f"adv-{i}").start() for i in range(3)]
    try:
        _wait(lambda: _balanced(ks), 15, "3 advisors to share 8 partitions")
        assert sorted(len(k.owned()) for k in ks) == [2, 3, 3]
        owners = lease_owners(js_url)
        assert sorted(owners) == list(range(P))
        for k in ks:
            assert {p for p, o in owners.items() if o == k.advisor_id} == set(k.owned())

        # a crash: no release; its partitions come back after the TTL, to the survivors
        dead = ks.pop(0)
        lost = set(dead.owned())
        # a dead process holds nothing and says nothing: forgotten before the crash, so that a
        # take-over, however soon after the crash the test gets here, is not seen as an overlap
        with rec.lock:
            rec.holder = {p: n for p, n in rec.holder.items() if n != dead.advisor_id}
        crashed = time.monotonic()  # read before the crash: its leases were renewed at most a heartbeat before
        dead.crash()
        assert dead.owned() == frozenset()
        _wait(lambda: _balanced(ks), 15, "the survivors to take over")
        # not before the lease could expire: the look that found the take-over came no earlier
        # than half a TTL after the crash (measured from before crash(), whose teardown may
        # take long on a loaded machine, a late look only makes this weaker)
        assert time.monotonic() - crashed >= SETTINGS.ttl_s * 0.5
        assert sorted(len(k.owned()) for k in ks) == [4, 4]
        assert lost <= set().union(*(k.owned() for k in ks))

        # a joiner gets its share: the others release their extras
        ks.append(rec.keeper(js_url, "adv-new").start())
        _wait(lambda: _balanced(ks) and len(ks[-1].owned()) >= 2, 15, "a rebalance to the joiner")
        assert ("rebalance" in {e for e, _, _ in rec.events})

        # a graceful stop hands its partitions over at once (no TTL wait)
        leaving = ks.pop()
        leaving.stop()
        # its leases are deleted before stop() returns (an expiry would leave them for a TTL)
        assert leaving.advisor_id not in lease_owners(js_url).values()
        _wait(lambda: _balanced(ks), 15, "the take-over after a graceful stop")
    finally:
        for k in ks:
            k.stop()
    assert rec.overlaps == []


def test_a_read_of_the_bucket_does_not_depend_on_consumer_deliveries(js_url: str) -> None:
    # through a proxy that hands JetStream deliveries over 0.5 s late, a watcher's consumer
    # info (nothing pending) came before its deliveries, and a read that trusted nats-py's
    # end marker saw an empty bucket (no owner at all, as seen in a full-suite run); a read
    # now lists the keys and gets each value (API requests only), so nothing it needs is held
    ks = [LeaseKeeper(js_url, f"adv-{i}", SETTINGS).start() for i in range(2)]
    try:
        _wait(lambda: _balanced(ks), 15, "2 advisors to share 8 partitions")
        direct = lease_owners(js_url)
        assert sorted(direct) == list(range(P))
        with NatsDeliveryDelayProxy(int(js_url.rsplit(":", 1)[1]), 0.5) as proxy:
            assert lease_owners(proxy.url) == direct
            assert proxy.delayed == 0  # no consumer delivery was needed
            # a keeper whose reads come late sees every member: it gets its share, and the
            # others hand theirs over (a read of no member would aim at all 8 partitions)
            ks.append(LeaseKeeper(proxy.url, "adv-late", SETTINGS).start())
            _wait(lambda: _balanced(ks) and len(ks[-1].owned()) >= 2, 20, "a rebalance to the late reader")
            for k in ks:
                k.stop()
            # a bucket whose every key was deleted holds only delete markers: read as empty
            assert lease_owners(proxy.url) == {}
    finally:
        for k in ks:
            k.stop()


def test_advisors_started_together_split_without_a_hand_over(js_url: str) -> None:
    """The second advisor starts right after the first one's start returns: the first takes
    nothing during its join delay, so both take their half directly and nobody releases
    a partition it took (without the delay the first takes all 8, then hands 4 over).

    On a loaded machine the second start (connect, bind the bucket) took longer than the
    default delay (a heartbeat, 0.5 s), so it did not start "together" and the first took
    all 8 (seen in a full-suite run); a longer delay (2 s) only moves that bound.  So the
    first one's join delay here lasts until the second has joined as well: a round of the
    first takes partitions only if the second's member entry was written before that round
    read the bucket, however long the second start took."""
    settings = dataclasses.replace(SETTINGS, join_delay_s=2.0)
    together = threading.Event()  # the second has joined: its member entry is in the bucket

    class FirstOfTwo(LeaseKeeper):
        seen_second = False

        async def _balance(self, kv: Any) -> None:
            self.seen_second = together.is_set()  # read before this round reads the members
            await super()._balance(kv)

        def _join_delay(self) -> float:
            return super()._join_delay() if self.seen_second else math.inf

    rec = _Recorder()
    ks = []
    try:
        ks.append(rec.keeper(js_url, "adv-0", settings, cls=FirstOfTwo).start())
        ks.append(rec.keeper(js_url, "adv-1", settings).start())
        together.set()
        joined_at = ks[0]._joined_at  # the first one's join delay runs from its first heartbeat
        assert joined_at is not None
        apart_s = time.monotonic() - joined_at  # named when the split below fails: not together
        _wait(lambda: _balanced(ks), 15, "2 advisors to share 8 partitions")
        assert sorted(len(k.owned()) for k in ks) == [4, 4]
        assert [e for e in rec.events if e[0] != "acquire"] == [], f"the second joined {apart_s:.2f} s after the first"
        assert sum(k.counters["released"] for k in ks) == 0
    finally:
        for k in ks:
            k.stop()
    assert rec.overlaps == []


def test_the_join_delay_is_one_heartbeat_unless_set() -> None:
    assert LeaseKeeper("nats://127.0.0.1:1", "a", LeaseSettings(partitions=4, heartbeat_s=0.7))._join_delay() == 0.7
    assert LeaseKeeper("nats://127.0.0.1:1", "a", LeaseSettings(partitions=4, heartbeat_s=0.7, join_delay_s=1.5))._join_delay() == 1.5
    assert LeaseKeeper("nats://127.0.0.1:1", "a", LeaseSettings(partitions=4, heartbeat_s=0.7, join_delay_s=0))._join_delay() == 0


def test_a_partition_its_owner_cannot_serve_is_handed_back_at_once(js_url: str) -> None:
    """on_acquire returning False (the stream did not answer, say) releases the lease in the
    same round, so a partition is never held by an advisor that does not serve it."""
    calls: list[tuple[str, int]] = []

    def acq(p: int) -> bool:
        calls.append(("acquire", p))
        return not (p == 0 and calls.count(("acquire", 0)) == 1)  # the first try at 0 fails

    k = LeaseKeeper(js_url, "adv-f", SETTINGS, on_acquire=acq,
                    on_release=lambda p, why: calls.append((why, p))).start()
    try:
        _wait(lambda: k.owned() == frozenset(range(P)), 15, "all partitions served")
        assert calls.count(("acquire", 0)) == 2 and ("failed", 0) in calls
        assert calls.index(("failed", 0)) < len(calls) - 1 - calls[::-1].index(("acquire", 0))
        assert k.counters["refused"] == 1
    finally:
        k.stop()


def _delete_key(url: str, key: str, bucket: str = "KVADVISOR_LEASES") -> None:
    async def go() -> None:
        nc = await nats.connect(url)
        try:
            await (await nc.jetstream().key_value(bucket)).delete(key)
        finally:
            await nc.close()

    asyncio.run(go())


def test_an_owner_that_takes_longer_than_the_ttl_to_open_a_partition_keeps_its_leases(js_url: str) -> None:
    """Opening a partition (on_acquire: rebuilding its replica from a slow stream) may take
    longer than the lease TTL, and another lease may be lost meanwhile.  The renewals go on
    beside the callback: the owner keeps the leases it held and the one being opened, the
    bucket keeps their entries (no peer could take them), the lost one is reported once, after
    the slow callback (callbacks never overlap), and every entry is gone after the stop.
    (When the keeper ran the callbacks between its renewals, every lease expired locally
    during a slow open; when the renewals waited for a queued callback, a single loss did the same.)"""
    settings = LeaseSettings(partitions=3, ttl_s=3.0, heartbeat_s=0.5, join_delay_s=0)
    events: list[tuple[str, int]] = []
    running = threading.Lock()
    overlaps = []
    slow = threading.Event()

    def acq(p: int) -> None:
        if not running.acquire(blocking=False):
            overlaps.append(("acquire", p))
            return
        try:
            events.append(("acquire", p))
            if sum(e == "acquire" for e, _ in events) == 3:  # the third opens slowly: twice the TTL
                slow.set()
                time.sleep(2 * settings.ttl_s)
            events.append(("opened", p))
        finally:
            running.release()

    def rel(p: int, reason: str) -> None:
        if not running.acquire(blocking=False):
            overlaps.append((reason, p))
            return
        events.append((reason, p))
        running.release()

    k = LeaseKeeper(js_url, "adv-slow", settings, on_acquire=acq, on_release=rel)
    starter = threading.Thread(target=k.start)
    starter.start()
    try:
        assert slow.wait(30), events
        first = events[0][1]
        _delete_key(js_url, f"part.{first}")  # lost while the third one opens
        starter.join(30)
        _wait(lambda: k.counters["lost"] == 1, 15, "the deleted lease reported lost")
        second, slow_p = events[2][1], events[4][1]
        assert events[:6] == [("acquire", first), ("opened", first), ("acquire", second), ("opened", second),
                              ("acquire", slow_p), ("opened", slow_p)], events
        _wait(lambda: ("lost", first) in events, 15, "on_release(lost)")
        assert events.index(("lost", first)) > events.index(("opened", slow_p))
        time.sleep(settings.ttl_s)  # time passes: a TTL more, after which the bucket would have dropped a stale entry
        assert k.counters["lost"] == 1 and not overlaps, (k.counters, overlaps)
        owners = lease_owners(js_url)
        assert {p for p, o in owners.items() if o == "adv-slow"} >= {second, slow_p}, owners
        assert k.owned() >= {second, slow_p}
    finally:
        starter.join(30)
        k.stop(30)
    assert lease_owners(js_url) == {}


_CHILD = textwrap.dedent("""
    import sys, time
    from advisor.cluster.leases import LeaseKeeper, LeaseSettings
    k = LeaseKeeper(sys.argv[1], "victim", LeaseSettings(partitions=8, ttl_s=3.0, heartbeat_s=0.5)).start()
    while len(k.owned()) < 8:
        time.sleep(0.05)
    print("owns", flush=True)
    time.sleep(600)
""")


def test_sigkill_of_an_owner_hands_its_partitions_over(js_url: str) -> None:
    child = subprocess.Popen([sys.executable, "-c", _CHILD, js_url], stdout=subprocess.PIPE, text=True)
    k = None
    try:
        assert child.stdout is not None and child.stdout.readline().strip() == "owns"
        k = LeaseKeeper(js_url, "survivor", SETTINGS).start()
        time.sleep(1.0)
        # the victim is alive: the survivor gets its share only after the victim releases extras
        _wait(lambda: len(k.owned()) == 4, 15, "a share for the second advisor")
        child.kill()
        child.wait(10)
        # a deadline the product promises (docs/scaling.md): a dead owner's leases are taken
        # over after their TTL (3 s) and a heartbeat (0.5 s); _wait fails past 15 s, over 4x
        _wait(lambda: len(k.owned()) == P, 15, "the take-over after SIGKILL")
        assert set(lease_owners(js_url).values()) == {"survivor"}
    finally:
        if child.poll() is None:
            child.kill()
        if k is not None:
            k.stop()


def test_bad_settings_and_unreachable_server_are_clear_errors() -> None:
    with pytest.raises(LeaseError, match="heartbeat_s"):
        LeaseSettings(partitions=4, ttl_s=1.0, heartbeat_s=0.5)
    with pytest.raises(LeaseError, match="partitions"):
        LeaseSettings(partitions=0)
    with pytest.raises(LeaseError, match="advisor id"):
        LeaseKeeper("nats://127.0.0.1:1", "a.b", LeaseSettings(4))
    with pytest.raises(LeaseError, match=r"nats://\*\*\*@127\.0\.0\.1:1"):
        LeaseKeeper("nats://s3cret@127.0.0.1:1", "a", LeaseSettings(4, connect_timeout_s=0.5)).start()


def test_a_bucket_with_another_ttl_is_refused(js_url: str) -> None:
    k = LeaseKeeper(js_url, "a", SETTINGS).start()
    try:
        with pytest.raises(LeaseError, match="ttl"):
            LeaseKeeper(js_url, "b", LeaseSettings(partitions=P, ttl_s=6.0, heartbeat_s=1.0)).start()
    finally:
        k.stop()


def test_a_lease_whose_epoch_cannot_be_read_is_handed_back_not_held_with_epoch_0(js_url: str,
                                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """The bucket's creation time is each lease's epoch (its fence ranks by (epoch, token)).
    When reading it fails right after a lease was created (here: as many reads in a row as
    the keeper tries), the keeper must hand that lease back, not hold it with epoch 0, which
    loses to every fence a former bucket left: the owner would write nothing for the whole
    ownership."""
    from nats.js.kv import KeyValue

    real_status = KeyValue.status
    calls = {"pass": 1, "fail": 3, "failed": 0}  # the keeper's bucket check passes, then 3 reads fail

    async def flaky_status(self: KeyValue) -> KeyValue.BucketStatus:
        if calls["pass"] > 0:
            calls["pass"] -= 1
        elif calls["fail"] > 0:
            calls["fail"] -= 1
            calls["failed"] += 1
            raise nats.errors.TimeoutError
        return await real_status(self)

    monkeypatch.setattr(KeyValue, "status", flaky_status)

    async def created_us() -> int:
        nc = await nats.connect(js_url)
        try:
            info = await nc.jetstream().stream_info("KV_KVADVISOR_LEASES")
            return int(info.created.timestamp() * 1_000_000)
        finally:
            await nc.close()

    k = LeaseKeeper(js_url, "adv-e", SETTINGS).start()
    try:
        _wait(lambda: k.owned() == frozenset(range(P)), 20, "all partitions owned")
        assert calls["failed"] == 3 and k.counters["refused"] == 1
        epoch = asyncio.run(created_us())
        assert epoch > 0 and {p: k.epoch(p) for p in range(P)} == dict.fromkeys(range(P), epoch)
    finally:
        k.stop()


def test_a_read_of_the_bucket_misses_no_entry_while_entries_are_rewritten(js_url: str) -> None:
    """Every lease and member entry is rewritten each heartbeat, so a read of the bucket
    always races rewrites.  A read must still return every live entry: one that missed a
    member entry made an advisor count too few members, take more than its share and hand
    it back."""
    bucket = "KVADVISOR_LEASES"
    stop = threading.Event()
    writes = {"n": 0}

    async def rewrite() -> None:
        nc = await nats.connect(js_url)
        try:
            from nats.js.api import KeyValueConfig

            kv = await nc.jetstream().create_key_value(KeyValueConfig(bucket=bucket, history=1, ttl=60.0))
            for p in range(P):
                await kv.put(f"part.{p}", json.dumps({"owner": f"adv-{p % 2}"}).encode())
            await kv.put("member.adv-0", b"{}")
            await kv.put("member.adv-1", b"{}")
            ready.set()
            while not stop.is_set():  # renewals: every entry written again, in turn
                for key in [f"part.{p}" for p in range(P)] + ["member.adv-0", "member.adv-1"]:
                    value = b"{}" if key.startswith("member") else json.dumps({"owner": "adv-1"}).encode()
                    await kv.put(key, value)
                    writes["n"] += 1
        finally:
            await nc.close()

    ready = threading.Event()
    writer = threading.Thread(target=lambda: asyncio.run(rewrite()), daemon=True)
    writer.start()
    try:
        assert ready.wait(20)
        reads = [lease_owners(js_url, bucket) for _ in range(60)]
    finally:
        stop.set()
        writer.join(10)
    assert writes["n"] > 0
    short = [sorted(set(range(P)) - set(r)) for r in reads if set(r) != set(range(P))]
    assert short == [], f"{len(short)} of {len(reads)} reads missed partitions, e.g. {short[:3]}"


def test_a_stop_that_outlasts_its_timeout_is_logged_and_still_completes(js_url: str, caplog) -> None:  # noqa: ANN001
    """``stop(timeout_s)`` waits that long for the keeper to release and leave; one still busy
    then (here: a mover's release callback that does not return) is named in the log, not
    waited for in silence, and finishes on its own once the callback returns."""
    settings = LeaseSettings(partitions=2, ttl_s=3.0, heartbeat_s=0.5, join_delay_s=0)
    unblock = threading.Event()
    k = LeaseKeeper(js_url, "adv-stuck", settings, on_release=lambda p, reason: unblock.wait(60))
    k.start()
    try:
        _wait(lambda: len(k.owned()) == 2, 15, "both leases taken")
        with caplog.at_level("WARNING", logger="advisor.cluster.leases"):
            k.stop(0.5)
        assert any("adv-stuck: still stopping" in r.getMessage() for r in caplog.records), caplog.text
    finally:
        unblock.set()
        k.stop(30)
    assert not k._thread.is_alive()  # noqa: SLF001 - the keeper ended once the callback returned
    _wait(lambda: lease_owners(js_url) == {}, 15, "every entry gone after the stop")
