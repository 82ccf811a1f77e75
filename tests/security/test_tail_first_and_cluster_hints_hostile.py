"""Hostile checks of the tail-first experts mirrored by the real tier
(``advisor/policy/eviction/experts.py``, "Tail first") and of a partitioned cluster's
``POST /v1/finished``, forwarded to partitions over NATS (``ClusterClient.finished``).

The S3-FIFO tests pin a kernel bug found while attacking (a ghost hit on the ghost FIFO's
own tail unlinked the block twice); the others guard behaviour that held up under attack.
"""

from __future__ import annotations

import asyncio
from typing import Any

import msgspec
import numpy as np
import pytest

from advisor.cluster.node import PartitionUnavailable, query_subject
from advisor.policy.eviction import experts, s3fifo
from advisor.policy.eviction.compact import compact
from advisor.policy.eviction.registry import POLICIES
from tests.integration.test_cluster_mover_policy import _chain, _cluster_api, _folded, _partitions_policy
from tests.integration.test_cluster_mover_races import rig_factory  # noqa: F401

E = experts.EXPERTS

# S3-FIFO, ghost hit on the ghost FIFO's own tail: the block x being referenced is in G and
# is G's oldest entry; making room moves S's tail into G, G goes over its share and trims its
# tail, which is x itself (``where[x] = -1``); the kernel then ran ``unlink(G, x)`` a second
# time (``if w == G``, the value read before the eviction loop): G's head/tail/size were
# corrupted, a ghost left dangling with ``where == G`` later re-enters a list and a block is
# evicted twice without a reference in between.  The mirror then must evict a block the
# leader holds (fallbacks > 0), and the kernel's own hit counts are those of a corrupted cache.
S3_TAIL_CASE = ([[4, 1], [4, 1, 2, 7, 9], [10], [10, 3], [1, 2, 7, 6, 5, 8]], 3)
S3_CLASSIC_CASE = ([[7, 1, 5, 9, 12], [10, 8], [7, 1, 13, 11, 4], [7, 1, 13, 3, 2], [10, 6]], 4)


def _fixed(reqs: list[list[int]], cap: int, name: str) -> Any:
    tr = compact(reqs)
    return tr, experts.run(tr, cap, leader=np.full(tr.requests, E.index(name), np.int8))


# ---------------------------------------------------------------- tail first: the S3-FIFO bug


@pytest.mark.parametrize(("case", "name"), [(S3_TAIL_CASE, "s3fifo_tail")])
def test_a_fixed_s3fifo_leader_needs_no_fallback(case: Any, name: str) -> None:
    """Failed (fallbacks == 1) with the S3-FIFO ghost double-unlink above.  s3fifo_tail is
    the selector's first leader (``SelectorSettings.initial``), so it hit the default."""
    reqs, cap = case
    _, run = _fixed(reqs, cap, name)
    assert run.fallbacks == 0, (name, run.hits.tolist(), run.expert_hits[E.index(name)].tolist())


@pytest.mark.parametrize(("case", "tail_first"), [(S3_TAIL_CASE, True), (S3_CLASSIC_CASE, False)])
def test_s3fifo_never_evicts_a_block_twice_without_referencing_it_in_between(case: Any, tail_first: bool) -> None:
    """Failed with that bug: request 4 logged block 6 (dense id 5) evicted at step 3 and
    again at step 5, served at step 2 only (tail first; the classic order had its own case).
    Root cause of the test above, at the kernel."""
    reqs, cap = case
    tr = compact(reqs)
    every = np.ones(tr.requests, dtype=np.bool_)
    _, (keys, blocks), _ = s3fifo.replay(tr, cap, every, np.zeros(tr.requests, dtype=np.bool_), tail_first=tail_first)
    evicted_since_ref: set[tuple[int, int]] = set()
    order = {(i, k): int(tr.flat[tr.offsets[i + 1] - 1 - k] if tail_first else tr.flat[tr.offsets[i] + k])
             for i in range(tr.requests)
             for k in range(int(tr.offsets[i + 1] - tr.offsets[i]))}
    last = (-1, -1)
    for key, v in zip(keys.tolist(), blocks.tolist()):
        i, step = key >> 32, key & 0xFFFFFFFF
        # blocks served (re-referenced) between the previous eviction and this one leave the set
        for (ri, rk), x in order.items():
            if last < (ri, rk) <= (i, step):
                evicted_since_ref = {(b, r) for b, r in evicted_since_ref if b != x}
        assert all(b != v for b, _ in evicted_since_ref), f"block {v} evicted twice (request {i}, step {step})"
        evicted_since_ref.add((v, i))
        last = (i, step)


