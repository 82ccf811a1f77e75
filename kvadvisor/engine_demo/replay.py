"""Replay a Mooncake trace against OpenAI-compatible engines, as a client sees it.

Prompts.  Each trace block (512 tokens in the Mooncake trace) becomes ``block_tokens``
token ids drawn from a generator seeded with the block's ``hash_id``, so requests that share
leading ``hash_ids`` share a token prefix, and the engines' prefix caches (and ours) see
the reuse the trace has.  A prompt is the concatenation of its blocks cut to
``input_length × block_tokens / 512`` tokens (the trace's last block is partial) and to the
engines' longest prompt.

Timing.  Requests keep the trace's arrival order and times divided by ``time_scale``; each
is sent at its time (or as soon as the previous ones have been sent) as
``POST /v1/completions`` with ``stream=true``.  TTFT is the time from sending the request to
the first streamed chunk carrying a token; ``cached_tokens`` is vLLM's own count of the
prompt tokens it did not compute (``usage.prompt_tokens_details.cached_tokens``, i.e.
``RequestOutput.num_cached_tokens``: its prefix cache plus what the connector loaded).
"""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import httpx
import numpy as np

from kvadvisor.trace import TraceRequest

from .router import Choice, Router

MOONCAKE_BLOCK = 512
"""Tokens per block of the Mooncake trace (its ``hash_ids`` name 512-token blocks)."""


