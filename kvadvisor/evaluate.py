"""Offline evaluator: replay a block-reuse trace against fast-tier policies.

Hit (docs/traces.md): the longest prefix of a request's blocks held on the
fast tier *before* the request is served, in blocks; after serving, all the request's
blocks are inserted (touched) and the policy evicts down to ``capacity`` blocks.  The hit
rate is hits / block references over the whole trace.

Policies:
    * ``lru``: least recently used; a request's blocks are touched first to last.
    * ``belady``: offline optimum for this insert-everything model: evict the block whose
      next use (request index) is farthest, ties by smaller id first.
    * ``seen_twice``: LRU that admits a block only from its second reference (known to win
      at small capacities and lose at large ones).
    * ``prefix_value``: the advisor's default policy (:mod:`advisor.prefix_policy`).

Trace formats:
    * ``mooncake``: jsonl, ``{"timestamp", "input_length", "output_length", "hash_ids"}``.
    * ``weka``: ``trace_NNNN.json[.gz]`` conversation files (a file or a directory of
      them); block ids are per file, so a block is ``(file number << 32) | id``; nested
      ``subagent`` requests are flattened with absolute times (subagent start + ``t``);
      conversation ``k`` (in file-name order) starts ``k × stagger_s`` seconds in.
"""

from __future__ import annotations

import gzip
import heapq
import json
import re
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

from advisor.prefix_policy import PrefixPolicySettings, PrefixValueCache
from kvadvisor.trace import TraceFormatError, read_mooncake

TraceFormat = Literal["mooncake", "weka"]
Requests = Sequence[Sequence[int]]
REFERENCE_POLICIES: tuple[str, ...] = ("lru", "belady")
OUR_POLICIES: tuple[str, ...] = ("prefix_value", "seen_twice")


class EvaluateError(ValueError):
    """Bad evaluator input (unknown policy or format, empty trace, bad capacity)."""


# ---------------------------------------------------------------------------- traces
def load_mooncake(path: str | Path, limit: int | None = None) -> list[list[int]]:
    """Block id lists of a Mooncake jsonl trace, in file (arrival) order.

    Raises:
        TraceFormatError: a line is not a Mooncake request.
        FileNotFoundError: ``path`` does not exist.
    """
    return [list(r.hash_ids) for r in read_mooncake(path, limit)]


def _weka_files(path: Path) -> list[Path]:
    if path.is_dir():
        files = sorted(p for p in path.iterdir() if re.fullmatch(r"trace_\d+\.json(\.gz)?", p.name))
    else:
        files = [path]
    if not files:
        raise EvaluateError(f"no trace_NNNN.json[.gz] files in {path}")
    return files


def _weka_flatten(reqs: Iterable[dict[str, Any]], t0: float, out: list[tuple[float, list[int]]],
                  file_tag: int, where: str) -> None:
    for r in reqs:
        try:
            t = t0 + float(r["t"])
            if r.get("type") == "subagent":
                _weka_flatten(r["requests"], t, out, file_tag, where)
                continue
            ids = [file_tag | int(h) for h in r["hash_ids"]]
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{where}: not a WEKA request ({exc!r})") from exc
        out.append((t, ids))


def load_weka(path: str | Path, stagger_s: float = 60.0, limit: int | None = None) -> list[list[int]]:
    """Block id lists of WEKA conversation files, merged by absolute time.

    Args:
        path: one ``trace_NNNN.json[.gz]`` file or a directory of them.
        stagger_s: start of conversation ``k`` (file-name order) is ``k × stagger_s`` s.
        limit: keep the first ``limit`` requests after merging.

    Raises:
        EvaluateError: no trace files found.
        TraceFormatError: a file is not a WEKA conversation.
    """
    timed: list[tuple[float, int, list[int]]] = []
    for k, f in enumerate(_weka_files(Path(path))):
        m = re.search(r"(\d+)", f.name)
        tag = (int(m.group(1)) if m else k) << 32
        opener = gzip.open if f.suffix == ".gz" else open
        try:
            with opener(f, "rt", encoding="utf-8") as fh:
                obj = json.load(fh)
            reqs = obj["requests"]
        except (OSError, ValueError, KeyError, TypeError) as exc:
            raise TraceFormatError(f"{f}: not a WEKA conversation file ({exc!r})") from exc
        flat: list[tuple[float, list[int]]] = []
        _weka_flatten(reqs, k * stagger_s, flat, tag, str(f))
        timed.extend((t, len(timed) + i, ids) for i, (t, ids) in enumerate(flat))
    timed.sort(key=lambda x: (x[0], x[1]))
    out = [ids for _, _, ids in timed]
    return out[:limit] if limit is not None else out


