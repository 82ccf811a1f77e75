"""Partition skew of the prefix index on real traces (scaled mode, event_plane/partition.py).

For each trace, every distinct block below the trunk is assigned to a partition, and the
most-loaded partition's block count is divided by the mean (1.0 = perfectly even; the goal
is <= 1.25 at 8 partitions).  Printed side by side, in the same run:

* ``first block``: partition by the chain's first block (what a naive key does; every
  Mooncake request shares block 0, so one partition gets everything);
* ``ancestor@K``: a whole chain by its ancestor at depth K (trunk = depths < K);
* ``ours``: trunk of K, then stretches of S blocks, each by its head (the default scheme).

Also printed: the mean number of partitions a lookup of a whole request asks (``pieces``).

    .venv/bin/python bench/partition_skew.py                       # bundled Mooncake slice
    .venv/bin/python bench/partition_skew.py --trace $KVADVISOR_TRACES/conversation_trace.jsonl \
        --trace $KVADVISOR_TRACES/claude_code_weka --partitions 8
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from bench._report import Report, add_json_option  # noqa: E402
from event_plane.partition import TRUNK, PartitionScheme  # noqa: E402
from kvadvisor.evaluate import load_trace  # noqa: E402
from kvadvisor.trace import bundled_trace  # noqa: E402

_M64 = (1 << 64) - 1


def _skew(counts: Counter[int], partitions: int) -> float:
    total = sum(counts.values())
    return max(counts.values()) * partitions / total if total else 1.0


def measure(requests: list[list[int]], scheme: PartitionScheme) -> dict[str, float]:
    """Skews (max/mean, trunk excluded) of the three keys, and the mean pieces per lookup."""
    n, k = scheme.partitions, scheme.trunk_depth
    naive: dict[int, int] = {}
    ancestor: dict[int, int] = {}
    ours: dict[int, int] = {}
    pieces = 0
    for req in requests:
        chain = [h & _M64 for h in req]
        if not chain:
            continue
        first = scheme.partition_of_head(chain[0])
        anc = scheme.partition_of_head(chain[k]) if len(chain) > k else TRUNK
        owners = scheme.owners(chain)
        pieces += len(scheme.pieces(chain))
        for d, h in enumerate(chain):
            naive.setdefault(h, first)
            if d >= k:
                ancestor.setdefault(h, anc)
                ours.setdefault(h, owners[d])
    return {
        "first block": _skew(Counter(naive.values()), n),
        f"ancestor@{k}": _skew(Counter(ancestor.values()), n),
        "ours": _skew(Counter(ours.values()), n),
        "blocks": float(len(ours)),
        "pieces": pieces / max(1, len(requests)),
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--trace", action="append", type=Path, help="trace file or WEKA directory (repeatable)")
    ap.add_argument("--partitions", type=int, default=8)
    ap.add_argument("--trunk-depth", type=int, default=1)
    ap.add_argument("--stretch", type=int, default=64)
    ap.add_argument("--goal", type=float, default=1.25)
    add_json_option(ap)
    args = ap.parse_args()
    report = Report("partition_skew", "partition skew of the scaled index: most-loaded partition / mean")
    traces = args.trace
    if not traces:
        env = os.environ.get("KVADVISOR_TRACES")
        traces = ([Path(env) / "conversation_trace.jsonl", Path(env) / "claude_code_weka"] if env
                  else [bundled_trace()])
    scheme = PartitionScheme(args.partitions, args.trunk_depth, args.stretch)
    print(f"partitions={scheme.partitions} trunk_depth={scheme.trunk_depth} stretch={scheme.stretch}; "
          f"skew = most-loaded partition / mean (trunk excluded), goal <= {args.goal}")
    print(f"{'trace':<28} {'blocks':>9} {'first block':>12} {f'ancestor@{scheme.trunk_depth}':>12} "
          f"{'ours':>7} {'ours/goal':>10} {'pieces':>7}")
    worst = 0.0
    figures = []
    for t in traces:
        t0 = time.perf_counter()
        reqs = load_trace(t)
        m = measure(reqs, scheme)
        worst = max(worst, m["ours"])
        print(f"{t.name:<28} {int(m['blocks']):>9,} {m['first block']:>12.3f} "
              f"{m[f'ancestor@{scheme.trunk_depth}']:>12.3f} {m['ours']:>7.3f} {m['ours'] / args.goal:>10.3f} "
              f"{m['pieces']:>7.2f}   ({time.perf_counter() - t0:.1f} s)")
        figures.append(report.add(
            f"skew, {t.name} ({int(m['blocks']):,} blocks)", m["ours"], m[f"ancestor@{scheme.trunk_depth}"],
            unit="max/mean", reference_name=f"whole chain by its ancestor at depth {scheme.trunk_depth}",
            goal=f"<= {args.goal}", met=m["ours"] <= args.goal, better="lower"))
        report.extra[t.name] = m
    print(f"worst skew of ours: {worst:.3f} ({'meets' if worst <= args.goal else 'misses'} the goal {args.goal})")
    if figures:
        max(figures, key=lambda f: f.ours or 0.0).headline = True
    report.write(args.json)


if __name__ == "__main__":
    main()
