"""The engine demo's KV-aware rule (Dynamo's cost: queued prefill + decode load, overlap from
the index) on fabricated ``POST /query`` answers: blocks on a shared tier count for every
engine, local tiers for their own; prefill still queued on an engine counts as its load
until the request's first token."""

from __future__ import annotations

import httpx

from kvadvisor.engine_demo.router import KvRouter, engine_overlaps

BS = 32


def test_shared_tier_blocks_count_for_every_engine_local_ones_for_their_own() -> None:
    answer = {
        "scores": {"0": {"0": 2 * BS}, "1": {"0": 3 * BS}},
        # engine 0: 1 block in G1, 2 on a shared volume (g3); engine 1: 3 in its G2 (local)
        "tiers": {"0": {"0": {"g1": BS, "g3": 2 * BS}}, "1": {"0": {"g2": 3 * BS}}},
    }
    overlaps, shared = engine_overlaps(answer, [0, 1, 2])
    assert shared == 2 * BS
    # engine 2 holds nothing itself but loads the shared blocks; engine 1's G2 is its own
    assert overlaps == [2 * BS, 3 * BS, 2 * BS]
    # g4 (object storage) is shared as well, and any instance of the answer counts
    answer = {"scores": {"7": {"0": 5 * BS}}, "tiers": {"7": {"0": {"g4": 5 * BS}}}}
    assert engine_overlaps(answer, [0, 1]) == ([5 * BS, 5 * BS], 5 * BS)
    # with no shared tier, a volume is local to the engine that published it
    assert engine_overlaps(answer, [0, 7], shared_tiers=()) == ([0, 5 * BS], 0)
    assert engine_overlaps({}, [0, 1]) == ([0, 0], 0)


def test_queued_prefill_counts_until_the_first_token() -> None:
    router = KvRouter(httpx.AsyncClient(), "m", [0, 1], BS)
    long_prompt = 64 * BS
    a = router.pick(long_prompt, [0, 0])
    b = router.pick(long_prompt, [0, 0])
    assert (a.engine, b.engine) == (0, 1)
    assert router.queued_prefill == [64, 64] and router.decode_blocks == [64, 64]
    router.first_token(b)  # engine 1 is decoding now; engine 0 still prefills 64 blocks
    router.first_token(b)  # a second signal changes nothing
    assert router.queued_prefill == [64, 0]
    # a short request: (64 + 2) + (64 + 2) on engine 0 against (0 + 2) + (64 + 2) on engine 1
    short = router.pick(2 * BS, [0, 0])
    assert short.engine == 1 and short.prefill_blocks == 2
    # an overlap lowers the prefill the request adds: 8 of its 10 blocks held on engine 0
    # still loses to engine 0's queue: (64 + 2) + (64 + 10) against (2 + 10) + (66 + 10)
    assert router.pick(10 * BS, [8 * BS, 0]).engine == 1
    router.finished(a, [])  # failed before its first token: its prefill leaves the queue too
    assert router.queued_prefill[0] == 0 and router.decode_blocks[0] == 0 and router.in_flight[0] == 0
    # with engine 0 idle, the overlap wins: (0 + 2) + (0 + 10) against (2 + 10 + 10) + (76 + 10)
    c = router.pick(10 * BS, [8 * BS, 0])
    assert c.engine == 0 and c.prefill_blocks == 2
    assert router.stats.with_overlap == 2 and router.stats.to_best_overlap == 1