def load_trace(path: str | Path, fmt: TraceFormat | None = None, limit: int | None = None,
               stagger_s: float = 60.0) -> list[list[int]]:
    """Load a trace; ``fmt=None`` guesses from the name (``.jsonl`` = mooncake, else weka)."""
    p = Path(path)
    if fmt is None:
        fmt = "mooncake" if p.suffix == ".jsonl" else "weka"
    if fmt == "mooncake":
        return load_mooncake(p, limit)
    if fmt == "weka":
        return load_weka(p, stagger_s, limit)
    raise EvaluateError(f"unknown trace format {fmt!r} (mooncake | weka)")


# ---------------------------------------------------------------------------- policies
def _prefix_hit(hashes: Sequence[int], cached: Any) -> int:
    n = 0
    for h in hashes:
        if h not in cached:
            break
        n += 1
    return n


def simulate_lru(requests: Requests, capacity: int) -> int:
    """Total hit blocks under LRU with ``capacity`` blocks."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    move = cache.move_to_end
    pop = cache.popitem
    for r in requests:
        hits += _prefix_hit(r, cache)
        for h in r:
            if h in cache:
                move(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    pop(last=False)
    return hits


def simulate_seen_twice(requests: Requests, capacity: int) -> int:
    """Total hit blocks under LRU admitting a block only from its second reference."""
    cache: OrderedDict[int, None] = OrderedDict()
    seen: set[int] = set()
    hits = 0
    for r in requests:
        hits += _prefix_hit(r, cache)
        for h in r:
            if h in cache:
                cache.move_to_end(h)
            elif h in seen:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
            else:
                seen.add(h)
    return hits


def next_uses(requests: Requests) -> list[list[int]]:
    """For each block reference, the index of the next request using that block
    (``len(requests)`` = never), same shape as ``requests``."""
    never = len(requests)
    last: dict[int, int] = {}
    out: list[list[int]] = [[] for _ in requests]
    for i in range(len(requests) - 1, -1, -1):
        r = requests[i]
        out[i] = [last.get(h, never) for h in r]
        for h in r:
            last[h] = i
    return out


def simulate_belady(requests: Requests, capacity: int, nxt: list[list[int]] | None = None) -> int:
    """Total hit blocks under Belady's rule (evict the farthest next use, ties: smaller id)."""
    nxt = nxt if nxt is not None else next_uses(requests)
    cache: dict[int, int] = {}
    heap: list[tuple[int, int]] = []
    hits = 0
    push, pop = heapq.heappush, heapq.heappop
    for r, nu in zip(requests, nxt):
        hits += _prefix_hit(r, cache)
        for h, u in zip(r, nu):
            cache[h] = u
            push(heap, (-u, h))
        while len(cache) > capacity:
            negu, h = pop(heap)
            if cache.get(h) == -negu:
                del cache[h]
    return hits


def simulate_prefix_value(requests: Requests, capacity: int, settings: PrefixPolicySettings | None = None) -> int:
    """Total hit blocks under the advisor's prefix-value policy."""
    cache = PrefixValueCache(capacity, settings)
    return sum(cache.access(r) for r in requests)


SIMULATORS: dict[str, Callable[[Requests, int], int]] = {
    "lru": simulate_lru,
    "belady": simulate_belady,
    "seen_twice": simulate_seen_twice,
    "prefix_value": simulate_prefix_value,
}


# ---------------------------------------------------------------------------- results
@dataclass
class CapacityResult:
    """Hit rates at one capacity: ``{policy: hit rate}`` and the gap share each closes."""

    capacity: int
    hit_rate: dict[str, float] = field(default_factory=dict)

    def gap_closed(self, policy: str) -> float | None:
        """(policy − LRU) / (Belady − LRU); ``None`` when Belady == LRU."""
        lru, opt = self.hit_rate["lru"], self.hit_rate["belady"]
        if opt - lru <= 1e-12:
            return None
        return (self.hit_rate[policy] - lru) / (opt - lru)


@dataclass
class Evaluation:
    """All capacities of one trace."""

    trace: str
    requests: int
    block_refs: int
    distinct_blocks: int
    policies: list[str]
    results: list[CapacityResult]
    seconds: float = 0.0

    def as_dict(self) -> dict[str, Any]:
        return {
            "trace": self.trace, "requests": self.requests, "block_refs": self.block_refs,
            "distinct_blocks": self.distinct_blocks, "policies": self.policies, "seconds": self.seconds,
            "results": [{"capacity": r.capacity, "hit_rate": r.hit_rate,
                         "gap_closed": {p: r.gap_closed(p) for p in self.policies if p not in REFERENCE_POLICIES}}
                        for r in self.results],
        }


