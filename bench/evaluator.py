"""Evaluator speed: every policy on a trace at several capacities, on one core.

    taskset -c 0 python bench/evaluator.py                      # WEKA traces, 10k/50k/200k blocks
    taskset -c 0 python bench/evaluator.py --split              # plus the two held-out halves

Prints the wall time of ``kvadvisor.evaluate.evaluate`` with every baseline, Belady and the
default policy (goal: < 120 s for the WEKA traces at 3 capacities), and ours vs two
references on the same requests at the first capacity, as speed ratios: the evaluator's
former pure-Python LRU (an ``OrderedDict``, reproduced below) against the compiled LRU, and
the former pure-Python prefix-value replay (``advisor.policy.prefix_policy.PrefixValueCache``, what
made the former evaluator take 284 s) against the compiled default policy (which replays
three instances: the tier and its two shadows), on the first ``--reference-requests``.  ``--split`` also evaluates the
conversations with odd and even file numbers separately (held-out validation: the default
policy's settings are one set for every trace).  The trace directory is ``--trace`` or
``$KVADVISOR_TRACES/claude_code_weka``.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from advisor.policy.eviction import lru, prefix_value  # noqa: E402
from advisor.policy.prefix_policy import PrefixValueCache  # noqa: E402
from advisor.policy.eviction.compact import compact  # noqa: E402
from kvadvisor.evaluate import evaluate, load_trace, markdown_table, parse_capacities  # noqa: E402


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


def _halves(path: Path) -> list[tuple[str, Path]]:
    files = sorted(p for p in path.iterdir() if p.name.startswith("trace_"))
    out = []
    for name, keep in (("odd", 1), ("even", 0)):
        d = Path(tempfile.mkdtemp(prefix=f"kvadvisor-weka-{name}-"))
        for f in files:
            digits = "".join(ch for ch in f.name if ch.isdigit())
            if digits and int(digits) % 2 == keep:
                (d / f.name).symlink_to(f.resolve())
        out.append((f"{path.name} ({name} file numbers)", d))
    return out


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    default = Path(os.environ["KVADVISOR_TRACES"]) / "claude_code_weka" if "KVADVISOR_TRACES" in os.environ else None
    ap.add_argument("--trace", type=Path, default=default, help="WEKA trace directory or Mooncake jsonl")
    ap.add_argument("--capacity", default="10000,50000,200000")
    ap.add_argument("--split", action="store_true", help="also evaluate odd / even file numbers apart")
    ap.add_argument("--reference-requests", type=int, default=2000,
                    help="requests replayed by the slow prefix-value reference")
    args = ap.parse_args()
    if args.trace is None:
        ap.error("pass --trace or set KVADVISOR_TRACES")
    caps = parse_capacities(args.capacity)
    t0 = time.perf_counter()
    reqs = load_trace(args.trace)
    t_load = time.perf_counter() - t0
    t0 = time.perf_counter()
    ct = compact(reqs)
    t_compact = time.perf_counter() - t0
    ev = evaluate(ct, caps, trace=args.trace.name)
    print(markdown_table(ev))
    print(f"\nload {t_load:.1f} s, compact {t_compact:.1f} s, evaluate {ev.seconds:.1f} s "
          f"({len(ev.baselines) + 1 + len(ev.policies)} policies x {len(caps)} capacities; goal < 120 s)")
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
    if args.split and args.trace.is_dir():
        for label, d in _halves(args.trace):
            part = evaluate(load_trace(d, "weka"), caps, trace=label)
            print(f"\n{label}: {part.requests:,} requests, {part.block_refs:,} block refs\n")
            print(markdown_table(part))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
