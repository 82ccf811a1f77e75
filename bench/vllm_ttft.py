#!/usr/bin/env python
"""Time to first token in a real vLLM engine: our connector's onboarding against
recomputing the prompt and against vLLM's own G1 prefix cache.

    python bench/vllm_ttft.py                  # 3 prompts of 4,096 tokens (~5 minutes here)
    python bench/vllm_ttft.py --prompts 5 --tokens 2048

A random-weight Llama (8 layers, hidden 512, 8 heads, fp32; ``--layers`` / ``--hidden``)
is built once in ``--model-dir``.  Each case is timed as the wall clock of one
``LLM.generate`` of a token-id prompt with ``max_tokens=1`` (the first token), on
``--prompts`` different prompts; the table gives medians, side by side, in one run:

* (0) G1 prefix-cache hit: vLLM without a connector, the same prompt twice, no reset
  (the bound: only the last partial block and one token are computed);
* (i) recompute: vLLM without a connector, the prompt again after
  ``reset_prefix_cache()``;
* (iii) ours from G2: vLLM with the kvbm connector, the prompt again after
  ``reset_prefix_cache()`` (its blocks come back from host memory);
* (iv) ours from G3: the connector in KVBM's disk-only mode (``DYN_KVBM_DISK_CACHE_GB``,
  no CPU cache: G1 → volume directly), the prompt again after ``reset_prefix_cache()``;
  "hot" with the segment files in the page cache as the write left them, "cold" after
  ``posix_fadvise(DONTNEED)`` on them.

vLLM's own ``OffloadingConnector`` (case ii) refuses the CPU backend ("CPU Offloading is
currently only supported on CUDA-alike and XPU GPUs"); on a CPU machine ours is the only
offload path, so (ii) is printed only with ``--offloading-connector`` on a GPU machine.

Goals (docs/BENCHMARKS.md): (iii) at least 5x faster than (i); (iv) at least 2x; the
product's goal is (iii) within 2x of (0).
"""

from __future__ import annotations

import argparse
import os
import random
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from bench._report import Report, add_json_option, cpu_model  # noqa: E402


def timed(fn: Callable[[], Any]) -> float:
    """Wall-clock seconds of one call."""
    t = time.perf_counter()
    fn()
    return time.perf_counter() - t


