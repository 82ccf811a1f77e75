"""Shared plumbing of the coverage-guided fuzz targets (``tests/fuzz/fuzz_*.py``).

A target module defines ``check(data: bytes) -> None``: it raises (``AssertionError`` for a
broken invariant, or whatever escaped the code under test) exactly when ``data`` shows a bug.
The same function serves three callers:

* ``python tests/fuzz/fuzz_<name>.py [libFuzzer flags] [corpus dirs]``: atheris drives it,
  coverage-guided (the project packages are imported instrumented);
* ``tests/fuzz/test_fuzz_bounded.py``: every file of ``corpus/<name>/`` and
  ``regressions/<name>/`` is replayed through it, and each target runs a bounded number of
  atheris iterations in a subprocess;
* a person reproducing a crasher: ``python tests/fuzz/fuzz_<name>.py CRASH_FILE``.

Several targets read a *record stream*: a flags byte, then records of a 2-byte big-endian
length and that many bytes (the last record takes what is left when the input is short), so
the fuzzer can feed several batches into one converter or one journal.
"""

from __future__ import annotations

import contextlib
import math
import os
import shlex
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

FUZZ_DIR = Path(__file__).resolve().parent
REPO = FUZZ_DIR.parents[1]
# The worktree's packages, not an installed copy of them.
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

INSTRUMENTED_PACKAGES = ("event_plane", "advisor")
"""Packages atheris instruments for coverage when a target runs as a fuzzer."""

DICTIONARY = FUZZ_DIR / "msgpack.dict"
"""libFuzzer dictionary of every target (MessagePack markers, special values, field names)."""

MAX_RECORDS = 16
"""Records a record stream is cut to (more only slows each run down)."""


def corpus_dir(name: str) -> Path:
    """The committed seed corpus of target ``name``."""
    return FUZZ_DIR / "corpus" / name


def regressions_dir(name: str) -> Path:
    """The committed crashers (minimised) of target ``name``."""
    return FUZZ_DIR / "regressions" / name


def instrumented(enabled: bool) -> contextlib.AbstractContextManager[Any]:
    """Context manager around a target's project imports: atheris instruments the imported
    project modules when ``enabled`` (the target runs as the fuzzer), else nothing happens."""
    if not enabled:
        return contextlib.nullcontext()
    import atheris

    return atheris.instrument_imports(include=list(INSTRUMENTED_PACKAGES))


def split_records(data: bytes, limit: int = MAX_RECORDS) -> list[bytes]:
    """Cut ``data`` (without the flags byte) into records: 2-byte big-endian length, bytes."""
    out: list[bytes] = []
    pos = 0
    while pos < len(data) and len(out) < limit:
        n = int.from_bytes(data[pos:pos + 2], "big")
        out.append(data[pos + 2:pos + 2 + n])
        pos += 2 + n
    return out


def join_records(flags: int, records: list[bytes]) -> bytes:
    """The input :func:`split_records` cuts back into ``records`` (behind ``flags``)."""
    return bytes((flags,)) + b"".join(len(r).to_bytes(2, "big") + r for r in records)


def has_nan(obj: object) -> bool:
    """Whether a NaN float sits anywhere in ``obj`` (containers walked without recursion):
    such values never compare equal, so a round trip is checked on its bytes alone."""
    stack = [obj]
    while stack:
        o = stack.pop()
        if isinstance(o, float):
            if math.isnan(o):
                return True
        elif isinstance(o, dict):
            stack.extend(o.keys())
            stack.extend(o.values())
        elif isinstance(o, list | tuple):
            stack.extend(o)
        elif hasattr(o, "__struct_fields__"):
            stack.extend(getattr(o, f) for f in o.__struct_fields__)
    return False


def nesting_depth(obj: object) -> int:
    """Containers nested in ``obj`` (``obj`` itself is level 1 if it is one): maps, arrays
    and arrays used as map keys (tuples), walked without recursion. An independent count
    of what ``MAX_METADATA_DEPTH`` limits."""
    deepest = 0
    stack: list[tuple[object, int]] = [(obj, 1)]
    while stack:
        o, depth = stack.pop()
        if isinstance(o, dict):
            items = [*o.keys(), *o.values()]
        elif isinstance(o, list | tuple):
            items = list(o)
        else:
            continue
        deepest = max(deepest, depth)
        stack.extend((x, depth + 1) for x in items)
    return deepest


def stack_depth() -> int:
    """Python frames on the current thread's stack."""
    depth = 0
    frame = sys._getframe()
    while frame is not None:
        depth += 1
        frame = frame.f_back
    return depth


def call_with_stack_budget(budget: int, fn: Callable[[], Any]) -> Any:
    """Call ``fn`` with only about ``budget`` levels of Python recursion left (the frames
    below ``sys.getrecursionlimit()``), as a decoder deep in a caller's stack would run."""
    target = sys.getrecursionlimit() - budget - stack_depth() - 2

    def down(k: int) -> Any:
        return fn() if k <= 0 else down(k - 1)

    return down(target)


SCRATCH_ENV = "KVADVISOR_FUZZ_SCRATCH"
"""Environment variable naming the directory scratch directories are made in (the bounded
suite points it at pytest's ``tmp_path``); unset: ``/dev/shm`` when the machine has it (so
SQLite runs on memory), else the system's temporary directory."""


def scratch_dir(prefix: str) -> Path:
    """A fresh private directory for one process's scratch files (see :data:`SCRATCH_ENV`).
    libFuzzer ends the process without Python's exit handlers, so it is left behind."""
    import tempfile

    base = os.environ.get(SCRATCH_ENV)
    if base:
        os.makedirs(base, exist_ok=True)
    elif os.path.isdir("/dev/shm") and os.access("/dev/shm", os.W_OK):
        base = "/dev/shm"
    return Path(tempfile.mkdtemp(prefix=prefix, dir=base))


def main(check: Callable[[bytes], None], name: str) -> None:
    """Run ``check`` under atheris with ``sys.argv``'s libFuzzer flags and corpus dirs.

    The libFuzzer dictionary :data:`DICTIONARY` is used unless the arguments name a
    ``-dict``. Without a corpus directory or file among the arguments, the committed seed corpus of
    ``name`` is read behind a scratch directory, which gets the new inputs (libFuzzer writes
    into its first corpus directory; the committed corpus is never written to).
    """
    import atheris

    argv = list(sys.argv)
    # libFuzzer runs argv[0] through the shell for -minimize_crash, -fork and -jobs: this
    # interpreter on this script, whatever the script's mode and shebang
    argv[0] = f"{shlex.quote(sys.executable)} {shlex.quote(str(Path(argv[0]).resolve()))}"
    if not any(a.startswith("-dict=") for a in argv[1:]):
        argv.insert(1, f"-dict={DICTIONARY}")
    if not any(not a.startswith("-") for a in argv[1:]):
        argv += [str(scratch_dir(f"kvadvisor-fuzz-{name}-")), str(corpus_dir(name))]
    atheris.Setup(argv, check)
    atheris.Fuzz()


def iter_inputs(name: str) -> Iterator[Path]:
    """Every committed input of target ``name`` (seed corpus, then regressions)."""
    for d in (corpus_dir(name), regressions_dir(name)):
        if d.is_dir():
            yield from sorted(p for p in d.iterdir() if p.is_file() and not p.name.startswith("."))
