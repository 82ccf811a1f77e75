"""Offline evaluator: replay a block-reuse trace against fast-tier policies.

Hit (docs/traces.md): the longest prefix of a request's blocks held on the
fast tier *before* the request is served, in blocks; after serving, all the request's
blocks are inserted (touched) and the policy evicts down to ``capacity`` blocks.  The hit
rate is hits / block references over the whole trace.

Policies (one module each in :mod:`advisor.policy.eviction`, compiled with numba over a compact
trace so that every policy replays a 15-million-reference trace in seconds):
    * baselines: ``lru``, ``arc``, ``lfu_da``, ``s3fifo``, ``sieve`` and ``prefix_lru``
      (leaf-first LRU), each cited from its paper in its module;
    * ``belady``: evict the block whose next use (request index) is farthest, ties by
      smaller id first (offline reference);
    * ``adaptive``: the default policy (:mod:`advisor.policy.eviction.experts`), which follows
      online the best of the baselines and ``prefix_value``;
    * ``prefix_value`` (:mod:`advisor.policy.eviction.prefix_value`), one of its experts; with a
      lookahead of K requests it also sees the next K requests (docs/BENCHMARKS.md).

Trace formats:
    * ``mooncake``: jsonl, ``{"timestamp", "input_length", "output_length", "hash_ids"}``.
    * ``weka``: ``trace_NNNN.json[.gz]`` conversation files (a file or a directory of
      them); block ids are per file, so a block is ``(file number << 32) | id``; nested
      ``subagent`` requests are flattened with absolute times (subagent start + ``t``);
      conversation ``k`` (in file-name order) starts ``k × stagger_s`` seconds in.
"""

from __future__ import annotations

import gzip
import json
import re
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import numpy as np

from advisor.policy.eviction import experts
from advisor.policy.eviction.compact import CompactTrace, RequestFinishes, compact
from advisor.policy.eviction.finish_aware import finish_class
from advisor.policy.eviction.registry import BASELINES, BELADY, DEFAULT_POLICY, LABELS, LRU, POLICIES
from kvadvisor.trace import TraceFormatError, read_mooncake

TraceFormat = Literal["mooncake", "weka"]
Requests = Sequence[Sequence[int]]


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


def _weka_flatten(reqs: Iterable[dict[str, Any]], t0: float, out: list[tuple[float, list[int], float, str]],
                  file_tag: int, where: str) -> None:
    for r in reqs:
        try:
            t = t0 + float(r["t"])
            if r.get("type") == "subagent":
                _weka_flatten(r["requests"], t, out, file_tag, where)
                continue
            ids = [file_tag | int(h) for h in r["hash_ids"]]
            api = max(float(r.get("api_time") or 0.0), 0.0)
        except (KeyError, TypeError, ValueError) as exc:
            raise TraceFormatError(f"{where}: not a WEKA request ({exc!r})") from exc
        out.append((t, ids, api, str(r.get("stop") or "")))


def load_weka(path: str | Path, stagger_s: float = 60.0, limit: int | None = None) -> list[list[int]]:
    """Block id lists of WEKA conversation files, merged by absolute time (see
    :func:`load_weka_timed`, which also gives the times)."""
    return [ids for _, _, ids in load_weka_timed(path, stagger_s, limit)]


def load_weka_timed(path: str | Path, stagger_s: float = 60.0,
                    limit: int | None = None) -> list[tuple[float, int, list[int]]]:
    """``(time s, order, block ids)`` of WEKA conversation files' requests, merged by time.

    Args:
        path: one ``trace_NNNN.json[.gz]`` file or a directory of them.
        stagger_s: start of conversation ``k`` (file-name order) is ``k × stagger_s`` s.
        limit: keep the first ``limit`` requests after merging.

    Raises:
        EvaluateError: no trace files found.
        TraceFormatError: a file is not a WEKA conversation.
    """
    return [(t, k, ids) for t, k, ids, _, _ in _weka_requests(path, stagger_s, limit)]


