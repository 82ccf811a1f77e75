"""Every thread's Python stack, grouped: what ``kill -USR1`` on ``python -m advisor`` writes.

:mod:`faulthandler` dumps at most 100 threads, newest first, without their names; an advisor
with 256 indexer registrations (a ZMQ subscriber thread each) would show only those, and not
the ingest or API threads a stall is looked for in. This dump names each thread and writes
threads with the same stack once, with their count and names.
"""

from __future__ import annotations

import sys
import threading
import traceback
from typing import TextIO


def dump_stacks(out: TextIO, *, max_names: int = 8) -> int:
    """Write every thread's stack to ``out``, the same stacks once (most threads first).

    Args:
        out: a text stream (the process's stderr, a file).
        max_names: thread names listed per group, the rest counted.

    Returns:
        Threads dumped.
    """
    names = {t.ident: t.name for t in threading.enumerate()}
    groups: dict[str, list[str]] = {}
    frames = sys._current_frames()
    for ident, frame in frames.items():
        stack = "".join(traceback.format_stack(frame))
        groups.setdefault(stack, []).append(names.get(ident, f"thread {ident}"))
    lines = [f"=== {len(frames)} threads, {len(groups)} distinct stacks (most recent call last)"]
    for stack, who in sorted(groups.items(), key=lambda kv: -len(kv[1])):
        shown = ", ".join(sorted(who)[:max_names]) + (f" and {len(who) - max_names} more" if len(who) > max_names else "")
        lines.append(f"--- {len(who)} thread(s): {shown}\n{stack}")
    lines.append("=== end of stacks\n")
    out.write("\n".join(lines))
    out.flush()
    return len(frames)


__all__ = ["dump_stacks"]