def drop_page_cache(root: Path) -> int:
    """``posix_fadvise(DONTNEED)`` every file under ``root``; returns the files touched."""
    n = 0
    for p in root.rglob("*"):
        if p.is_file():
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fsync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                n += 1
            finally:
                os.close(fd)
    return n


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--prompts", type=int, default=3, help="prompts per case (medians over them)")
    ap.add_argument("--tokens", type=int, default=4096, help="prompt length in tokens")
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--model-dir", default=str(Path(tempfile.gettempdir()) / "kvbm-bench-llama"))
    ap.add_argument("--offloading-connector", action="store_true", help="also time vLLM's OffloadingConnector (GPU only)")
    add_json_option(ap)
    args = ap.parse_args()
    report = Report("vllm_ttft", "time to first token of a real vLLM engine: our G2 / G3 onboarding against "
                    "recompute and vLLM's own prefix cache")

    from kvbm_runtime.testing.llama_model import LlamaGeometry, build_llama
    from kvbm_runtime.testing.vllm_engine import generate, llm_engine

    geo = LlamaGeometry(vocab=1024, hidden=args.hidden, layers=args.layers, heads=8, kv_heads=8,
                        intermediate=2 * args.hidden, max_positions=2 * args.tokens + 64)
    model = build_llama(Path(args.model_dir) / f"l{args.layers}h{args.hidden}", geo)
    page = 32
    blocks = -(-args.tokens // page) + 2
    block_bytes = geo.kv_bytes_per_token() * page
    rng = random.Random(7)
    prompts = [[rng.randrange(1, geo.vocab) for _ in range(args.tokens)] for _ in range(args.prompts)]
    common: dict[str, Any] = {
        "num_blocks": 2 * blocks, "max_model_len": args.tokens + 64,
        "kv_cache_memory_bytes": 2 * blocks * block_bytes, "max_num_batched_tokens": args.tokens + 64,
    }
    one = lambda llm, p: generate(llm, [p], max_tokens=1)  # noqa: E731
    results: dict[str, list[float]] = {}
    cached: dict[str, list[int]] = {}

    print(f"model: Llama {args.layers} layers, hidden {args.hidden}, fp32; prompt {args.tokens} tokens; "
          f"{args.prompts} prompts; block {page} tokens = {block_bytes >> 10} KiB", flush=True)

    with llm_engine(model, use_connector=False, **common) as llm:
        one(llm, [1] * 64)  # warm-up
        for p in prompts:
            llm.reset_prefix_cache()
            one(llm, p)
            results.setdefault("(0) G1 prefix hit", []).append(timed(lambda: one(llm, p)))
            llm.reset_prefix_cache()
            results.setdefault("(i) recompute", []).append(timed(lambda: one(llm, p)))

    g2 = {"g2_blocks": args.prompts * blocks + 8}
    with llm_engine(model, connector=g2, **common) as llm:
        one(llm, [1] * 64)
        for p in prompts:
            one(llm, p)
            llm.reset_prefix_cache()
            out: list[Any] = []
            results.setdefault("(iii) ours, from G2", []).append(timed(lambda: out.extend(one(llm, p))))
            cached.setdefault("(iii) ours, from G2", []).append(out[0].num_cached_tokens)

    disk = Path(tempfile.mkdtemp(prefix="kvbm-bench-disk-"))
    env = {
        "DYN_KVBM_DISK_CACHE_GB": str(round(3 * args.prompts * blocks * block_bytes / 1e9, 3)),
        "DYN_KVBM_DISK_CACHE_DIR": str(disk),
    }
    with llm_engine(model, env=env, **common) as llm:
        one(llm, [1] * 64)
        for p in prompts:
            one(llm, p)
            time.sleep(0.5)  # the disk-only save runs behind the step
            for label, cold in (("(iv) ours, from G3 (hot)", False), ("(iv) ours, from G3 (cold)", True)):
                llm.reset_prefix_cache()
                if cold:
                    drop_page_cache(disk)
                out = []
                results.setdefault(label, []).append(timed(lambda: out.extend(one(llm, p))))
                cached.setdefault(label, []).append(out[0].num_cached_tokens)

    med = {k: statistics.median(v) for k, v in results.items()}
    base, bound = med["(i) recompute"], med["(0) G1 prefix hit"]
    print(f"\nCPU: {cpu_model()}; load average {os.getloadavg()[0]:.2f}; vLLM on {os.cpu_count()} CPUs")
    print(f"{'case':28s} {'TTFT median s':>14s} {'vs (i)':>9s} {'vs (0)':>9s}  cached tokens / samples")
    for k, v in med.items():
        extra = f"  {cached.get(k, '-')} / {[round(x, 3) for x in results[k]]}"
        print(f"{k:28s} {v:14.3f} {base / v:8.2f}x {v / bound:8.2f}x{extra}")
    g2_speed = base / med["(iii) ours, from G2"]
    g3_speed = base / med["(iv) ours, from G3 (hot)"]
    g3_cold = base / med["(iv) ours, from G3 (cold)"]
    print(f"\ngoal (iii) >= 5x faster than (i): {g2_speed:.2f}x {'met' if g2_speed >= 5 else 'NOT met'}")
    print(f"goal (iv) >= 2x faster than (i): hot {g3_speed:.2f}x, cold {g3_cold:.2f}x "
          f"{'met' if min(g3_speed, g3_cold) >= 2 else 'NOT met'}")
    ratio = med["(iii) ours, from G2"] / bound
    print(f"product goal (iii) within 2x of (0): {ratio:.2f}x {'met' if ratio <= 2 else 'NOT met'}")
    g2, hot, cold = med["(iii) ours, from G2"], med["(iv) ours, from G3 (hot)"], med["(iv) ours, from G3 (cold)"]
    report.add("TTFT, (iii) ours onboarding from G2", g2, base, unit="s", reference_name="(i) recompute",
               goal=">= 5x faster", met=g2_speed >= 5, better="lower", headline=True)
    report.add("TTFT, (iii) ours onboarding from G2, against vLLM's own G1 hit", g2, bound, unit="s",
               reference_name="(0) vLLM G1 prefix-cache hit", goal="<= 2x", met=ratio <= 2, better="lower")
    report.add("TTFT, (iv) ours onboarding from G3, page cache hot", hot, base, unit="s",
               reference_name="(i) recompute", goal=">= 2x faster", met=g3_speed >= 2, better="lower")
    report.add("TTFT, (iv) ours onboarding from G3, after posix_fadvise(DONTNEED)", cold, base, unit="s",
               reference_name="(i) recompute", goal=">= 2x faster", met=g3_cold >= 2, better="lower")
    report.extra = {"samples_s": results, "cached_tokens": cached, "tokens": args.tokens, "layers": args.layers,
                    "hidden": args.hidden}
    report.write(args.json)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