def _weka_requests(path: str | Path, stagger_s: float,
                   limit: int | None) -> list[tuple[float, int, list[int], float, str]]:
    """:func:`load_weka_timed`'s tuples with each request's ``api_time`` (s) and ``stop`` reason."""
    timed: list[tuple[float, int, list[int], float, str]] = []
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
        flat: list[tuple[float, list[int], float, str]] = []
        _weka_flatten(reqs, k * stagger_s, flat, tag, str(f))
        timed.extend((t, len(timed) + i, ids, api, stop) for i, (t, ids, api, stop) in enumerate(flat))
    timed.sort(key=lambda x: (x[0], x[1]))
    return timed[:limit] if limit is not None else timed


def _format(p: Path, fmt: TraceFormat | None) -> TraceFormat:
    """``fmt``, or guessed from the name (``.jsonl`` = mooncake, else weka)."""
    if fmt is not None:
        return fmt
    return "mooncake" if p.suffix == ".jsonl" else "weka"


def load_trace_finishes(path: str | Path, fmt: TraceFormat | None = None, limit: int | None = None,
                        stagger_s: float = 60.0) -> tuple[list[list[int]], RequestFinishes | None]:
    """:func:`load_trace`'s requests and, in the same read, each one's arrival, finish and
    finish-reason class for the finish-aware expert (:mod:`advisor.policy.eviction.finish_aware`);
    ``None`` for a format that records no finish reasons (Mooncake).

    WEKA: arrival = ``t`` (s, conversation ``k`` starting at ``k × stagger_s``), finish =
    arrival + ``api_time``, reason = ``stop`` (``tool_use``, ``end_turn``, or empty:
    unknown; :func:`~advisor.policy.eviction.finish_aware.finish_class`).

    Raises:
        EvaluateError, TraceFormatError, FileNotFoundError: as :func:`load_trace`.
    """
    p = Path(path)
    fmt = _format(p, fmt)
    if fmt != "weka":
        return load_trace(p, fmt, limit, stagger_s), None
    reqs = _weka_requests(p, stagger_s, limit)
    arrival = np.array([r[0] for r in reqs], dtype=np.float64)
    finish = arrival + np.array([r[3] for r in reqs], dtype=np.float64)
    reason = np.array([finish_class(r[4]) for r in reqs], dtype=np.int8)
    return [r[2] for r in reqs], RequestFinishes(arrival, finish, reason)


def load_trace(path: str | Path, fmt: TraceFormat | None = None, limit: int | None = None,
               stagger_s: float = 60.0) -> list[list[int]]:
    """Load a trace; ``fmt=None`` guesses from the name (``.jsonl`` = mooncake, else weka)."""
    p = Path(path)
    fmt = _format(p, fmt)
    if fmt == "mooncake":
        return load_mooncake(p, limit)
    if fmt == "weka":
        return load_weka(p, stagger_s, limit)
    raise EvaluateError(f"unknown trace format {fmt!r} (mooncake | weka)")


def load_trace_times(path: str | Path, fmt: TraceFormat | None = None, limit: int | None = None,
                     stagger_s: float = 60.0) -> list[float]:
    """Arrival time (seconds from the trace's start) of each request of :func:`load_trace`.

    Raises:
        EvaluateError, TraceFormatError, FileNotFoundError: as :func:`load_trace`.
    """
    p = Path(path)
    fmt = _format(p, fmt)
    if fmt == "mooncake":
        return [r.timestamp_ms / 1e3 for r in read_mooncake(p, limit)]
    if fmt == "weka":
        return [t for t, _, _ in load_weka_timed(p, stagger_s, limit)]
    raise EvaluateError(f"unknown trace format {fmt!r} (mooncake | weka)")


def load_compact(path: str | Path, fmt: TraceFormat | None = None, limit: int | None = None,
                 stagger_s: float = 60.0) -> CompactTrace:
    """:func:`load_trace_finishes`' requests and finishes, compacted.

    Raises:
        EvaluateError, TraceFormatError, FileNotFoundError: as :func:`load_trace`.
    """
    return compact(*load_trace_finishes(path, fmt, limit, stagger_s))


