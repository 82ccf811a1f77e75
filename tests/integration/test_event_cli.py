"""``kvadvisor events tail|stats`` against a real ZMQ publisher (typer's CliRunner)."""

from __future__ import annotations

import json
import threading
import time

from typer.testing import CliRunner

from event_plane import PublisherConfig, ZmqPublisher, store
from kvadvisor.cli import app
from storage_backends.local_s3 import free_port

runner = CliRunner()


class Ticker:
    """Publishes one single-event batch every ``period`` seconds until stopped."""

    def __init__(self, pub: ZmqPublisher, start: int, period: float = 0.05) -> None:
        self.pub, self.next, self.period = pub, start, period
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def _run(self) -> None:
        while not self._stop.is_set():
            self.pub.publish([store(self.next, 1, self.next - 1, 4096, "g1")])
            self.next += 1
            time.sleep(self.period)

    def stop(self) -> None:
        self._stop.set()
        self._thread.join()


def test_tail_prints_events_in_order_with_gap_marker() -> None:
    port = free_port()
    # no replay socket: the batches sent before tail joined are a gap it reports
    pub = ZmqPublisher("w0", f"tcp://127.0.0.1:{port}", None, epoch=5, config=PublisherConfig(max_events=1))
    try:
        pub.publish([store(1, 1, None, 4096, "g1")])
        pub.publish([store(2, 1, 1, 4096, "g1")])
        ticker = Ticker(pub, 3)
        try:
            result = runner.invoke(app, ["events", "tail", f"zmq://127.0.0.1:{port}", "--count", "5", "--duration", "10"])
        finally:
            ticker.stop()
    finally:
        pub.close()
    assert result.exit_code == 0, result.output
    lines = [json.loads(line) for line in result.output.splitlines()]
    assert "gap" in lines[0]
    gap = lines[0]["gap"]
    events = lines[1:]
    assert len(events) == 5 and all("gap" not in e for e in events)
    first_seq = events[0]["seq"]
    assert gap == {"source": "w0", "epoch": 5, "first": 0, "last": first_seq - 1} and first_seq >= 2
    assert [e["seq"] for e in events] == list(range(first_seq, first_seq + 5))
    assert [e["sequence_hash"] for e in events] == [s + 1 for s in range(first_seq, first_seq + 5)]
    e = events[0]
    assert (e["source"], e["epoch"], e["index"], e["type"], e["prefix_hash"], e["block_size"], e["storage_location"]) == (
        "w0", 5, 0, "store", 1, 4096, "g1"
    )
    assert e["parent_hash"] == e["sequence_hash"] - 1 and e["extra_metadata"] is None


def test_tail_with_replay_recovers_history_and_stats_reports_rates() -> None:
    port, rport = free_port(), free_port()
    pub = ZmqPublisher("w0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{rport}", config=PublisherConfig(max_events=1))
    url = f"zmq://127.0.0.1:{port}?replay={rport}"
    try:
        for h in range(1, 4):
            pub.publish([store(h, 1, h - 1 or None, 4096, "g1")])
        ticker = Ticker(pub, 4)
        try:
            tail = runner.invoke(app, ["events", "tail", url, "-n", "6", "-d", "10"])
            stats = runner.invoke(app, ["events", "stats", url, "--duration", "1.0"])
        finally:
            ticker.stop()
    finally:
        pub.close()
    assert tail.exit_code == 0, tail.output
    lines = [json.loads(line) for line in tail.output.splitlines()]
    # the history sent before tail joined comes first, from the replay buffer (start-up
    # catch-up), so no gap is ever seen
    assert all("gap" not in x for x in lines)
    assert [x["sequence_hash"] for x in lines] == [1, 2, 3, 4, 5, 6]
    assert stats.exit_code == 0, stats.output
    report = json.loads(stats.output)
    assert report["events"] >= 10 and report["events"] == report["batches"]  # history + live ticks
    assert 5 < report["events_per_s"] < 10_000 and report["batches_per_s"] == report["events_per_s"]
    assert 30 < report["bytes_per_event"] < 100  # one small Store per batch: envelope included
    assert report["gaps"] == 0 and report["unrecovered"] == 0 and report["drops"] == 0 and report["replayed"] >= 3


def test_bad_url_is_a_clear_error() -> None:
    result = runner.invoke(app, ["events", "tail", "ftp://x:1"])
    assert result.exit_code == 2
    assert "unsupported event URL scheme" in result.output


def test_tail_and_stats_on_a_dead_endpoint_say_nothing_answered_and_exit_1() -> None:
    """Nothing listens on the loopback ports: tail warns on stderr after --connect-timeout
    and exits 1 when --duration ends; stats exits 1 with a message instead of a report of
    zeros. Both end on their own (a hang would end at pytest's timeout)."""
    url = f"zmq://127.0.0.1:{free_port()}?replay={free_port()}"
    tail = runner.invoke(app, ["events", "tail", url, "--duration", "1.2", "--connect-timeout", "0.3"])
    assert tail.exit_code == 1, tail.output
    assert tail.stdout == ""
    assert tail.stderr.count("nothing answered at " + url) == 2  # the warning, then the verdict
    assert "still waiting" in tail.stderr
    stats = runner.invoke(app, ["events", "stats", url, "--duration", "0.5"])
    assert stats.exit_code == 1, stats.output
    assert stats.stdout == "" and "nothing answered at " + url in stats.stderr


def test_tail_and_stats_on_a_live_but_quiet_publisher_exit_0() -> None:
    """A publisher with a replay socket answers the start-up catch-up even when it has sent
    nothing: that is an idle stream, not a dead endpoint."""
    port, replay = free_port(), free_port()
    pub = ZmqPublisher("w0", f"tcp://127.0.0.1:{port}", f"tcp://127.0.0.1:{replay}")
    try:
        url = f"zmq://127.0.0.1:{port}?replay={replay}"
        tail = runner.invoke(app, ["events", "tail", url, "--duration", "0.8", "--connect-timeout", "0.3"])
        assert tail.exit_code == 0 and tail.stderr == "", tail.output
        stats = runner.invoke(app, ["events", "stats", url, "--duration", "0.5"])
        assert stats.exit_code == 0, stats.output
        assert json.loads(stats.stdout)["batches"] == 0
    finally:
        pub.close()


def test_get_on_a_never_started_subscriber_raises_at_once() -> None:
    import pytest

    from event_plane import NotStartedError, iter_events, subscribe

    sub = subscribe(f"zmq://127.0.0.1:{free_port()}")
    with pytest.raises(NotStartedError, match="before start"):
        sub.get()  # used to block forever (pytest's timeout would end the test)
    with pytest.raises(NotStartedError):
        next(iter_events(sub, timeout=None))
    with pytest.raises(NotStartedError):
        subscribe([f"zmq://127.0.0.1:{free_port()}", f"zmq://127.0.0.1:{free_port()}"]).get(timeout=5)
    sub.close()
    assert sub.get(timeout=0.1) is None  # closed and drained: the documented end, no error