# ---------------------------------------------------------------- tail first: what held up


def _traces(rng: np.random.Generator, n: int) -> list[tuple[list[list[int]], int]]:
    out = []
    for t in range(n):
        reqs = []
        for _ in range(int(rng.integers(1, 12))):
            length = int(rng.integers(0, 10))  # empty requests, and longer than the tier
            if t % 2:  # repeated blocks inside one request, not prefix-chained
                reqs.append([int(x) for x in rng.integers(0, int(rng.integers(1, 9)), length)])
            else:  # prefix-chained, branching
                path = [int(x) for x in rng.integers(0, 2, length)]
                reqs.append([hash(tuple(path[:k + 1])) % 10**9 for k in range(length)])
        if sum(map(len, reqs)):
            out.append((reqs, int(rng.integers(1, 7))))  # capacity 1 included
    return out


def test_tail_first_and_classic_leaders_are_reproduced_on_hostile_traces() -> None:
    rng = np.random.default_rng(11)
    for reqs, cap in _traces(rng, 150):
        tr = compact(reqs)
        for name in ("arc_tail", "s3fifo_tail", "lfu_da_tail", "lru_tail", "sieve", "prefix_lru"):
            run = experts.run(tr, cap, leader=np.full(tr.requests, E.index(name), np.int8))
            assert run.fallbacks == 0, (name, cap, reqs)
            assert (run.hits == POLICIES[name](tr, cap, 0, True)).all(), (name, cap, reqs)


def test_switching_every_request_between_tail_first_and_classic_leaders_needs_no_fallback() -> None:
    tail = [E.index(n) for n in ("arc_tail", "s3fifo_tail", "lfu_da_tail", "lru_tail")]
    classic = [E.index(n) for n in ("prefix_value", "sieve", "prefix_lru", "finish_aware")]
    rng = np.random.default_rng(12)
    for reqs, cap in _traces(rng, 150):
        tr = compact(reqs)
        lead = np.array([rng.choice(tail) if i % 2 else rng.choice(classic) for i in range(tr.requests)], np.int8)
        assert experts.run(tr, cap, leader=lead).fallbacks == 0, (cap, reqs, lead.tolist())
        lead = rng.choice(tail + classic, tr.requests).astype(np.int8)
        assert experts.run(tr, cap, leader=lead).fallbacks == 0, (cap, reqs, lead.tolist())


def test_capacity_one_and_empty_requests() -> None:
    reqs = [[], [1, 1, 1], [], [2, 1, 2, 1], [1], []]
    for name in ("arc_tail", "lfu_da_tail", "lru_tail"):
        tr, run = _fixed(reqs, 1, name)
        assert run.fallbacks == 0 and (run.hits == POLICIES[name](tr, 1, 0, True)).all(), name


# ---------------------------------------------------------------- the cluster's finish hints


def _raw(client: Any, partition: int, payload: bytes) -> Any:
    """Send raw bytes on a partition's query subject; the decoded answer."""
    async def req() -> Any:
        return await client._nc.request(query_subject(client.namespace, partition), payload, timeout=5.0)
    msg = asyncio.run_coroutine_threadsafe(req(), client._loop).result(10)
    return msgspec.msgpack.decode(msg.data)