def evaluate(requests: Requests, capacities: Sequence[int], policies: Sequence[str] = OUR_POLICIES,
             trace: str = "", progress: Callable[[str, int], None] | None = None) -> Evaluation:
    """Replay ``requests`` at each capacity under LRU, Belady and ``policies``.

    Args:
        requests: block id lists in arrival order.
        capacities: fast-tier capacities in blocks (each >= 1).
        policies: our policies to compare (names of :data:`SIMULATORS`).
        trace: a label for reports.
        progress: called with ``(policy, capacity)`` before each replay.

    Raises:
        EvaluateError: empty trace, capacity < 1 or unknown policy.
    """
    import time

    if not requests:
        raise EvaluateError("the trace has no requests")
    bad = [c for c in capacities if c < 1]
    if bad or not capacities:
        raise EvaluateError(f"capacities must be >= 1 block, got {list(capacities)}")
    unknown = [p for p in policies if p not in SIMULATORS or p in REFERENCE_POLICIES]
    if unknown:
        raise EvaluateError(f"unknown policies {unknown} (choose from {sorted(set(SIMULATORS) - set(REFERENCE_POLICIES))})")
    t0 = time.perf_counter()
    refs = sum(len(r) for r in requests)
    distinct = len({h for r in requests for h in r})
    nxt = next_uses(requests)
    results = []
    for cap in capacities:
        res = CapacityResult(cap)
        for p in (*REFERENCE_POLICIES, *policies):
            if progress:
                progress(p, cap)
            hits = simulate_belady(requests, cap, nxt) if p == "belady" else SIMULATORS[p](requests, cap)
            res.hit_rate[p] = hits / refs if refs else 0.0
        results.append(res)
    return Evaluation(trace, len(requests), refs, distinct, list(policies), results, time.perf_counter() - t0)


def render_table(ev: Evaluation) -> Any:
    """A :class:`rich.table.Table` of hit rates and gap shares closed."""
    from rich.table import Table

    t = Table(title=f"fast-tier prefix hit rate — {ev.trace} ({ev.requests:,} requests, "
                    f"{ev.block_refs:,} block refs, {ev.distinct_blocks:,} distinct)")
    t.add_column("capacity\n(blocks)", justify="right")
    t.add_column("LRU", justify="right")
    t.add_column("Belady", justify="right")
    for p in ev.policies:
        # policy names are never cut (a terminal of 80 columns used to show "prefix_v…")
        t.add_column(p, justify="right", min_width=len(p))
        t.add_column("gap\nclosed", justify="right")
    for r in ev.results:
        row = [f"{r.capacity:,}", f"{r.hit_rate['lru']:.4f}", f"{r.hit_rate['belady']:.4f}"]
        for p in ev.policies:
            g = r.gap_closed(p)
            row += [f"{r.hit_rate[p]:.4f}", "—" if g is None else f"{100 * g:.1f}%"]
        t.add_row(*row)
    return t


def markdown_table(ev: Evaluation) -> str:
    """The same table as GitHub markdown (for docs/BENCHMARKS.md)."""
    head = ["capacity (blocks)", "LRU", "Belady"] + [x for p in ev.policies for x in (p, f"{p} gap closed")]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for r in ev.results:
        row = [f"{r.capacity:,}", f"{r.hit_rate['lru']:.4f}", f"{r.hit_rate['belady']:.4f}"]
        for p in ev.policies:
            g = r.gap_closed(p)
            row += [f"{r.hit_rate[p]:.4f}", "—" if g is None else f"{100 * g:.1f}%"]
        lines.append("| " + " | ".join(row) + " |")
    return "\n".join(lines)


def plot(ev: Evaluation, out: str | Path) -> Path:
    """Write a PNG of hit rate vs capacity (one line per policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [r.capacity for r in ev.results]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    for p in (*REFERENCE_POLICIES, *ev.policies):
        ax.plot(caps, [r.hit_rate[p] for r in ev.results], marker="o", label=p,
                linestyle="--" if p in REFERENCE_POLICIES else "-")
    ax.set_xscale("log")
    ax.set_xlabel("fast-tier capacity (blocks)")
    ax.set_ylabel("prefix hit rate (blocks)")
    ax.set_title(f"{ev.trace}: {ev.requests:,} requests")
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def parse_capacities(text: str) -> list[int]:
    """``"1000,5859"`` → ``[1000, 5859]`` (underscores allowed).

    Raises:
        EvaluateError: a part is not a positive integer.
    """
    parts = [x.strip() for x in text.split(",")]
    if any(not x for x in parts):
        raise EvaluateError(f"capacities must be comma-separated integers with none empty, got {text!r}")
    try:
        caps = [int(x.replace("_", "")) for x in parts]
    except ValueError as exc:
        raise EvaluateError(f"capacities must be comma-separated integers, got {text!r}") from exc
    if not caps or any(c < 1 for c in caps):
        raise EvaluateError(f"capacities must be >= 1 block, got {text!r}")
    return caps


__all__ = [
    "CapacityResult", "EvaluateError", "Evaluation", "SIMULATORS", "evaluate", "load_mooncake", "load_trace",
    "load_weka", "markdown_table", "next_uses", "parse_capacities", "plot", "render_table", "simulate_belady",
    "simulate_lru", "simulate_prefix_value", "simulate_seen_twice",
]
