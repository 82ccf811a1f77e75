"""Hostile review of the publisher's on_flush delivery (55b0434, event_plane/publisher.py
``EventPublisher._deliver``): sent batches queue under the lock, one thread at a time runs
``on_flush`` outside it in seq order, ``flush``/``close`` wait until every sent batch ran.

The bugs it found (strict xfails at first) are fixed: ``on_flush`` now runs in
``_run_callbacks`` / ``_wait_callbacks`` / ``_run_claimed`` (each call runs up to its own
batches, the rest go to a delivery thread, bounded back-pressure, errors kept for the
``flush`` covering them); each test says what it was.  Anything that can hang runs in a
child interpreter with
``faulthandler.dump_traceback_later`` (a hang exits 1 with the stacks)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from event_plane import EventBatch, NullPublisher, PublisherClosedError, PublisherConfig, store
from tests.polling import wait_until

ROOT = Path(__file__).resolve().parents[2]

CHILD_PRELUDE = """
import faulthandler, random, sys, threading, time
from event_plane import NullPublisher, PublisherClosedError, PublisherConfig, store
from event_plane.codec import encode_event
def ev(h):
    return [store(h, h, None, 1, "g1")]
"""


def in_child(body: str, hang_s: float = 60) -> subprocess.CompletedProcess:
    """Run ``body`` in a fresh interpreter; a hang past ``hang_s`` dumps stacks and exits 1.

    The watchdog is armed after the imports (the prelude's and the body's leading ones):
    it bounds the part that could deadlock, not an import of torch on a loaded machine."""
    lines = textwrap.dedent(body).lstrip("\n").splitlines()
    n = 0
    while n < len(lines) and (lines[n].startswith(("import ", "from ")) or not lines[n].strip()):
        n += 1
    arm = f"faulthandler.dump_traceback_later({hang_s}, exit=True)\n"
    code = CHILD_PRELUDE + "\n".join(lines[:n]) + "\n" + arm + "\n".join(lines[n:]) + "\n"
    proc = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=hang_s + 30)
    assert proc.returncode == 0, f"child exited {proc.returncode}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def ev(h: int) -> list:
    return [store(h, h, None, 1, "g1")]


# ----------------------------------------------------------------------------- what held


def test_many_threads_timer_flush_and_reentrant_publish_deliver_every_seq_once_in_order() -> None:
    """6 threads x 400 calls mixing publish / publish_valid (lazy) / publish_encoded and
    random flush(), a 0.5 ms timer, an on_flush that sometimes publishes re-entrantly and
    sometimes raises: every seq runs exactly once, in order, never two at a time, and every
    accepted event is in exactly one delivered batch."""
    proc = in_child(
        """
        seqs, seen, active, peak = [], [], [0], [0]
        reentrant, errors = [], [0]
        rng_lock = threading.Lock()
        nxt = iter(range(10**9, 2 * 10**9))
        def on_flush(batch, payload):
            active[0] += 1
            peak[0] = max(peak[0], active[0])
            seqs.append(batch.seq)
            seen.extend(e.sequence_hash for e in batch.events)
            r = random.random()
            try:
                if r < 0.03:
                    h = next(nxt)
                    reentrant.append(h)
                    pub.publish(ev(h))
                elif r < 0.05:
                    raise RuntimeError("boom")
                elif r < 0.06:
                    time.sleep(0.002)
            finally:
                active[0] -= 1
        cfg = PublisherConfig(max_events=7, max_delay_s=0.0005, min_delay_s=0.0002, adaptive_delay=False)
        pub = NullPublisher("w0", config=cfg, on_flush=on_flush)
        accepted = [[] for _ in range(6)]
        def worker(k):
            rnd = random.Random(k)
            for i in range(400):
                hs = [k * 10**6 + i * 10 + j + 1 for j in range(rnd.randint(1, 5))]
                evs = [e for h in hs for e in ev(h)]
                how = rnd.random()
                try:
                    if how < 0.4:
                        pub.publish(evs)
                    elif how < 0.7:
                        pub.publish_valid(evs, max_event_bytes=64)
                    else:
                        pub.publish_encoded(b"".join(encode_event(e) for e in evs), len(evs))
                    accepted[k].extend(hs)
                    if rnd.random() < 0.03:
                        pub.flush()
                except RuntimeError as exc:
                    assert str(exc) == "boom", exc
                    errors[0] += 1
                    if not accepted[k] or accepted[k][-1] != hs[-1]:
                        accepted[k].extend(hs)  # the events were accepted before on_flush raised
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(6)]
        for t in ts: t.start()
        for t in ts: t.join()
        try:
            pub.close()
        except RuntimeError:
            errors[0] += 1
        assert peak[0] == 1, peak
        assert seqs == list(range(pub.next_seq)), (len(seqs), pub.next_seq)
        want = sorted([h for a in accepted for h in a] + reentrant)
        assert sorted(seen) == want, (len(seen), len(want))
        print("ok", pub.next_seq, len(seen), errors[0], len(reentrant))
        """
    )
    assert proc.stdout.startswith("ok")


def test_close_racing_publishers_delivers_exactly_the_accepted_events_before_it_returns() -> None:
    """4 threads publish until PublisherClosedError while the main thread closes: when
    close() returns, on_flush has run every accepted event once (and nothing after)."""
    proc = in_child(
        """
        seen, refused = [], [[] for _ in range(4)]
        attempted = [[] for _ in range(4)]
        def on_flush(batch, payload):
            seen.extend(e.sequence_hash for e in batch.events)
            if batch.seq % 5 == 0:
                time.sleep(0.001)
        pub = NullPublisher("w0", config=PublisherConfig(max_events=3, max_delay_s=0.001, adaptive_delay=False),
                            on_flush=on_flush)
        def worker(k):
            i = 0
            while True:
                i += 1
                h = k * 10**7 + i
                attempted[k].append(h)
                try:
                    pub.publish(ev(h))
                except PublisherClosedError:
                    refused[k].append(h)
                    return
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(4)]
        for t in ts: t.start()
        time.sleep(0.3)
        pub.close()
        at_close = list(seen)
        for t in ts: t.join()
        accepted = sorted(h for k in range(4) for h in attempted[k] if h not in refused[k])
        assert sorted(at_close) == accepted, (len(at_close), len(accepted))
        assert seen == at_close
        print("ok", len(accepted))
        """
    )
    assert proc.stdout.startswith("ok")


def test_close_from_inside_on_flush_on_the_timer_thread_delivers_the_rest_and_the_timer_exits() -> None:
    ran: list[int] = []
    closed = threading.Event()

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        ran.append(batch.seq)
        if threading.current_thread() is pub._timer and not closed.is_set():
            pub.publish(ev(50))  # pending: sent by the close below, run after this returns
            pub.close()
            closed.set()

    pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=0.01), on_flush=on_flush)
    pub.publish(ev(1))  # the timer sends it (seq 0) and runs on_flush, which closes
    assert closed.wait(5)
    pub._timer.join(5)
    assert not pub._timer.is_alive()
    assert ran == [0, 1]
    with pytest.raises(PublisherClosedError):
        pub.publish(ev(2))
    pub.close()  # idempotent, returns


def test_close_from_another_thread_waits_for_a_blocking_on_flush_then_runs_the_rest() -> None:
    gate, inside = threading.Event(), threading.Event()
    ran: list[int] = []

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        if batch.seq == 0:
            inside.set()
            gate.wait(5)
        ran.append(batch.seq)

    pub = NullPublisher("w0", config=PublisherConfig(max_events=1, max_delay_s=10), on_flush=on_flush)
    t = threading.Thread(target=pub.publish, args=(ev(1),))
    t.start()
    assert inside.wait(5)
    pub.publish(ev(2))  # seq 1, left to t
    done = threading.Event()
    c = threading.Thread(target=lambda: (pub.close(), done.set()))
    c.start()
    assert not done.wait(0.3) and ran == []  # close waits for the running callback
    gate.set()
    assert done.wait(5) and ran == [0, 1]
    t.join(5)
    c.join(5)


def test_on_flush_reading_four_pools_from_eight_threads_does_not_deadlock() -> None:
    """The pool test of test_runtime_pool_core_hostile, scaled: 4 pools on one publisher,
    2 threads per pool registering / evicting, on_flush reading every pool's stats (and
    evicting one block of the pool it reads) from whichever thread runs it."""
    proc = in_child(
        """
        import torch
        from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig, make_layout
        from kvbm_runtime.layout import MemoryKind
        from event_plane.urls import make_publisher
        CFG = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)
        pools, flushes = [], [0]
        def on_flush(batch, payload):
            flushes[0] += 1
            for p in pools:
                p.stats()
            try:
                pools[batch.seq % len(pools)].evict(1)  # publishes Removes re-entrantly
            except PublisherClosedError:
                pass  # only past _MAX_CLOSE_ROUNDS rounds of re-entrant publishes at close()
        cfg = PublisherConfig(max_events=64, max_delay_s=0.001, min_delay_s=0.0005, adaptive_delay=False)
        pub = make_publisher("null://", "w1", config=cfg, on_flush=on_flush)
        for n in range(4):
            lay = make_layout("FullyContiguous", CFG, 64, torch.device("cpu"), MemoryKind.SYSTEM)
            pools.append(BlockPool(f"g{n + 1}", lay, pub))
        stop = time.time() + 4
        def worker(k):
            pool, i = pools[k % 4], 0
            while time.time() < stop:
                i += 1
                base = (k * 1000 + i % 40) * 10
                try:
                    metas = [BlockMeta(h, None, h, 1) for h in range(base, base + 6)]
                    pool.register_downgrade(pool.allocate_complete(metas))
                except Exception as exc:  # PoolExhausted under contention is fine; a hang is not
                    if type(exc).__name__ != "PoolExhaustedError":
                        raise
                if i % 7 == 0:
                    pool.evict(3)
        ts = [threading.Thread(target=worker, args=(k,)) for k in range(8)]
        for t in ts: t.start()
        for t in ts: t.join()
        pub.close()
        assert flushes[0] > 0
        print("ok", flushes[0], pub.next_seq)
        """,
    )
    assert proc.stdout.startswith("ok")


def test_a_mover_sees_its_events_journaled_when_flush_returns_while_others_and_the_timer_publish() -> None:
    """The advisor's mover publishes Store + Remove then flush()es and the next step reads
    the index the journal fed (mover.py _move_group, service.py _on_own_batch): 300 rounds
    while another thread (1 batch / ms) and the 1 ms timer run on_flush for most batches."""
    journal: set[int] = set()
    jlock = threading.Lock()

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        time.sleep(0.0001)  # a journal append
        with jlock:
            journal.update(e.sequence_hash for e in batch.events)

    pub = NullPublisher("adv", config=PublisherConfig(max_events=4, max_delay_s=0.001, adaptive_delay=False),
                        on_flush=on_flush)
    stop, missing = threading.Event(), []

    def other() -> None:
        i = 0
        while not stop.is_set():
            i += 1
            pub.publish(ev(10**8 + i))
            time.sleep(0.001)

    def mover() -> None:
        for r in range(300):
            h = 2 * r + 1
            pub.publish(ev(h))
            pub.publish(ev(h + 1))
            pub.flush()
            with jlock:
                if not {h, h + 1} <= journal:
                    missing.append(r)

    o, m = threading.Thread(target=other, daemon=True), threading.Thread(target=mover, daemon=True)
    o.start()
    m.start()
    m.join(30)
    stop.set()
    o.join(5)
    assert not m.is_alive(), "the mover's flush() hung"
    pub.close()
    assert missing == []


def test_close_waits_for_the_timer_threads_slow_on_flush_and_exit_does_not_hang_on_the_daemon_timer() -> None:
    proc = in_child(
        """
        ran, inside = [], threading.Event()
        def slow(batch, payload):
            inside.set()
            time.sleep(0.5)
            ran.append(batch.seq)
        pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=0.01), on_flush=slow)
        pub.publish(ev(1))
        assert inside.wait(5)
        pub.publish(ev(2))
        pub.close()  # waits for the timer's on_flush of seq 0, then runs seq 1
        assert ran == [0, 1], ran
        inside.clear()
        left = NullPublisher("w1", config=PublisherConfig(max_events=100, max_delay_s=0.01), on_flush=slow)
        left.publish(ev(3))
        assert inside.wait(5)  # exit while the daemon timer is inside on_flush, never closed
        print("ok")
        """,
    )
    assert proc.stdout.startswith("ok")


# ----------------------------------------------------------------------------- bugs

NO_BACKPRESSURE = (  # the finding, fixed
    "no back-pressure: a publish that sends a batch while another thread runs on_flush only "
    "queues it (publisher.py _deliver, 'if not wait ... return'), so producers faster than "
    "on_flush grow _deliver_q without bound; the running thread loops until the queue is empty "
    "(its own publish() does not return) and flush() waits for _deliverer is None, not for the "
    "batches sent before it (starved while others publish)"
)


@pytest.fixture(scope="module")
def flood() -> dict[str, float]:
    """2 producers send ~1 batch/ms each (max_events=1) for 3 s while on_flush takes ~1 ms
    (a journal append with fsync): 2x what on_flush can run.  Records whether a flush()
    started at 0.2 s, and the publish() of the thread that ran seq 0, returned while the
    producers still ran (the flood only ends when they stop: a call that waits for an empty
    queue returns after it), how long each took (printed), and the largest backlog (sent,
    on_flush not yet run)."""
    slow, ran = [True], [0]
    deliverer_started = threading.Event()

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        ran[0] += 1
        if batch.seq == 0:
            deliverer_started.set()
        if slow[0]:
            time.sleep(0.001)

    pub = NullPublisher("w0", config=PublisherConfig(max_events=1, max_delay_s=10), on_flush=on_flush)
    out: dict[str, float] = {"flush_s": float("inf"), "first_publish_s": float("inf"), "max_backlog": 0,
                             "flush_in_flood": False, "first_publish_in_flood": False}
    stop = threading.Event()

    def first() -> None:
        t0 = time.monotonic()
        pub.publish(ev(1))  # seq 0: this thread starts running on_flush
        out["first_publish_s"] = time.monotonic() - t0
        out["first_publish_in_flood"] = not stop.is_set()

    def producer(k: int) -> None:
        i = 0
        while not stop.is_set():
            i += 1
            pub.publish(ev(k * 10**7 + i))
            time.sleep(0.001)

    f0 = threading.Thread(target=first)
    f0.start()
    assert deliverer_started.wait(5)
    ps = [threading.Thread(target=producer, args=(k,)) for k in (1, 2)]
    for p in ps:
        p.start()
    t_start = time.monotonic()

    def flusher() -> None:
        time.sleep(0.2)
        t0 = time.monotonic()
        pub.flush()
        out["flush_s"] = time.monotonic() - t0
        out["flush_in_flood"] = not stop.is_set()

    fl = threading.Thread(target=flusher)
    fl.start()
    while time.monotonic() - t_start < 3.0:
        out["max_backlog"] = max(out["max_backlog"], pub.next_seq - ran[0])
        time.sleep(0.01)
    stop.set()  # the flood ends here (then on_flush is fast again: what is left drains)
    slow[0] = False
    for t in (*ps, f0, fl):
        t.join(30)
    pub.close()
    assert ran[0] == pub.next_seq
    print(f"flood: flush {out['flush_s']:.2f} s, first publish {out['first_publish_s']:.2f} s, "
          f"backlog {out['max_backlog']}")
    return out


# fixed finding: NO_BACKPRESSURE
def test_flush_returns_while_other_threads_keep_publishing(flood: dict[str, float]) -> None:
    # what it has to wait for at 0.2 s: ~200-400 batches of ~1 ms (0.3-0.5 s here); with the
    # bug it waited for an empty queue, which only comes once the producers stop
    assert flood["flush_in_flood"], flood


# fixed finding: NO_BACKPRESSURE
def test_a_publish_call_does_not_run_other_threads_batches_for_ever(flood: dict[str, float]) -> None:
    # with the bug it ran the other threads' batches until the queue was empty: after the flood
    assert flood["first_publish_in_flood"], flood


# fixed finding: NO_BACKPRESSURE
def test_batches_waiting_for_on_flush_stay_bounded(flood: dict[str, float]) -> None:
    # before 55b0434 on_flush ran under the lock: at most one batch per thread waited
    assert flood["max_backlog"] <= 256, flood


# fixed finding: flush() swallows the on_flush error of the very batch it sent when another thread
# (the timer) runs it: the error is only logged there (publisher.py _timer_loop), flush()  returns
# normally. Before 55b0434 flush ran that on_flush itself and raised; the advisor's  mover
# (mover.py _move_group: publish + flush) now reports DONE a move whose journal  append failed
def test_flush_raises_when_on_flush_of_its_batch_failed_on_the_timer_thread() -> None:
    inside = threading.Event()

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        if batch.seq == 0:  # a timed batch: the timer thread runs it, slowly
            inside.set()
            time.sleep(0.3)
        if batch.seq == 1:
            raise RuntimeError("journal append failed")

    pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=0.01, adaptive_delay=False),
                        on_flush=on_flush)
    try:
        pub.publish(ev(1))
        assert inside.wait(5)
        pub.publish(ev(2))
        with pytest.raises(RuntimeError, match="journal append failed"):
            pub.flush()  # sends seq 1; the timer thread runs it (and logs the error)
    finally:
        pub.close()


# fixed finding: a KeyboardInterrupt that lands between _deliver's claim (self._deliverer = me,
# under cond) and its try: (publisher.py _deliver, the 'first: Exception | None = None'  line) is
# outside the except BaseException that resets _deliverer: the publisher thinks  that thread still
# runs on_flush for ever; later batches are never run, close() from that  thread returns without
# running them, flush() from any other thread hangs
def test_keyboard_interrupt_right_after_the_claim_does_not_wedge_the_publisher() -> None:
    in_child(
        """
        import inspect
        import event_plane.publisher as P
        ran = []
        pub = NullPublisher("w0", config=PublisherConfig(max_events=1, max_delay_s=10),
                            on_flush=lambda b, p: ran.append(b.seq))
        fn = P.EventPublisher._run_claimed
        src, start = inspect.getsourcelines(fn)
        claim = next(i for i, s in enumerate(src) if s.strip() == "self._deliverer = me")
        line = start + claim + 1  # the first line after the claim
        armed = [True]
        def local(frame, event, arg):
            if event == "line" and frame.f_lineno == line and armed[0]:
                armed[0] = False
                raise KeyboardInterrupt  # Ctrl-C delivered at this bytecode
            return local
        def tracer(frame, event, arg):
            return local if frame.f_code is fn.__code__ else None
        sys.settrace(tracer)
        try:
            pub.publish(ev(1))  # seq 0
        except KeyboardInterrupt:
            pass
        sys.settrace(None)
        assert not armed[0]
        pub.publish(ev(2))  # seq 1
        done = threading.Event()
        t = threading.Thread(target=lambda: (pub.flush(), done.set()), daemon=True)
        t.start()
        assert done.wait(3), "flush() from another thread hangs after a Ctrl-C in publish"
        pub.close()
        assert ran == [0, 1], ran
        print("ok")
        """
    )


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
# fixed finding: a BaseException (SystemExit, KeyboardInterrupt) from on_flush on the timer thread
# kills the timer (publisher.py _timer_loop catches Exception only) and _ensure_timer never
# starts another: no timed flush ever again, events wait for max_events or flush()  (pre-existing:
# the old timer loop caught Exception only too)
def test_a_base_exception_in_on_flush_on_the_timer_thread_does_not_stop_timed_flushes() -> None:
    ran: list[int] = []
    second = threading.Event()

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        ran.append(batch.seq)
        if batch.seq == 0:
            raise SystemExit  # e.g. sys.exit() in a callback: ends the thread that runs it
        second.set()

    pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=0.01, adaptive_delay=False),
                        on_flush=on_flush)
    try:
        pub.publish(ev(1))
        wait_until(lambda: ran, what="on_flush ran")
        assert ran == [0]
        time.sleep(0.05)
        pub.publish(ev(2))  # one event, far below max_events: only the timer sends it
        assert second.wait(2), f"no timed flush after the timer's on_flush raised (ran {ran})"
    finally:
        pub.close()


# fixed finding: a second close() returns at once ('if self._closed: return', publisher.py close)
# while  the first is still running on_flush for the last batches: 'close() returns after on_flush
# ran for every batch' does not hold for it. Before 55b0434 it blocked on the lock until the
# first close's on_flush ran. Fix: when already closed, still _deliver(wait=True) (and join  the
# timer unless on it) before returning
def test_a_second_close_waits_until_on_flush_ran_for_the_batches_the_first_sent() -> None:
    inside = threading.Event()
    ran: list[int] = []

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        inside.set()
        time.sleep(0.3)  # the last batch's journal append
        ran.append(batch.seq)

    pub = NullPublisher("w0", config=PublisherConfig(max_events=100, max_delay_s=10), on_flush=on_flush)
    pub.publish(ev(1))
    first = threading.Thread(target=pub.close)  # sends seq 0 and runs on_flush for it
    first.start()
    assert inside.wait(5)
    pub.close()  # e.g. a signal handler's stop() racing atexit's
    seen = list(ran)
    first.join(5)
    assert seen == [0]


# fixed finding: NO_BACKPRESSURE; a block pool publishes under its own lock, so the pool whose
# thread ran the loop stayed locked for as long as other pools kept publishing
def test_a_pool_is_not_locked_while_its_thread_runs_other_pools_on_flush() -> None:
    """kvbm_runtime/pool.py publishes under the pool's lock: the pool thread that becomes the
    one running on_flush keeps its pool locked while it runs every other pool's batches."""
    proc = in_child(
        """
        import torch
        from kvbm_runtime import BlockMeta, BlockPool, LayoutConfig, make_layout
        from kvbm_runtime.layout import MemoryKind
        from event_plane.urls import make_publisher
        CFG = LayoutConfig(num_layers=1, outer_dim=1, page_size=4, inner_dim=8, dtype=torch.float16)
        first, go, slow, stop = threading.Event(), threading.Event(), [True], threading.Event()
        def on_flush(batch, payload):
            if batch.seq == 0:  # p1's Store, run by t1 (holding p1's lock) until the flood runs
                first.set()
                go.wait(5)
            if slow[0]:
                time.sleep(0.001)  # a journal append
        pub = make_publisher("null://", "w1", config=PublisherConfig(max_events=1, max_delay_s=10), on_flush=on_flush)
        lay = lambda: make_layout("FullyContiguous", CFG, 64, torch.device("cpu"), MemoryKind.SYSTEM)
        p1, p2 = BlockPool("g1", lay(), pub), BlockPool("g2", lay(), pub)
        t1 = threading.Thread(target=lambda: p1.register_downgrade(p1.allocate_complete([BlockMeta(1, None, 1, 1)])))
        def flood(k):
            i = 0
            while not stop.is_set():
                i += 1
                h = k * 10**7 + i
                p2.register_downgrade(p2.allocate_complete([BlockMeta(h, None, h, 1)]))
                time.sleep(0.001)
        t1.start()  # p1's Store: seq 0, this thread runs on_flush, holding p1's lock
        assert first.wait(5)
        fs = [threading.Thread(target=flood, args=(k,)) for k in (1, 2)]
        for f in fs: f.start()
        time.sleep(0.05)
        go.set()
        time.sleep(0.1)
        def end():
            slow[0] = False
            stop.set()
        threading.Timer(3.0, end).start()
        p1.stats()  # e.g. the scheduler asking the host pool for free blocks
        # the flood runs until end(): stats() waiting for p1's lock returns only after it
        print("stats_before_end", not stop.is_set())
        for f in fs: f.join()
        t1.join()
        pub.close()
        """,
        hang_s=90,  # a hang bound only
    )
    assert "stats_before_end True" in proc.stdout, f"p1.stats() waited for p1's lock until the flood ended: {proc.stdout}"