def trace_prompt(req: TraceRequest, block_tokens: int, vocab: int, max_len: int) -> list[int]:
    """Token ids of ``req``'s prompt (module doc): ids in ``[1, vocab)``, length
    ``min(ceil(input_length × block_tokens / 512), len(hash_ids) × block_tokens, max_len)``."""
    want = min(-(-req.input_length * block_tokens // MOONCAKE_BLOCK), len(req.hash_ids) * block_tokens, max_len)
    out: list[int] = []
    for h in req.hash_ids:
        if len(out) >= want:
            break
        out.extend(np.random.default_rng(h).integers(1, vocab, size=block_tokens).tolist())
    return out[:want]


@dataclass
class RequestResult:
    """One request as the client saw it (seconds; tokens).

    Attributes:
        index: position in the trace.
        engine: index of the engine that served it.
        prompt_tokens: prompt length.
        cached_tokens: prompt tokens vLLM did not compute (module doc).
        ttft_s: time to the first token, from the request's arrival (routing included).
        latency_s: time to the last token, from its arrival.
        route_s: from its arrival to its sending (the router's decision).
        burst: trace index of the first request routed together with it (its own when alone).
        output: generated token ids.
        overlap_tokens: the router's view of each engine's overlap (KV-aware only).
        sent_s: when it was sent, seconds from the start of the replay.
        ahead_at_send: requests the same engine was serving when it was sent (its queue).
        prefilling_at_send: of those, requests still waiting for their first token.
        error: why the request failed (``None`` when it did not).
    """

    index: int
    engine: int
    prompt_tokens: int
    cached_tokens: int = 0
    ttft_s: float = 0.0
    latency_s: float = 0.0
    output: tuple[int, ...] = ()
    overlap_tokens: tuple[int, ...] = ()
    route_s: float = 0.0
    burst: int = 0
    sent_s: float = 0.0
    ahead_at_send: int = 0
    prefilling_at_send: int = 0
    error: str | None = None


async def complete(http: httpx.AsyncClient, url: str, model: str, prompt: Sequence[int], max_tokens: int,
                   on_first_token: Callable[[], None] | None = None) -> tuple[float, float, list[int], int]:
    """One streamed greedy completion of a token-id prompt; ``on_first_token`` is called
    when the first chunk carrying a token arrives.

    Returns:
        ``(ttft_s, latency_s, output token ids, cached prompt tokens)``.

    Raises:
        httpx.HTTPError: the request failed; ``RuntimeError``: the stream carried no token.
    """
    body = {"model": model, "prompt": list(prompt), "max_tokens": max_tokens, "temperature": 0.0,
            "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}, "return_token_ids": True}
    t0 = time.perf_counter()
    ttft: float | None = None
    out: list[int] = []
    cached = 0
    async with http.stream("POST", f"{url}/v1/completions", json=body) as r:
        if r.status_code != 200:
            raise RuntimeError(f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}")
        async for line in r.aiter_lines():
            if not line.startswith("data: {"):
                continue
            chunk = json.loads(line[6:])
            for choice in chunk.get("choices", []):
                ids = choice.get("token_ids") or []
                if ids and ttft is None:
                    ttft = time.perf_counter() - t0
                    if on_first_token is not None:
                        on_first_token()
                out.extend(ids)
            usage = chunk.get("usage")
            if usage:
                cached = int((usage.get("prompt_tokens_details") or {}).get("cached_tokens") or 0)
    if ttft is None:
        raise RuntimeError("the stream carried no token")
    return ttft, time.perf_counter() - t0, out, cached


async def replay(
    prompts: Sequence[Sequence[int]],
    arrivals_s: Sequence[float],
    engine_urls: Sequence[str],
    model: str,
    router: Router,
    max_tokens: int,
    progress: Callable[[int, int], None] | None = None,
) -> list[RequestResult]:
    """Send every prompt at its arrival time (seconds from the start), routed by ``router``
    (told of each request's first token and end), and wait for all of them.

    The prompts due at one moment (a trace's timestamps come in bursts: the Mooncake
    conversation trace's are multiples of 3 s) are routed together
    (:meth:`Router.choose_many`) and sent together.  Times count from each request's arrival,
    so the router's decision is part of its TTFT, as a client sees it.  A failed request is
    recorded with its ``error``; each result records the queue it met on its engine
    (``ahead_at_send``, ``prefilling_at_send``: the client's own count, whatever the
    router)."""
    results: list[RequestResult | None] = [None] * len(prompts)
    done = 0
    serving = [0] * len(engine_urls)
    prefilling = [0] * len(engine_urls)
    limits = httpx.Limits(max_connections=256, max_keepalive_connections=64)
    async with httpx.AsyncClient(timeout=httpx.Timeout(600.0), limits=limits) as http:

        async def one(i: int, choice: Choice, burst: int) -> None:
            nonlocal done
            e = choice.engine
            now = time.monotonic() - t0
            res = RequestResult(i, e, len(prompts[i]), overlap_tokens=choice.overlap_tokens,
                                route_s=max(0.0, now - arrivals_s[i]), burst=burst, sent_s=now,
                                ahead_at_send=serving[e], prefilling_at_send=prefilling[e])
            serving[e] += 1
            prefilling[e] += 1
            first = False

            def on_first_token() -> None:
                nonlocal first
                first = True
                prefilling[e] -= 1
                router.first_token(choice)

            try:
                ttft, latency, out, res.cached_tokens = await complete(
                    http, engine_urls[e], model, prompts[i], max_tokens, on_first_token)
                res.ttft_s, res.latency_s, res.output = res.route_s + ttft, res.route_s + latency, tuple(out)
            except (httpx.HTTPError, RuntimeError, ValueError) as exc:
                res.error = f"{type(exc).__name__}: {exc}"
            finally:
                serving[e] -= 1
                if not first:
                    prefilling[e] -= 1
                router.finished(choice, prompts[i])
            results[i] = res
            done += 1
            if progress:
                progress(done, len(prompts))

        t0 = time.monotonic()
        tasks = []
        i = 0
        while i < len(prompts):
            delay = arrivals_s[i] - (time.monotonic() - t0)
            if delay > 0:
                await asyncio.sleep(delay)
            now = time.monotonic() - t0
            j = i + 1
            while j < len(prompts) and arrivals_s[j] <= now:  # every prompt due by now, in order
                j += 1
            choices = await router.choose_many(prompts[i:j])
            tasks += [asyncio.create_task(one(k, c, i)) for k, c in zip(range(i, j), choices)]
            i = j
        await asyncio.gather(*tasks)
    return [r for r in results if r is not None]


def percentile(values: Sequence[float], q: float) -> float:
    """The ``q``-th percentile (0-100, linear interpolation, numpy's default); 0 when empty."""
    return float(np.percentile(np.asarray(values, dtype=float), q)) if len(values) else 0.0
