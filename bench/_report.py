"""Machine-readable output shared by every bench: ``--json PATH`` writes one report per run.

A bench builds a :class:`Report` when it starts (the load average then is recorded), adds
its figures as it prints them (:meth:`Report.add`: ours, the reference measured in the same
run, their ratio, the unit, the goal) and writes the file at the end (:meth:`Report.write`:
the load average again, the timestamp).  ``bench/summary.py`` reads a folder of these files
and writes the headline table of docs/BENCHMARKS.md from them.

File format (JSON object, ``schema`` 1)::

    {"schema": 1, "bench": "events", "what": "<what the bench measures, one line>",
     "command": "python bench/events.py --quick", "cpu": "<lscpu model name>", "cores": 2,
     "affinity": [0, 1], "load_start": [1.2, 1.1, 0.9], "load_end": [1.4, 1.2, 0.9],
     "started": "2026-12-05T00:30:01Z", "timestamp": "2026-12-05T00:31:10Z", "commit": "a359052",
     "figures": [{"name": "...", "ours": 1.0, "reference": 2.0, "ratio": 0.5, "unit": "events/s",
                  "reference_name": "...", "goal": ">= 300,000 events/s", "met": true,
                  "better": "higher", "headline": true}, ...],
     "extra": {...}}

``load_*`` are ``os.getloadavg()`` (1, 5 and 15 minutes); ``cores`` is ``os.cpu_count()``
and ``affinity`` the CPUs this process may run on (``taskset``); ``ratio`` is ours /
reference unless the bench computes it otherwise (e.g. the median of per-run ratios);
numbers that are not finite are written as ``null``.
"""

from __future__ import annotations

import argparse
import datetime as dt
import json
import math
import numbers
import os
import platform
import shlex
import subprocess
import sys
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

SCHEMA = 1
ROOT = Path(__file__).resolve().parents[1]


def add_json_option(parser: argparse.ArgumentParser) -> None:
    """Add the ``--json PATH`` option every bench takes (same name and help everywhere)."""
    parser.add_argument("--json", type=Path, default=None, metavar="PATH",
                        help="also write the figures (ours, reference, ratio, units), the command, CPU, load "
                             "average and timestamp as JSON to PATH (read by bench/summary.py)")


def cpu_model() -> str:
    """The CPU's model name as ``lscpu`` prints it (``/proc/cpuinfo``, then
    ``platform.processor()`` where ``lscpu`` is missing); ``"unknown"`` if none says."""
    try:
        out = subprocess.run(["lscpu"], capture_output=True, text=True, timeout=10).stdout
        for line in out.splitlines():
            if line.startswith("Model name:"):
                return line.split(":", 1)[1].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def load_average() -> list[float]:
    """``os.getloadavg()`` rounded to 2 decimals: the 1, 5 and 15 minute averages."""
    return [round(x, 2) for x in os.getloadavg()]


def _utc_now() -> str:
    return dt.datetime.now(dt.timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def _commit() -> str | None:
    try:
        out = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=ROOT, capture_output=True, text=True,
                             timeout=10)
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() or None


def _without_json(argv: list[str]) -> list[str]:
    """The arguments less ``--json PATH`` (where the report goes is not part of the command)."""
    out: list[str] = []
    skip = False
    for a in argv:
        if skip:
            skip = False
        elif a == "--json":
            skip = True
        elif not a.startswith("--json="):
            out.append(a)
    return out


def _finite(x: Any) -> Any:
    """JSON-ready, recursively: numpy scalars as Python numbers, non-finite floats as None
    (JSON has no NaN), anything else that JSON cannot hold as its ``str``."""
    if isinstance(x, bool) or x is None or isinstance(x, str):
        return x
    if isinstance(x, numbers.Integral):
        return int(x)
    if isinstance(x, numbers.Real):
        x = float(x)
        return x if math.isfinite(x) else None
    if isinstance(x, dict):
        return {str(k): _finite(v) for k, v in x.items()}
    if isinstance(x, (list, tuple)):
        return [_finite(v) for v in x]
    return str(x)  # anything else (paths, enums, objects) as its text, as json.dumps(default=str) would


@dataclass
class Figure:
    """One measured figure: ours against the reference of the same run.

    ``better`` says which way is good (``"higher"`` for rates, ``"lower"`` for times and
    sizes); ``headline``: the figure bench/summary.py puts in the headline table (the
    first figure when none is marked)."""

    name: str
    ours: float | None
    reference: float | None = None
    ratio: float | None = None
    unit: str = ""
    reference_name: str = ""
    goal: str = ""
    met: bool | None = None
    better: str = "higher"
    headline: bool = False


@dataclass
class Report:
    """The machine-readable report of one bench run (module docstring: the file format).

    ``bench`` is the script's name without ``.py``; ``argv`` the arguments it was run with
    (default ``sys.argv[1:]``), from which ``command`` is rebuilt as ``python bench/<bench>.py ...``."""

    bench: str
    what: str
    argv: list[str] | None = None
    figures: list[Figure] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)
    started: str = field(default_factory=_utc_now)
    load_start: list[float] = field(default_factory=load_average)

    def add(self, name: str, ours: float | None, reference: float | None = None, *, unit: str = "",
            reference_name: str = "", ratio: float | None = None, goal: str = "", met: bool | None = None,
            better: str = "higher", headline: bool = False) -> Figure:
        """Record one figure; ``ratio`` defaults to ours / reference (None without both)."""
        if better not in ("higher", "lower"):
            raise ValueError(f"better must be 'higher' or 'lower', not {better!r}")
        if ratio is None and ours is not None and reference:
            ratio = ours / reference
        f = Figure(name, ours, reference, ratio, unit, reference_name, goal, met, better, headline)
        self.figures.append(f)
        return f

    def to_dict(self) -> dict[str, Any]:
        """The report as the JSON object written to the file (load_end and timestamp: now)."""
        argv = _without_json(sys.argv[1:] if self.argv is None else self.argv)
        return _finite({
            "schema": SCHEMA, "bench": self.bench, "what": self.what,
            "command": shlex.join(["python", f"bench/{self.bench}.py", *argv]),
            "cpu": cpu_model(), "cores": os.cpu_count(), "affinity": sorted(os.sched_getaffinity(0)),
            "load_start": self.load_start, "load_end": load_average(),
            "started": self.started, "timestamp": _utc_now(), "commit": _commit(),
            "figures": [asdict(f) for f in self.figures], "extra": self.extra,
        })

    def write(self, path: Path | None) -> None:
        """Write the report to ``path`` (nothing when None), creating its folder; the file
        appears whole or not at all (written aside, then renamed)."""
        if path is None:
            return
        path = Path(path)
        path.parent.mkdir(parents=True, exist_ok=True)
        tmp = path.with_name(path.name + ".tmp")
        tmp.write_text(json.dumps(self.to_dict(), indent=2, allow_nan=False) + "\n")
        os.replace(tmp, path)
        print(f"report written to {path}")