# ---------------------------------------------------------------------------- policies
def _hits(name: str, requests: Requests | CompactTrace, capacity: int, lookahead: int = 0) -> int:
    trace = requests if isinstance(requests, CompactTrace) else compact(requests)
    if capacity < 1:
        raise EvaluateError(f"capacity must be >= 1 block, got {capacity}")
    return int(POLICIES[name](trace, capacity, lookahead).sum())


def simulate_lru(requests: Requests, capacity: int) -> int:
    """Total hit blocks under LRU with ``capacity`` blocks (:mod:`advisor.policy.eviction.lru`)."""
    return _hits("lru", requests, capacity)


def simulate_belady(requests: Requests, capacity: int) -> int:
    """Total hit blocks under Belady's rule (:mod:`advisor.policy.eviction.belady`)."""
    return _hits("belady", requests, capacity)


def simulate_prefix_value(requests: Requests, capacity: int, lookahead: int = 0) -> int:
    """Total hit blocks under the ``prefix_value`` policy (:mod:`advisor.policy.eviction.prefix_value`)."""
    return _hits("prefix_value", requests, capacity, lookahead)


def next_uses(requests: Requests) -> list[list[int]]:
    """For each block reference, the index of the next request using that block
    (``len(requests)`` = never), same shape as ``requests``."""
    trace = compact(requests)
    nu = trace.next_use().tolist()
    off = trace.offsets.tolist()
    return [nu[off[i]:off[i + 1]] for i in range(len(requests))]


def column(policy: str, lookahead: int = 0) -> str:
    """Result key of a policy run: its name, or ``name@K`` with a lookahead of K requests."""
    return policy if lookahead <= 0 else f"{policy}@{lookahead}"


# ---------------------------------------------------------------------------- results
@dataclass
class CapacityResult:
    """Hit rates at one capacity: ``{column: hit rate}`` (see :func:`column`)."""

    capacity: int
    hit_rate: dict[str, float] = field(default_factory=dict)
    baselines: tuple[str, ...] = BASELINES
    switches: dict[str, int] = field(default_factory=dict)
    """Leader changes of the default policy's selector (:mod:`advisor.policy.eviction.experts`), by column."""
    refill: dict[str, float] = field(default_factory=dict)
    """The selector's refill cost, by column: hits the followed experts took that the real
    tier missed after its switches, net, as a share of the counted block references (a
    share of the margin over the best baseline; the rest is lag, following a worse expert)."""
    infinite: float = 1.0
    """Hit rate of an infinite tier (every block referenced before is a hit): the ceiling
    of a policy that sees the next requests and promotes their blocks ahead of use."""

    def gap_closed(self, policy: str) -> float | None:
        """(policy − LRU) / (ceiling − LRU); ``None`` when the ceiling equals LRU.

        The ceiling is Belady for a column without lookahead.  With a lookahead (``name@K``)
        the policy promotes blocks from lower tiers before they are used, which Belady (no
        hints, nothing but the fast tier) cannot, so Belady is no ceiling there (a share of
        its gap could exceed 100 %); those columns use the infinite tier's hit rate.
        """
        lru = self.hit_rate[LRU]
        opt = self.infinite if "@" in policy else self.hit_rate[BELADY]
        if opt - lru <= 1e-12:
            return None
        return (self.hit_rate[policy] - lru) / (opt - lru)

    def best_baseline(self) -> tuple[str, float]:
        """``(name, hit rate)`` of the best online baseline at this capacity."""
        name = max(self.baselines, key=lambda p: self.hit_rate[p])
        return name, self.hit_rate[name]

    def margin(self, policy: str) -> float:
        """Hit rate of ``policy`` minus the best baseline's (≥ −0.002 is the acceptance)."""
        return self.hit_rate[policy] - self.best_baseline()[1]


