#!/usr/bin/env python
"""Time to first token with the whole loop, on the Mooncake conversation trace, side by side.

    python bench/e2e_ttft.py                       # 6 configurations, ~25 minutes here
    python bench/e2e_ttft.py --configs a,d,f --requests 300 --warmup 150

Every configuration starts its own engines (``kvadvisor demo --engine vllm``'s harness,
:mod:`kvadvisor.engine_demo`) and replays the same requests, the same way: the first
``--requests`` of the bundled trace, ``--block-tokens`` tokens per trace block, trace time
divided by ``--time-scale``, streamed over HTTP.  The first ``--warmup`` requests warm the
caches and are not measured; the figures are those of the window after them.

(a) vLLM alone: its own prefix cache (G1), round-robin;
(b) our connector with G2 only, round-robin;
(c) G2 + the shared volumes (``fast`` POSIX, ``archive`` S3), advisor moves off, round-robin;
(d) the full loop: (c) + the advisor's policy rounds + KV-aware routing (Dynamo's rule on
    our ``POST /query``);
(e) (d) with round-robin routing;
(f) the bound: vLLM alone with a G1 large enough to hold the whole replay, KV-aware
    routing (what an unlimited GPU memory gives).

The window's reuse share is the prefill tokens (f) saves out of all prompt tokens.  Outputs
(greedy) of every configuration are compared request by request with (a)'s.

Goals (docs/BENCHMARKS.md): (d) saves >= 80 % of what (f) saves; (d) closes >= 70 % of the
mean TTFT gap between (a) and (f) and >= 50 % at p90; (d) not worse than (c) or (e).
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import Report, add_json_option, cpu_model, load_average  # noqa: E402

CONFIGS: dict[str, dict[str, Any]] = {
    "a": {"mode": "vllm", "router": "round-robin", "moves": False},
    "b": {"mode": "g2", "router": "round-robin", "moves": False},
    "c": {"mode": "volumes", "router": "round-robin", "moves": False},
    "d": {"mode": "volumes", "router": "kv", "moves": True},
    "e": {"mode": "volumes", "router": "round-robin", "moves": True},
    "f": {"mode": "vllm", "router": "kv", "moves": False, "bound": True},
}
LABELS = {"a": "vLLM alone", "b": "+ connector, G2", "c": "+ volumes, no moves", "d": "full loop, KV routing",
          "e": "full loop, round-robin", "f": "bound: G1 holds all"}


def run_config(key: str, args: argparse.Namespace) -> Any:
    from kvadvisor.engine_demo.run import EngineDemoSettings, run_engine_demo

    c = dict(CONFIGS[key])
    bound = c.pop("bound", False)
    g1 = args.g1_blocks
    if bound:  # every block of the replay fits: prompt blocks + output blocks of every request
        g1 = max(g1, args.requests * (args.max_model_len // 32 + 1) // args.engines + 64)
    s = EngineDemoSettings(requests=args.requests, warmup=args.warmup, engines=args.engines,
                           block_tokens=args.block_tokens, time_scale=args.time_scale, g1_blocks=g1,
                           g2_blocks=args.g2_blocks, fast_capacity_blocks=args.fast_blocks, sample=0,
                           layers=args.layers, hidden=args.hidden, max_model_len=args.max_model_len,
                           policy_interval_s=args.policy_interval, **c)
    return run_engine_demo(s)


def gap_closed(a: float, x: float, f: float) -> float:
    """Share of the (a) → (f) gap that x closes: ``(a - x) / (a - f)``."""
    return (a - x) / (a - f) if a != f else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="a,b,c,d,e,f")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--warmup", type=int, default=200)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--block-tokens", type=int, default=32)
    p.add_argument("--time-scale", type=float, default=4.0)
    p.add_argument("--g1-blocks", type=int, default=128, help="vLLM's KV blocks per engine, (a)-(e)")
    p.add_argument("--g2-blocks", type=int, default=512)
    p.add_argument("--fast-blocks", type=int, default=4096, help="capacity of the fast volume in blocks")
    p.add_argument("--policy-interval", type=float, default=3.0)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--hidden", type=int, default=128)
    p.add_argument("--max-model-len", type=int, default=2048)
    add_json_option(p)
    args = p.parse_args()
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    report = Report("e2e_ttft", "time to first token of the whole loop (vLLM engines, connector, volumes, advisor, "
                    "KV-aware routing) on the Mooncake trace, against vLLM alone")
    cpu = f"{cpu_model()}, {os.cpu_count()} cores"
    reports: dict[str, Any] = {}
    t0 = time.monotonic()
    for k in keys:
        print(f"== ({k}) {LABELS[k]} ...", flush=True)
        reports[k] = run_config(k, args)
        r = reports[k]
        print(f"   TTFT mean {r.ttft_s['mean'] * 1000:.0f} ms, p90 {r.ttft_s['p90'] * 1000:.0f} ms, saved "
              f"{r.prefill_saved:,}/{r.prompt_tokens:,}, failed {r.failed}, {r.wall_s:.0f} s", flush=True)

    ref = {res.index: res.output for res in reports["a"].results if res.error is None} if "a" in reports else {}
    print(f"\nwindow: requests {args.warmup}..{args.requests - 1} of the Mooncake conversation trace "
          f"(first {args.warmup} = warm-up), {args.block_tokens} tokens per trace block, time / {args.time_scale:g}, "
          f"{args.engines} engines, model {args.layers} layers x {args.hidden}")
    if "f" in reports:
        f = reports["f"]
        print(f"reuse share of the window ((f) saved / prompt tokens): {f.prefill_saved / max(f.prompt_tokens, 1):.1%}")
    print(f"CPU: {cpu}; load average before {report.load_start}, after {load_average()}; "
          f"{time.monotonic() - t0:.0f} s in all\n")
    head = f"| config | TTFT mean | p50 | p90 | p99 | prefill saved | G1 / G2 / volumes (vLLM) | moves P/D/C | outputs = (a) |"
    print(head)
    print("|" + "---|" * 9)
    rows: dict[str, dict[str, Any]] = {}
    for k, r in reports.items():
        same = sum(1 for res in r.results if res.error is None and res.index in ref and res.output == ref[res.index])
        checked = sum(1 for res in r.results if res.error is None and res.index in ref)
        c = r.vllm_cached_by_source
        mv = r.moves
        win = [res for res in r.results if res.error is None and res.index >= args.warmup]
        hit = [res.ttft_s for res in win if res.cached_tokens > 0]
        miss = [res.ttft_s for res in win if res.cached_tokens == 0]
        rows[k] = {"ttft_hit_mean": sum(hit) / len(hit) if hit else None, "hits": len(hit),
                   "ttft_miss_mean": sum(miss) / len(miss) if miss else None,
                   "requests": [(res.index, res.engine, res.prompt_tokens, res.cached_tokens, round(res.ttft_s, 4))
                                for res in r.results if res.error is None],
                   "kvbm": r.kvbm, "wall_s": r.wall_s, "replay_s": r.replay_s,
                   "ttft": r.ttft_s, "saved": r.prefill_saved, "prompt": r.prompt_tokens, "same": same, "checked": checked,
                   "failed": r.failed, "cached_by_source": c, "moves": mv, "router": r.router_choices}
        print(f"| ({k}) {LABELS[k]} | {r.ttft_s['mean'] * 1000:.0f} ms | {r.ttft_s['p50'] * 1000:.0f} | "
              f"{r.ttft_s['p90'] * 1000:.0f} | {r.ttft_s['p99'] * 1000:.0f} | {r.prefill_saved:,} "
              f"({r.prefill_saved / max(r.prompt_tokens, 1):.1%}) | {c.get('device', 0):,.0f} / {c.get('host', 0):,.0f} / "
              f"{c.get('disk', 0):,.0f} | {mv.get('promotions', 0)}/{mv.get('demotions', 0)}/{mv.get('compactions', 0)} | "
              f"{same}/{checked} |")
    if {"a", "d", "f"} <= reports.keys():
        a, d, f = reports["a"], reports["d"], reports["f"]
        saved = d.prefill_saved / f.prefill_saved if f.prefill_saved else float("nan")
        gm = gap_closed(a.ttft_s["mean"], d.ttft_s["mean"], f.ttft_s["mean"])
        g90 = gap_closed(a.ttft_s["p90"], d.ttft_s["p90"], f.ttft_s["p90"])
        print(f"\n(d) saves {saved:.0%} of what (f) saves (goal >= 80 %); closes {gm:.0%} of the mean TTFT gap "
              f"(a)→(f) (goal >= 70 %) and {g90:.0%} at p90 (goal >= 50 %)")
        for other in ("c", "e"):
            if other in reports:
                o = reports[other]
                print(f"(d) vs ({other}): mean {d.ttft_s['mean'] * 1000:.0f} vs {o.ttft_s['mean'] * 1000:.0f} ms, "
                      f"p90 {d.ttft_s['p90'] * 1000:.0f} vs {o.ttft_s['p90'] * 1000:.0f} ms")
        report.add("TTFT mean, (d) full loop", d.ttft_s["mean"] * 1000, a.ttft_s["mean"] * 1000, unit="ms",
                   reference_name="(a) vLLM alone", goal=">= 70 % of the (a) -> (f) gap closed", met=gm >= 0.7,
                   better="lower", headline=True)
        report.add("TTFT p90, (d) full loop", d.ttft_s["p90"] * 1000, a.ttft_s["p90"] * 1000, unit="ms",
                   reference_name="(a) vLLM alone", goal=">= 50 % of the (a) -> (f) gap closed", met=g90 >= 0.5,
                   better="lower")
        report.add("prefill tokens saved, (d) full loop", d.prefill_saved, f.prefill_saved, unit="tokens",
                   reference_name="(f) G1 holds the replay", goal=">= 80 %", met=saved >= 0.8)
    for k, r in reports.items():
        report.add(f"TTFT mean, ({k}) {LABELS[k]}", r.ttft_s["mean"] * 1000, unit="ms", better="lower",
                   headline=not report.figures and k == keys[0])
    report.extra = {"args": {k: v for k, v in vars(args).items() if k != "json"}, "rows": rows}
    report.write(args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
