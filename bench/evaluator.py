"""Evaluator speed: every policy on a trace at several capacities, on one core.

    taskset -c 0 python bench/evaluator.py                      # WEKA traces, 10k/50k/200k blocks
    taskset -c 0 python bench/evaluator.py --split              # plus the first and second halves
    taskset -c 0 python bench/evaluator.py --full               # every table of the policy section, timed
    python bench/evaluator.py --robustness 1000,2000,3000       # the synthetic suite and its variants, other seeds
    python bench/evaluator.py --supersessions --trace …         # superseded branches, and those read again
    python bench/evaluator.py --finish-gaps                     # WEKA: time to a session's next request, by finish reason
    python bench/evaluator.py --tail-first 0,1000,2000          # ARC, S3-FIFO, LFU-DA, LRU, SIEVE: tail first vs block order

Prints the wall time of ``kvadvisor.evaluate.evaluate`` with every baseline, Belady and the
default policy (goal: < 120 s for the WEKA traces at 3 capacities), and ours vs two
references on the same requests at the first capacity, as speed ratios: the evaluator's
former pure-Python LRU (an ``OrderedDict``, reproduced below) against the compiled LRU, and
the former pure-Python prefix-value replay (``advisor.policy.prefix_policy.PrefixValueCache``, what
made the former evaluator take 284 s) against the compiled prefix_value policy (which replays
three instances: the tier and its two shadows), on the first ``--reference-requests``.
``--split`` prints the honest protocol's two tables: hit rates on
the first half of the requests (where settings may be chosen) and on the second half (the
held-out report), every policy replaying the whole trace in order and counting only its
half (warm start).  The default policy's settings (:class:`advisor.policy.eviction.experts.
SelectorSettings` and its experts' own) are one set chosen on neither half: the switching
rule's settings were set from the synthetic suite and its variants (docs/traces.md; z on
seeds 0–6,000).  The trace is
``--trace`` (WEKA directory or Mooncake jsonl) or ``$KVADVISOR_TRACES/claude_code_weka``.
``--robustness SEEDS`` replays the synthetic suite and its variants (the same generators
with other parameters, :data:`kvadvisor.synthetic.VARIANTS`) generated with each seed: the
acceptance (every row >= best - 0.002); seeds from 7,000 on are traces no setting was
chosen on.
``--tail-first SEEDS`` replays each block-level baseline in its classic block-by-block
order and tail first (a request's blocks last first, the order the default's experts use,
:mod:`advisor.policy.eviction.experts`, "Tail first") on Mooncake, WEKA (from
``$KVADVISOR_TRACES``) and the synthetic suite and variants of each seed, and prints, per
policy, the hit rates side by side and the spread of tail first − classic.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.policy.eviction import lru, prefix_value  # noqa: E402
from advisor.policy.eviction.registry import DEFAULT_POLICY  # noqa: E402
from advisor.policy.prefix_policy import PrefixValueCache  # noqa: E402
from advisor.policy.eviction.compact import compact  # noqa: E402
from bench._report import Report, add_json_option  # noqa: E402
from kvadvisor.evaluate import (  # noqa: E402
    Evaluation, evaluate, load_trace, load_trace_finishes, markdown_table, parse_capacities)

WHAT = "eviction policies: the default policy's hit rate against the best online baseline, and replay speed"


def add_hit_rates(report: Report, ev: Evaluation, label: str, headline: bool = False) -> None:
    """One figure per capacity: the default policy's hit rate against the best online
    baseline's at that capacity (acceptance: at most 0.002 below it)."""
    for i, r in enumerate(ev.results):
        best, best_rate = r.best_baseline()
        margin = r.margin(DEFAULT_POLICY)
        report.add(f"hit rate, {label}, {r.capacity:,} blocks", r.hit_rate[DEFAULT_POLICY], best_rate,
                   unit="hit rate", reference_name=f"best online baseline, {best}", goal=">= best - 0.002",
                   met=margin >= -0.002, headline=headline and i == 0)
    report.extra.setdefault("evaluations", []).append(ev.as_dict())


