"""No test asserts a duration, except a deadline the product promises (a speed is a benchmark).

A speed is measured by a benchmark (``bench/``), never asserted by a test: a loaded CI machine
makes any such limit flaky.  This check reads every test module with :mod:`ast` and finds an
``assert`` that bounds a duration from above: ``elapsed < N`` where ``elapsed`` came from
``time.monotonic()`` / ``time.perf_counter()`` / ``time.time()`` (or the call itself), or a
value named as a duration (``stop_s``, ``out["flush_s"]``, ``elapsed``, ``took``: measured
elsewhere, in a fixture or a child process) bounded by a number.  Such an
assert is allowed only with a comment, on its line or the four above, that says it is
``a deadline the product promises`` (a lease take-over, a stop before SIGKILL: with at least
3x margin over what this machine measures) or that it ``bounds a wait`` (a polling loop's own
deadline).  Lower bounds (``waited >= delay``) are behaviour, and allowed.

Nor does a test wait a fixed time for something to happen: it polls for the condition
(``tests/polling.py``: ``wait_until``; a fold, a flush, a counter, a server answering PING).
A fixed ``time.sleep`` / ``asyncio.sleep`` is kept only where time itself must pass: a TTL,
a rate limit's refill or a lease running out, a check that something does *not* happen
(what would show after the wait), a fake peer's pacing, ZMQ's slow joiner (no event tells a
PUB socket's subscription has arrived).  The check below finds the plain case, a sleep
directly followed by an ``assert``; such a sleep says why on its own line (``# time
passes: ...`` or ``# ... slow joiner ...``).  A sleep followed by other statements (a call,
then an assert) cannot be told from pacing by reading the code: the rule holds there too,
and review keeps it.
"""

from __future__ import annotations

import ast
import re
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIME_CALLS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns"}
MARKERS = ("deadline the product promises", "bounds a wait")
SLEEP_MARKERS = ("time passes", "slow joiner")
DURATION_NAME = re.compile(r"(^|_)(elapsed|took|waited|duration|latency)$|(?<!per)_s$|_secs?$|_seconds$")


def _is_time_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TIME_CALLS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")


def _named_duration(expr: ast.AST) -> bool:
    """A name, attribute or string-keyed item whose name says it is a duration."""
    name = (expr.id if isinstance(expr, ast.Name) else expr.attr if isinstance(expr, ast.Attribute)
            else expr.slice.value if isinstance(expr, ast.Subscript) and isinstance(expr.slice, ast.Constant)
            else None)
    return isinstance(name, str) and DURATION_NAME.search(name) is not None


def _number(expr: ast.AST) -> bool:
    """A bound made of numbers only (``20``, ``3 * 0.5``)."""
    return all(isinstance(x, (ast.Constant, ast.BinOp, ast.UnaryOp, ast.operator, ast.unaryop))
               for x in ast.walk(expr))


def duration_asserts(source: str) -> list[int]:
    """Lines of the asserts in ``source`` that bound a duration from above without a marker."""
    tree = ast.parse(source)
    timed: set[str] = set()
    for node in ast.walk(tree):
        if isinstance(node, (ast.Assign, ast.AnnAssign, ast.AugAssign)) and node.value is not None:
            if any(_is_time_call(x) for x in ast.walk(node.value)):
                for target in (node.targets if isinstance(node, ast.Assign) else [node.target]):
                    timed.update(n.id for n in ast.walk(target) if isinstance(n, ast.Name))

    def is_timed(expr: ast.AST) -> bool:
        return any(_is_time_call(x) or (isinstance(x, ast.Name) and x.id in timed) for x in ast.walk(expr))

    lines = source.splitlines()
    found = []
    for node in ast.walk(tree):
        if not isinstance(node, ast.Assert):
            continue
        for cmp in (c for c in ast.walk(node.test) if isinstance(c, ast.Compare)):
            sides = [cmp.left, *cmp.comparators]
            upper = any((isinstance(op, (ast.Lt, ast.LtE)) and is_timed(a) and not is_timed(b))
                        or (isinstance(op, (ast.Gt, ast.GtE)) and is_timed(b) and not is_timed(a))
                        or (isinstance(op, (ast.Lt, ast.LtE)) and _named_duration(a) and _number(b))
                        or (isinstance(op, (ast.Gt, ast.GtE)) and _named_duration(b) and _number(a))
                        for a, op, b in zip(sides, cmp.ops, sides[1:]))
            if upper:
                near = "\n".join(lines[max(0, node.lineno - 5): node.end_lineno]).lower()
                if not any(m in near for m in MARKERS):
                    found.append(node.lineno)
                break
    return found