def test_hostile_finish_hints_are_refused_or_bounded_and_the_fold_goes_on(rig_factory: Any) -> None:  # noqa: F811
    rig = rig_factory(partitions=2)
    node, client, http = _cluster_api(rig)
    try:
        chain = _chain(12, 31)
        owner = rig.scheme.pieces(chain)[-1].partition
        assert owner in (0, 1)
        enc = msgspec.msgpack.encode
        bad = [
            {"op": "finished", "hash": 5.0, "reason": "stop"},
            {"op": "finished", "reason": "x"},
            {"op": "finished", "hash": 5, "reason": {"nested": ["x" * 1000]}},
            {"op": "finished", "hash": 5, "reason": None},
            {"op": "finished", "hash": [5], "reason": "stop"},
            {"op": "finished", "hash": False, "reason": "stop"},
            {"op": "finished", "hash": -(1 << 63), "reason": "stop"},
            {"op": "finished", "hash": 5, "reason": "stop", "client": 7},
            {"op": "finished", "hash": 5, "reason": "stop", "client": None},
            {"op": "finished", "hash": 5, "reason": "stop", "client": ["a"]},
        ]
        for body in bad:
            with pytest.raises(PartitionUnavailable, match="bad request"):
                client._request(owner, body)
        # bytes msgpack cannot make from a Python int: a 2**64 hash as a float64, as bin, as ext
        for payload in (enc({"op": "finished", "hash": float(1 << 64), "reason": "stop"}),
                        enc({"op": "finished", "hash": b"\x01" * 8, "reason": "stop"}),
                        enc({"op": "finished", "hash": msgspec.msgpack.Ext(1, b"\xff" * 9), "reason": "stop"}),
                        b"\x91" * 5000 + b"\xc0",  # deeply nested arrays
                        b"\x81\x81\xa1a\x01\x01"):  # a map as a map key
            out = _raw(client, owner, payload)
            assert isinstance(out, dict) and "unavailable" in out, out
        # a huge reason is cut to 64 characters and taken once
        assert client._request(owner, {"op": "finished", "hash": (1 << 64) - 1, "reason": "y" * 200_000})["taken"]
        # a flood: the quota keeps max_hints, drops the rest, and answers every one
        node.serving()[owner].selector.max_hints = 4
        for k in range(40):
            r = http.post("/v1/finished", json={"sequence_hashes": [hex(h) for h in chain[:-1] + [k + 1]],
                                                "finish_reason": "tool_calls"})
            assert r.status_code == 200, r.text
        st = _partitions_policy(http)[str(owner)]
        assert st["finish_hints"] == 4 and st["finish_hints_dropped"] >= 36, st
        # the quota is shared by client: a second client's hint pushes out the first's oldest,
        # and the first one's flood then drops its own, never the second's
        sel = node.serving()[owner].selector
        assert client._request(owner, {"op": "finished", "hash": 77, "reason": "stop", "client": "token-b"})["taken"]
        for k in range(10):
            assert client._request(owner, {"op": "finished", "hash": 1000 + k, "reason": "stop"})["taken"]
        assert 77 in sel._hints and sel.stats()["finish_hint_clients"] == 2  # noqa: SLF001 - the quota's state
        # an empty prompt is answered, not forwarded
        r = http.post("/v1/finished", json={"sequence_hashes": [], "finish_reason": "stop"})
        assert r.status_code == 200 and r.json()["taken"] is False, r.text
        # the fold still runs: a block announced after all that is indexed by every partition
        _folded(rig, node, 0x5EED)
        # a partition without an owner: 503 with Retry-After, never 500
        rig.stop(node)
        client.timeout_s = 1.0
        for body in ({"sequence_hashes": [hex(h) for h in chain], "finish_reason": "stop"},
                     {"sequence_hashes": chain[:1], "finish_reason": "end_turn"}):  # last piece trunk
            r = http.post("/v1/finished", json=body)
            assert r.status_code == 503 and "Retry-After" in r.headers, (r.status_code, r.text)
    finally:
        http.close()
        client.close()