@dataclass
class Evaluation:
    """All capacities of one trace; ``policies`` are our columns (with lookahead suffixes)."""

    trace: str
    requests: int
    block_refs: int
    distinct_blocks: int
    policies: list[str]
    results: list[CapacityResult]
    seconds: float = 0.0
    baselines: tuple[str, ...] = BASELINES

    def as_dict(self) -> dict[str, Any]:
        """JSON-ready form (hit rates, gap closed and margin over the best baseline)."""
        return {
            "trace": self.trace, "requests": self.requests, "block_refs": self.block_refs,
            "distinct_blocks": self.distinct_blocks, "baselines": list(self.baselines),
            "policies": self.policies, "seconds": self.seconds,
            "results": [{"capacity": r.capacity, "hit_rate": r.hit_rate,
                         "best_baseline": r.best_baseline()[0],
                         "gap_closed": {p: r.gap_closed(p) for p in (*self.baselines, *self.policies)},
                         "margin": {p: r.margin(p) for p in self.policies}, "switches": r.switches,
                         "refill": r.refill}
                        for r in self.results],
        }


def evaluate(requests: Requests | CompactTrace, capacities: Sequence[int],
             policies: Sequence[str] = (DEFAULT_POLICY,), lookaheads: Sequence[int] = (0,),
             baselines: Sequence[str] = BASELINES, trace: str = "",
             progress: Callable[[str, int], None] | None = None, promote: bool = True,
             count: tuple[int, int] | None = None) -> Evaluation:
    """Replay ``requests`` at each capacity under the baselines, Belady and ``policies``.

    Args:
        requests: block id lists in arrival order, or their :class:`CompactTrace`.
        capacities: fast-tier capacities in blocks (each >= 1).
        policies: our policies (names of :data:`advisor.policy.eviction.registry.POLICIES`).
        lookaheads: for each of ``policies``, the numbers of upcoming requests it sees
            (``0`` = none); each K > 0 adds a column ``policy@K``.
        baselines: online baselines to compare with (LRU is always run).
        trace: a label for reports.
        progress: called with ``(column, capacity)`` before each replay.
        promote: with a lookahead, a visible request's blocks seen before are promoted
            before it runs; ``False``: hints only keep cached blocks from eviction.
        count: ``(first, end)`` request indices: every policy replays the whole trace but
            hit rates count only requests ``first .. end - 1`` (held-out halves: warm start).

    Raises:
        EvaluateError: empty trace, capacity < 1, lookahead < 0 or unknown policy.
    """
    import time

    ct = requests if isinstance(requests, CompactTrace) else (compact(requests) if requests else None)
    if ct is None or ct.requests == 0:
        raise EvaluateError("the trace has no requests")
    bad = [c for c in capacities if c < 1]
    if bad or not capacities:
        raise EvaluateError(f"capacities must be >= 1 block, got {list(capacities)}")
    if any(k < 0 for k in lookaheads) or not lookaheads:
        raise EvaluateError(f"lookaheads must be >= 0 requests, got {list(lookaheads)}")
    unknown = [p for p in (*policies, *baselines) if p not in POLICIES or p == BELADY]
    if unknown:
        raise EvaluateError(f"unknown policies {unknown} (choose from {sorted(set(POLICIES) - {BELADY})})")
    base = tuple(dict.fromkeys((LRU, *baselines)))
    t0 = time.perf_counter()
    first, end = count if count is not None else (0, ct.requests)
    if not 0 <= first < end <= ct.requests:
        raise EvaluateError(f"count must be 0 <= first < end <= {ct.requests}, got {count}")
    refs = int(ct.offsets[end] - ct.offsets[first])
    ct.next_use()
    cols = [column(p, k) for p in policies for k in lookaheads]
    infinite = float(POLICIES[LRU](ct, max(1, ct.n_blocks), 0, True)[first:end].sum()) / refs if refs else 0.0
    results = []
    for cap in capacities:
        res = CapacityResult(cap, baselines=base, infinite=infinite)
        runs = [(p, 0) for p in (*base, BELADY)] + [(p, k) for p in policies for k in lookaheads]
        done: dict[str, np.ndarray] = {}  # hits per request at lookahead 0: the default policy's experts reuse them
        for p, k in runs:
            col = column(p, k)
            if progress:
                progress(col, cap)
            if p == DEFAULT_POLICY and k == 0:
                run = experts.run(ct, cap, known=done)
                hits = run.hits
                res.switches[col] = run.switches
                res.refill[col] = float((run.followed[first:end] - hits[first:end]).sum()) / refs if refs else 0.0
            else:
                hits = POLICIES[p](ct, cap, k, promote)
            if k == 0:
                done[p] = hits
            res.hit_rate[col] = float(hits[first:end].sum()) / refs if refs else 0.0
        results.append(res)
    distinct = int(ct.n_blocks)
    return Evaluation(trace, end - first, refs, distinct, cols, results, time.perf_counter() - t0, base)