def _is_fixed_sleep(st: ast.stmt) -> bool:
    """``time.sleep(...)``, ``asyncio.sleep(...)`` or ``await asyncio.sleep(...)`` as a statement."""
    if not isinstance(st, ast.Expr):
        return False
    call = st.value.value if isinstance(st.value, ast.Await) else st.value
    return (isinstance(call, ast.Call) and isinstance(call.func, ast.Attribute) and call.func.attr == "sleep"
            and isinstance(call.func.value, ast.Name) and call.func.value.id in ("time", "asyncio"))


def sleeps_before_asserts(source: str) -> list[int]:
    """Lines of the fixed sleeps in ``source`` directly followed by an ``assert`` whose line
    does not say why time must pass (:data:`SLEEP_MARKERS`)."""
    lines = source.splitlines()
    found = []
    for node in ast.walk(ast.parse(source)):
        for field in ("body", "orelse", "finalbody"):
            block = getattr(node, field, None)
            if not isinstance(block, list):
                continue
            for st, nxt in zip(block, block[1:]):
                if _is_fixed_sleep(st) and isinstance(nxt, ast.Assert):
                    said = lines[st.lineno - 1].partition("#")[2].lower()
                    if not any(m in said for m in SLEEP_MARKERS):
                        found.append(st.lineno)
    return sorted(found)


def test_no_test_asserts_a_duration() -> None:
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        for line in duration_asserts(path.read_text()):
            bad.append(f"{path.relative_to(TESTS.parent)}:{line}")
    assert not bad, "durations asserted in tests (poll with a deadline, or measure it in bench/):\n" + "\n".join(bad)


def test_the_check_finds_a_duration_bound() -> None:
    src = (
        "import time\n"
        "def test_a():\n"
        "    t0 = time.monotonic()\n"
        "    work()\n"
        "    took = time.monotonic() - t0\n"
        "    assert took < 5\n"                       # a budget: found
        "    assert took >= 0.1\n"                    # a lower bound: behaviour
        "    assert 5 > time.perf_counter() - t0\n"   # the same bound, reversed: found
        "    assert out['flush_s'] < 1.5\n"            # measured elsewhere, named a duration: found
        "    assert 2.0 > child.stop_s\n"              # the same, reversed: found
        "    assert 5 < report['events_per_s']\n"      # a rate: not a duration
        "    assert took_first <= ran + 0.1\n"         # two times compared: not a budget
        "    # a deadline the product promises: the lease TTL plus a heartbeat, 4x\n"
        "    assert took <= 15\n"                     # marked: allowed
    )
    assert duration_asserts(src) == [6, 8, 9, 10]


def test_no_test_sleeps_a_fixed_time_before_an_assert() -> None:
    bad = []
    for path in sorted(TESTS.rglob("*.py")):
        for line in sleeps_before_asserts(path.read_text()):
            bad.append(f"{path.relative_to(TESTS.parent)}:{line}")
    assert not bad, ("a fixed sleep, then an assert (poll with tests/polling.py wait_until, or say on the sleep's "
                     "line why time must pass: '# time passes: ...'):\n" + "\n".join(bad))


def test_the_check_finds_a_sleep_before_an_assert() -> None:
    src = (
        "import asyncio, time\n"
        "def test_a():\n"
        "    start()\n"
        "    time.sleep(0.5)\n"                            # waits for something: found
        "    assert done()\n"
        "    time.sleep(1.2)  # time passes: the TTL\n"    # time must pass: allowed
        "    assert expired()\n"
        "    while not done():\n"
        "        time.sleep(0.05)\n"                       # polling: allowed
        "    time.sleep(0.3)  # the Stores are folded\n"   # a reason that is a condition: found
        "    assert folded()\n"
        "async def test_b():\n"
        "    if x:\n"
        "        await asyncio.sleep(0.1)\n"               # nested, awaited: found
        "        assert y\n"
        "    time.sleep(0.1)\n"
        "    run()\n"                                     # not directly before an assert: not found
        "    assert z\n"
    )
    assert sleeps_before_asserts(src) == [4, 10, 14]
