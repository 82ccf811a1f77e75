#!/usr/bin/env python
"""Time to first token with the whole loop, on the Mooncake conversation trace, side by side.

    python bench/e2e_ttft.py                       # 7 configurations, ~45 minutes here
    python bench/e2e_ttft.py --configs a,d,f --requests 300 --warmup 200
    python bench/e2e_ttft.py --configs a,f,d,e --repeat 2   # each configuration twice, in turn

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
    routing (what an unlimited GPU memory gives);
(d0) (d) with every volume load asynchronous (``sync_load_volumes: []``, the connector's
    behaviour before loads from POSIX volumes ran within the engine step): where (d)'s
    time went.

The model is a random-weight Llama whose prefill FLOPs per KV byte are those of a real
model (printed at the start, against Llama-2-7B, Llama-3-8B and Llama-3-70B): loading a
block instead of recomputing it is weighed as on a real model.

With ``--repeat N`` the configurations run N times in turn (a, f, d, ..., a, f, d, ...), so a
drift of the machine's load reaches every configuration alike; each figure is then taken over
the measured requests of every repetition pooled (mean and percentiles of all of them; tokens
per repetition), and the spread of the per-repetition means is printed beside it.  One
repetition of 100 measured requests moved the mean TTFT of one unchanged configuration by up
to 15 % between two runs on a quiet machine (docs/BENCHMARKS.md): more than the effect the
goals below ask to resolve.

The window's reuse share is the prefill tokens (f) saves out of all prompt tokens.  Outputs
(greedy) of every configuration are compared request by request with (a)'s.

Goals (docs/BENCHMARKS.md): (d) saves >= 80 % of what (f) saves; (d) closes >= 70 % of the
mean TTFT gap between (a) and (f) and >= 50 % at p90; (d) not worse than (c) or (e).
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
from pathlib import Path
from dataclasses import dataclass, field
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
    "d0": {"mode": "volumes", "router": "kv", "moves": True, "sync_loads": False},
}
LABELS = {"a": "vLLM alone", "b": "+ connector, G2", "c": "+ volumes, no moves", "d": "full loop, KV routing",
          "e": "full loop, round-robin", "f": "bound: G1 holds all",
          "d0": "(d), volume loads asynchronous"}


def load_now() -> str:
    """The load average now (1, 5, 15 minutes), as ``uptime`` prints it."""
    return ", ".join(f"{x:.2f}" for x in load_average())


def onboard_row(kvbm: dict[str, float]) -> str:
    """Blocks onboarded per volume and the mean storage read (the demo report's row)."""
    from kvadvisor.engine_demo.cli import onboard_row as row

    return row(kvbm)


def run_config(key: str, args: argparse.Namespace) -> Any:
    from kvadvisor.engine_demo.run import EngineDemoSettings, run_engine_demo

    c = dict(CONFIGS[key])
    bound = c.pop("bound", False)
    g1 = args.g1_blocks
    if bound:  # every block of the replay fits: prompt blocks + output blocks of every request
        g1 = max(g1, args.requests * (args.max_model_len // 32 + 1) // args.engines + 64)
    s = EngineDemoSettings(requests=args.requests, warmup=args.warmup, engines=args.engines,
                           block_tokens=args.block_tokens, time_scale=args.time_scale,
                           warmup_time_scale=args.warmup_time_scale, g1_blocks=g1,
                           g2_blocks=args.g2_blocks, fast_capacity_blocks=args.fast_blocks, sample=0,
                           layers=args.layers, hidden=args.hidden, head_dim=args.head_dim, kv_heads=args.kv_heads,
                           intermediate=args.intermediate, max_model_len=args.max_model_len, models_dir=args.models_dir,
                           policy_interval_s=args.policy_interval, **c)
    return run_engine_demo(s)


def model_report(args: argparse.Namespace) -> str:
    """One paragraph: the random-weight model's prefill FLOPs and KV bytes per token, and the
    same ratio for real models (their published shapes, KV cache in bf16), so the reader
    sees whether loading a block against recomputing it is weighed as on a real model."""
    from kvbm_runtime.testing.llama_model import LlamaGeometry

    heads = args.hidden // args.head_dim
    ours = LlamaGeometry(hidden=args.hidden, layers=args.layers, heads=heads, kv_heads=args.kv_heads,
                         intermediate=args.intermediate, max_positions=args.max_model_len)
    ctx = args.max_model_len // 4  # causal prefill of a half-length prompt: average context
    real = {  # config.json of each model on the Hugging Face hub
        "Llama-2-7B": LlamaGeometry(vocab=32000, hidden=4096, layers=32, heads=32, kv_heads=32, intermediate=11008),
        "Llama-3-8B": LlamaGeometry(vocab=128256, hidden=4096, layers=32, heads=32, kv_heads=8, intermediate=14336),
        "Llama-3-70B": LlamaGeometry(vocab=128256, hidden=8192, layers=80, heads=64, kv_heads=8, intermediate=28672),
    }

    def per_elem(g: LlamaGeometry) -> float:  # FLOPs per KV element, independent of the KV dtype
        return g.flops_per_token(ctx) / (g.kv_bytes_per_token(1))

    lines = [f"model: random-weight Llama, {ours.layers} layers, hidden {ours.hidden}, {ours.heads} heads x {ours.head_size}, "
             f"{ours.kv_heads} KV heads, MLP {ours.intermediate}, vocab {ours.vocab}, fp32: "
             f"{ours.flops_per_token(ctx) / 1e6:,.0f} MFLOP per prompt token (context {ctx}), "
             f"{ours.kv_bytes_per_token(4):,} KV bytes per token (fp32) -> {per_elem(ours) / 1e3:,.0f}k FLOP per KV element"]
    for name, g in real.items():
        lines.append(f"  vs {name}: {g.flops_per_token(ctx) / 1e9:,.1f} GFLOP, {g.kv_bytes_per_token(2) >> 10:,} KiB KV per token "
                     f"(bf16) -> {per_elem(g) / 1e3:,.0f}k FLOP per KV element (ours / theirs {per_elem(ours) / per_elem(g):.2f})")
    return "\n".join(lines)


@dataclass
class Pooled:
    """One configuration's figures over every repetition (the fields :func:`main` reads of
    ``kvadvisor.engine_demo.run.EngineDemoReport``).

    ``ttft_s`` (seconds: mean, p50, p90, p99) is taken over the measured requests of every
    repetition together; ``prefill_saved``, ``prompt_tokens`` and ``vllm_cached_by_source``
    (tokens) are per repetition (their mean); ``kvbm`` counters and ``moves`` are summed;
    ``means_s`` is each repetition's mean TTFT, in run order.
    """

    runs: list[Any]
    ttft_s: dict[str, float] = field(default_factory=dict)
    prefill_saved: float = 0.0
    prompt_tokens: float = 0.0
    vllm_cached_by_source: dict[str, float] = field(default_factory=dict)
    kvbm: dict[str, float] = field(default_factory=dict)
    moves: dict[str, Any] = field(default_factory=dict)
    router_choices: list[Any] = field(default_factory=list)
    means_s: list[float] = field(default_factory=list)
    failed: int = 0
    wall_s: float = 0.0
    replay_s: float = 0.0

    @classmethod
    def of(cls, runs: list[Any], warmup: int) -> "Pooled":
        """Pool the reports ``runs`` (one per repetition; non-empty)."""
        from kvadvisor.engine_demo.replay import percentile

        n = len(runs)
        ttfts = [res.ttft_s for r in runs for res in r.results if res.error is None and res.index >= warmup]
        p = cls(runs)
        p.ttft_s = {"mean": sum(ttfts) / len(ttfts) if ttfts else 0.0, "p50": percentile(ttfts, 50),
                    "p90": percentile(ttfts, 90), "p99": percentile(ttfts, 99)}
        p.prefill_saved = sum(r.prefill_saved for r in runs) / n
        p.prompt_tokens = sum(r.prompt_tokens for r in runs) / n
        for r in runs:
            for k, v in r.vllm_cached_by_source.items():
                p.vllm_cached_by_source[k] = p.vllm_cached_by_source.get(k, 0.0) + v / n
            for k, v in r.kvbm.items():
                p.kvbm[k] = p.kvbm.get(k, 0.0) + v
            for k, v in r.moves.items():
                if isinstance(v, (int, float)):
                    p.moves[k] = p.moves.get(k, 0) + v
        p.router_choices = [r.router_choices for r in runs]
        p.means_s = [r.ttft_s["mean"] for r in runs]
        p.failed = sum(r.failed for r in runs)
        p.wall_s = sum(r.wall_s for r in runs)
        p.replay_s = sum(r.replay_s for r in runs)
        return p

    @property
    def results(self) -> list[Any]:
        """Every repetition's per-request results, in run order."""
        return [res for r in self.runs for res in r.results]


def queue_ahead(runs: list[Any], warmup: int) -> dict[str, Any]:
    """The queue the window's requests met on their engine when sent, hits and misses apart.

    Per request: ``served`` and ``prefilling`` are the client's counts at send
    (``RequestResult.ahead_at_send`` / ``prefilling_at_send``); ``tokens`` is the prompt
    tokens still to compute (prompt − cached) of the requests on the same engine, of the same
    repetition, sent before it and without their first token yet (from each one's ``sent_s``
    and ``ttft_s``).  Returns the means of each (``{"hit": {...}, "miss": {...}}``) and
    ``computed_share``: each engine's share of the window's computed prompt tokens.
    """
    acc = {"hit": [0, 0.0, 0.0, 0.0], "miss": [0, 0.0, 0.0, 0.0]}
    computed: dict[int, int] = {}
    for r in runs:
        ok = [res for res in r.results if res.error is None]
        for res in ok:
            if res.index < warmup:
                continue
            computed[res.engine] = computed.get(res.engine, 0) + res.prompt_tokens - res.cached_tokens
            ahead = sum(o.prompt_tokens - o.cached_tokens for o in ok
                        if o.engine == res.engine and o.sent_s < res.sent_s < o.sent_s + o.ttft_s)
            a = acc["hit" if res.cached_tokens > 0 else "miss"]
            a[0] += 1
            a[1] += res.ahead_at_send
            a[2] += res.prefilling_at_send
            a[3] += ahead
    out: dict[str, Any] = {k: {"n": v[0], "served": v[1] / max(v[0], 1), "prefilling": v[2] / max(v[0], 1),
                               "tokens": v[3] / max(v[0], 1)} for k, v in acc.items()}
    routes = [res.route_s for r in runs for res in r.results if res.error is None and res.index >= warmup]
    out["route_ms"] = {"mean": 1000 * sum(routes) / max(len(routes), 1), "max": 1000 * max(routes, default=0.0)}
    total = sum(computed.values()) or 1
    out["computed_share"] = [computed[e] / total for e in sorted(computed)]
    return out


def gap_closed(a: float, x: float, f: float) -> float:
    """Share of the (a) → (f) gap that x closes: ``(a - x) / (a - f)``."""
    return (a - x) / (a - f) if a != f else float("nan")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--configs", default="a,f,d,d0,c,e,b")
    p.add_argument("--repeat", type=int, default=1,
                   help="run the configurations this many times, in turn; figures pool every repetition")
    p.add_argument("--requests", type=int, default=400)
    p.add_argument("--warmup", type=int, default=300)
    p.add_argument("--engines", type=int, default=2)
    p.add_argument("--block-tokens", type=int, default=8)
    p.add_argument("--time-scale", type=float, default=0.25, help="the measured requests' trace time divided by this")
    p.add_argument("--warmup-time-scale", type=float, default=2.0,
                   help="the warm-up's (not measured; the engines may queue, the window starts once it is done)")
    p.add_argument("--g1-blocks", type=int, default=64, help="vLLM's KV blocks per engine, (a)-(e)")
    p.add_argument("--g2-blocks", type=int, default=512)
    p.add_argument("--fast-blocks", type=int, default=4096, help="capacity of the fast volume in blocks")
    p.add_argument("--policy-interval", type=float, default=3.0)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--kv-heads", type=int, default=2)
    p.add_argument("--intermediate", type=int, default=4096)
    p.add_argument("--max-model-len", type=int, default=512)
    p.add_argument("--models-dir", type=Path, default=None, help="where the model is built once for every configuration")
    add_json_option(p)
    args = p.parse_args()
    keys = [k.strip() for k in args.configs.split(",") if k.strip()]
    report = Report("e2e_ttft", "time to first token of the whole loop (vLLM engines, connector, volumes, advisor, "
                    "KV-aware routing) on the Mooncake trace, against vLLM alone")
    cpu = f"{cpu_model()}, {os.cpu_count()} cores"
    tmp = None
    if args.models_dir is None:
        tmp = tempfile.TemporaryDirectory(prefix="e2e-ttft-models-")
        args.models_dir = Path(tmp.name)
    model_line = model_report(args)
    print(model_line, flush=True)
    runs: dict[str, list[Any]] = {k: [] for k in keys}
    t0 = time.monotonic()
    for rep, k in ((rep, k) for rep in range(args.repeat) for k in keys):
        print(f"== ({k}) {LABELS[k]}" + (f", repetition {rep + 1}/{args.repeat}" if args.repeat > 1 else "") + " ...",
              flush=True)
        runs[k].append(run_config(k, args))
        r = runs[k][-1]
        print(f"   TTFT mean {r.ttft_s['mean'] * 1000:.0f} ms, p90 {r.ttft_s['p90'] * 1000:.0f} ms, saved "
              f"{r.prefill_saved:,}/{r.prompt_tokens:,}, failed {r.failed}, {r.wall_s:.0f} s; load {load_now()}",
              flush=True)
        if r.kvbm:
            print(f"   onboarded per volume: {onboard_row(r.kvbm)}; G2 resident at the end: "
                  + ", ".join(f"{v:,.0f}" for k, v in r.kvbm.items() if k.startswith("kvbm_g2_resident_blocks{")), flush=True)

    reports = {k: Pooled.of(v, args.warmup) for k, v in runs.items()}
    ref = {res.index: res.output for res in reports["a"].results if res.error is None} if "a" in reports else {}
    print(f"\nwindow: requests {args.warmup}..{args.requests - 1} of the Mooncake conversation trace "
          f"(first {args.warmup} = warm-up, time / {args.warmup_time_scale:g}), {args.block_tokens} tokens per trace block, "
          f"window time / {args.time_scale:g}, "
          f"{args.engines} engines" + (f"; {args.repeat} repetitions in turn, figures pooled" if args.repeat > 1 else ""))
    print(model_line)
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
                   "requests": [(res.index, res.engine, res.prompt_tokens, res.cached_tokens, round(res.ttft_s, 4),
                                 round(res.sent_s, 4), res.ahead_at_send, res.prefilling_at_send, round(res.route_s, 4),
                                 res.burst)
                                for res in r.results if res.error is None],
                   "queue": queue_ahead(r.runs, args.warmup),
                   "kvbm": r.kvbm, "wall_s": r.wall_s, "replay_s": r.replay_s,
                   "ttft": r.ttft_s, "saved": r.prefill_saved, "prompt": r.prompt_tokens, "same": same, "checked": checked,
                   "failed": r.failed, "cached_by_source": c, "moves": mv, "router": r.router_choices}
        print(f"| ({k}) {LABELS[k]} | {r.ttft_s['mean'] * 1000:.0f} ms | {r.ttft_s['p50'] * 1000:.0f} | "
              f"{r.ttft_s['p90'] * 1000:.0f} | {r.ttft_s['p99'] * 1000:.0f} | {r.prefill_saved:,.0f} "
              f"({r.prefill_saved / max(r.prompt_tokens, 1):.1%}) | {c.get('device', 0):,.0f} / {c.get('host', 0):,.0f} / "
              f"{c.get('disk', 0):,.0f} | {mv.get('promotions', 0)}/{mv.get('demotions', 0)}/{mv.get('compactions', 0)} | "
              f"{same}/{checked} |")
    if args.repeat > 1:
        print("\nmean TTFT of each repetition (ms, in run order): "
              + "; ".join(f"({k}) " + " / ".join(f"{m * 1000:.0f}" for m in r.means_s) for k, r in reports.items()))
    print("\nwhere the time goes (window): TTFT of requests with a cache hit (vLLM's num_cached_tokens > 0) and "
          "without; the connector's storage reads")
    print("| config | hits: n, mean TTFT | misses: n, mean TTFT | onboarded per volume (blocks); reads, mean read |")
    print("|---|---|---|---|")
    for k, row in rows.items():
        hm, mm = row["ttft_hit_mean"], row["ttft_miss_mean"]
        n_miss = sum(1 for q in row["requests"] if q[0] >= args.warmup and q[3] == 0)
        print(f"| ({k}) | {row['hits']}, {hm * 1000 if hm is not None else float('nan'):,.0f} ms | "
              f"{n_miss}, {mm * 1000 if mm is not None else float('nan'):,.0f} ms | {onboard_row(row['kvbm'])} |")
    print("\nthe queue each request met on its engine when it was sent (window; means): requests being served, "
          "of them still before their first token, and their prompt tokens left to compute (prompt - cached); "
          "engines' share of the computed prompt tokens; the router's time (arrival to sending, part of TTFT)")
    print("| config | hits: served / prefilling / tokens ahead | misses: served / prefilling / tokens ahead "
          "| computed tokens per engine | routing mean / max |")
    print("|---|---|---|---|---|")
    for k, row in rows.items():
        q = row["queue"]
        print(f"| ({k}) | {q['hit']['served']:.2f} / {q['hit']['prefilling']:.2f} / {q['hit']['tokens']:,.0f} | "
              f"{q['miss']['served']:.2f} / {q['miss']['prefilling']:.2f} / {q['miss']['tokens']:,.0f} | "
              + " / ".join(f"{x:.0%}" for x in q["computed_share"])
              + f" | {q['route_ms']['mean']:.1f} / {q['route_ms']['max']:.0f} ms |")
    if {"a", "d", "f"} <= reports.keys():
        a, d, f = reports["a"], reports["d"], reports["f"]
        saved = d.prefill_saved / f.prefill_saved if f.prefill_saved else float("nan")
        gm = gap_closed(a.ttft_s["mean"], d.ttft_s["mean"], f.ttft_s["mean"])
        g90 = gap_closed(a.ttft_s["p90"], d.ttft_s["p90"], f.ttft_s["p90"])
        print(f"\n(d) saves {saved:.0%} of what (f) saves (goal >= 80 %); closes {gm:.0%} of the mean TTFT gap "
              f"(a)→(f) (goal >= 70 %) and {g90:.0%} at p90 (goal >= 50 %)")
        for other in ("c", "e", "d0"):
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
        for other in ("c", "e"):
            if other in reports:
                o = reports[other]
                for stat in ("mean", "p90"):
                    report.add(f"TTFT {stat}, (d) against ({other})", d.ttft_s[stat] * 1000, o.ttft_s[stat] * 1000,
                               unit="ms", reference_name=f"({other}) {LABELS[other]}", goal="not worse",
                               met=d.ttft_s[stat] <= o.ttft_s[stat], better="lower")
    for k, r in reports.items():
        report.add(f"TTFT mean, ({k}) {LABELS[k]}", r.ttft_s["mean"] * 1000, unit="ms", better="lower",
                   headline=not report.figures and k == keys[0])
    report.extra = {"args": {k: str(v) for k, v in vars(args).items() if k != "json"}, "model": model_line, "rows": rows}
    report.write(args.json)
    if tmp is not None:
        tmp.cleanup()
    return 0


if __name__ == "__main__":
    sys.exit(main())
