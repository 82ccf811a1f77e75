"""Adaptive flush time limit: the rule, the rate estimate, and a publisher under load."""

from __future__ import annotations

import math
import threading
import time

import pytest

from event_plane import ConfigError, EventBatch, NullPublisher, PublisherConfig, store
from event_plane.flush_policy import AdaptiveDelay, flush_delay


def test_rule_clamps_target_over_rate() -> None:
    assert flush_delay(0.0, 256, 0.01, 10.0) == 10.0  # at rest: the ceiling
    assert flush_delay(10.0, 256, 0.01, 10.0) == 10.0  # 25.6 s clamped to 10 s
    assert flush_delay(1000.0, 256, 0.01, 10.0) == pytest.approx(0.256)
    assert flush_delay(1e6, 256, 0.01, 10.0) == 0.01  # floor
    rates = [0.0, 1.0, 30.0, 100.0, 1e3, 1e4, 1e5, 1e7]
    delays = [flush_delay(r, 256, 0.01, 10.0) for r in rates]
    assert delays == sorted(delays, reverse=True)  # never longer at a higher rate


def test_rate_estimate_converges_and_decays() -> None:
    d = AdaptiveDelay(10.0, 0.01, 100, window_s=1.0)
    assert d.delay(0.0) == 10.0
    t = 0.0
    for _ in range(5000):  # 1,000 events/s for 5 s: 1 event per ms
        t += 0.001
        d.observe(1, t)
    assert d.rate(t) == pytest.approx(1000.0, rel=0.02)
    assert d.delay(t) == pytest.approx(0.1, rel=0.02)
    assert d.rate(t + 1.0) == pytest.approx(1000.0 / 2.718281828, rel=0.02)  # e-fold per window
    assert d.delay(t + 60.0) == 10.0  # idle again: back to the ceiling
    off = AdaptiveDelay(10.0, 0.01, 100, enabled=False)
    off.observe(10**6, 1.0)
    assert off.delay(1.0) == 10.0


@pytest.mark.parametrize("kw", [{"min_delay_s": 0}, {"rate_window_s": -1.0}, {"target_batch_events": 0}, {"adaptive_delay": 1}])
def test_config_rejects_bad_adaptive_settings(kw: dict) -> None:
    with pytest.raises(ConfigError):
        PublisherConfig(**kw)


RATE_WINDOW_S = PublisherConfig().rate_window_s
"""Time constant of the publishers' rate estimate here (the default): it decays e-fold per window."""


def _run_load(adaptive: bool, flushes: int = 0) -> tuple[list[float], NullPublisher, float]:
    """≥ 20k events/s (bursts of 200, so a loaded machine's long sleeps still leave a high
    rate) for 0.4 s, and on until the timer has flushed ``flushes`` batches (a loaded machine
    may run the timer thread late), into a publisher whose count and byte limits never
    trigger; returns each batch's age at flush (flush time - first event's publish time),
    the publisher and the monotonic time read after the last burst."""
    sent_at: dict[int, float] = {}
    ages: list[float] = []
    lock = threading.Lock()

    def on_flush(batch: EventBatch, payload: bytes) -> None:
        now = time.monotonic()
        with lock:
            ages.append(now - sent_at[batch.events[0].sequence_hash])

    cfg = PublisherConfig(
        max_events=10**6, max_bytes=10**8, max_delay_s=10.0, adaptive_delay=adaptive, min_delay_s=0.02, target_batch_events=200
    )
    pub = NullPublisher("w0", config=cfg, on_flush=on_flush)
    h = 1
    t_end = time.monotonic() + 0.4
    give_up = t_end + 60.0  # bounds a wait: the timer never flushing is a failure below
    while time.monotonic() < t_end or (len(ages) < flushes and time.monotonic() < give_up):
        now = time.monotonic()
        for _ in range(200):
            sent_at[h] = now
            pub.publish([store(h, 1, None, 4096, "g1")])
            h += 1
        time.sleep(0.001)
    last = time.monotonic()
    time.sleep(0.15)
    return ages, pub, last


def test_publisher_time_limit_drops_under_load_and_latency_stays_bounded() -> None:
    ages, pub, last = _run_load(adaptive=True, flushes=4)
    looked = time.monotonic()  # read before the look: the estimate read below is no older
    st = pub.stats()
    # the estimate saw the load: once the load stops it decays e-fold per window, so what it
    # held when the load ended is at least what it shows now scaled back by the time since
    # (a look made late on a loaded machine shows less, and is scaled back by more)
    at_end = st.event_rate * math.exp((looked - last) / RATE_WINDOW_S)
    assert at_end > 2000
    # the time limit follows the estimate: lowered from 10 s to target/rate, so under
    # 200 / 2,000 = 0.1 s when the load ended (computed, not measured)
    assert st.flush_delay_s == pytest.approx(flush_delay(st.event_rate, 200, 0.02, 10.0))
    assert len(ages) >= 4  # the timer flushed repeatedly under the load
    # a deadline the product promises: under load the time limit drops to target/rate
    # (min_delay_s, 0.02 s here), so every batch leaves within it plus the timer's
    # scheduling; measured 0.05-0.08 s here (0.5 s is over 6x that), never near the 10 s ceiling
    assert max(ages) < 0.5, ages
    pub.close()
    assert pub.stats().batches == len(ages)  # the close flush is reported too; nothing else

    ages_off, pub_off, _ = _run_load(adaptive=False)
    # fixed 10 s limit: no batch left before it (on an idle machine none has left at all;
    # one that left after a stall of the whole run past 10 s was 10 s old)
    assert all(age >= 10.0 for age in ages_off), ages_off
    assert pub_off.current_flush_delay() == 10.0
    pub_off.close()


def test_low_rate_keeps_the_ceiling() -> None:
    pub = NullPublisher("w0", config=PublisherConfig(max_delay_s=10.0))
    pub.publish([store(1, 1, None, 1, "g1")])
    assert pub.current_flush_delay() == pytest.approx(10.0)
    pub.close()


def test_rate_updates_at_most_once_per_thousandth_of_a_window_and_counts_every_event() -> None:
    d = AdaptiveDelay(10.0, 0.01, 100, window_s=1.0)
    assert d.observe(5, 100.0) is True  # the first observation always updates
    assert d.observe(5, 100.0002) is False  # within 1 ms: summed, not decayed yet
    assert d.observe(5, 100.0009) is False
    assert d.rate(100.0009) == pytest.approx(15.0, rel=1e-3)  # summed events count at once
    assert d.observe(5, 100.0011) is True  # the fold: 20 events, decayed by 1.1 ms at most
    assert d.rate(100.0011) == pytest.approx(20.0, rel=2e-3)
    assert d.observe(1, 99.0) is True  # a clock read earlier than the last update: no sum into the past
    assert d.rate(99.0) == pytest.approx(21.0, rel=2e-3)
