"""No test asserts a duration, except a deadline the product promises (a speed is a benchmark).

A speed is measured by a benchmark (``bench/``), never asserted by a test: a loaded CI machine
makes any such limit flaky.  This check reads every test module with :mod:`ast` and finds an
``assert`` that bounds a duration from above: ``elapsed < N`` where ``elapsed`` came from
``time.monotonic()`` / ``time.perf_counter()`` / ``time.time()`` (or the call itself).  Such an
assert is allowed only with a comment, on its line or the four above, that says it is
``a deadline the product promises`` (a lease take-over, a stop before SIGKILL: with at least
3x margin over what this machine measures) or that it ``bounds a wait`` (a polling loop's own
deadline).  Lower bounds (``waited >= delay``) are behaviour, and allowed.
"""

from __future__ import annotations

import ast
from pathlib import Path

TESTS = Path(__file__).resolve().parents[1]
TIME_CALLS = {"monotonic", "perf_counter", "time", "monotonic_ns", "perf_counter_ns"}
MARKERS = ("deadline the product promises", "bounds a wait")


def _is_time_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in TIME_CALLS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")


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
                        for a, op, b in zip(sides, cmp.ops, sides[1:]))
            if upper:
                near = "\n".join(lines[max(0, node.lineno - 5): node.end_lineno]).lower()
                if not any(m in near for m in MARKERS):
                    found.append(node.lineno)
                break
    return found


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
        "    # a deadline the product promises: the lease TTL plus a heartbeat, 4x\n"
        "    assert took <= 15\n"                     # marked: allowed
    )
    assert duration_asserts(src) == [6, 8]
