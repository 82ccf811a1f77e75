#!/usr/bin/env python
"""vLLM with the kvbm connector, end to end on this machine (no download, CPU or CUDA).

    .venv/bin/python examples/vllm_offload.py                     # G2 host memory
    .venv/bin/python examples/vllm_offload.py --disk /tmp/kvbm    # disk-only: G1 -> volume

Builds a random-weight Llama (2 layers, hidden 128) in a temporary directory, starts vLLM
with ``KvbmVllmConnector`` (``kvbm_runtime.vllm_adapter``), runs two prompts that share a
512-token prefix, empties vLLM's own prefix cache (``reset_prefix_cache()``) and runs the
first prompt again: its blocks come back from the connector.  Prints what vLLM itself
reports: ``num_cached_tokens`` per request and its ``external_prefix_cache_hits`` counter.
"""

from __future__ import annotations

import argparse
import random
import tempfile
from pathlib import Path

from kvbm_runtime.testing.llama_model import build_llama
from kvbm_runtime.testing.vllm_engine import generate, llm_engine, metric


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--disk", help="KVBM disk-only mode: a G3 volume in this directory instead of G2")
    ap.add_argument("--events-url", default="null://", help="where the connector publishes its Store/Remove events")
    args = ap.parse_args()

    model = build_llama(Path(tempfile.mkdtemp(prefix="kvbm-example-")) / "llama")
    rng = random.Random(0)
    prefix = [rng.randrange(1, 1024) for _ in range(512)]
    first = prefix + [rng.randrange(1, 1024) for _ in range(40)]
    second = prefix + [rng.randrange(1, 1024) for _ in range(40)]
    env = {"DYN_KVBM_DISK_CACHE_GB": "0.1", "DYN_KVBM_DISK_CACHE_DIR": args.disk} if args.disk else None
    connector = {"events_url": args.events_url} if args.disk else {"events_url": args.events_url, "g2_blocks": 256}
    with llm_engine(model, connector=connector, env=env) as llm:
        a, b = generate(llm, [first, second])
        print(f"first prompt : {len(first)} tokens, {a.num_cached_tokens} cached, output {list(a.token_ids)}")
        print(f"second prompt: {len(second)} tokens, {b.num_cached_tokens} cached (vLLM's own prefix cache)")
        llm.reset_prefix_cache()
        (again,) = generate(llm, [first])
        print(f"first again after reset_prefix_cache(): {again.num_cached_tokens} tokens loaded by the connector, "
              f"output {'identical' if again.token_ids == a.token_ids else 'DIFFERENT'}")
        print(f"vllm:external_prefix_cache_hits = {metric(llm, 'vllm:external_prefix_cache_hits'):.0f} tokens")
    return 0 if again.num_cached_tokens > 0 and again.token_ids == a.token_ids else 1


if __name__ == "__main__":
    raise SystemExit(main())
