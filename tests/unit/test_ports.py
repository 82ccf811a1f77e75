"""Ports handed to servers that bind late must not come from the kernel's ephemeral range."""

from __future__ import annotations

import random
import socket
from collections import deque

import pytest

from storage_backends import ports
from storage_backends.ports import _bindable, _ephemeral_low, free_port


def test_ports_sit_below_the_ephemeral_range_where_no_connect_can_take_them() -> None:
    low = _ephemeral_low()
    ports = {free_port() for _ in range(50)}
    assert all(10_000 <= p < low for p in ports), sorted(ports)
    assert len(ports) > 1  # chosen at random, so two fixtures seldom race for one port


def test_a_run_of_ports_is_free_as_a_whole() -> None:
    first = free_port(count=2)
    assert first + 1 < _ephemeral_low()
    with socket.socket() as a, socket.socket() as b:
        a.bind(("127.0.0.1", first))
        b.bind(("127.0.0.1", first + 1))  # vLLM's replay socket sits at PORT + 1


def test_ports_not_yet_bound_are_not_handed_out_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    # the first draw is ``first`` again, later draws are random: a fixed second draw could be
    # bound by another process or handed out earlier in the run (seen once in a whole suite)
    monkeypatch.setattr(ports, "_RECENT", deque(maxlen=8))
    first = free_port()
    draws = iter([first])
    real = random.randint
    monkeypatch.setattr(random, "randint", lambda lo, hi: next(draws, None) or real(lo, hi))
    assert free_port() != first  # nobody bound ``first`` yet, but its caller is about to


def test_a_taken_port_is_never_returned(monkeypatch: pytest.MonkeyPatch) -> None:
    # the draws below are the held port's neighbours: pick a port whose neighbours are free
    # now (another process may hold any fixed port while the whole suite runs)
    start = next((p for p in (free_port(count=2) for _ in range(50))
                  if all(_bindable("127.0.0.1", q) for q in (p - 2, p - 1, p + 2))), None)
    assert start is not None, "no free port with free neighbours in 50 draws"
    with socket.socket() as held:
        held.bind(("127.0.0.1", start))
        taken = held.getsockname()[1]
        # the taken port itself, then a free one; a run that covers the taken port, then a free run
        draws = iter([taken, taken - 2, taken - 1, taken + 1])
        monkeypatch.setattr(ports, "_RECENT", deque(maxlen=8))  # only the bind check refuses
        monkeypatch.setattr(random, "randint", lambda lo, hi: next(draws))
        assert free_port() == taken - 2
        assert free_port(count=2) == taken + 1