def _label(col: str) -> str:
    name, _, k = col.partition("@")
    return LABELS.get(name, name) + (f" K={k}" if k else "")


def render_table(ev: Evaluation) -> Any:
    """A :class:`rich.table.Table`, one row per policy (hit rate, then our policies' gap
    closed and margin over the best baseline), one column per capacity (fits 80 columns)."""
    from rich.table import Table

    t = Table(title=f"fast-tier prefix hit rate — {ev.trace} ({ev.requests:,} requests, "
                    f"{ev.block_refs:,} block refs, {ev.distinct_blocks:,} distinct)")
    t.add_column("policy", no_wrap=True)
    for r in ev.results:
        t.add_column(f"{r.capacity:,}", justify="right", no_wrap=True)
    for p in (*ev.baselines, BELADY):
        t.add_row(_label(p), *[f"{r.hit_rate[p]:.4f}" for r in ev.results])
    for p in ev.policies:
        t.add_row(f"[bold]{_label(p)}[/bold]", *[f"{r.hit_rate[p]:.4f}" for r in ev.results])
        t.add_row("  gap closed" + (" (of ∞ tier)" if "@" in p else ""),
                  *["—" if (g := r.gap_closed(p)) is None else f"{100 * g:.1f}%" for r in ev.results])
        t.add_row("  vs best baseline", *[f"{r.margin(p):+.4f}" for r in ev.results])
        if any(p in r.switches for r in ev.results):
            t.add_row("  leader switches", *[str(r.switches.get(p, "—")) for r in ev.results])
            t.add_row("  refill cost", *[f"{-r.refill[p] or 0.0:+.4f}" if p in r.refill else "—" for r in ev.results])
    return t


def _head(ev: Evaluation) -> list[str]:
    return (["capacity (blocks)"] + [_label(p) for p in (*ev.baselines, BELADY)]
            + [x for p in ev.policies for x in (_label(p), f"{_label(p)} gap closed" + (" (of ∞ tier)" if "@" in p else ""),
                                                f"{_label(p)} vs best")])


def _rows(ev: Evaluation) -> list[list[str]]:
    rows = []
    for r in ev.results:
        row = [f"{r.capacity:,}"] + [f"{r.hit_rate[p]:.4f}" for p in (*ev.baselines, BELADY)]
        for p in ev.policies:
            g = r.gap_closed(p)
            row += [f"{r.hit_rate[p]:.4f}", "—" if g is None else f"{100 * g:.1f}%", f"{r.margin(p):+.4f}"]
        rows.append(row)
    return rows


def markdown_table(ev: Evaluation) -> str:
    """The same table as GitHub markdown (for docs/BENCHMARKS.md)."""
    head = _head(ev)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(row) + " |" for row in _rows(ev)]
    return "\n".join(lines)


