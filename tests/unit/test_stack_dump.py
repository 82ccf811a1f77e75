"""advisor.embedded.stacks.dump_stacks: every thread named, the same stacks written once."""

from __future__ import annotations

import io
import threading

from advisor.embedded.stacks import dump_stacks


def _park(ev: threading.Event) -> None:
    ev.wait()


def test_threads_with_one_stack_are_written_once_with_their_names() -> None:
    ev = threading.Event()
    threads = [threading.Thread(target=_park, args=(ev,), name=f"parked-{i}") for i in range(12)]
    for t in threads:
        t.start()
    try:
        out = io.StringIO()
        n = dump_stacks(out, max_names=3)
        text = out.getvalue()
    finally:
        ev.set()
        for t in threads:
            t.join()
    assert n >= 13
    assert "--- 12 thread(s): parked-0, parked-1, parked-10 and 9 more" in text
    assert text.count("in _park") == 1  # one group for the twelve
    assert "MainThread" in text and "test_threads_with_one_stack" in text  # the caller's own stack
    assert text.rstrip().endswith("=== end of stacks")