def python_lru(requests: Sequence[Sequence[int]], capacity: int) -> int:
    """The evaluator's former LRU (pure Python), the speed reference."""
    cache: OrderedDict[int, None] = OrderedDict()
    hits = 0
    for r in requests:
        for h in r:
            if h not in cache:
                break
            hits += 1
        for h in r:
            if h in cache:
                cache.move_to_end(h)
            else:
                cache[h] = None
                if len(cache) > capacity:
                    cache.popitem(last=False)
    return hits


def full_evaluation(report: Report, json_path: Path | None) -> int:
    """Every table of docs/BENCHMARKS.md "Advisor policies", timed as one run."""
    import numpy as np

    from kvadvisor import timemodel
    from kvadvisor.evaluate import evaluate_synthetic, load_compact, load_trace_times, summary_markdown

    if "KVADVISOR_TRACES" not in os.environ:
        print("set KVADVISOR_TRACES to the directory of the traces", file=sys.stderr)
        return 2
    root = Path(os.environ["KVADVISOR_TRACES"])
    start = time.perf_counter()
    times: dict[str, float] = {}
    t0 = time.perf_counter()
    moon = compact(load_trace(root / "conversation_trace.jsonl"))
    ev = evaluate(moon, [1000, 5859, 10000, 30000], trace="Mooncake conversation")
    print(markdown_table(ev))
    add_hit_rates(report, ev, "Mooncake")
    times["Mooncake"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    weka = load_compact(root / "claude_code_weka", "weka")
    ev = evaluate(weka, [10000, 50000, 200000], trace="WEKA")
    print(markdown_table(ev))
    add_hit_rates(report, ev, "WEKA")
    del weka
    times["WEKA"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    print(summary_markdown(evaluate_synthetic()))
    times["synthetic suite"] = time.perf_counter() - t0
    t0 = time.perf_counter()
    arrivals = np.array(load_trace_times(root / "conversation_trace.jsonl"))
    print(timemodel.timed_markdown(5859, timemodel.evaluate_timed(moon, arrivals, 5859, [16])))
    times["time model"] = time.perf_counter() - t0
    total = time.perf_counter() - start
    print("\n" + ", ".join(f"{k} {v:.1f} s" for k, v in times.items()) + f"; total {total:.1f} s (goal < 300 s)")
    report.add("full evaluation, wall clock", total, unit="s", goal="< 300 s on one core", met=total < 300,
               better="lower", headline=True)
    report.extra["times_s"] = times
    report.write(json_path)
    return 0


def supersessions(trace: Path, max_fork: int) -> dict[str, tuple[int, int, int, int]]:
    """Superseded branches of ``trace`` by ``prefix_value``'s rule (module docstring of
    :mod:`advisor.policy.eviction.prefix_value`, "Superseded branches" and "Superseded
    first"): a request that continues a known prefix (more than its first block) and leaves
    it at a block ``d`` that had fewer than ``max_fork`` children supersedes the path the
    latest earlier request through ``d`` took from ``d``'s child on.

    Returns:
        By kind (``"last block"``: the previous request's one-off last block; ``"branch"``:
        more than one block), ``(branches, reused, blocks, blocks reused)``: those
        branches, those with a block referenced again later in the trace, their blocks,
        and the blocks referenced again.
    """
    import numpy as np

    ct = compact(load_trace(trace))
    flat, off, n = ct.flat, ct.offsets, ct.requests
    next_use = ct.next_use()
    last_req = np.full(ct.n_blocks, -1, dtype=np.int64)
    last_ref = np.zeros(ct.n_blocks, dtype=np.int64)
    taken = np.full(ct.n_blocks, -1, dtype=np.int64)
    children = np.zeros(ct.n_blocks, dtype=np.int64)
    counts = {"last block": [0, 0, 0, 0], "branch": [0, 0, 0, 0]}
    for i in range(n):
        a, b = int(off[i]), int(off[i + 1])
        req = flat[a:b].tolist()
        known = 0
        while known < len(req) and last_req[req[known]] >= 0:
            known += 1
        if 1 < known < len(req) and children[req[known - 1]] < max_fork:
            y, r, again = int(taken[req[known - 1]]), last_req[req[known - 1]], 0
            if y >= 0:
                c = counts["branch" if taken[y] >= 0 else "last block"]
                c[0] += 1
                while y >= 0 and last_req[y] == r:
                    c[2] += 1
                    again += int(next_use[last_ref[y]] < n)
                    y = int(taken[y])
                c[1] += int(again > 0)
                c[3] += again
        for j, x in enumerate(req):
            if j and last_req[x] < 0:
                children[req[j - 1]] += 1
            last_req[x], last_ref[x] = i, a + j
            taken[x] = req[j + 1] if j + 1 < len(req) else -1
    return {k: (v[0], v[1], v[2], v[3]) for k, v in counts.items()}


def robustness(report: Report, seeds: Sequence[int], json_path: Path | None) -> int:
    """The synthetic suite and its variants generated with each of ``seeds``: one summary
    table, the rows below best - 0.002 counted."""
    from kvadvisor.evaluate import evaluate_synthetic, summary_markdown

    t0 = time.perf_counter()
    evs = []
    for seed in seeds:
        for variants in (False, True):
            for ev in evaluate_synthetic(seed, variants=variants):
                ev.trace = f"{ev.trace}, seed {seed}"
                evs.append(ev)
    print(summary_markdown(evs))
    rows = [r for ev in evs for r in ev.results]
    below = sum(r.margin(DEFAULT_POLICY) < -0.002 for r in rows)
    print(f"seeds {', '.join(map(str, seeds))}, suite and variants: {time.perf_counter() - t0:.1f} s")
    report.add(f"synthetic suite and variants, seeds {', '.join(map(str, seeds))}: rows below best - 0.002",
               below, unit="rows", goal="0", met=below == 0, better="lower")
    report.extra.setdefault("evaluations", []).extend(ev.as_dict() for ev in evs)
    report.write(json_path)
    return 0


TAIL_FIRST_POLICIES = ("arc", "s3fifo", "lfu_da", "lru", "sieve")


def tail_first(report: Report, seeds: Sequence[int], json_path: Path | None) -> int:
    """Each block-level baseline tail first against its classic order, on the same rows
    (Mooncake and WEKA at their capacities when ``$KVADVISOR_TRACES`` is set, the synthetic
    suite and variants of each of ``seeds``); prints every row and, per policy, the rows,
    the smallest and largest difference (hit rate) and the rows more than 0.002 below."""
    import numpy as np

    from advisor.policy.eviction import arc, lfu_da, s3fifo, sieve
    from kvadvisor import synthetic
    from kvadvisor.evaluate import load_compact

    mods = {"arc": arc, "s3fifo": s3fifo, "lfu_da": lfu_da, "lru": lru, "sieve": sieve}
    items = []
    if "KVADVISOR_TRACES" in os.environ:
        root = Path(os.environ["KVADVISOR_TRACES"])
        items.append(("Mooncake", load_compact(root / "conversation_trace.jsonl"), (1000, 5859, 10000, 30000)))
        items.append(("WEKA", load_compact(root / "claude_code_weka"), (10000, 50000, 200000)))
    for seed in seeds:
        for c in synthetic.suite(seed) + synthetic.variants(seed):
            items.append((f"{c.name}, seed {seed}", compact(c.requests, c.finishes), c.capacities))
    diffs: dict[str, list[float]] = {p: [] for p in TAIL_FIRST_POLICIES}
    rates: dict[str, list[tuple[float, float]]] = {p: [] for p in TAIL_FIRST_POLICIES}
    print("| trace | capacity | " + " | ".join(f"{p} classic / tail first" for p in TAIL_FIRST_POLICIES) + " |")
    print("|---|---|" + "---|" * len(TAIL_FIRST_POLICIES))
    for name, ct, caps in items:
        refs = float(ct.flat.shape[0])
        for cap in caps:
            cells = []
            for p in TAIL_FIRST_POLICIES:
                classic = float(mods[p].simulate(ct, cap).sum()) / refs
                tail = float(mods[p].simulate(ct, cap, tail_first=True).sum()) / refs
                diffs[p].append(tail - classic)
                rates[p].append((tail, classic))
                cells.append(f"{classic:.4f} / {tail:.4f}")
            print(f"| {name} | {cap:,} | " + " | ".join(cells) + " |", flush=True)
    print()
    for p, d in diffs.items():
        a = np.array(d)
        below = int((a < -0.002).sum())
        print(f"{p}: {a.size} rows, tail first - classic from {a.min():+.4f} to {a.max():+.4f} "
              f"(median {np.median(a):+.4f}), {below} rows more than 0.002 below")
        tail_mean, classic_mean = np.mean(rates[p], axis=0)
        report.add(f"{p} mean hit rate over the rows, tail first vs classic order", float(tail_mean),
                   float(classic_mean), unit="hit rate", reference_name="classic block-by-block order")
        report.add(f"{p} tail first: rows more than 0.002 below the classic order", below, unit="rows",
                   better="lower")
    report.write(json_path)
    return 0


def finish_gaps(trace: Path) -> dict[str, tuple[int, int, float, float, float]]:
    """Time from each request's finish to its session's next request, by finish reason
    (the input the finish-aware expert learns, :mod:`advisor.policy.eviction.finish_aware`).

    A session's next request is the next request that continues it (the deepest of its
    blocks seen before was last read by this one), as the expert sees it online.

    Returns:
        By finish class name, ``(requests, never continued, p10, median, p90 of the gap in s)``.
    """
    import numpy as np

    from advisor.policy.eviction.finish_aware import FINISH_CLASS_NAMES
    from kvadvisor.evaluate import load_compact

    ct = load_compact(trace)
    fin = ct.finishes
    if fin is None:
        raise SystemExit(f"{trace} records no finish reasons")
    last: dict[int, int] = {}
    gaps: dict[int, list[float]] = {}
    continued = np.zeros(ct.requests, dtype=bool)
    for i in range(ct.requests):
        blocks = ct.flat[ct.offsets[i]:ct.offsets[i + 1]].tolist()
        prev = [last[b] for b in blocks if b in last]
        if prev and not continued[prev[-1]]:
            r = prev[-1]
            continued[r] = True
            gaps.setdefault(int(fin.reason[r]), []).append(max(float(fin.arrival[i] - fin.finish[r]), 0.0))
        for b in blocks:
            last[b] = i
    out = {}
    for c, name in enumerate(FINISH_CLASS_NAMES):
        n = int((fin.reason == c).sum())
        if n:
            g = np.array(gaps.get(c, [0.0]))
            p10, p50, p90 = np.percentile(g, [10, 50, 90])
            out[name] = (n, int(n - continued[fin.reason == c].sum()), float(p10), float(p50), float(p90))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(os.environ["KVADVISOR_TRACES"]) / "claude_code_weka" if "KVADVISOR_TRACES" in os.environ else None
    ap.add_argument("--trace", type=Path, default=default, help="WEKA trace directory or Mooncake jsonl")
    ap.add_argument("--capacity", default="10000,50000,200000")
    ap.add_argument("--split", action="store_true", help="also print the first and the second (held-out) half")
    ap.add_argument("--full", action="store_true",
                    help="the full evaluation in one process, timed: Mooncake (1,000-30,000 blocks), WEKA "
                         "(10,000-200,000), the synthetic suite, the time model (Mooncake, 5,859 blocks, K = 0, 16); "
                         "traces from $KVADVISOR_TRACES (goal < 300 s on one core)")
    ap.add_argument("--reference-requests", type=int, default=2000,
                    help="requests replayed by the slow prefix-value reference")
    ap.add_argument("--robustness", metavar="SEEDS", type=lambda t: [int(x) for x in t.split(",")],
                    help="replay the synthetic suite and its variants generated with each of these seeds "
                         "(comma-separated) and count the rows below best - 0.002")
    ap.add_argument("--tail-first", metavar="SEEDS", type=lambda t: [int(x) for x in t.split(",")],
                    help="each block-level baseline tail first against its classic order, on the visible "
                         "traces and the synthetic suite and variants of these seeds")
    ap.add_argument("--finish-gaps", action="store_true",
                    help="time from a request's finish to its session's next request, by finish reason")
    ap.add_argument("--supersessions", action="store_true",
                    help="count the trace's superseded branches (prefix_value's rule) and those read again")
    add_json_option(ap)
    args = ap.parse_args()
    report = Report("evaluator", WHAT)
    if args.full:
        return full_evaluation(report, args.json)
    if args.robustness:
        return robustness(report, args.robustness, args.json)
    if args.tail_first:
        return tail_first(report, args.tail_first, args.json)
    if args.trace is None:
        ap.error("pass --trace or set KVADVISOR_TRACES")
    if args.finish_gaps:
        print("| finish reason | requests | never continued | gap p10 (s) | median (s) | p90 (s) |\n|---|---|---|---|---|---|")
        for name, (n, never, p10, p50, p90) in finish_gaps(args.trace).items():
            print(f"| {name} | {n:,} | {never:,} | {p10:.0f} | {p50:.0f} | {p90:.0f} |")
        return 0
    if args.supersessions:
        from advisor.policy.eviction.prefix_value import PrefixValueSettings

        fork = PrefixValueSettings().supersede_max_fork
        for label, max_fork in ((f"at forks (< {fork} children)", fork), ("at every block", 1 << 62)):
            for kind, (br, again, blk, blk_again) in supersessions(args.trace, max_fork).items():
                print(f"{args.trace.name}, superseded {kind.replace('branch', 'branche')}s {label}: {br:,}, {br - again:,} never read again; "
                      f"{blk:,} blocks, {blk - blk_again:,} ({(blk - blk_again) / max(blk, 1):.1%}) never read again")
        return 0
    caps = parse_capacities(args.capacity)
    t0 = time.perf_counter()
    reqs, finishes = load_trace_finishes(args.trace)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    ct = compact(reqs, finishes)
    t_compact = time.perf_counter() - t0
    ev = evaluate(ct, caps, trace=args.trace.name)
    print(markdown_table(ev))
    print(f"\nload {t_load:.1f} s, compact {t_compact:.1f} s, evaluate {ev.seconds:.1f} s "
          f"({len(ev.baselines) + 1 + len(ev.policies)} policies x {len(caps)} capacities; goal < 120 s)")
    add_hit_rates(report, ev, args.trace.name, headline=True)
    report.add(f"evaluate, {len(caps)} capacities, wall clock", ev.seconds, unit="s", goal="< 120 s",
               met=ev.seconds < 120, better="lower")
    cap = caps[0]
    t0 = time.perf_counter()
    ref = python_lru(reqs, cap)
    t_ref = time.perf_counter() - t0
    t0 = time.perf_counter()
    ours = int(lru.simulate(ct, cap).sum())
    t_ours = time.perf_counter() - t0
    assert ours == ref, (ours, ref)
    print(f"LRU at {cap:,} blocks: ours {t_ours:.2f} s, pure-Python reference {t_ref:.1f} s, "
          f"ratio {t_ref / t_ours:.0f}x (same hits: {ours:,})")
    report.add(f"LRU replay at {cap:,} blocks", t_ours, t_ref, unit="s", reference_name="pure-Python OrderedDict LRU",
               better="lower")
    head = reqs[:args.reference_requests]
    t0 = time.perf_counter()
    cache = PrefixValueCache(cap)
    for r in head:
        cache.access(r)
    t_ref = time.perf_counter() - t0
    ct_head = compact(head)
    prefix_value.simulate(ct_head, cap)  # compiled already; timed below
    t0 = time.perf_counter()
    prefix_value.simulate(ct_head, cap)
    t_ours = time.perf_counter() - t0
    print(f"prefix value at {cap:,} blocks, first {len(head):,} requests: ours {t_ours:.2f} s (3 replays), "
          f"former pure-Python replay {t_ref:.1f} s, ratio {t_ref / t_ours:.0f}x")
    report.add(f"prefix_value replay at {cap:,} blocks, first {len(head):,} requests", t_ours, t_ref, unit="s",
               reference_name="former pure-Python PrefixValueCache", better="lower")
    if args.split:
        half = ct.requests // 2
        for label, span in (("first half", (0, half)), ("second half (held out)", (half, ct.requests))):
            part = evaluate(ct, caps, trace=f"{args.trace.name}, {label}", count=span)
            print(f"\n{args.trace.name}, {label}: requests {span[0]:,}-{span[1] - 1:,}, "
                  f"{part.block_refs:,} block refs\n")
            print(markdown_table(part))
            add_hit_rates(report, part, f"{args.trace.name}, {label}")
    report.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