def plot(ev: Evaluation, out: str | Path) -> Path:
    """Write a PNG of hit rate vs capacity (one line per policy)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    caps = [r.capacity for r in ev.results]
    fig, ax = plt.subplots(figsize=(9, 5))
    tab20 = list(plt.get_cmap("tab20").colors)
    ax.set_prop_cycle(color=tab20[0::2] + tab20[1::2])  # 20 distinct colours, strong ones first
    for p in (*ev.baselines, BELADY, *ev.policies):
        ax.plot(caps, [r.hit_rate[p] for r in ev.results], marker="o", label=_label(p),
                linestyle="--" if p in (*ev.baselines, BELADY) else "-", linewidth=2 if p in ev.policies else 1)
    ax.set_xscale("log")
    ax.set_xlabel("fast-tier capacity (blocks)")
    ax.set_ylabel("prefix hit rate (blocks)")
    ax.set_title(f"{ev.trace}: {ev.requests:,} requests")
    ax.grid(True, alpha=0.3)
    ax.legend(loc="center left", bbox_to_anchor=(1.01, 0.5), fontsize="small")
    fig.tight_layout()
    out = Path(out)
    fig.savefig(out, dpi=120)
    plt.close(fig)
    return out


def evaluate_synthetic(seed: int = 0, policies: Sequence[str] = (DEFAULT_POLICY,),
                       baselines: Sequence[str] = BASELINES,
                       progress: Callable[[str, int], None] | None = None,
                       variants: bool = False) -> list[Evaluation]:
    """Evaluate every case of the synthetic robustness suite (:mod:`kvadvisor.synthetic`,
    docs/traces.md) at its capacities; one :class:`Evaluation` per case (``trace`` = its name).

    Args:
        variants: the generators with other parameters (:data:`kvadvisor.synthetic.VARIANTS`)
            instead of the suite.

    Raises:
        EvaluateError: an unknown policy.
    """
    from kvadvisor import synthetic

    cases = synthetic.variants(seed) if variants else synthetic.suite(seed)
    return [evaluate(compact(c.requests, c.finishes), c.capacities, policies, (0,), baselines, trace=c.name,
                     progress=progress) for c in cases]


def summary_markdown(evs: Sequence[Evaluation], policy: str = DEFAULT_POLICY) -> str:
    """One row per trace and capacity: the best baseline, Belady, ``policy``, its margin
    over the best baseline (the robustness acceptance: ≥ −0.002 on every row), the
    selector's leader switches and their refill cost (the default policy; the margin's
    part lost to refills, :attr:`CapacityResult.refill`), then a line counting the rows
    below −0.002."""
    lines = [f"| trace | capacity (blocks) | LRU | best baseline | Belady | {_label(policy)} | vs best | switches "
             "| refill cost |", "|---|---|---|---|---|---|---|---|---|"]
    margins = []
    for ev in evs:
        for r in ev.results:
            name, best = r.best_baseline()
            margins.append(r.margin(policy))
            refill = f"{-r.refill[policy] or 0.0:+.4f}" if policy in r.refill else "—"
            lines.append(f"| {ev.trace} | {r.capacity:,} | {r.hit_rate[LRU]:.4f} | {best:.4f} ({_label(name)}) | "
                         f"{r.hit_rate[BELADY]:.4f} | {r.hit_rate[policy]:.4f} | {r.margin(policy):+.4f} | "
                         f"{r.switches.get(policy, '—')} | {refill} |")
    if margins:
        below = sum(m < -0.002 for m in margins)
        lines.append(f"\n{below} of {len(margins)} rows below best − 0.002 (worst {min(margins):+.4f})")
    return "\n".join(lines)


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


def parse_lookaheads(text: str) -> list[int]:
    """``"0,1,4,16"`` → ``[0, 1, 4, 16]`` (numbers of upcoming requests visible).

    Raises:
        EvaluateError: a part is not an integer >= 0.
    """
    try:
        ks = [int(x.strip()) for x in text.split(",")]
    except ValueError as exc:
        raise EvaluateError(f"lookahead must be comma-separated integers >= 0, got {text!r}") from exc
    if not ks or any(k < 0 for k in ks):
        raise EvaluateError(f"lookahead must be comma-separated integers >= 0, got {text!r}")
    return list(dict.fromkeys(ks))


__all__ = [
    "CapacityResult", "EvaluateError", "Evaluation", "column", "evaluate", "load_mooncake", "load_trace",
    "load_compact", "load_trace_finishes", "load_trace_times", "load_weka", "load_weka_timed", "markdown_table",
    "next_uses", "parse_capacities",
    "parse_lookaheads", "plot", "render_table",
    "simulate_belady", "simulate_lru", "simulate_prefix_value", "evaluate_synthetic", "summary_markdown",
]
